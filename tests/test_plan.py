"""The schedule, checked offline: the plan's steps for every rank are run through a simulator of
the transport semantics (lanes in issue order, groups progressing together, k-th send meets
k-th receive per pair, direction and lane, strict rendezvous). Every mode must complete and
pair activations with activations and gradients with gradients for every size from 1 to 64,
on chains and rings. By Siegel and Avrunin, completing without buffering means no amount of
buffering can make these programs deadlock."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Iterable

import pytest

from megatron_p2p import _C

SENDS = {"send_next": "activation", "send_prev": "gradient"}
RECVS = {"recv_prev": "activation", "recv_next": "gradient"}
ALL_OPS = ("send_next", "recv_prev", "send_prev", "recv_next")

PlanFn = Callable[[str, int, int, Iterable[str], bool, bool], list]


@dataclass
class Op:
    name: str
    rank: int
    peer: int
    lane: int
    step: int
    seq: int
    done: bool = False
    got: str = ""

    def channel(self) -> tuple[int, int, int, int]:
        """(src, dst, lane, seq): the same for a send and the receive it must meet."""
        src, dst = (self.rank, self.peer) if self.name in SENDS else (self.peer, self.rank)
        return (src, dst, self.lane, self.seq)


Program = dict[tuple[int, int], list[list[Op]]]  # (rank, lane) -> steps in issue order


@functools.lru_cache(maxsize=None)
def _c_plan(mode, lanes, parity, ops, prev_self, next_self):
    return _C.plan(mode, lanes, parity, sorted(ops), prev_self, next_self)


def c_plan(mode, lanes, rank, ops, prev_self, next_self):
    """The C plan; it depends on the rank only through its parity."""
    return _c_plan(mode, lanes, rank % 2, frozenset(ops), prev_self, next_self)


def megatron_batched_plan(mode, lanes, rank, ops, prev_self, next_self):
    """megatron-core's _batched_p2p_ops: one group in its fixed order, on one stream."""
    order = ("send_prev", "recv_prev", "send_next", "recv_next")
    return [(0, tuple(o for o in order if o in ops))]


def build(size: int, calls: list[list[set[str]]], mode: str, lanes: int, plan: PlanFn) -> Program:
    """Issues each rank's exchange calls through `plan`, numbering ops per channel as the
    bindings do."""
    program: Program = {}
    for r in range(size):
        prev, nxt = (r - 1) % size, (r + 1) % size
        counters: dict[tuple, int] = {}
        for call in calls[r]:
            for lane, names in plan(mode, lanes, r, call, prev == r, nxt == r):
                steps = program.setdefault((r, lane), [])
                step = []
                for name in names:
                    peer = nxt if name.endswith("next") else prev
                    key = (lane, name in SENDS, peer)
                    step.append(Op(name, r, peer, lane, len(steps), counters.get(key, 0)))
                    counters[key] = counters.get(key, 0) + 1
                steps.append(step)
    return program


def simulate(program: Program) -> tuple[list[str], list[str]]:
    """Runs to quiescence under strict rendezvous; returns (ops left pending, receives that got
    the wrong payload). Only the head step of a lane is active; a send and its receive
    complete together once both are active."""
    by_channel: dict[tuple, dict[bool, Op]] = {}
    for steps in program.values():
        for step in steps:
            for op in step:
                by_channel.setdefault(op.channel(), {})[op.name in SENDS] = op
    heads = {key: 0 for key in program}

    def is_active(op: Op) -> bool:
        return heads[(op.rank, op.lane)] == op.step

    work = list(program)  # lanes to look at again
    queued = set(work)
    while work:
        key = work.pop()
        queued.discard(key)
        steps = program[key]
        while heads[key] < len(steps):
            step = steps[heads[key]]
            for op in step:
                if op.done:
                    continue
                other = by_channel[op.channel()].get(op.name not in SENDS)
                if other is not None and not other.done and is_active(other):
                    send, recv = (op, other) if op.name in SENDS else (other, op)
                    send.done = recv.done = True
                    recv.got = SENDS[send.name]
                    peer_key = (other.rank, other.lane)
                    if peer_key not in queued:  # its step may now be complete
                        queued.add(peer_key)
                        work.append(peer_key)
            if not all(op.done for op in step):
                break
            heads[key] += 1
            for op in steps[heads[key]] if heads[key] < len(steps) else ():
                peer_key = (op.peer, op.lane)  # a newly active op may complete a waiting peer
                if peer_key in program and peer_key not in queued:
                    queued.add(peer_key)
                    work.append(peer_key)
    pending, wrong = [], []
    for steps in program.values():
        for step in steps:
            for op in step:
                if not op.done:
                    pending.append(f"rank {op.rank} {op.name} (peer {op.peer}, lane {op.lane})")
                elif op.name in RECVS and op.got != RECVS[op.name]:
                    wrong.append(f"rank {op.rank} {op.name} received a {op.got}")
    return pending, wrong


def exchange_calls(size: int, ring: bool, iterations: int = 3) -> list[list[set[str]]]:
    """Every rank posts all four ops each iteration; a chain drops the ops past its ends."""
    calls = []
    for r in range(size):
        ops = set(ALL_OPS)
        if not ring:
            if r == 0:
                ops -= {"recv_prev", "send_prev"}
            if r == size - 1:
                ops -= {"send_next", "recv_next"}
        calls.append([ops] * iterations if ops else [])
    return calls


def one_f_one_b_calls(size: int, microbatches: int) -> list[list[set[str]]]:
    """The calls megatron-core's non-interleaved 1F1B schedule makes on each stage."""
    calls = []
    for r in range(size):
        first, last = r == 0, r == size - 1

        def keep(*names: str) -> set[str]:
            return {n for n in names if not (first and n.endswith("prev")) and not (last and n.endswith("next"))}

        warmup = min(size - r - 1, microbatches)
        remaining = microbatches - warmup
        seq = []
        for _ in range(warmup):
            seq += [keep("recv_prev"), keep("send_next")]
        if remaining:
            seq.append(keep("recv_prev"))
        for i in range(remaining):
            seq.append(keep("send_next", "recv_next"))  # send_forward_recv_backward
            seq.append(keep("send_prev") if i == remaining - 1 else keep("send_prev", "recv_prev"))
        for _ in range(warmup):
            seq += [keep("recv_next"), keep("send_prev")]
        calls.append([c for c in seq if c])
    return calls


MODES = [("parity", 1), ("parity", 2), ("batched", 1), ("batched", 2)]


@pytest.mark.parametrize("mode,lanes", MODES)
@pytest.mark.parametrize("ring", [False, True], ids=["chain", "ring"])
def test_every_size_from_1_to_64_completes_and_pairs_directions(mode, lanes, ring):
    for size in range(1, 65):
        if size == 1 and not ring:
            continue  # a one-stage chain posts nothing
        pending, wrong = simulate(build(size, exchange_calls(size, ring), mode, lanes, c_plan))
        assert not pending, f"size {size}: deadlock, pending {pending[:4]}"
        assert not wrong, f"size {size}: {wrong[:4]}"


@pytest.mark.parametrize("mode,lanes", MODES)
def test_one_f_one_b_call_patterns_complete(mode, lanes):
    for size in [*range(2, 17), 31, 32, 63, 64]:
        for microbatches in (1, size // 2 + 1, size + 1):
            calls = one_f_one_b_calls(size, microbatches)
            pending, wrong = simulate(build(size, calls, mode, lanes, c_plan))
            assert not pending and not wrong, (size, microbatches, pending[:4], wrong[:4])


def test_megatrons_batched_order_swaps_directions_at_two_ranks():
    """The checker catches the defect it exists for: megatron-core's fixed batched order on one
    stream delivers a gradient into recv_prev when prev == next."""
    pending, wrong = simulate(build(2, exchange_calls(2, True, 1), "batched", 1, megatron_batched_plan))
    assert not pending
    assert "rank 0 recv_prev received a gradient" in wrong


def test_megatrons_batched_order_is_right_from_three_ranks():
    pending, wrong = simulate(build(3, exchange_calls(3, True, 1), "batched", 1, megatron_batched_plan))
    assert not pending and not wrong


def test_ops_issued_one_by_one_in_ring_order_deadlock_under_rendezvous():
    """The simulator reports a deadlock it should: every rank sends to next before receiving."""
    def send_first(mode, lanes, rank, ops, prev_self, next_self):
        return [(0, (name,)) for name in ("send_next", "recv_prev") if name in ops]

    pending, _ = simulate(build(4, [[{"send_next", "recv_prev"}]] * 4, "parity", 1, send_first))
    assert len(pending) == 8


def test_parity_order_follows_the_rank_parity():
    assert _C.plan("parity", 1, 0, ALL_OPS) == [(0, ("send_next",)), (0, ("recv_prev",)),
                                                (0, ("send_prev",)), (0, ("recv_next",))]
    assert _C.plan("parity", 1, 1, ALL_OPS) == [(0, ("recv_prev",)), (0, ("send_next",)),
                                                (0, ("recv_next",)), (0, ("send_prev",))]


def test_two_lanes_split_forward_and_backward():
    assert _C.plan("batched", 2, 0, ALL_OPS) == [(0, ("send_next", "recv_prev")), (1, ("send_prev", "recv_next"))]


def test_self_exchange_is_grouped_in_parity_mode():
    """NCCL's rule: a self send needs its receive in the same group."""
    assert _C.plan("parity", 2, 0, ALL_OPS, True, True) == [(0, ("send_next", "recv_prev")),
                                                            (1, ("send_prev", "recv_next"))]


def test_plan_rejects_unknown_modes_and_ops():
    with pytest.raises(ValueError, match="mode"):
        _C.plan("eager", 1, 0, ALL_OPS)
    with pytest.raises(ValueError, match="unknown op"):
        _C.plan("parity", 1, 0, ["send_sideways"])
