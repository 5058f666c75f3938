"""A rank that returns from its work with its NCCL communicator (over the fake libraries) still
open, so that the package's atexit hook closes it (params["case"]):
  idle     its exchange has completed
  pending  its exchange never runs (the test keeps the rank silent: MPFAKE_NCCL_SILENT_RANK)
A hook registered before the package's runs after it, at the very end of the exit: it adds to
the rank's result whether the communicator ended closed and how long the exit took from the
body's return."""
import atexit
import json
import os
import time
from pathlib import Path
from typing import Any

import harness
import nccl_model_cuda

KEPT: dict[str, Any] = {}  # the communicator stays referenced: the atexit hook, not garbage collection, closes it


def record_exit() -> None:
    path = Path(os.environ["MP_RESULT_DIR"]) / f"rank{os.environ['RANK']}.json"
    result = json.loads(path.read_text())
    result["value"]["exit"] = {"closed": KEPT["comm"].closed, "seconds": time.monotonic() - KEPT["returned"]}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, path)


atexit.register(record_exit)  # before megatron_p2p is imported, so after its hooks


def body(params):
    nccl_model_cuda.install()
    import torch

    import megatron_p2p as mp

    on = nccl_model_cuda.on_device
    comm = KEPT["comm"] = mp.init_communicator(backend="nccl", timeout=params["timeout"])
    sent = torch.arange(64, dtype=torch.float32) + 100 * comm.rank
    got = torch.zeros(64, dtype=torch.float32)
    reqs = comm.exchange(send_next=on(sent), recv_prev=on(got))
    if params["case"] == "idle":
        for r in reqs.values():
            r.synchronize()
    KEPT["returned"] = time.monotonic()
    return {"exact": torch.equal(got, torch.arange(64, dtype=torch.float32) + 100 * comm.prev_rank)}


harness.run(body)
