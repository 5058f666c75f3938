"""The schedule, checked offline: every rank's exchange calls, expanded by the C plan, are run
through the package's simulator of the transport semantics (lanes in issue order, groups
progressing together, k-th send meets k-th receive per pair, direction and lane, strict
rendezvous). Every mode must complete and pair activations with activations and gradients with
gradients for every size from 1 to 64, on chains and rings. By Siegel and Avrunin, completing
without buffering means no amount of buffering can make these programs deadlock.

Activations and gradients get different sizes, so a receive handed the wrong direction's
message is a MISMATCH."""
from __future__ import annotations

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
            builder.exchange(r, mode=mode, **{s: spec(s, r, size, k) for s in ops})
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


@pytest.mark.parametrize("mode,lanes", MODES)
@pytest.mark.parametrize("ring", [False, True], ids=["chain", "ring"])
def test_every_size_from_1_to_64_completes_and_pairs_directions(mode, lanes, ring):
    for size in range(1, 65):
        if size == 1 and not ring:
            continue  # a one-stage chain posts nothing
        verdict = simulate(exchange_program(size, exchange_calls(size, ring), mode, lanes))
        assert verdict.verdict == "ok", f"size {size}: {verdict.detail()}"


@pytest.mark.parametrize("mode,lanes", MODES)
def test_one_f_one_b_call_patterns_complete(mode, lanes):
    for size in [*range(2, 17), 31, 32, 63, 64]:
        for microbatches in (1, size // 2 + 1, size + 1):
            verdict = simulate(exchange_program(size, one_f_one_b_calls(size, microbatches), mode, lanes))
            assert verdict.verdict == "ok", (size, microbatches, verdict.detail())


def test_megatrons_batched_order_swaps_directions_at_two_ranks():
    """The checker catches the defect it exists for: megatron-core's fixed batched order on one
    stream delivers a gradient into recv_prev when prev == next."""
    verdict = simulate(megatron_batched_program(2, exchange_calls(2, True, 1)))
    assert verdict.verdict == "mismatch"
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


def test_self_exchange_is_grouped_in_parity_mode():
    """NCCL's rule: a self send needs its receive in the same group."""
    assert _C.plan("parity", 2, 0, ALL_OPS, True, True) == [(0, ("send_next", "recv_prev")),
                                                            (1, ("send_prev", "recv_next"))]


def test_plan_rejects_unknown_modes_and_ops():
    with pytest.raises(ValueError, match="mode"):
        _C.plan("eager", 1, 0, ALL_OPS)
    with pytest.raises(ValueError, match="unknown op"):
        _C.plan("parity", 1, 0, ["send_sideways"])
