"""The NCCL watchdog over the fake libraries. Every rank posts one exchange and waits on it the
GPU way, on the stream only (Request.wait()), then its host idles for params["idle"] seconds
without a host sync, as a training loop between syncs does. Then it makes one more call.
params["timeout"] is one timeout, or a list with one per rank."""
import os
import time
from typing import Any

import harness
import nccl_model_cuda


def body(params):
    nccl_model_cuda.install()
    import torch

    import megatron_p2p as mp

    on = nccl_model_cuda.on_device
    timeout = params["timeout"]
    if isinstance(timeout, list):
        timeout = timeout[int(os.environ["RANK"])]
    harness.barrier("create")
    comm = mp.init_communicator(backend="nccl", timeout=timeout)
    t = torch.full((64,), float(comm.rank + 1))
    got = torch.zeros(64)
    out: dict[str, Any] = {
        "wait": harness.caught(lambda: [r.wait() for r in comm.exchange(send_next=on(t), recv_prev=on(got)).values()])}
    time.sleep(params["idle"])
    out["next_call"] = harness.caught(lambda: [r.synchronize() for r in
                                               comm.exchange(send_next=on(t), recv_prev=on(got)).values()])
    out["exact"] = bool(torch.equal(got, torch.full((64,), float(comm.prev_rank + 1))))
    comm.close()
    return out


harness.run(body)
