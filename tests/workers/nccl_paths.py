"""On CPU-only ranks: which backend init_communicator picks, the errors that say NCCL cannot
run here, and the ops an shm communicator ran (its flight recorder), for the NCCL issue check.

Returns {"auto": ..., "errors": {...}, "runs": [{"mode", "lanes", "calls": [...], "ops": [...]}]}."""
from __future__ import annotations

from typing import Any

import harness

DTYPES = ["float32", "bfloat16", "int64", "float8_e4m3fn", "bool", "complex64", "float16", "uint8"]


def caught(fn):
    try:
        fn()
    except Exception as exc:  # the test asserts on the type and message
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": None}


def body(params):
    import torch

    import megatron_p2p as mp

    out: dict[str, Any] = {"errors": {}, "runs": []}
    auto = mp.init_communicator(backend="auto", timeout=30.0)
    out["auto"] = auto.backend
    auto.close()
    out["errors"]["nccl_without_gpu"] = caught(lambda: mp.init_communicator(backend="nccl", timeout=30.0))
    out["errors"]["auto_on_cuda_without_gpu"] = caught(
        lambda: mp.init_communicator(backend="auto", device="cuda", timeout=30.0))
    out["errors"]["shm_on_cuda"] = caught(lambda: mp.init_communicator(backend="shm", device="cuda:0"))

    gen = torch.Generator().manual_seed(7)
    for mode in ("parity", "batched"):
        for lanes in (1, 2):
            comm = mp.init_communicator(timeout=30.0, lanes=lanes)
            if comm.rank == 0:
                out["errors"]["meta_tensor"] = caught(lambda: comm.isend(torch.empty(4, device="meta"), comm.next_rank))
            calls: list[dict[str, Any]] = []
            for i, dtype in enumerate(DTYPES):
                numel = int(torch.randint(0, 3000, (1,), generator=gen))
                make = lambda: torch.zeros(numel, dtype=getattr(torch, dtype))  # noqa: E731
                # Every subset of the four ops that pairs up around the ring.
                present = [("send_next", "recv_prev"), ("send_prev", "recv_next"),
                           ("send_next", "recv_prev", "send_prev", "recv_next")][i % 3]
                ops: dict[str, Any] = {name: make() for name in present}  # exchange's tensor arguments
                reqs = comm.exchange(mode=mode, **ops)
                for r in reqs.values():
                    r.wait()
                calls.append({"kind": "exchange", "ops": list(present)})
            peer = comm.next_rank if comm.rank % 2 == 0 else comm.prev_rank
            if comm.size % 2 == 0:  # isend/irecv in pairs (0,1), (2,3): even ranks send first
                t = torch.ones(100)
                first, second = (comm.isend, comm.irecv) if comm.rank % 2 == 0 else (comm.irecv, comm.isend)
                first(t, peer).wait()
                second(t, peer).wait()
                calls += [{"kind": "single"}, {"kind": "single"}]
                batched = comm.batch([(True, torch.ones(8), peer), (False, torch.empty(8), peer)])
                for b in batched:
                    b.wait()
                calls.append({"kind": "batch"})
            out["runs"].append({"mode": mode, "lanes": lanes, "rank": comm.rank, "size": comm.size,
                                "calls": calls, "ops": comm.recent_ops()})
            comm.close()
    return out


harness.run(body)
