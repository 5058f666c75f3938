"""Stalls on the NCCL backend over the model, and what the stall analysis makes of them
(megatron_p2p/_stall.py). One job of 3 ranks runs params["cases"] in order, each on a new
communicator, with the model's options of its "env" set while it is created:
  ring       every rank isends to its next, then irecvs from its previous rank, and synchronizes:
             the naive ring, a cycle of posted ops
  send_send  ranks 0 and 1 send to each other and synchronize, then receive from each other; with
             "stream_wait", rank 1 only makes its stream wait and computes instead
  computing  rank 1 computes case["compute"] seconds before it posts its receive from rank 0
  slow       rank 0 sends to rank 1, whose kernels each take MPFAKE_NCCL_DELAY_MS
Rank 2 takes part only in the ring. Each rank reports, per case, what its wait raised
(harness.caught) and when."""
import os
import time

import harness
import nccl_model_cuda


def run_case(mp, torch, on, case, rank):
    numel = case.get("numel", 1 << 20)
    comm = mp.init_communicator(backend="nccl", timeout=case["timeout"], lanes=1)
    send = torch.full((numel,), float(comm.rank))
    got = torch.full((numel,), -1.0)
    kind = case["case"]

    def run():
        if kind == "ring":
            s = comm.isend(on(send), comm.next_rank)
            r = comm.irecv(on(got), comm.prev_rank)
            s.synchronize()
            r.synchronize()
        elif rank == 2:
            return
        elif kind == "send_send":
            s = comm.isend(on(send), 1 - rank)
            if rank == 1 and case.get("stream_wait"):
                s.wait()
                time.sleep(case["timeout"] + 2)  # computing, never in a host wait
            else:
                s.synchronize()
                comm.irecv(on(got), 1 - rank).synchronize()  # reached only where the send was buffered
        elif rank == 0:  # computing, slow
            comm.isend(on(send), 1).synchronize()
        else:
            time.sleep(case.get("compute", 0.0))
            comm.irecv(on(got), 0).synchronize()

    out = {"wait": harness.caught(run), "buffered_at_most": comm.buffered_at_most}
    comm.close()
    return out


def body(params):
    nccl_model_cuda.install()
    import torch

    import megatron_p2p as mp

    rank = int(os.environ["RANK"])
    results = []
    for case in params["cases"]:
        with harness.environ(case.get("env")):  # the model reads its options at creation
            results.append(run_case(mp, torch, nccl_model_cuda.on_device, case, rank))
    return results


harness.run(body)
