"""Exchanges on the NCCL backend over the fake libcuda/libnccl: in each mode, every rank sends
random bytes to both ring neighbours and reports digests of what it sent and what arrived."""
import hashlib
from typing import Any

import harness
import nccl_model_cuda


def digest(t) -> str:
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


def body(params):
    nccl_model_cuda.install()
    import torch

    import megatron_p2p as mp

    on = nccl_model_cuda.on_device
    numel = params.get("numel", 1000)
    out: dict[str, Any] = {"runs": []}
    with mp.init_communicator(backend="nccl", timeout=params.get("timeout", 20.0), lanes=params.get("lanes", 2)) as comm:
        for mode in params.get("modes", ["parity", "batched"]):
            for round_ in range(params.get("rounds", 3)):
                gen = torch.Generator().manual_seed(1000 * comm.rank + round_)
                fwd = torch.randint(-2**31, 2**31 - 1, (numel,), dtype=torch.int32, generator=gen)
                bwd = torch.rand(numel + 7, generator=gen, dtype=torch.float64)
                got_fwd, got_bwd = torch.zeros_like(fwd), torch.zeros_like(bwd)
                reqs = comm.exchange(send_next=on(fwd), recv_prev=on(got_fwd), send_prev=on(bwd),
                                     recv_next=on(got_bwd), mode=mode)
                for r in reqs.values():
                    r.synchronize()
                out["runs"].append({"mode": mode, "round": round_, "fwd_sent": digest(fwd), "bwd_sent": digest(bwd),
                                    "fwd_got": digest(got_fwd), "bwd_got": digest(got_bwd)})
        out.update(rank=comm.rank, prev=comm.prev_rank, next=comm.next_rank)
    return out


harness.run(body)
