"""The schedule, checked offline: every rank's exchange calls, expanded by the C plan, are run
through the package's simulator of the transport semantics (lanes in issue order, groups
progressing together, k-th send meets k-th receive per pair, direction and lane, strict
rendezvous). Every mode must complete and pair activations with activations and gradients with
gradients for every size from 1 to 64, on chains and rings. By Siegel and Avrunin, completing
without buffering means no amount of buffering can make these programs deadlock.

Activations and gradients get different sizes, so a receive handed the wrong direction's
message is a MISMATCH.

Lanes are separate NCCL communicators, which NCCL may run in one order per device: every plan
issues lane 0 before lane 1, and the schedules also complete with each rank's lanes serialized
in issue order (serialize_lanes)."""
from __future__ import annotations

import itertools
from typing import Any

import pytest

from megatron_p2p import _C
from megatron_p2p.program import Program, ProgramBuilder
from megatron_p2p.simulate import simulate

ALL_OPS = ("send_next", "recv_prev", "send_prev", "recv_next")
ACT, GRAD = 4096, 2048
MODES = [("parity", 1), ("parity", 2), ("batched", 1), ("batched", 2)]


def spec(slot: str, rank: int, size: int, k: int) -> tuple[int, str, str]:
    """(bytes, dtype, label) of one op: activations forward, gradients backward."""
    forward = slot in ("send_next", "recv_prev")
    src = rank if slot.startswith("send") else (rank - 1) % size if forward else (rank + 1) % size
    return (ACT if forward else GRAD, "float32", f"{'act' if forward else 'grad'} {k} from {src}")


def exchange_program(size: int, calls: list[list[set[str]]], mode: str, lanes: int) -> Program:
    """Each rank's exchange calls, expanded by the runtime's plan."""
    builder = ProgramBuilder(size, lanes)
    for r in range(size):
        for k, ops in enumerate(calls[r]):
            slots: dict[str, Any] = {s: spec(s, r, size, k) for s in ops}  # exchange's slot arguments
            builder.exchange(r, mode=mode, **slots)
    return builder.build()


def megatron_batched_program(size: int, calls: list[list[set[str]]]) -> Program:
    """megatron-core's _batched_p2p_ops: one group in its fixed order, on one stream."""
    order = ("send_prev", "recv_prev", "send_next", "recv_next")
    builder = ProgramBuilder(size, 1)
    for r in range(size):
        for k, ops in enumerate(calls[r]):
            group = []
            for s in order:
                if s in ops:
                    peer = (r + 1) % size if s.endswith("next") else (r - 1) % size
                    nbytes, dtype, label = spec(s, r, size, k)
                    group.append(("send" if s.startswith("send") else "recv", peer, nbytes, dtype, label))
            builder.steps(r, [(0, group)], name="_batched_p2p_ops")
    return builder.build()


def old_batched_program(size: int, calls: list[list[set[str]]]) -> Program:
    """Batched mode on two lanes as the plan issued it before lanes had a fixed order: a lane's
    group created where its first op appeared in send_next, send_prev, recv_prev, recv_next, so
    send_prev + recv_prev went lane 1 first and send_next + recv_next lane 0 first."""
    order = ("send_next", "send_prev", "recv_prev", "recv_next")
    builder = ProgramBuilder(size, 2)
    for r in range(size):
        for k, ops in enumerate(calls[r]):
            groups: dict[int, list] = {}
            for s in order:
                if s in ops:
                    peer = (r + 1) % size if s.endswith("next") else (r - 1) % size
                    nbytes, dtype, label = spec(s, r, size, k)
                    op = ("send" if s.startswith("send") else "recv", peer, nbytes, dtype, label)
                    groups.setdefault(0 if s in ("send_next", "recv_prev") else 1, []).append(op)
            builder.steps(r, list(groups.items()), name="exchange")
    return builder.build()


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


SERIALIZE = pytest.mark.parametrize("serialize_lanes", [False, True], ids=["lanes-side-by-side", "lanes-serialized"])


@SERIALIZE
@pytest.mark.parametrize("mode,lanes", MODES)
@pytest.mark.parametrize("ring", [False, True], ids=["chain", "ring"])
def test_every_size_from_1_to_64_completes_and_pairs_directions(mode, lanes, ring, serialize_lanes):
    for size in range(1, 65):
        if size == 1 and not ring:
            continue  # a one-stage chain posts nothing
        program = exchange_program(size, exchange_calls(size, ring), mode, lanes)
        verdict = simulate(program, serialize_lanes=serialize_lanes)
        assert verdict.verdict == "ok", f"size {size}: {verdict.detail()}"


@SERIALIZE
@pytest.mark.parametrize("mode,lanes", MODES)
def test_one_f_one_b_call_patterns_complete(mode, lanes, serialize_lanes):
    for size in [*range(2, 17), 31, 32, 63, 64]:
        for microbatches in (1, size // 2 + 1, size + 1):
            program = exchange_program(size, one_f_one_b_calls(size, microbatches), mode, lanes)
            verdict = simulate(program, serialize_lanes=serialize_lanes)
            assert verdict.verdict == "ok", (size, microbatches, verdict.detail())


def test_megatrons_batched_order_swaps_directions_at_two_ranks():
    """The checker catches the defect it exists for: megatron-core's fixed batched order on one
    stream delivers a gradient into recv_prev when prev == next."""
    verdict = simulate(megatron_batched_program(2, exchange_calls(2, True, 1)))
    assert verdict.verdict == "mismatch" and verdict.mismatch is not None
    send, recv = verdict.mismatch
    assert (send.op.bytes, recv.op.bytes) == (GRAD, ACT)
    assert send.op.label.startswith("grad") and recv.op.label.startswith("act")


def test_megatrons_batched_order_is_right_from_three_ranks():
    assert simulate(megatron_batched_program(3, exchange_calls(3, True, 1))).verdict == "ok"


def test_ops_issued_one_by_one_in_ring_order_deadlock_under_rendezvous():
    """The simulator reports a deadlock it should: every rank sends to next before receiving."""
    builder = ProgramBuilder(4, 1)
    for r in range(4):
        builder.steps(r, [(0, [("send", (r + 1) % 4, ACT, "float32", "act")]),
                          (0, [("recv", (r - 1) % 4, ACT, "float32", "act")])])
    verdict = simulate(builder.build())
    assert verdict.verdict == "deadlock"
    assert verdict.num_pending == 8
    assert sorted(verdict.ranks) == [0, 1, 2, 3]


def test_the_same_ring_completes_with_an_eager_threshold_above_its_messages():
    builder = ProgramBuilder(4, 1, eager_threshold=ACT)
    for r in range(4):
        builder.steps(r, [(0, [("send", (r + 1) % 4, ACT, "float32", "act")]),
                          (0, [("recv", (r - 1) % 4, ACT, "float32", "act")])])
    assert simulate(builder.build()).verdict == "ok"


def test_parity_order_follows_the_rank_parity():
    assert _C.plan("parity", 1, 0, ALL_OPS) == [(0, ("send_next",)), (0, ("recv_prev",)),
                                                (0, ("send_prev",)), (0, ("recv_next",))]
    assert _C.plan("parity", 1, 1, ALL_OPS) == [(0, ("recv_prev",)), (0, ("send_next",)),
                                                (0, ("recv_next",)), (0, ("send_prev",))]


def test_two_lanes_split_forward_and_backward():
    assert _C.plan("batched", 2, 0, ALL_OPS) == [(0, ("send_next", "recv_prev")), (1, ("send_prev", "recv_next"))]


def op_subsets() -> list[tuple[str, ...]]:
    return [ops for n in range(1, 5) for ops in itertools.combinations(ALL_OPS, n)]


@pytest.mark.parametrize("mode", ["parity", "batched"])
@pytest.mark.parametrize("lanes", [1, 2])
def test_every_plan_issues_its_lane_0_steps_before_its_lane_1_steps(mode, lanes):
    """NCCL needs one order of a device's communicators, the same on every rank
    (communicators.rst in NVIDIA/nccl): each lane is one, so the lanes go in one fixed order."""
    for rank, ops, is_self in itertools.product((0, 1, 2, 3), op_subsets(), (False, True)):
        plan = _C.plan(mode, lanes, rank, ops, is_self, is_self)
        issued = [lane for lane, _ in plan]
        assert issued == sorted(issued), (rank, ops, is_self, plan)


@pytest.mark.parametrize("lanes", [1, 2])
def test_batched_groups_send_next_then_prev_and_receive_prev_then_next(lanes):
    """The order that pairs directions when prev == next (2 ranks), kept by the lane order."""
    for rank, ops, is_self in itertools.product((0, 1), op_subsets(), (False, True)):
        issued = [op for _, group in _C.plan("batched", lanes, rank, ops, is_self, is_self) for op in group]
        for kind in ("send", "recv"):
            expected = [op for op in ALL_OPS if op.startswith(kind) and op in ops]  # next, prev / prev, next
            assert [op for op in issued if op.startswith(kind)] == expected, (rank, ops, is_self)


def test_a_batched_backward_send_and_forward_receive_issue_lane_0_first():
    """send_backward_recv_forward, the partner of send_forward_recv_backward in 1F1B."""
    assert _C.plan("batched", 2, 1, ("send_prev", "recv_prev")) == [(0, ("recv_prev",)), (1, ("send_prev",))]
    assert _C.plan("batched", 2, 0, ("send_next", "recv_next")) == [(0, ("send_next",)), (1, ("recv_next",))]


def one_f_one_b_pair(backward_lane_first: bool) -> Program:
    """Rank 0's send_forward_recv_backward and rank 1's send_backward_recv_forward, one group
    per lane. Rank 0 issues lane 0 first; rank 1 too, or lane 1 first (the old batched order,
    which created a lane's group where its first op appeared, sends first)."""
    builder = ProgramBuilder(2, 2)
    builder.steps(0, [(0, [("send", 1, ACT, "float32", "act 0->1")]),
                      (1, [("recv", 1, GRAD, "float32", "grad 1->0")])], name="send_forward_recv_backward")
    rank1 = [(0, [("recv", 0, ACT, "float32", "act 0->1")]), (1, [("send", 0, GRAD, "float32", "grad 1->0")])]
    builder.steps(1, rank1[::-1] if backward_lane_first else rank1, name="send_backward_recv_forward")
    return builder.build()


def test_lanes_issued_in_opposite_orders_deadlock_when_lanes_are_serialized():
    verdict = simulate(one_f_one_b_pair(backward_lane_first=True), serialize_lanes=True)
    assert verdict.verdict == "deadlock", verdict.detail()
    assert sorted(verdict.ranks) == [0, 1] and verdict.num_pending == 4
    assert "lanes serialized" in verdict.detail()


def test_lanes_issued_in_lane_order_complete_when_lanes_are_serialized():
    assert simulate(one_f_one_b_pair(backward_lane_first=False), serialize_lanes=True).verdict == "ok"


def test_lanes_issued_in_opposite_orders_complete_when_lanes_run_side_by_side():
    """Why the checker alone did not catch the old order: lanes that overlap hide it."""
    assert simulate(one_f_one_b_pair(backward_lane_first=True)).verdict == "ok"


def test_one_f_one_b_in_the_old_batched_lane_order_deadlocks_when_lanes_are_serialized():
    """The same calls through the plan complete serialized (test_one_f_one_b_call_patterns_complete)."""
    for size in range(2, 9):
        verdict = simulate(old_batched_program(size, one_f_one_b_calls(size, size + 1)), serialize_lanes=True)
        assert verdict.verdict == "deadlock", size


def test_self_exchange_is_grouped_in_parity_mode():
    """NCCL's rule: a self send needs its receive in the same group."""
    assert _C.plan("parity", 2, 0, ALL_OPS, True, True) == [(0, ("send_next", "recv_prev")),
                                                            (1, ("send_prev", "recv_next"))]


def test_plan_rejects_unknown_modes_and_ops():
    with pytest.raises(ValueError, match="mode"):
        _C.plan("eager", 1, 0, ALL_OPS)
    with pytest.raises(ValueError, match="unknown op"):
        _C.plan("parity", 1, 0, ["send_sideways"])


def test_the_c_core_exports_its_slot_and_mode_names_and_the_lane_maximum():
    """One table each, in C (csrc/core/plan.c), in enum order; the Python modules read them."""
    from megatron_p2p import _shape_headers, p2p_communication
    from megatron_p2p.verify import program

    assert _C.SLOT_NAMES == ALL_OPS
    assert _C.MODE_NAMES == ("parity", "batched")
    assert _C.MAX_LANES == 2
    assert program.SLOTS is p2p_communication.SLOTS is _C.SLOT_NAMES
    assert program.MODES is p2p_communication.MODES is _C.MODE_NAMES
    assert program.LANES == (1, 2)
    assert (_shape_headers.SENDS, _shape_headers.RECVS) == (("send_next", "send_prev"), ("recv_prev", "recv_next"))
    assert program._SLOT_IS_SEND == (True, False, True, False)
    assert program._SLOT_IS_NEXT == (True, False, False, True)
