"""Ctrl-C while a call blocks, in one process without torchrun: a SIGINT 0.3 s into the call must
raise KeyboardInterrupt within 200 ms. Usage: interrupt_blocked_call.py SCENARIO; prints one JSON
object.

  wait         rank 0 waits on a receive whose sender (rank 1, a thread) has not sent yet; after
               the interrupt the op is still pending and a second wait completes it, exactly
  synchronize  the same through synchronize(); after the interrupt abort() ends the op
  create       rank 0 creates a two-rank communicator whose rank 1 never comes
  attach       rank 1 waits for a segment whose rank 0 never creates it
  store        init_communicator as rank 1 of 2, waiting in the store for rank 0, who never comes
  close        wait() as in `wait`, with a SIGINT handler that closes the communicator and returns
               (a shutdown handler): the wait, still inside the transport, ends with P2PError
"""
import datetime
import json
import os
import signal
import socket
import sys
import threading
import time

import torch

import megatron_p2p as mp
from megatron_p2p import _C

SIGNAL_AFTER = 0.3
# Ctrl-C as an interactive Python takes it: a shell that starts the suite in the background makes
# its jobs ignore SIGINT, and a Python started so installs no handler of its own.
signal.signal(signal.SIGINT, signal.default_int_handler)


def interrupted(call) -> dict:
    """Runs `call` with a SIGINT 0.3 s in; when and how it ended."""
    threading.Timer(SIGNAL_AFTER, os.kill, (os.getpid(), signal.SIGINT)).start()
    start = time.monotonic()
    try:
        call()
        outcome = "returned"
    except KeyboardInterrupt:
        outcome = "KeyboardInterrupt"
    except Exception as e:  # noqa: BLE001 - recorded for the test to show
        outcome = f"{type(e).__name__}: {e}"
    return {"outcome": outcome, "after_signal": time.monotonic() - start - SIGNAL_AFTER}


def two_ranks_in_threads():
    """Both ranks of one shm communicator, in this process: rank 1 is created on a thread."""
    name = _C.new_unique_id()
    made: dict[int, _C.Communicator] = {}
    peer = threading.Thread(target=lambda: made.setdefault(1, _C.Communicator("shm", name, 1, [0, 1], timeout=30.0)))
    peer.start()
    rank0 = _C.Communicator("shm", name, 0, [0, 1], timeout=30.0)
    peer.join()
    return rank0, made[1]


def blocked_receive(how: str) -> dict:
    rank0, rank1 = two_ranks_in_threads()
    buf = torch.zeros(1024)
    req = rank0.irecv(buf, 1)
    out = interrupted(req.wait if how == "wait" else req.synchronize)
    out["pending_after"] = not req.is_completed()
    if how == "wait":
        sent = rank1.isend(torch.full((1024,), 7.0), 0)
        req.wait()
        sent.wait()
        out["completed_exactly"] = bool((buf == 7.0).all())
    else:
        rank0.abort(reason="stopped after Ctrl-C")
        start = time.monotonic()
        try:
            req.wait()
            out["after_abort"] = "returned"
        except mp.P2PError as e:
            out["after_abort"] = f"{type(e).__name__}: {e}"
        out["abort_ended_it_in"] = time.monotonic() - start
    rank0.close()
    rank1.close()
    return out


def closed_by_handler() -> dict:
    threads_before = len(os.listdir("/proc/self/task"))
    rank0, rank1 = two_ranks_in_threads()
    req = rank0.irecv(torch.zeros(1024), 1)
    signal.signal(signal.SIGINT, lambda *_: rank0.close())
    out = interrupted(req.wait)
    out["pending_after"] = not req.is_completed()
    try:
        rank0.isend(torch.zeros(1), 1)
        out["post_after"] = "accepted"
    except mp.P2PError as e:
        out["post_after"] = str(e)
    rank1.close()
    time.sleep(0.1)  # the signal's timer thread exits
    out["threads_left"] = len(os.listdir("/proc/self/task")) - threads_before  # each transport's progress thread
    return out


def creation(role: str) -> dict:
    name = _C.new_unique_id()
    rank = 0 if role == "create" else 1
    out = interrupted(lambda: _C.Communicator("shm", name, rank, [0, 1], timeout=30.0))
    out["segment_left"] = os.path.exists("/dev/shm" + name)
    return out


def store_wait() -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                                        timeout=datetime.timedelta(seconds=30))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="1", WORLD_SIZE="2")
    out = interrupted(lambda: mp.init_communicator(timeout=30.0))
    del server
    return out


def main() -> None:
    scenario = sys.argv[1]
    if scenario in ("wait", "synchronize"):
        out = blocked_receive(scenario)
    elif scenario in ("create", "attach"):
        out = creation(scenario)
    elif scenario == "close":
        out = closed_by_handler()
    else:
        out = store_wait()
    print(json.dumps(out), flush=True)


main()
