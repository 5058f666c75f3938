"""The classic ring deadlock: every rank posts isend to its next rank, then irecv from its
previous rank, one by one (so the irecv is queued behind the isend on lane 0).

The same program runs twice, each time on a new communicator:
- "buffered": eager_threshold >= the message size, so every send completes without its
  receive and the ring finishes (buffering hides the ordering bug);
- "strict": strict rendezvous, so no rank's irecv is ever posted and every wait must raise
  P2PTimeoutError within the timeout instead of hanging.

On backend "nccl" (the NCCL backend over the fake libraries) only "strict" runs: NCCL has no
eager threshold to set; the ranks' stall analysis names the cycle (megatron_p2p/_stall.py).

params: numel (float32 elements per message), eager_threshold (for "buffered"), timeout, backend
("shm", the default, or "nccl")."""
import time

import harness
from nccl_model_backend import Backend


def naive_ring(torch, mp, comm, numel, backend):
    send = torch.full((numel,), float(comm.rank), dtype=torch.float32)
    recv = torch.full((numel,), -1.0, dtype=torch.float32)
    out = {"next": comm.next_rank, "prev": comm.prev_rank, "nbytes": send.nbytes,
           "eager_threshold": comm.eager_threshold}
    start = time.monotonic()
    try:
        s = comm.isend(backend.tensor(send), comm.next_rank)
        r = comm.irecv(backend.tensor(recv), comm.prev_rank)
        backend.settle(s)
        backend.settle(r)
    except Exception as exc:  # the test asserts on what was raised, and when
        out.update(error_type=type(exc).__name__, is_p2p_error=isinstance(exc, mp.P2PError),
                   is_timeout_error=isinstance(exc, TimeoutError), error=str(exc))
    out["elapsed"] = time.monotonic() - start
    out["received"] = sorted(set(recv.tolist()))
    return out


def body(params):
    backend = Backend(params.get("backend", "shm"))
    import torch

    import megatron_p2p as mp

    results = {}
    runs = (("strict", 0),) if backend.nccl else (("buffered", params["eager_threshold"]), ("strict", 0))
    for name, eager in runs:
        with mp.init_communicator(backend=backend.name, timeout=params["timeout"], eager_threshold=eager) as comm:
            results[name] = naive_ring(torch, mp, comm, params["numel"], backend)
    return results


if __name__ == "__main__":
    harness.run(body)
