"""Receive buffers from a rank's shared arena (`comm.empty`), observed on 2 ranks in one job:
importing torch and creating communicators costs seconds, so every section runs here and
returns records; tests/test_arena.py asserts on them.

Rank 0 sends, rank 1 receives, unless a section says otherwise. Where a buffer lives is read
from /proc/self/maps (arena_maps.py).

params: timeout (of every communicator), sections (names of SECTIONS to run; all when absent)."""
import ctypes
import logging
import os
import re
import time
import types
from pathlib import Path
from typing import Any

import harness
from arena_maps import arena_mappings, in_own_arena

KIB, MIB = 1 << 10, 1 << 20
SMALL_ARENA = 8 * MIB  # room for one block of 6 MiB, not two
BLOCK = 6 * MIB
SEGMENT = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) .*/dev/shm/mp2p-(\d+)-[0-9a-f]+(?: \(deleted\))?$")
FAIL_WAIT = 0.5  # seconds a receive waits for a sender that never sends


class Logs(logging.Handler):
    """WARNING records of logger "megatron_p2p.communicator", as (level, message)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.records = []
        logging.getLogger("megatron_p2p.communicator").addHandler(self)

    def emit(self, record):
        self.records.append([record.levelname, record.getMessage()])

    def arena_warnings(self):
        return [msg for _, msg in self.records if "receive arena" in msg]


def dev_shm_of(pid):
    return sorted(p.name for p in Path("/dev/shm").glob(f"mp2p-{pid}-*"))


class Ctx:
    def __init__(self, params):
        import torch

        import megatron_p2p as mp
        from megatron_p2p.communicator import _env_rendezvous

        self.torch, self.mp = torch, mp
        # float32 elements of a message whose sender always waits for the receive's answer, so
        # that the path it takes does not depend on which rank posts first
        self.large = mp._C.ARENA_WAIT_BYTES // 4
        self.store, self.me, _ = _env_rendezvous()
        self.timeout = params["timeout"]
        self.logs = Logs()
        self.store.set(f"arena/pid{self.me}", str(os.getpid()))
        self.peer_pid = int(self.store.get(f"arena/pid{1 - self.me}"))
        self.step = 0

    def init(self, env=None, **kwargs):
        """A communicator over both ranks, created with `env` set (and restored after)."""
        with harness.environ(env):
            return self.mp.init_communicator(timeout=self.timeout, **kwargs)

    def sync(self, what):
        """Both ranks reach this point (a fresh store key per call)."""
        self.step += 1
        self.store.set(f"arena/{what}/{self.step}/{self.me}", "1")
        self.store.wait([f"arena/{what}/{self.step}/{1 - self.me}"])

    def payload(self, tag, numel, dtype=None):
        return (self.torch.arange(numel, dtype=self.torch.float64) * 3 + tag).to(dtype or self.torch.float32)

    def transfer(self, comm, buf, tag, send_first=False):
        """Rank 0 sends a payload of buf's size and dtype; rank 1 receives it into `buf`. On
        rank 1: whether it arrived exactly, and the path that carried it (received_by_path)."""
        torch = self.torch
        if self.me == 0:
            data = self.payload(tag, buf.numel(), buf.dtype).reshape(buf.shape)
            req = comm.isend(data, 1)
            if send_first:
                self.store.set(f"arena/sent/{tag}", "1")
            req.wait()
            return None
        if send_first:
            self.store.wait([f"arena/sent/{tag}"])
            time.sleep(0.05)  # the send is waiting for this receive
        before = dict(comm.stats()["received_by_path"])
        comm.irecv(buf, 0).wait()
        after = comm.stats()["received_by_path"]
        paths = [p for p in after if after[p] != before[p]]
        expected = self.payload(tag, buf.numel(), buf.dtype).reshape(buf.shape)
        return {"exact": bool(torch.equal(buf.detach(), expected)), "paths": paths}


def burst(ctx, comm, count, numel):
    """`count` arena receives posted at once, more than a channel's offer slots, then their
    sends: whether each arrived exactly, and the paths that carried them (rank 1)."""
    torch = ctx.torch
    if ctx.me == 0:
        ctx.store.wait(["arena/burst-posted"])
        reqs = [comm.isend(ctx.payload(100 + i, numel), 1) for i in range(count)]
        for r in reqs:
            r.wait()
        return None
    before = dict(comm.stats()["received_by_path"])
    bufs = [comm.empty((numel,), torch.float32) for _ in range(count)]
    reqs = [comm.irecv(b, 0) for b in bufs]
    ctx.store.set("arena/burst-posted", "1")
    for r in reqs:
        r.wait()
    after = comm.stats()["received_by_path"]
    return {"exact": [bool(torch.equal(b, ctx.payload(100 + i, numel))) for i, b in enumerate(bufs)],
            "paths": {p: after[p] - before[p] for p in after if after[p] != before[p]}}


STREAM_MESSAGES = 120
STREAM_BATCH = 10  # receives in one group: more than a channel's 8 offer slots
STREAM_WINDOW = 12  # single receives kept posted past the batches


def stream_numel(i):
    """float32 elements of message i: past the inline slot (4 KiB), under ARENA_WAIT_BYTES, over
    every power of two between."""
    base = 1024 << (i % 8)
    return base + 1 + (i * 997) % (base - 1)


def offers_in_flight(ctx, comm):
    """Rank 0 streams STREAM_MESSAGES sends; rank 1 receives them into arena buffers, first in
    groups of STREAM_BATCH, then singly with STREAM_WINDOW posted while the earlier ones complete:
    more receives outstanding on the channel than it has offer slots, so that receives k and k + 8
    answer into one slot, from the posting thread and from the engine's (rank 1)."""
    torch = ctx.torch
    if ctx.me == 0:
        reqs = [comm.isend(ctx.payload(200 + i, stream_numel(i)), 1) for i in range(STREAM_MESSAGES)]
        for r in reqs:
            r.wait()
        return None
    before = dict(comm.stats()["received_by_path"])
    bufs = [comm.empty((stream_numel(i),), torch.float32).zero_() for i in range(STREAM_MESSAGES)]
    batched = STREAM_MESSAGES // 2
    reqs = []
    for first in range(0, batched, STREAM_BATCH):
        reqs += comm.batch([(False, bufs[i], 0) for i in range(first, first + STREAM_BATCH)])
    for i in range(batched, STREAM_MESSAGES):
        if len(reqs) - STREAM_WINDOW >= 0:
            reqs[len(reqs) - STREAM_WINDOW].wait()
        reqs.append(comm.irecv(bufs[i], 0))
    for r in reqs:
        r.wait()
    after = comm.stats()["received_by_path"]
    return {"exact": sum(bool(torch.equal(b, ctx.payload(200 + i, b.numel()))) for i, b in enumerate(bufs)),
            "in_arena": sum(in_own_arena(b) for b in bufs),
            "paths": {p: after[p] - before[p] for p in after if after[p] != before[p]}}


# ---- sections ----------------------------------------------------------------------------------


def delivery(ctx):
    """Into comm.empty and into torch.empty, single copy on and off; send posted first."""
    torch, out = ctx.torch, {}
    n = ctx.large
    comm = ctx.init()
    out["arena_bytes"] = comm.arena_bytes
    arena_buf = comm.empty((n,), torch.float32)
    out["arena_buf_in_arena"] = in_own_arena(arena_buf)
    out["into_arena"] = ctx.transfer(comm, arena_buf, 1)
    waits = ctx.mp._C.ARENA_WAIT_BYTES // 4  # float32 elements of the smallest send that waits
    out["into_arena_send_first"] = ctx.transfer(comm, comm.empty((waits,), torch.float32), 2, send_first=True)
    out["into_arena_send_first_small"] = ctx.transfer(comm, comm.empty((waits - 1,), torch.float32), 3,
                                                      send_first=True)
    plain = torch.empty(n, dtype=torch.float32)
    out["plain_buf_in_arena"] = in_own_arena(plain)
    out["into_plain"] = ctx.transfer(comm, plain, 3)
    # 40 MiB: the sender copies it in several passes
    out["into_arena_40mib"] = ctx.transfer(comm, comm.empty((10 * MIB,), torch.float32), 6)
    # a view at an offset inside a block: the bytes land there, and nowhere else in the block
    block = comm.empty((3 * n,), torch.float32)
    block.fill_(-1)
    out["into_view"] = ctx.transfer(comm, block[n:2 * n], 7)
    out["view_neighbours_untouched"] = bool((block[:n] == -1).all() and (block[2 * n:] == -1).all())
    out["burst"] = burst(ctx, comm, 12, n)
    out["offers_in_flight"] = offers_in_flight(ctx, comm)
    comm.close()
    comm = ctx.init(env={"MEGATRON_P2P_SHM_SINGLE_COPY": "0"})
    out["no_single_copy"] = {"into_arena": ctx.transfer(comm, comm.empty((n,), torch.float32), 4),
                             "into_plain": ctx.transfer(comm, torch.empty(n, dtype=torch.float32), 5)}
    comm.close()
    return out


def tensors(ctx):
    """What comm.empty returns: ordinary tensors; small ones plain."""
    torch = ctx.torch
    out: dict[str, Any] = {}
    comm = ctx.init(eager_threshold=64 * KIB)
    for name in ("float32", "bfloat16", "float16", "complex64", "int64", "uint8", "bool"):
        dtype = getattr(torch, name)
        t = comm.empty((65, 1024), dtype)  # above the 64 KiB eager threshold
        rec = {"shape": list(t.shape), "dtype": str(t.dtype), "contiguous": t.is_contiguous(),
               "device": str(t.device), "in_arena": in_own_arena(t)}
        t.fill_(True if dtype == torch.bool else 7)
        rec["written"] = bool((t == (True if dtype == torch.bool else 7)).all())
        if dtype.is_floating_point or dtype.is_complex:
            g = t.requires_grad_()
            (g.real if dtype.is_complex else g).float().sum().backward()
            rec["grad"] = g.requires_grad and g.grad is not None and bool((g.grad == 1).all())
        out[name] = rec
    size = torch.Size([8, 4096])
    out["torch_size_shape"] = list(comm.empty(size, torch.float32).shape)
    # eager_threshold is 64 KiB: what fits it travels inline, so is plain memory
    out["at_eager_threshold_in_arena"] = in_own_arena(comm.empty((16 * KIB,), torch.float32))
    out["above_eager_threshold_in_arena"] = in_own_arena(comm.empty((16 * KIB + 1,), torch.float32))
    out["scalar"] = {"shape": list(comm.empty((), torch.float32).shape),
                     "in_arena": in_own_arena(comm.empty((), torch.float32))}
    out["zero_elements"] = {"shape": list(comm.empty((0, 5), torch.float32).shape),
                            "in_arena": in_own_arena(comm.empty((0, 5), torch.float32))}
    comm.close()
    comm = ctx.init()  # eager_threshold 0: the 4 KiB of a descriptor slot decide
    out["at_slot_size_in_arena"] = in_own_arena(comm.empty((KIB,), torch.float32))
    out["above_slot_size_in_arena"] = in_own_arena(comm.empty((KIB + 1,), torch.float32))
    comm.close()
    return out


def exhaustion(ctx):
    """An 8 MiB arena: a second 6 MiB buffer falls back to plain memory, logged once; after the
    first is freed, its room is handed out again."""
    torch, out = ctx.torch, {}
    comm = ctx.init(arena_bytes=SMALL_ARENA)
    out["arena_bytes"] = comm.arena_bytes
    warned = len(ctx.logs.arena_warnings())
    first = comm.empty((BLOCK,), torch.uint8)
    out["first_in_arena"] = in_own_arena(first)
    out["warnings_before_full"] = ctx.logs.arena_warnings()[warned:]
    spilled = []
    spill = [harness.caught(lambda: spilled.append(comm.empty((BLOCK,), torch.uint8))) for _ in range(3)]
    out["spill_raised"] = [r["type"] for r in spill]
    out["spilled_in_arena"] = [in_own_arena(t) for t in spilled]
    out["warnings_when_full"] = ctx.logs.arena_warnings()[warned:]
    out["into_spilled"] = ctx.transfer(comm, spilled[0], 11)
    del first
    again = comm.empty((BLOCK,), torch.uint8)
    out["after_free_in_arena"] = in_own_arena(again)
    out["into_reused"] = ctx.transfer(comm, again, 12)
    out["warnings_after_reuse"] = ctx.logs.arena_warnings()[warned:]
    comm.close()
    return out


def lifetime(ctx):
    """A buffer outlives its communicator; the arena goes with the last of its buffers."""
    torch, out = ctx.torch, {}
    comm = ctx.init()
    buf = comm.empty((ctx.large,), torch.float32)
    out["transfer"] = ctx.transfer(comm, buf, 21)
    out["peer_arena_mapped_while_open"] = len(arena_mappings(ctx.peer_pid))
    ctx.sync("lifetime-received")
    comm.close()
    expected = ctx.payload(21, ctx.large)
    out["readable_after_close"] = bool(torch.equal(buf, expected)) if ctx.me == 1 else None
    buf.fill_(5)
    out["writable_after_close"] = bool((buf == 5).all())
    out["in_arena_after_close"] = in_own_arena(buf)
    out["peer_arena_mapped_after_close"] = len(arena_mappings(ctx.peer_pid))
    after_close = comm.empty((ctx.large,), torch.float32)
    out["empty_after_close_in_arena"] = in_own_arena(after_close)
    out["empty_after_close_shape"] = list(after_close.shape)
    del buf, after_close
    out["own_arena_mapped_after_del"] = len(arena_mappings(os.getpid()))
    out["dev_shm_after"] = dev_shm_of(os.getpid())
    return out


def disabled(ctx):
    """arena_bytes=0, and MEGATRON_P2P_SHM_ARENA_BYTES, decide whether there is an arena."""
    torch, out = ctx.torch, {}
    comm = ctx.init(arena_bytes=0)
    buf = comm.empty((ctx.large,), torch.float32)
    out["arg_zero"] = {"arena_bytes": comm.arena_bytes, "own_arenas": len(arena_mappings(os.getpid())),
                       "in_arena": in_own_arena(buf), "transfer": ctx.transfer(comm, buf, 31)}
    comm.close()
    del buf
    comm = ctx.init(env={"MEGATRON_P2P_SHM_ARENA_BYTES": "0"})
    out["env_zero"] = {"arena_bytes": comm.arena_bytes, "own_arenas": len(arena_mappings(os.getpid()))}
    comm.close()
    comm = ctx.init(env={"MEGATRON_P2P_SHM_ARENA_BYTES": str(16 * MIB)})
    buf = comm.empty((ctx.large,), torch.float32)
    out["env_16mib"] = {"arena_bytes": comm.arena_bytes, "in_arena": in_own_arena(buf),
                        "transfer": ctx.transfer(comm, buf, 32)}
    comm.close()
    del buf
    comm = ctx.init(arena_bytes=ctx.mp._C.MAX_ARENA_BYTES)
    buf = comm.empty((ctx.large,), torch.float32)
    out["arg_max"] = {"arena_bytes": comm.arena_bytes, "in_arena": in_own_arena(buf),
                      "transfer": ctx.transfer(comm, buf, 33)}
    comm.close()
    return out


def invalid(ctx):
    """Arena sizes refused before anything is created (nothing collective happens)."""
    top = ctx.mp._C.MAX_ARENA_BYTES
    out: dict[str, Any] = {"arg": {}, "env": {}}
    for value in (-1, True, 1.5, top + 1, "1048576"):
        out["arg"][repr(value)] = harness.caught(lambda: ctx.init(arena_bytes=value))
    for value in ("lots", "-1", str(top + 1), "1.5", ""):
        out["env"][repr(value)] = harness.caught(lambda: ctx.init(env={"MEGATRON_P2P_SHM_ARENA_BYTES": value}))
    return out


def failed_receive(ctx, fail):
    """An 8 MiB arena that one receive buffer fills. `fail` says how the receive ends:
    - None: it completes;
    - "timeout": it waits FAIL_WAIT for a sender that never sends (which aborts the communicator);
    - "peer_abort": rank 0 aborts while it waits;
    - "mismatch": rank 0 sends another size, so it chooses a path other than the arena, and the
      receive raises MismatchError;
    - "timeout_plain": like "timeout", into a plain buffer (the arena's buffer is not received into).
    Then, the buffer gone, rank 1 asks for the whole arena again."""
    torch = ctx.torch
    comm = ctx.init(arena_bytes=SMALL_ARENA)
    out: dict[str, Any] = {}
    if ctx.me == 0:
        if fail is None:
            ctx.transfer(comm, torch.empty(SMALL_ARENA, dtype=torch.uint8), 41)
        elif fail == "peer_abort":
            ctx.store.wait([f"arena/waiting/{fail}"])
            time.sleep(0.3)  # rank 1 is inside its wait, its receive active (offered)
            comm.abort(reason="arena test: rank 0 gives up")
        elif fail == "mismatch":
            out["send"] = harness.caught(lambda: comm.isend(torch.ones(SMALL_ARENA // 2, dtype=torch.uint8), 1).wait())
        ctx.sync(f"failed-{fail}")
        comm.close()
        return out
    buf = comm.empty((SMALL_ARENA,), torch.uint8)
    out["in_arena"] = in_own_arena(buf)
    if fail is None:
        out["transfer"] = ctx.transfer(comm, buf, 41)
    else:
        req = comm.irecv(torch.empty(SMALL_ARENA, dtype=torch.uint8) if fail == "timeout_plain" else buf, 0)
        if fail == "peer_abort":
            ctx.store.set(f"arena/waiting/{fail}", "1")
        limit = FAIL_WAIT if fail.startswith("timeout") else ctx.timeout
        out["wait"] = harness.caught(lambda: req.wait(limit))
        del req
    ctx.sync(f"failed-{fail}")
    del buf
    again = comm.empty((SMALL_ARENA,), torch.uint8)
    out["again_in_arena"] = in_own_arena(again)
    comm.close()
    del again
    out["own_arenas_left"] = len(arena_mappings(os.getpid()))
    return out


def quarantine(ctx):
    return {fail or "completed": failed_receive(ctx, fail)
            for fail in (None, "timeout", "peer_abort", "mismatch", "timeout_plain")}


FORGED_NBYTES = 3 * MIB + 4 * KIB  # a size no other offer in the segment has
FORGED_ARENA = 16 * MIB


def segment_words(pid):
    """The communicator's shared segment (created by `pid`), as 64-bit words over its mapping."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        m = SEGMENT.match(line)
        if m and int(m.group(3)) == pid:
            start, end = int(m.group(1), 16), int(m.group(2), 16)
            return (ctypes.c_uint64 * ((end - start) // 8)).from_address(start)
    raise RuntimeError(f"no segment of pid {pid} is mapped")


def find_offer(torch, words, nbytes):
    """The index of the offset word of the offer {seq 1, offset, nbytes} in the segment: the
    receive of message #0 offering a buffer of `nbytes`. Polls until its receive is active;
    reads the segment from its start a piece at a time (the channels come before the bounce
    buffers, which reading would back with memory)."""
    piece = 8 * KIB  # words
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:
        for start in range(0, len(words), piece):
            count = min(piece + 2, len(words) - start)
            view = torch.frombuffer(words, dtype=torch.int64, offset=start * 8, count=count)
            for i in torch.nonzero(view[2:] == nbytes).flatten().tolist():
                if view[i] == 1:
                    return start + i + 1
        time.sleep(0.01)
    raise RuntimeError(f"no offer of {nbytes} bytes appeared in the segment")


def forged_offer(ctx, forge):
    """Rank 1 posts a receive into its arena, then (as a hostile peer could) rewrites the
    offset of its offer before rank 0 sends: `forge` maps (arena bytes, nbytes) to the offset,
    or is None (nothing rewritten). Rank 0 reports its send, rank 1 its receive and whether the
    bytes landed where the offset points."""
    torch = ctx.torch
    comm = ctx.init(arena_bytes=FORGED_ARENA)
    segment_pid = ctx.peer_pid if ctx.me == 1 else os.getpid()  # rank 0 created the segment
    payload = (torch.arange(FORGED_NBYTES, dtype=torch.int64) % 251).to(torch.uint8)
    out: dict[str, Any] = {}
    if ctx.me == 0:
        ctx.store.wait([f"arena/forged/{forge}"])
        out["send"] = harness.caught(lambda: comm.isend(payload, 1).wait())
        ctx.sync(f"forged-{forge}")
        comm.close()
        return out
    buf = comm.empty((FORGED_NBYTES,), torch.uint8).zero_()
    req = comm.irecv(buf, 0)
    words = segment_words(segment_pid)
    at = find_offer(torch, words, FORGED_NBYTES)
    out["offered_offset"] = words[at]
    if forge is not None:
        words[at] = FORGES[forge](comm.arena_bytes, FORGED_NBYTES) % (1 << 64)
        out["forged_offset"] = words[at]
    ctx.store.set(f"arena/forged/{forge}", "1")
    out["recv"] = harness.caught(lambda: req.wait(ctx.timeout))
    out["buffer_exact"] = bool(torch.equal(buf, payload))
    target = words[at] if forge is not None else out["offered_offset"]
    lo = [lo for lo, _, _, _ in arena_mappings(os.getpid())]
    if target + FORGED_NBYTES <= comm.arena_bytes and len(lo) == 1:
        landed = (ctypes.c_uint8 * FORGED_NBYTES).from_address(lo[0] + target)
        out["landed_where_pointed"] = bool(torch.equal(torch.frombuffer(landed, dtype=torch.uint8), payload))
    ctx.sync(f"forged-{forge}")
    req = buf = None  # the arena buffer released before close
    comm.close()
    return out


FORGES = {
    "at_the_end": lambda arena, nbytes: arena - nbytes,  # the last bytes of the arena: in bounds
    "one_past_the_end": lambda arena, nbytes: arena - nbytes + 1,
    "huge": lambda arena, nbytes: -4096,  # offset + nbytes wraps around 2**64
}


def forged_offers(ctx):
    return {forge or "untouched": forged_offer(ctx, forge) for forge in (None, *FORGES)}


def mixed(ctx):
    """Rank 0 has no arena, rank 1 has one: each side's receive buffers follow its own arena."""
    torch, n = ctx.torch, ctx.large
    comm = ctx.init(arena_bytes=0 if ctx.me == 0 else 16 * MIB)
    buf = comm.empty((n,), torch.float32)
    out = {"arena_bytes": comm.arena_bytes, "in_arena": in_own_arena(buf),
           "peer_arenas_mapped": len(arena_mappings(ctx.peer_pid))}
    out["to_rank_1"] = ctx.transfer(comm, buf, 61)
    # and the other way: rank 1 sends to rank 0's plain buffer
    if ctx.me == 1:
        comm.isend(ctx.payload(62, n), 0).wait()
    else:
        before = dict(comm.stats()["received_by_path"])
        comm.irecv(buf, 1).wait()
        after = comm.stats()["received_by_path"]
        out["to_rank_0"] = {"exact": bool(torch.equal(buf, ctx.payload(62, n))),
                            "paths": [p for p in after if after[p] != before[p]]}
    comm.close()
    return out


def dropin(ctx):
    """megatron_p2p's P2PCommunicator allocates its receive buffers from the arena."""
    import torch.distributed as dist
    from torch import Tensor

    from megatron_p2p.p2p_communication import P2PCommunicator

    torch = ctx.torch
    dist.init_process_group("gloo")
    comm = ctx.init()
    config = types.SimpleNamespace(pipeline_dtype=torch.float32, batch_p2p_comm=True, variable_seq_lengths=False,
                                   timers=None)
    p2p = P2PCommunicator(None, config, comm=comm)
    shape = [512, 2, 512]  # 2 MiB of float32: its senders wait for the answer
    before = dict(comm.stats()["received_by_path"])
    out = {}
    if ctx.me == 0:
        p2p.send_forward(ctx.payload(51, 512 * 2 * 512).reshape(shape), is_last_stage=False)
        got = p2p.recv_backward(shape, is_last_stage=False)
        expected = ctx.payload(52, 512 * 2 * 512).reshape(shape)
    else:
        got = p2p.recv_forward(shape, is_first_stage=False)
        p2p.send_backward(ctx.payload(52, 512 * 2 * 512).reshape(shape), is_first_stage=False)
        expected = ctx.payload(51, 512 * 2 * 512).reshape(shape)
    assert isinstance(got, Tensor)  # one shape: one tensor
    after = comm.stats()["received_by_path"]
    out = {"exact": bool(torch.equal(got.detach(), expected)), "requires_grad": got.requires_grad,
           "in_arena": in_own_arena(got), "arena_delta": after["arena"] - before["arena"],
           "other_paths_delta": sum(after[p] - before[p] for p in after if p != "arena")}
    comm.close()
    dist.destroy_process_group()
    return out


SECTIONS = {f.__name__: f for f in (delivery, tensors, exhaustion, lifetime, disabled, invalid, quarantine, mixed,
                                   forged_offers, dropin)}


def body(params):
    ctx = Ctx(params)
    ctx.torch.ones(8).sum()
    wanted = params.get("sections") or list(SECTIONS)
    out: dict[str, Any] = {"pid": os.getpid(), "peer_pid": ctx.peer_pid}
    for name in wanted:
        start = time.monotonic()
        out[name] = SECTIONS[name](ctx)
        out[name + "_seconds"] = time.monotonic() - start
        ctx.sync(name)
    out["warnings"] = ctx.logs.records
    return out


harness.run(body)
