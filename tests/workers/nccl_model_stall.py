"""Stalls on the NCCL backend over the model, and what the stall analysis makes of them
(megatron_p2p/stall.py). Cases (params["case"]):
  ring       every rank isends to its next, then irecvs from its previous rank, and synchronizes:
             the naive ring, a cycle of posted ops
  send_send  2 ranks send to each other and synchronize (the receives never posted); with
             "stream_wait", rank 1 only makes its stream wait and computes instead
  computing  rank 1 computes params["compute"] seconds before it posts its receive
  slow       one exchange whose kernels take MPFAKE_NCCL_DELAY_MS each (set by the test)
Each rank reports what its synchronize raised (harness.caught), and when."""
import time

import harness
import nccl_model_cuda


def body(params):
    nccl_model_cuda.install()
    import torch
    import megatron_p2p as mp

    on = nccl_model_cuda.on_device
    case, numel = params["case"], params.get("numel", 1 << 20)
    out = {}
    comm = mp.init_communicator(backend="nccl", timeout=params["timeout"], lanes=1)
    send = torch.full((numel,), float(comm.rank))
    got = torch.full((numel,), -1.0)
    if case == "ring":
        def run():
            s = comm.isend(on(send), comm.next_rank)
            r = comm.irecv(on(got), comm.prev_rank)
            s.synchronize()
            r.synchronize()
    elif case == "send_send":
        def run():
            s = comm.isend(on(send), 1 - comm.rank)
            if comm.rank == 1 and params.get("stream_wait"):
                s.wait()
                time.sleep(params["timeout"] + 2)  # computing, never in a host wait
            else:
                s.synchronize()
    else:  # computing, slow
        def run():
            if comm.rank == 0:
                comm.isend(on(send), 1).synchronize()
            else:
                time.sleep(params.get("compute", 0.0))
                comm.irecv(on(got), 0).synchronize()
    out["wait"] = harness.caught(run)
    out["received"] = sorted(set(got.tolist()))
    return out


harness.run(body)
