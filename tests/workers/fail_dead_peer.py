"""A rank dies; the others' pending waits must raise PeerFailureError quickly.

params: victim (global rank that dies), how ("exit": os._exit(1) before posting exchange
`die_at`, after `die_at` successful ring exchanges; "sigkill": SIGKILL right after init;
"sigkill_mid_copy": the victim sends `nbytes` to the next rank and is SIGKILLed once the
receiver is reading them with single copy), exchanges, die_at, timeout (30: the failure must
come from liveness, not from the timeout).

When a worker dies, torchrun sends SIGTERM to the others; the survivors ignore it so that they
can report what they saw (torchrun waits for them before it kills them)."""
import os
import signal
import time
from typing import Any

import harness


def body(params):
    import torch

    import megatron_p2p as mp

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    comm = mp.init_communicator(timeout=params["timeout"])
    me, victim = comm.global_rank, params["victim"]
    out: dict[str, Any] = {"pid": os.getpid(), "completed": 0}
    if params["how"] == "sigkill" and me == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    if params["how"] == "sigkill_mid_copy":
        return out | copy_interrupted(torch, comm, me == victim, params["nbytes"])
    for it in range(params["exchanges"]):
        if params["how"] == "exit" and me == victim and it == params["die_at"]:
            os._exit(1)
        send_next = torch.full((1000,), me * 100 + it, dtype=torch.int64)
        send_prev = torch.full((1000,), -(me * 100 + it), dtype=torch.int64)
        recv_prev = torch.zeros(1000, dtype=torch.int64)
        recv_next = torch.zeros(1000, dtype=torch.int64)
        start = time.monotonic()
        try:
            reqs = comm.exchange(send_next=send_next, recv_prev=recv_prev, send_prev=send_prev, recv_next=recv_next)
            for r in reqs.values():
                r.wait()
        except Exception as exc:
            out.update(error_type=type(exc).__name__, error=str(exc), elapsed=time.monotonic() - start,
                       failed_at=it)
            break
        assert bool((recv_prev == comm.prev_rank * 100 + it).all()), it
        assert bool((recv_next == -(comm.next_rank * 100 + it)).all()), it
        out["completed"] += 1
    comm.close()
    return out


def copy_interrupted(torch, comm, victim, nbytes):
    """The victim sends, and kills itself 30 ms after its receiver starts to receive (the single
    copy of `nbytes` takes far longer, and may run inside irecv itself); the receiver reports
    what its wait raised."""
    from megatron_p2p.communicator import _env_rendezvous

    store = _env_rendezvous()[0]
    buf = torch.ones(nbytes, dtype=torch.uint8) if victim else torch.zeros(nbytes, dtype=torch.uint8)
    if victim:
        comm.isend(buf, comm.next_rank)
        store.wait(["receiving"])
        time.sleep(0.03)
        os.kill(os.getpid(), signal.SIGKILL)
    single_copy = comm.single_copy(comm.prev_rank)
    start = time.monotonic()
    store.set("receiving", "1")
    caught = harness.caught(lambda: comm.irecv(buf, comm.prev_rank).wait())
    return {"single_copy": single_copy, "wait": caught, "elapsed": time.monotonic() - start}


harness.run(body)
