"""Trace dump worker: 2 ranks with MEGATRON_P2P_TRACE_DIR set exchange a few messages and exit.

On the first communicator rank 0 signals itself (SIGUSR1) twice: while it computes, and while it
is blocked on a receive that rank 1 posts late. On a second communicator the ranks disagree on a
message's size, so both raise MismatchError. Each rank returns {"clean": id, "mismatched": id,
"raised": the error's class, "error_dump": dump} and rank 0 also {"computing": dump, "blocked":
dump}, with dump = {"reason", "error", "pending": [[kind, peer, state], ...]} as read right after
it was written. The exit dumps are what the parent test analyses."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import harness


def body(params):
    import torch

    import megatron_p2p as mp

    comm = mp.init_communicator(timeout=30.0)
    mine = torch.full((16,), float(comm.rank))
    theirs = torch.empty(16)
    for _ in range(3):
        if comm.rank == 0:
            reqs = comm.exchange(send_next=mine, recv_next=theirs, call="send_forward_recv_backward")
        else:
            reqs = comm.exchange(recv_prev=theirs, send_prev=mine, call="recv_forward_send_backward")
        for r in reqs.values():
            r.wait()
        assert theirs[0].item() == 1 - comm.rank

    result = {"clean": comm.id}
    if comm.rank == 1:
        time.sleep(1.5)  # rank 0 computes, then blocks on this message; it dumps on each signal
        comm.isend(torch.ones(4), comm.ranks[0], call="late_message").wait()
    else:
        signal_in(0.1)
        time.sleep(0.4)
        result["computing"] = read(dump_path(comm))
        timer = signal_in(0.3)
        comm.irecv(torch.empty(4), comm.ranks[1], call="late_message").wait()
        timer.join()
        result["blocked"] = read(dump_path(comm))

    bad = mp.init_communicator(timeout=30.0)
    result["mismatched"] = bad.id
    try:
        if bad.rank == 0:
            bad.isend(torch.ones(4), bad.ranks[1], call="wrong_size").wait()
        else:
            bad.irecv(torch.empty(2), bad.ranks[0], call="wrong_size").wait()
    except mp.P2PError as exc:
        result["raised"] = type(exc).__name__
    result["error_dump"] = read(dump_path(bad))
    return result


def dump_path(comm):
    return Path(os.environ["MEGATRON_P2P_TRACE_DIR"]) / f"rank{comm.global_rank}.{comm.id}.json"


def signal_in(seconds):
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGUSR1))
    timer.start()
    return timer


def read(path):
    dump = json.loads(path.read_text())
    return {"reason": dump["reason"], "error": dump["error"],
            "pending": [[o["kind"], o["peer"], o["state"]] for o in dump["ops"] if o["state"] in ("posted", "matched")]}


harness.run(body)
