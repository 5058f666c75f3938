"""A failed receive's buffer after an abort, on 2 ranks over the model, buffering small sends
(MPFAKE_NCCL_EAGER_BYTES). params["cases"] run in order, each on a communicator of its own:
rank 0 posts a receive from rank 1 into a tensor whose only reference it hands to the
communicator (it keeps a weak one), aborts 0.2 s later, and reports when the package let the
tensor go and whether a kernel wrote it after the abort (the model counts such writes).
  {"case": "late", "close": bool}  rank 0's kernels start params["delay_ms"] late (device work
            queued before them); rank 1's send is buffered meanwhile, so the late kernel finds
            its bytes ready and writes them; with "close", close() right after the abort instead
            of polling recent_ops()
  {"case": "idle"}  rank 1 sends nothing: rank 0's kernel waits, and ends at the abort flag"""
import ctypes
import gc
import os
import time
import weakref
from typing import Any

import harness
import nccl_model_cuda

NUMEL = 256  # 1 KiB: buffered


def run_case(mp, torch, on, nccl, rank, case, delay_s):
    late = case["case"] == "late"
    if rank == 0 and late:
        os.environ["MPFAKE_NCCL_DELAY_MS"] = str(int(delay_s * 1000))  # read as each communicator is made
    else:
        os.environ.pop("MPFAKE_NCCL_DELAY_MS", None)
    comm = mp.init_communicator(backend="nccl", timeout=30.0, lanes=1)
    out: dict[str, Any] = {}
    if rank == 1:
        if late:
            out["send"] = harness.caught(lambda: comm.isend(on(torch.full((NUMEL,), 1.0)), 0).synchronize())
        time.sleep(delay_s + 1.5 if late else 1.5)  # rank 0 is done with the buffer by then
        comm.close()
        return out
    writes_before = nccl.mpfake_nccl_writes_after_abort()
    got = torch.full((NUMEL,), -1.0)
    view = on(got)
    held = weakref.ref(view)
    posted = time.monotonic()
    comm.irecv(view, 1)
    del view
    time.sleep(0.2)
    comm.abort()
    aborted = time.monotonic()
    if case.get("close"):
        comm.close()
    else:
        comm.recent_ops()  # prunes what the communicator may let go
    gc.collect()
    out["held_after_abort"] = held() is not None
    while held() is not None and time.monotonic() - aborted < delay_s + 5.0:
        time.sleep(0.01)
        if not case.get("close"):
            comm.recent_ops()
        gc.collect()
    out["released_after_abort_s"] = time.monotonic() - aborted if held() is None else None
    out["released_after_post_s"] = time.monotonic() - posted if held() is None else None
    out["written"] = bool(torch.equal(got, torch.full((NUMEL,), 1.0)))
    out["writes_after_abort"] = nccl.mpfake_nccl_writes_after_abort() - writes_before
    comm.close()
    return out


def body(params):
    nccl_model_cuda.install()
    import torch

    import megatron_p2p as mp

    nccl = ctypes.CDLL(os.environ["MEGATRON_P2P_NCCL_LIBRARY"])
    nccl.mpfake_nccl_writes_after_abort.restype = ctypes.c_long
    rank = int(os.environ["RANK"])
    return [run_case(mp, torch, nccl_model_cuda.on_device, nccl, rank, case, params["delay_ms"] / 1000)
            for case in params["cases"]]


harness.run(body)
