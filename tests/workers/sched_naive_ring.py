"""The classic ring deadlock: every rank posts isend to its next rank, then irecv from its
previous rank, one by one (so the irecv is queued behind the isend on lane 0).

The same program runs twice, each time on a new communicator:
- "buffered": eager_threshold >= the message size, so every send completes without its
  receive and the ring finishes (buffering hides the ordering bug);
- "strict": strict rendezvous, so no rank's irecv is ever posted and every wait must raise
  P2PTimeoutError within the timeout instead of hanging.

params: numel (float32 elements per message), eager_threshold (for "buffered"), timeout."""
import time

import harness


def naive_ring(torch, mp, comm, numel):
    send = torch.full((numel,), float(comm.rank), dtype=torch.float32)
    recv = torch.full((numel,), -1.0, dtype=torch.float32)
    out = {"next": comm.next_rank, "prev": comm.prev_rank, "nbytes": send.nbytes,
           "eager_threshold": comm.eager_threshold}
    start = time.monotonic()
    try:
        s = comm.isend(send, comm.next_rank)
        r = comm.irecv(recv, comm.prev_rank)
        s.wait()
        r.wait()
    except Exception as exc:  # the test asserts on what was raised, and when
        out.update(error_type=type(exc).__name__, is_p2p_error=isinstance(exc, mp.P2PError),
                   is_timeout_error=isinstance(exc, TimeoutError), error=str(exc))
    out["elapsed"] = time.monotonic() - start
    out["received"] = sorted(set(recv.tolist()))
    return out


def body(params):
    import torch

    import megatron_p2p as mp

    results = {}
    for name, eager in (("buffered", params["eager_threshold"]), ("strict", 0)):
        with mp.init_communicator(timeout=params["timeout"], eager_threshold=eager) as comm:
            results[name] = naive_ring(torch, mp, comm, params["numel"])
    return results


harness.run(body)
