"""Matching worker: every rank runs the same schedule of pipeline exchanges and checks every byte
it receives.

Each message is a deterministic byte pattern derived from (sender's global rank, direction,
size) whose first bytes are a header naming the sender, the direction (fwd: sent with
send_next / to the next stage, bwd: sent with send_prev / to the previous stage) and the
exchange number, so a receiver can tell exactly what it got and from whom. Receive buffers are
filled with 0xEE before every exchange, so an unwritten buffer never passes.

params (all from tests/test_matching.py):
    suite: what to run over the WORLD communicator (see run_suite)
    process_group: call dist.init_process_group("gloo") first
    subgroups / subgroup_suite: global-rank groups, created with dist.new_group on every rank in
        the same order; each rank also runs subgroup_suite over the group holding it
    partitions: [{"groups": [...], "suite": ...}]: more such sets of groups, one after the other
    expect_single_copy: True/False: asserted for comm.single_copy(comm.next_rank); None: not asserted
    backend: "shm" (the default) or "nccl", the NCCL backend over the fake libraries
Returns {"world": suite result, "subgroup": suite result or None, "partitions": [suite result]}.
"""
from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import harness
from nccl_model_backend import Backend

FWD, BWD = 0, 1
DIRS = ("fwd", "bwd")
KINDS = ("both", "fwd", "bwd")  # which half of an exchange a step posts, cycling over steps
BLOCK_WORDS = 16384  # a pattern hashes 64 KiB once and offsets it per 64 KiB block
HEADER = 4  # bytes: sender * 2 + direction, then the exchange number (24 bits, little endian)
SENTINEL = 0xEE
MAX_FAILURES = 40
SLOTS = ("send_next", "recv_prev", "send_prev", "recv_next")


class Checker:
    """Makes messages, checks received ones, and keeps what the test asserts on."""

    def __init__(self, torch):
        self.torch = torch
        self.bodies = {}
        self.send_bufs = {}
        self.recv_bufs = {}
        self.failures = []  # {"config", "group", "text"}, the first MAX_FAILURES
        self.nfailures = defaultdict(int)  # "config group" -> failures
        # config -> group -> checks
        self.checks: defaultdict[Any, defaultdict[Any, int]] = defaultdict(lambda: defaultdict(int))
        # config -> slot -> {"<rank>:<dir>"}
        self.origins: defaultdict[Any, defaultdict[Any, set[str]]] = defaultdict(lambda: defaultdict(set))
        self.dtypes = defaultdict(set)  # slot -> dtype names verified with at least one byte
        self.sizes = set()  # byte counts verified

    # ---- patterns ------------------------------------------------------------------------

    def body(self, sender, direction, nbytes):
        """The pattern's bytes: position-dependent, different for every sender and direction."""
        key = (sender, direction, nbytes)
        if key not in self.bodies:
            torch = self.torch
            words = (nbytes + 3) // 4
            x = torch.arange(min(words, BLOCK_WORDS), dtype=torch.int32)
            x = x * -1640531535 + (sender * 2 + direction) * 40503 + 12345
            x = x ^ (x >> 15)
            x = x * 739982445
            x = x ^ (x >> 13)
            if words > BLOCK_WORDS:  # one hashed block, offset per block: cheap at 64 MiB, never periodic
                blocks = -(-words // BLOCK_WORDS)
                offsets = torch.arange(blocks, dtype=torch.int32) * -1640531535
                x = (x.view(1, -1) + offsets.view(-1, 1)).view(-1)[:words]
            self.bodies[key] = x.view(torch.uint8)[:nbytes]
        return self.bodies[key]

    @staticmethod
    def header(sender, direction, number):
        return [sender * 2 + direction, number & 0xFF, (number >> 8) & 0xFF, (number >> 16) & 0xFF]

    @staticmethod
    def describe_header(got):
        if not got:
            return "nothing"
        if all(b == SENTINEL for b in got):
            return "the unwritten sentinel"
        text = f"rank {got[0] // 2} {DIRS[got[0] % 2]}"
        if len(got) == HEADER:
            text += f" of exchange #{got[1] | got[2] << 8 | got[3] << 16}"
        return text

    def message(self, sender, direction, number, dtype, numel, fresh=False):
        """The bytes to send, as `dtype`. The buffer is reused per sender, direction and size
        unless fresh: every exchange but those in flight together waits before the next."""
        torch = self.torch
        nbytes = numel * dtype.itemsize
        key = (sender, direction, nbytes)
        if fresh or key not in self.send_bufs:
            out = self.body(sender, direction, nbytes).clone()
            if not fresh:
                self.send_bufs[key] = out
        else:
            out = self.send_bufs[key]
        h = self.header(sender, direction, number)[: min(HEADER, nbytes)]
        if h:
            out[: len(h)] = torch.tensor(h, dtype=torch.uint8)
        return out.view(dtype)

    def recv_buffer(self, slot, dtype, numel, fresh=False):
        """A receive buffer full of the sentinel (reused per slot and shape unless fresh)."""
        torch = self.torch
        key = (slot, dtype, numel)
        if fresh or key not in self.recv_bufs:
            buf = torch.empty(numel, dtype=dtype)
            if not fresh:
                self.recv_bufs[key] = buf
        else:
            buf = self.recv_bufs[key]
        buf.view(torch.uint8).fill_(SENTINEL)
        return buf

    # ---- checks --------------------------------------------------------------------------

    def fail(self, config, group, where, what):
        self.nfailures[f"{config} {group}"] += 1
        if len(self.failures) < MAX_FAILURES:
            self.failures.append({"config": config, "group": group, "text": f"{where}: {what}"})

    def check(self, config, group, where, slot, buf, sender, direction, number):
        """Counts one check of a received message: its exact bytes, hence its sender and direction."""
        torch = self.torch
        got = buf.view(torch.uint8)
        nbytes = got.numel()
        body = self.body(sender, direction, nbytes)
        want_head = self.header(sender, direction, number)[: min(HEADER, nbytes)]
        got_head = got[: len(want_head)].tolist()
        self.checks[config][group] += 1
        if got_head:
            self.origins[config][slot].add(f"{got_head[0] // 2}:{DIRS[got_head[0] % 2]}" if got_head[0] < 64 else "?")
        body_ok = torch.equal(got[len(want_head):], body[len(want_head):])
        if got_head == want_head and body_ok:
            if nbytes:
                self.dtypes[slot].add(str(buf.dtype).removeprefix("torch."))
            self.sizes.add(nbytes)
            return
        expected = torch.cat([torch.tensor(want_head, dtype=torch.uint8), body[len(want_head):]])
        diff = (got != expected).nonzero()
        self.fail(
            config, group, where,
            f"{slot} ({nbytes} B of {str(buf.dtype).removeprefix('torch.')}) expected rank {sender} "
            f"{DIRS[direction]} of exchange #{number}, got {self.describe_header(got_head)}; "
            f"{diff.numel()} byte(s) differ, first at offset {int(diff[0]) if diff.numel() else -1}",
        )

    def check_request(self, config, group, where, name, req, peer, lane, nbytes, seqs, is_send):
        """The request says what was posted: peer, lane, size, and its number on its channel."""
        key = (is_send, peer, lane)
        want = (peer, lane, nbytes, seqs[key], is_send)
        got = (req.peer, req.lane, req.nbytes, req.seq, req.is_send)
        seqs[key] += 1
        if got != want:
            self.fail(config, group, where, f"{name}: request (peer, lane, nbytes, seq, is_send) = {got}, expected {want}")

    def result(self):
        return {
            "failures": self.failures,
            "nfailures": dict(self.nfailures),
            "checks": {c: dict(g) for c, g in self.checks.items()},
            "origins": {c: {s: sorted(v) for s, v in o.items()} for c, o in self.origins.items()},
            "dtypes": {s: sorted(v) for s, v in self.dtypes.items()},
            "sizes": sorted(self.sizes),
        }


def wait_all(reqs, where, backend):
    for name, r in reqs:
        try:
            backend.settle(r)
        except BaseException as exc:
            exc.add_note(f"while waiting for {name} in {where}")
            raise


class Runner:
    """Drives one communicator through exchanges that every rank of its group issues alike."""

    def __init__(self, torch, comm, chk, seqs, backend):
        self.torch = torch
        self.comm = comm
        self.backend = backend
        self.chk = chk
        self.seqs = seqs  # (is_send, peer, lane) -> next expected request seq
        self.number = 0  # exchange number: equal on every rank, carried in the header

    def next_number(self):
        self.number += 1
        return self.number

    def lane_of(self, slot):
        return 0 if self.comm.lanes == 1 or slot in ("send_next", "recv_prev") else 1

    def plan(self, topo, kind):
        """The ops this rank posts: a chain's ends skip the ops that would cross the wrap."""
        comm = self.comm
        has_prev = topo == "ring" or comm.rank > 0
        has_next = topo == "ring" or comm.rank < comm.size - 1
        fwd, bwd = kind in ("both", "fwd"), kind in ("both", "bwd")
        return {
            "send_next": fwd and has_next,
            "recv_prev": fwd and has_prev,
            "send_prev": bwd and has_prev,
            "recv_next": bwd and has_next,
        }

    def post_exchange(self, config, group, topo, mode, kind, fwd, bwd, where, fresh=False):
        """Posts one exchange; fwd / bwd: (dtype, numel) of the activation and the gradient."""
        comm, chk = self.comm, self.chk
        number = self.next_number()
        me = comm.global_rank
        posted = self.plan(topo, kind)
        spec = {"send_next": fwd, "recv_prev": fwd, "send_prev": bwd, "recv_next": bwd}
        tensors = {}
        for slot in SLOTS:
            if not posted[slot]:
                continue
            dtype, numel = spec[slot]
            if slot == "send_next":
                tensors[slot] = chk.message(me, FWD, number, dtype, numel, fresh=fresh)
            elif slot == "send_prev":
                tensors[slot] = chk.message(me, BWD, number, dtype, numel, fresh=fresh)
            else:
                tensors[slot] = chk.recv_buffer(slot, dtype, numel, fresh=fresh)
        reqs = comm.exchange(mode=mode, **{slot: self.backend.tensor(t) for slot, t in tensors.items()})
        if set(reqs) != set(tensors):
            chk.fail(config, group, where, f"exchange returned requests {sorted(reqs)} for posted ops {sorted(tensors)}")
        peer = {"send_next": comm.next_rank, "recv_next": comm.next_rank,
                "send_prev": comm.prev_rank, "recv_prev": comm.prev_rank}
        # Sends are numbered send_next then send_prev, receives recv_prev then recv_next, on
        # every channel: that pairing is what keeps the directions apart when prev == next.
        for slot in SLOTS:
            if slot in reqs:
                t = tensors[slot]
                chk.check_request(config, group, where, slot, reqs[slot], peer[slot], self.lane_of(slot),
                                  t.numel() * t.element_size(), self.seqs, slot.startswith("send"))
        return number, tensors, reqs

    def check_exchange(self, config, group, where, number, tensors):
        comm, chk = self.comm, self.chk
        if "recv_prev" in tensors:
            chk.check(config, group, where, "recv_prev", tensors["recv_prev"], comm.prev_rank, FWD, number)
        if "recv_next" in tensors:
            chk.check(config, group, where, "recv_next", tensors["recv_next"], comm.next_rank, BWD, number)

    def exchange(self, config, topo, mode, kind, fwd, bwd, group, where):
        number, tensors, reqs = self.post_exchange(config, group, topo, mode, kind, fwd, bwd, where)
        wait_all(list(reqs.items()), where, self.backend)
        self.check_exchange(config, group, where, number, tensors)

    # ---- torch.distributed-style ops -----------------------------------------------------

    def isend_chain(self, config, dtype, numel, where):
        """Megatron's _p2p_ops with isend/irecv one by one: even ranks send first, odd ranks
        receive first; a chain's ends skip the ops across the wrap."""
        comm, chk = self.comm, self.chk
        number = self.next_number()
        me = comm.global_rank
        posted = self.plan("chain", "both")
        order = SLOTS if comm.rank % 2 == 0 else ("recv_prev", "send_next", "recv_next", "send_prev")
        reqs, tensors = [], {}
        for slot in order:
            if not posted[slot]:
                continue
            if slot == "send_next":
                t = chk.message(me, FWD, number, dtype, numel)
                r = comm.isend(self.backend.tensor(t), comm.next_rank)
                peer, send = comm.next_rank, True
            elif slot == "send_prev":
                t = chk.message(me, BWD, number, dtype, numel)
                r = comm.isend(self.backend.tensor(t), comm.prev_rank)
                peer, send = comm.prev_rank, True
            elif slot == "recv_prev":
                t = chk.recv_buffer(slot, dtype, numel)
                r = comm.irecv(self.backend.tensor(t), comm.prev_rank)
                peer, send = comm.prev_rank, False
            else:
                t = chk.recv_buffer(slot, dtype, numel)
                r = comm.irecv(self.backend.tensor(t), comm.next_rank)
                peer, send = comm.next_rank, False
            chk.check_request(config, "isend", where, slot, r, peer, 0, t.numel() * t.element_size(), self.seqs, send)
            tensors[slot] = t
            reqs.append((slot, r))
        wait_all(reqs, where, self.backend)
        self.check_exchange(config, "isend", where, number, tensors)

    def batch_ring(self, config, dtype, numel, where, flip):
        """One batch_isend_irecv group of all four ring ops. Within a pair the k-th send meets the
        k-th receive, so the activation is listed before the gradient on both sides; flip lists
        the receives first, which must not matter."""
        import megatron_p2p as mp

        comm, chk = self.comm, self.chk
        number = self.next_number()
        me = comm.global_rank
        tensors = {
            "send_next": chk.message(me, FWD, number, dtype, numel),
            "recv_prev": chk.recv_buffer("recv_prev", dtype, numel),
            "send_prev": chk.message(me, BWD, number, dtype, numel),
            "recv_next": chk.recv_buffer("recv_next", dtype, numel),
        }
        peer = {"send_next": comm.next_rank, "recv_prev": comm.prev_rank,
                "send_prev": comm.prev_rank, "recv_next": comm.next_rank}
        order = ("recv_prev", "recv_next", "send_next", "send_prev") if flip else SLOTS
        on = self.backend.tensor
        ops = [mp.P2POp(mp.isend if s.startswith("send") else mp.irecv, on(tensors[s]), peer[s], comm=comm)
               for s in order]
        reqs = mp.batch_isend_irecv(ops)
        if len(reqs) != 4:
            chk.fail(config, "batch", where, f"batch_isend_irecv returned {len(reqs)} requests for 4 ops")
        for s, r in zip(order, reqs):
            t = tensors[s]
            chk.check_request(config, "batch", where, s, r, peer[s], 0, t.numel() * t.element_size(), self.seqs,
                              s.startswith("send"))
        wait_all(list(zip(order, reqs)), where, self.backend)
        self.check_exchange(config, "batch", where, number, tensors)


def numel_for(dtype, label):
    """Elements for a dtype-sweep size: one element, 4 KiB (the largest message carried inline),
    or one element more (the large-message path)."""
    base = 4096 // dtype.itemsize
    return {"one": 1, "4KiB": base, "4KiB+1": base + 1}[label]


def error_text(exc):
    """The exception's first lines (a timeout lists the pending ops after its first) and notes."""
    lines = f"{type(exc).__name__}: {exc}".splitlines()
    return " | ".join([*lines[:4], *getattr(exc, "__notes__", [])])


def run_suite(torch, mp, group, suite, expect_single_copy, backend):
    """Runs the suite over one group and returns what the test asserts on. Every section gets a
    communicator of its own (created by every rank in the same order), so an error in one is
    reported against it and the next still runs.

    suite keys: configs ([topo, mode, lanes]), steps, dtypes, dtype_numels ("one", "4KiB",
    "4KiB+1"), sizes ([dtype, nbytes]), huge ([dtype, nbytes], run huge_steps times), inflight
    ([dtype, nbytes], inflight_depth exchanges posted before any wait), isend / batch
    ([dtype, nbytes], steps each, for every lane count of the configs).
    """
    chk = Checker(torch)
    t0 = time.monotonic()
    dt = lambda name: getattr(torch, name)  # noqa: E731
    shape_of = lambda name, nbytes: (dt(name), nbytes // dt(name).itemsize)  # noqa: E731
    dtypes = suite.get("dtypes", [])
    steps = suite["steps"]
    out: dict[str, Any] = {"neighbours": {}, "single_copy": {}, "errors": {}}

    def section(config, lanes, fn):
        comm = None
        try:
            comm = mp.init_communicator(group=group, backend=backend.name, timeout=suite.get("timeout", 20.0),
                                        lanes=lanes)
            out["neighbours"].setdefault(str(lanes), {
                "rank": comm.rank, "global_rank": comm.global_rank, "size": comm.size, "ranks": list(comm.ranks),
                "prev": comm.prev_rank, "next": comm.next_rank, "lanes": comm.lanes,
            })
            sc = {"next": comm.single_copy(comm.next_rank), "prev": comm.single_copy(comm.prev_rank)}
            out["single_copy"].setdefault(str(lanes), sc)
            if expect_single_copy is not None:
                assert sc["next"] is expect_single_copy, (
                    f"comm.single_copy(next rank {comm.next_rank}) is {sc['next']}, expected {expect_single_copy}")
            fn(Runner(torch, comm, chk, defaultdict(int), backend))
        except mp.P2PError as exc:  # reported against this section; the next gets a new communicator
            out["errors"][config] = error_text(exc)
            chk.fail(config, "error", config, error_text(exc))
        finally:
            if comm is not None:
                comm.close()

    cases = []  # (group, label, fwd (dtype, numel), bwd (dtype, numel))
    for i, name in enumerate(dtypes):
        other = dtypes[(i + len(dtypes) // 2) % len(dtypes)]  # the gradient travels as another dtype
        for label in suite.get("dtype_numels", []):
            fwd, bwd = (dt(name), numel_for(dt(name), label)), (dt(other), numel_for(dt(other), label))
            cases.append(("dtypes", f"{name}/{other} {label}", fwd, bwd))
    for name, nbytes in suite.get("sizes", []):
        cases.append(("sizes", f"{nbytes} B of {name}", shape_of(name, nbytes), shape_of(name, nbytes)))

    for topo, mode, lanes in suite["configs"]:
        config = f"{topo}/{mode}/lanes{lanes}"

        def exchanges(run, topo=topo, mode=mode, config=config):
            me = run.comm.global_rank
            for group_name, label, fwd, bwd in cases:
                for step in range(steps):
                    kind = KINDS[step % len(KINDS)]
                    where = f"{config} {label} step {step} ({kind}) rank {me}"
                    run.exchange(config, topo, mode, kind, fwd, bwd, group_name, where)
            for name, nbytes in suite.get("huge", []):
                for step in range(suite.get("huge_steps", 1)):
                    kind = KINDS[step % len(KINDS)]
                    where = f"{config} {nbytes} B of {name} step {step} ({kind}) rank {me}"
                    run.exchange(config, topo, mode, kind, shape_of(name, nbytes), shape_of(name, nbytes), "huge", where)
            # Several exchanges posted before any wait (more than the transport's descriptor
            # slots per channel), each with buffers of its own, kinds cycling.
            for name, nbytes in suite.get("inflight", []):
                shape = shape_of(name, nbytes)
                posted = []
                for k in range(suite["inflight_depth"]):
                    kind = KINDS[k % len(KINDS)]
                    where = f"{config} in flight #{k} ({kind}) {nbytes} B of {name} rank {me}"
                    number, tensors, reqs = run.post_exchange(config, "inflight", topo, mode, kind, shape, shape, where,
                                                                 fresh=True)
                    posted.append((where, number, tensors, reqs))
                for where, _number, _tensors, reqs in posted:
                    wait_all(list(reqs.items()), where, run.backend)
                for where, number, tensors, _reqs in posted:
                    run.check_exchange(config, "inflight", where, number, tensors)

        section(config, lanes, exchanges)

    for lanes in sorted({lanes for _, _, lanes in suite["configs"]}):
        if suite.get("isend"):
            config = f"isend-chain/lanes{lanes}"

            def isends(run, config=config):
                for name, nbytes in suite["isend"]:
                    for step in range(steps):
                        where = f"{config} {nbytes} B of {name} step {step} rank {run.comm.global_rank}"
                        run.isend_chain(config, *shape_of(name, nbytes), where)

            section(config, lanes, isends)
        if suite.get("batch"):
            config = f"batch-ring/lanes{lanes}"

            def batches(run, config=config):
                for name, nbytes in suite["batch"]:
                    for step in range(steps):
                        where = f"{config} {nbytes} B of {name} step {step} rank {run.comm.global_rank}"
                        run.batch_ring(config, *shape_of(name, nbytes), where, flip=step % 2 == 1)

            section(config, lanes, batches)

    out.update(chk.result())
    out["seconds"] = round(time.monotonic() - t0, 2)
    return out


def run_partition(torch, mp, dist, groups, suite, expect_single_copy, backend):
    """Runs `suite` over the one of `groups` (lists of global ranks) that holds this rank."""
    me = dist.get_rank()
    made = [dist.new_group(ranks) for ranks in groups]  # every rank, same order
    mine = [g for g, ranks in zip(made, groups) if me in ranks]
    assert len(mine) == 1, f"rank {me} is in {len(mine)} of the groups {groups}"
    return run_suite(torch, mp, mine[0], suite, expect_single_copy, backend)


def run_all(params, backend):
    """Every suite of `params` (see the module's docstring), once the process group, if any, exists."""
    import torch
    import torch.distributed as dist

    import megatron_p2p as mp

    # A first, generous communicator waits for every rank to have started (importing torch on a
    # loaded machine can take long), so the sections' short timeouts measure only the library.
    mp.init_communicator(timeout=120.0).close()
    expect = params.get("expect_single_copy")
    result = {"world": run_suite(torch, mp, None, params["suite"], expect, backend), "subgroup": None}
    if params.get("subgroups"):
        result["subgroup"] = run_partition(torch, mp, dist, params["subgroups"], params["subgroup_suite"], expect,
                                           backend)
    result["partitions"] = [run_partition(torch, mp, dist, p["groups"], p["suite"], expect, backend)
                            for p in params.get("partitions", [])]
    return result


def body(params):
    backend = Backend(params.get("backend", "shm"))
    import torch.distributed as dist

    if params.get("process_group"):
        dist.init_process_group("gloo")
    try:
        return run_all(params, backend)
    finally:
        if params.get("process_group"):
            dist.destroy_process_group()


if __name__ == "__main__":
    harness.run(body)
