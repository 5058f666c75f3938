"""SIGKILL at one place of a communicator's life, on 2 ranks (params["where"], a key of
PLACES). The survivor reports what its call raised and how long it took, and what threads or
descriptors it still holds once it has closed everything (none, it must be).

params: where; timeout (the communicator timeout, long: a report well within it comes from
the transport noticing the death, not from the timeout); nbytes (the large message of the
copy rows). Each rank publishes its pid in torchrun's store, so that the survivor can check
that its error names the dead one. Survivors ignore torchrun's SIGTERM so that they can report."""
import json
import os
import signal
import threading
import time
from pathlib import Path

import arena_maps
import fault_resources
import harness

ARENA_PASS = 16 << 20  # what a sender copies into an arena buffer per pass
LANDING_LIMIT = 60.0  # seconds a receiver watches its arena buffer for the sender's first bytes


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def wait_until_gone(pid: int) -> None:
    """Until `pid` has exited and been reaped: a zombie still answers kill(pid, 0)."""
    while Path(f"/proc/{pid}").exists():
        time.sleep(0.005)


def kill_when_my_segment_is_ready() -> None:
    """Rank 0 is killed once its segment is sized and initialised, while it waits for the others."""
    prefix = f"mp2p-{os.getpid()}-"
    while not any(p.name.startswith(prefix) and p.stat().st_size > 0 for p in Path("/dev/shm").glob("mp2p-*")):
        time.sleep(0.001)
    time.sleep(0.02)
    die()


def attempt(make):
    """harness.caught of make(), keeping what it returned (a communicator to close)."""
    made = []
    record = harness.caught(lambda: made.append(make()))
    return record, (made[0] if made else None)


def before_attach(ctx):
    """Rank 1 has the segment's name and is killed before it opens it; rank 0 waits in creation."""
    if ctx.me == 1:
        ctx.C.Communicator = lambda *args, **kwargs: die()
    return attempt(ctx.init)


def during_attach(ctx):
    """Rank 0 is killed right after it created and initialised the segment; rank 1 attaches only
    then, to the orphan."""
    if ctx.me == 0:
        threading.Thread(target=kill_when_my_segment_is_ready, daemon=True).start()
    else:
        original = ctx.C.Communicator

        def attach_late(*args, **kwargs):
            wait_until_gone(ctx.peer_pid)
            return original(*args, **kwargs)

        ctx.C.Communicator = attach_late
    return attempt(ctx.init)


def mid_rendezvous(ctx):
    """Rank 0 posts a large send; rank 1 is killed before it posts the matching receive."""
    comm = ctx.init()
    if ctx.me == 1:
        ctx.store.wait(["posted"])
        die()
    req = comm.isend(ctx.torch.ones(ctx.nbytes, dtype=ctx.torch.uint8), 1)
    ctx.store.set("posted", "1")
    return harness.caught(req.wait), comm


def sender_dies_mid_copy(ctx):
    """Rank 0 sends `nbytes` and kills itself 30 ms after rank 1 starts to receive them (single
    copy or bounce buffer, as the environment says); rank 1 reports its receive."""
    comm = ctx.init()
    buf = ctx.torch.ones(ctx.nbytes, dtype=ctx.torch.uint8)
    if ctx.me == 0:
        comm.isend(buf, 1)
        ctx.store.wait(["receiving"])
        time.sleep(0.03)
        die()
    ctx.extra["single_copy"] = comm.single_copy(0)
    ctx.store.set("receiving", "1")
    return harness.caught(lambda: comm.irecv(buf, 0).wait()), comm


def receiver_dies_mid_copy(ctx):
    """Rank 1 receives `nbytes` by single copy and is killed by rank 0 30 ms after it starts;
    rank 0 reports its send."""
    comm = ctx.init()
    buf = ctx.torch.ones(ctx.nbytes, dtype=ctx.torch.uint8)
    if ctx.me == 1:
        ctx.store.set("receiving", "1")
        comm.irecv(buf, 0).wait()
        signal.pause()  # rank 0 kills this rank: mid-copy, or just after it in a failing run
    ctx.extra["single_copy"] = comm.single_copy(1)
    req = comm.isend(buf, 1)
    ctx.store.wait(["receiving"])
    time.sleep(0.03)
    os.kill(ctx.peer_pid, signal.SIGKILL)
    return harness.caught(req.wait), comm


def copy_under_way(buf):
    """Polls `buf`, zeroed, until the sender's first copy pass has written into it (or
    LANDING_LIMIT passed); then whether the copy is under way: its last byte still untouched."""
    deadline = time.monotonic() + LANDING_LIMIT
    while buf[0].item() == 0 and buf[ARENA_PASS - 1].item() == 0 and time.monotonic() < deadline:
        pass
    return buf[-1].item() == 0 and (buf[0].item() != 0 or buf[ARENA_PASS - 1].item() != 0)


def sender_dies_mid_arena_copy(ctx):
    """Rank 1 receives `nbytes` into a buffer from its arena; it kills rank 0 as soon as rank 0's
    copy into it has begun, and reports its receive."""
    comm = ctx.init()
    if ctx.me == 0:
        comm.isend(ctx.torch.ones(ctx.nbytes, dtype=ctx.torch.uint8), 1).wait()
        signal.pause()  # rank 1 kills this rank: mid-copy, or just after it in a failing run
    buf = comm.empty((ctx.nbytes,), ctx.torch.uint8).zero_()
    ctx.extra["in_arena"] = arena_maps.in_own_arena(buf)

    def receive():
        req = comm.irecv(buf, 0)
        ctx.extra["mid_copy"] = copy_under_way(buf)
        os.kill(ctx.peer_pid, signal.SIGKILL)
        req.wait()

    return harness.caught(receive), comm


def receiver_dies_mid_arena_copy(ctx):
    """Rank 1 receives `nbytes` into a buffer from its arena and is killed as soon as rank 0's
    copy into it has begun (it tells rank 0 first whether the copy was under way); rank 0
    reports its send."""
    comm = ctx.init()
    if ctx.me == 1:
        buf = comm.empty((ctx.nbytes,), ctx.torch.uint8).zero_()
        in_arena = arena_maps.in_own_arena(buf)
        comm.irecv(buf, 0)
        ctx.store.set("receiver", json.dumps({"mid_copy": copy_under_way(buf), "in_arena": in_arena}))
        die()
    record = harness.caught(lambda: comm.isend(ctx.torch.ones(ctx.nbytes, dtype=ctx.torch.uint8), 1).wait())
    ctx.extra.update(json.loads(ctx.store.get("receiver")))
    return record, comm


REASON = "fault matrix: rank 1 gave up"


def right_after_abort(ctx):
    """Rank 1 aborts with a reason and is killed at once; rank 0 waits on a receive from it."""
    comm = ctx.init()
    if ctx.me == 1:
        ctx.store.wait(["waiting"])
        comm.abort(reason=REASON)
        die()
    req = comm.irecv(ctx.torch.zeros(4, dtype=ctx.torch.uint8), 1)
    ctx.store.set("waiting", "1")
    return harness.caught(req.wait), comm


def right_after_close(ctx):
    """Rank 1 closes with a receive pending and is killed at once; rank 0 waits on a receive from it."""
    comm = ctx.init()
    if ctx.me == 1:
        comm.irecv(ctx.torch.zeros(4, dtype=ctx.torch.uint8), 0)
        ctx.store.wait(["waiting"])
        comm.close()
        die()
    req = comm.irecv(ctx.torch.zeros(4, dtype=ctx.torch.uint8), 1)
    ctx.store.set("waiting", "1")
    return harness.caught(req.wait), comm


PLACES = {f.__name__: f for f in (before_attach, during_attach, mid_rendezvous, sender_dies_mid_copy,
                                   receiver_dies_mid_copy, sender_dies_mid_arena_copy, receiver_dies_mid_arena_copy,
                                   right_after_abort, right_after_close)}


class Context:
    def __init__(self, params):
        import torch

        import megatron_p2p as mp
        from megatron_p2p import _C
        from megatron_p2p.communicator import _env_rendezvous

        self.torch, self.C, self.extra = torch, _C, {}
        self.store, self.me, _ = _env_rendezvous()
        self.nbytes = params.get("nbytes", 0)
        self.init = lambda: mp.init_communicator(timeout=params["timeout"])
        self.store.set(f"pid{self.me}", str(os.getpid()))
        self.peer_pid = int(self.store.get(f"pid{1 - self.me}"))


def body(params):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ctx = Context(params)
    ctx.torch.ones(8).sum()  # torch's lazy setup, before the first snapshot
    before = fault_resources.snapshot()
    record, comm = PLACES[params["where"]](ctx)
    if comm is not None:
        comm.close()
    left = fault_resources.left_behind(before, fault_resources.snapshot())
    return {"pid": os.getpid(), "peer_pid": ctx.peer_pid, "call": record, "left": left, **ctx.extra}


harness.run(body)
