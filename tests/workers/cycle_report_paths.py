"""One program replayed on shm (run-time detection, with the flight recorder dumping into
params["trace_dir"]) and then on NCCL over the model (the stall analysis), by
megatron_p2p.replay's own runner. Each rank returns, per backend, the error its replay raised."""
import datetime

import harness
import nccl_model_cuda


def body(params):
    nccl_model_cuda.install()
    import torch
    import torch.distributed as dist

    from megatron_p2p.verify import program, replay

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    me = dist.get_rank()
    ring = program.loads(params["program"])
    out = {}
    with harness.environ({"MEGATRON_P2P_TRACE_DIR": params["trace_dir"]}):
        out["shm"] = replay._run_one(ring, "shm", params["timeout"], me)
    dist.barrier()
    # torch has no CUDA here: replay's buffers become the model's device memory (CPU underneath)
    on_host = replay._tensor
    replay._tensor = lambda nbytes, dtype, device, fill=None: nccl_model_cuda.on_device(
        on_host(nbytes, dtype, torch.device("cpu"), fill))
    out["nccl"] = replay._run_one(ring, "nccl", params["timeout"], me)
    dist.barrier()
    dist.destroy_process_group()
    return out


harness.run(body)
