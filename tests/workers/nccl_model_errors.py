"""How the NCCL backend reports NCCL's failures, on one rank over the fakes (params["case"]):
  async   an exchange on a communicator that the fake fails with an asynchronous error (the
          environment says which, and whether the fake logs a warning for it)
  create  creating a two-rank communicator whose rank 1 never comes, with a short timeout
  one_rank  creating a one-rank communicator (the environment may hold NCCL_COMM_BLOCKING)
With params["stale"], an earlier call that has nothing to do with the communicator fails first
(ncclGroupEnd without ncclGroupStart, as another user of the same libnccl in the process, torch's
ProcessGroupNCCL say, might make), leaving NCCL's process-wide last error set. Reports what the
calls raised (harness.caught) and the last error the stale call left."""
import ctypes
from typing import Any

import harness
import nccl_model_cuda


def body(params):
    nccl_model_cuda.install()
    import torch

    import megatron_p2p as mp

    out: dict[str, Any] = {"stale": None}
    mp.nccl_version()  # loads libnccl; the handle below is the same copy
    if params.get("stale"):
        nccl = ctypes.CDLL(nccl_model_cuda.ENV["MEGATRON_P2P_NCCL_LIBRARY"])
        nccl.ncclGetLastError.argtypes = [ctypes.c_void_p]
        nccl.ncclGetLastError.restype = ctypes.c_char_p
        assert nccl.ncclGroupEnd() == 5  # ncclInvalidUsage
        out["stale"] = nccl.ncclGetLastError(None).decode()
    if params["case"] == "one_rank":  # a one-rank communicator, made and closed
        ids = b"".join(mp._C.nccl_unique_id() for _ in range(2))
        out["create"] = harness.caught(lambda: mp._C.Communicator(
            "nccl", ids, 0, [0], device=0, stream=mp.nccl.stream_handle(0), timeout=10.0).close())
        return out
    if params["case"] == "create":
        ids = b"".join(mp._C.nccl_unique_id() for _ in range(2))  # one per lane
        out["create"] = harness.caught(lambda: mp._C.Communicator(
            "nccl", ids, 0, [0, 1], device=0, stream=mp.nccl.stream_handle(0), timeout=params["timeout"]).close())
        return out
    on = nccl_model_cuda.on_device
    comm = mp.init_communicator(backend="nccl", lanes=1, timeout=20.0)
    t = torch.ones(64, dtype=torch.float32)
    got = torch.zeros(64, dtype=torch.float32)
    out["wait"] = harness.caught(lambda: [r.synchronize(timeout=10.0) for r in
                                          comm.exchange(send_next=on(t), recv_prev=on(got)).values()])
    comm.close()
    return out


harness.run(body)
