"""The shm suites, run on the NCCL backend over the fake libraries, in one 4-rank job (a job
start costs seconds, megatron-core's import many more):

  matching    matching_exchange.py: over the 4 ranks, then any partitions of them
  contiguity  a non-contiguous tensor is refused before anything is posted; a contiguous one is
              carried
  pipeline    sched_pipeline.py: ring exchanges and 1F1B on 2 to 4 stages, every payload exact
  megatron    megatron_dropin.py: megatron-core's P2PCommunicator and schedules over ours
  naive_ring  sched_naive_ring.py on params["ranks"]: isend to next, then irecv from prev

Each part is recorded as {"ok": True, "value", "seconds"} or the error it raised, so that one failing part
does not hide the others. params: one entry per part to run, holding that part's params."""
import datetime
import time
from typing import Any

import harness
import matching_exchange
import megatron_dropin
import sched_naive_ring
import sched_pipeline
from harness import caught
from nccl_model_backend import Backend


def contiguity(params, backend):
    """Both ranks' exchange with a non-contiguous receive (then send) is refused, posting
    nothing; the same exchange with contiguous tensors then carries exact bytes."""
    import torch

    import megatron_p2p as mp

    on = backend.tensor
    out: dict[str, Any] = {}
    with mp.init_communicator(backend=backend.name, timeout=params["timeout"]) as comm:
        sent = torch.arange(300, dtype=torch.float64) + 1000 * comm.rank
        strided = torch.zeros(300, 2, dtype=torch.float64)[:, 0]
        before = comm.stats()
        out["non_contiguous_recv"] = caught(lambda: comm.exchange(send_next=on(sent), recv_prev=on(strided)))
        out["non_contiguous_send"] = caught(
            lambda: comm.exchange(send_next=on(torch.stack([sent, sent], 1)[:, 0]), recv_prev=on(torch.zeros(300))))
        out["posted_nothing"] = comm.stats() == before
        got = torch.zeros(300, dtype=torch.float64)
        out["contiguous"] = caught(lambda: [backend.settle(r) for r in
                                            comm.exchange(send_next=on(sent), recv_prev=on(got)).values()])
        out["exact"] = torch.equal(got, torch.arange(300, dtype=torch.float64) + 1000 * comm.prev_rank)
    return out


def naive_ring(params, backend):
    import torch
    import torch.distributed as dist

    import megatron_p2p as mp

    group = dist.new_group(params["ranks"])  # collective over every rank
    if dist.get_rank() not in params["ranks"]:
        return None
    with mp.init_communicator(group, backend.name, timeout=params["timeout"]) as comm:
        return sched_naive_ring.naive_ring(torch, mp, comm, params["numel"], backend)


PARTS = {"matching": matching_exchange.run_all, "contiguity": contiguity, "pipeline": sched_pipeline.run_all,
         "megatron": megatron_dropin.run_all, "naive_ring": naive_ring}


def body(params):
    backend = Backend("nccl")
    if "megatron" in params:
        megatron_dropin.prepare()  # megatron-core's import, before the first collective's clock starts
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    out = {}
    for name, run in PARTS.items():
        if name in params:
            start = time.monotonic()
            out[name] = megatron_dropin.guarded(run, params[name], backend)
            out[name]["seconds"] = time.monotonic() - start
            dist.barrier()
    dist.destroy_process_group()
    return out


harness.run(body)
