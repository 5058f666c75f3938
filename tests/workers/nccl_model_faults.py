"""Failure cases of the NCCL backend over the fake libraries (params["case"]):
  mismatch  rank 0 sends 1000 int32 to rank 1, which receives 999 (or 1000 when "agree")
  silent    one exchange and synchronize(timeout), while the fake keeps a rank from posting
            ("wait" is one timeout for all ranks, or a list with one per rank); then one more exchange
  close     an exchange left pending (the peer never posts), then close(): how long it takes
  close_tells  rank 0 closes with a send pending (timeout params["timeouts"][0]) while rank 1, whose
            timeout is far longer, waits on its own send to rank 0: how soon rank 1 hears of it;
            with "idle", rank 0's ops have all completed when it closes, and rank 1 then waits
            params["wait"] on a send that rank 0 never receives
Each rank reports what its calls raised (harness.caught) and how long they took."""
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
    case = params["case"]
    out: dict[str, Any] = {}
    timeout = params["timeouts"][int(os.environ["RANK"])] if "timeouts" in params else params.get("timeout", 20.0)
    comm = mp.init_communicator(backend="nccl", timeout=timeout)
    if case == "mismatch":
        n = 1000 if comm.rank == 0 or params.get("agree") else 999
        t = torch.arange(n, dtype=torch.int32)
        got = torch.zeros(n, dtype=torch.int32)
        reqs = comm.exchange(send_next=on(t)) if comm.rank == 0 else comm.exchange(recv_prev=on(got))
        out["wait"] = harness.caught(lambda: [r.synchronize(timeout=params.get("wait", 10.0)) for r in reqs.values()])
        out["exact"] = comm.rank == 0 or bool(torch.equal(got, torch.arange(n, dtype=torch.int32)))
    elif case == "silent":
        t = torch.ones(64, dtype=torch.float32)
        got = torch.zeros(64, dtype=torch.float32)
        wait = params["wait"][comm.rank] if isinstance(params["wait"], list) else params["wait"]
        out["wait"] = harness.caught(lambda: [r.synchronize(timeout=wait) for r in
                                              comm.exchange(send_next=on(t), recv_prev=on(got)).values()])
        out["next_call"] = harness.caught(lambda: comm.exchange(send_next=on(t), recv_prev=on(got)))
    elif case == "close":
        t = torch.ones(64, dtype=torch.float32)
        got = torch.zeros(64, dtype=torch.float32)
        comm.exchange(send_next=on(t), recv_prev=on(got))
    elif case == "close_tells":
        return close_tells(comm, params, out, on, torch)
    start = time.monotonic()
    comm.close()
    out["close_seconds"] = time.monotonic() - start
    return out


def close_tells(comm, params, out, on, torch):
    t = torch.ones(4096, dtype=torch.float32)
    got = torch.zeros(4096, dtype=torch.float32)
    peer = comm.ranks[1 - comm.rank]
    if params.get("idle"):
        for r in comm.exchange(send_next=on(t), recv_prev=on(got)).values():
            r.synchronize()
        if comm.rank == 0:
            comm.close()
            time.sleep(params["wait"] + 2.0)  # alive, so only a relayed abort could fail rank 1's op
            return out
        req = comm.isend(on(t), peer)
        out["wait"] = harness.caught(lambda: req.synchronize(timeout=params["wait"]))
        return out
    req = comm.isend(on(t), peer)
    if comm.rank == 0:
        start = time.monotonic()
        comm.close()
        out["close_seconds"] = time.monotonic() - start
        time.sleep(3.0)  # alive while rank 1 hears of the close through the store
        return out
    out["wait"] = harness.caught(lambda: req.synchronize())
    return out


harness.run(body)
