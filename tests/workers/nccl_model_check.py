"""Debug matching (MEGATRON_P2P_CHECK=1) on the NCCL backend over the fakes, two ranks. Each case
makes a communicator, rank 0 sends one tensor to rank 1, and each rank reports what its
exchange-and-synchronize raised and whether the bytes arrived. Cases (params["cases"]):
  agree  the same shape and dtype on both sides
  count  rank 1 receives 999 of the 1000 int32 sent
  dtype  rank 1 receives int32 where float32 is sent: the same bytes
  shape  rank 1 receives [100, 10] where [10, 100] is sent: the same bytes and dtype
Rank 0 idles briefly before closing, so that a relayed abort reaches it."""
import math
import time
from typing import Any

import harness
import nccl_model_cuda

SENT = {"agree": ((10, 100), "float32"), "count": ((1000,), "int32"), "dtype": ((1000,), "float32"),
        "shape": ((10, 100), "float32")}
RECEIVED = {"agree": ((10, 100), "float32"), "count": ((999,), "int32"), "dtype": ((1000,), "int32"),
            "shape": ((100, 10), "float32")}


def body(params):
    nccl_model_cuda.install()
    import torch

    import megatron_p2p as mp

    def tensor(spec):
        shape, dtype = spec
        return torch.arange(math.prod(shape)).reshape(shape).to(getattr(torch, dtype))

    on = nccl_model_cuda.on_device
    out = {}
    for case in params["cases"]:
        comm = mp.init_communicator(backend="nccl", timeout=params.get("timeout", 10.0))
        sent = tensor(SENT[case])
        buf = sent if comm.rank == 0 else torch.zeros_like(tensor(RECEIVED[case]))
        op: dict[str, Any] = {"send_next": on(buf)} if comm.rank == 0 else {"recv_prev": on(buf)}
        out[case] = harness.caught(lambda: [r.synchronize() for r in comm.exchange(**op, call="check_case").values()])
        out[case]["arrived"] = comm.rank == 1 and buf.numpy().tobytes() == sent.numpy().tobytes()
        if comm.rank == 0:
            time.sleep(0.5)
        comm.close()
    return out


harness.run(body)
