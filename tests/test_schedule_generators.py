"""The schedule generators (megatron_p2p.schedules): what each rank of megatron-core's 1F1B and
interleaved schedules posts and waits for. They agree call for call with megatron-core's real
schedule functions run through P2PCommunicator over a recording communicator
(megatron_p2p.megatron_recording), and their programs pair every send with the receive of the
same tensor."""
from __future__ import annotations

import importlib
import inspect
import itertools
import warnings
from collections import defaultdict

import pytest

from megatron_p2p import schedules
from megatron_p2p.program import MODES, Program, ProgramBuilder
from megatron_p2p.schedules import Rank, generate, grid_configs, rank_calls

TENSOR = 4096


def calls_of(schedule, pp, vpp=1, microbatches=None, overlap=False, variable=False, lanes=2):
    return rank_calls(schedule, pp, vpp=vpp, microbatches=microbatches or 2 * pp, overlap=overlap, variable=variable,
                      tensor_bytes=TENSOR, dtype="float32", lanes=lanes if variable else None)


def expanded(program: Program):
    """Per rank, per call: (name, wait, awaits, [(kind, peer, lane, bytes, dtype, label) per op])."""
    return [[(c.name, c.wait, c.awaits, [(o.kind, o.peer, o.lane, o.bytes, o.dtype, o.label)
                                         for step in c.steps for o in step])
             for c in calls] for calls in program.ranks]


def channels(program: Program):
    """{(src, dst, lane): ([send (bytes, dtype, label)...], [recv ...])} in issue order."""
    out: defaultdict[tuple[int, int, int], tuple[list, list]] = defaultdict(lambda: ([], []))
    for rank, calls in enumerate(expanded(program)):
        for _, _, _, ops in calls:
            for kind, peer, lane, nbytes, dtype, label in ops:
                key = (rank, peer, lane) if kind == "send" else (peer, rank, lane)
                out[key][kind == "recv"].append((nbytes, dtype, label))
    return out


# ---- the generators on their own ------------------------------------------------------------------


PAIRING_CASES = [("1f1b", pp, 1, m, False, var) for pp in (1, 2, 3, 5) for m in (pp, 4 * pp + 1)
                 for var in (False, True)]
PAIRING_CASES += [("interleaved", pp, vpp, m, ov, var) for pp in (2, 3, 4) for vpp in (2, 3) for m in (pp, 2 * pp)
                  for ov in (False, True) for var in (False, True)]


@pytest.mark.parametrize("schedule,pp,vpp,microbatches,overlap,variable", PAIRING_CASES)
def test_every_send_meets_a_receive_of_the_same_tensor(schedule, pp, vpp, microbatches, overlap, variable):
    """On every channel the k-th send and the k-th receive carry the same label, bytes and dtype,
    in both modes and lane counts: the generator knows which tensor each receive is for."""
    for mode, lanes in itertools.product(MODES, (1, 2)):
        program = generate(schedule, pp, vpp=vpp, microbatches=microbatches, mode=mode, lanes=lanes,
                           overlap=overlap, variable_seq_lengths=variable)
        for key, (sends, recvs) in channels(program).items():
            assert sends == recvs, f"{mode} lanes={lanes} channel {key}"


def test_a_send_without_its_receive_is_told_apart():
    """The pairing check above fails for a schedule that drops one receive."""
    calls = [list(map(list, r)) for r in calls_of("1f1b", 3, microbatches=3)]
    broken = Rank()
    for c in calls[1]:
        if c[2] is not None and c[0] == "recv_forward":
            continue  # drop the stage's first activation receive
        broken.post(c[0], c[1], c[2], c[3], c[4], waited=True)
    builder = ProgramBuilder(3, 2)
    for r, rc in enumerate([calls[0], broken.finish(), calls[2]]):
        schedules.emit(builder, r, rc, "parity")
    assert any(s != r for s, r in channels(builder.build()).values())


def test_1f1b_first_stage_never_receives_activations_and_last_never_sends_them():
    for pp in (2, 4, 7):
        calls = calls_of("1f1b", pp, microbatches=2 * pp)
        assert all(c[2] is None for c in calls[0])  # recv_prev
        assert all(c[1] is None for c in calls[-1])  # send_next
        assert all(c[4] is None for c in calls[-1])  # recv_next
        assert all(c[3] is None for c in calls[0])  # send_prev
        assert any(c[2] is not None for c in calls[1])  # a middle stage does receive


def test_interleaved_first_stage_receives_activations_only_for_later_chunks():
    """The first stage gets its chunk-0 input from data; what it receives from the last stage
    left chunk vpp-2 at most, and the last stage never sends its last chunk's output."""
    pp, vpp = 4, 3
    calls = calls_of("interleaved", pp, vpp, 8)
    received = [c[2][2] for c in calls[0] if c[2] is not None]
    assert received and all(not label.endswith(f"chunk{vpp - 1}") for label in received)
    assert {label.split()[-1] for label in received} == {f"chunk{c}" for c in range(vpp - 1)}
    assert all(not c[1][2].endswith(f"chunk{vpp - 1}") for c in calls[-1] if c[1] is not None)


def test_1f1b_runs_warmup_then_one_forward_one_backward_then_cooldown():
    """The middle stage of 3 with 4 microbatches: one warmup forward, three 1F1B pairs, one
    cooldown backward, each exchange blocking, as forward_backward_pipelining_without_interleaving."""
    calls = calls_of("1f1b", 3, microbatches=4)[1]
    assert [c[0] for c in calls] == [
        "recv_forward", "send_forward", "recv_forward",
        "send_forward_recv_backward", "send_backward_recv_forward",
        "send_forward_recv_backward", "send_backward_recv_forward",
        "send_forward_recv_backward", "send_backward",
        "recv_backward", "send_backward"]
    assert all(c[5] and not c[6] for c in calls)


def test_interleaved_sends_microbatches_in_megatron_core_schedule_table_order():
    """pp 2, vpp 2, 4 microbatches: groups of pp microbatches per chunk, chunk by chunk
    (megatron-core's get_schedule_table), so stage 0 sends mb 0 1 of chunk 0, then of chunk 1,
    then mb 2 3 of chunk 0, then of chunk 1."""
    sent = [c[1][2] for c in calls_of("interleaved", 2, 2, 4)[0] if c[1] is not None]
    assert sent == ["act mb0 chunk0", "act mb1 chunk0", "act mb0 chunk1", "act mb1 chunk1",
                    "act mb2 chunk0", "act mb3 chunk0", "act mb2 chunk1", "act mb3 chunk1"]


def test_overlap_turns_handles_into_later_awaits_and_blocking_calls_into_waits():
    """With overlap_p2p_comm the interleaved steady state posts without waiting, and the
    handles are waited before later calls; without it every call waits for its own ops."""
    plain = [c for r in calls_of("interleaved", 4, 2, 8) for c in r]
    assert all(c[5] and not c[6] for c in plain)
    overlapped = [c for r in calls_of("interleaved", 4, 2, 8, overlap=True) for c in r]
    assert any(not c[5] for c in overlapped)
    awaited = {w[1] for c in overlapped for w in c[6]}
    assert awaited == {"send_next", "recv_prev", "send_prev", "recv_next"}


HEADER_OP = schedules.HEADER[:2]


@pytest.mark.parametrize("lanes", [1, 2])
def test_variable_seq_lengths_sends_each_header_right_ahead_of_its_tensor(lanes):
    """Every call is one step; each data send follows its header in the step; each step with
    data receives follows, on its lane, a step of their headers' receives that is waited for
    before the data step is posted (_shape_headers.round_steps)."""
    for stage, calls in enumerate(calls_of("interleaved", 4, vpp=2, microbatches=8, variable=True, lanes=lanes)):
        waited: set[int] = set()
        for index, (name, kind, (lane, ops), _, _, wait, awaits) in enumerate(calls):
            assert kind == schedules.STEP
            waited.update(c for c, _ in awaits)
            if wait:
                waited.add(index)
            if name == schedules.SHAPE_ROUND:
                assert all(op[0] == "recv" and tuple(op[2:4]) == HEADER_OP for op in ops), ops
                data_lane, data_ops = calls[index + 1][2]
                assert data_lane == lane
                assert [op[1] for op in ops] == [op[1] for op in data_ops if op[0] == "recv"]
                continue
            for i, op in enumerate(ops):
                if op[0] == "send" and tuple(op[2:4]) != HEADER_OP:
                    assert ops[i - 1][:4] == ("send", op[1], *HEADER_OP), (stage, index, ops)
            if any(op[0] == "recv" for op in ops):
                assert calls[index - 1][0] == schedules.SHAPE_ROUND and index - 1 in waited, (stage, index)


def test_a_program_without_variable_seq_lengths_has_no_headers():
    for calls in calls_of("interleaved", 4, vpp=2, microbatches=8):
        assert all(c[1] != schedules.STEP and c[0] != schedules.SHAPE_ROUND for c in calls)
        assert all(s is None or s[:2] != HEADER_OP for c in calls for s in c[1:5])


def test_a_partial_wait_is_an_await_by_op_and_a_full_wait_is_the_call_wait():
    rank = Rank()
    spec = (8, "float32", "x")
    a = rank.post("a", send_next=spec, recv_next=spec)
    rank.wait(a, "recv_next")
    b = rank.post("b", send_next=spec)
    rank.wait(b, "send_next")
    rank.wait(a, "send_next")
    rank.post("c", recv_prev=spec)
    calls = rank.finish()
    assert calls[0][5] is False and calls[1][6] == ((0, "recv_next"),)
    assert calls[1][5] is True and calls[2][6] == ((0, "send_next"),)


def test_waiting_on_an_op_that_was_not_posted_is_an_error():
    rank = Rank()
    rank.post("a", send_next=(8, "float32", "x"))
    with pytest.raises(ValueError, match="recv_prev of call 0"):
        rank.wait(0, "recv_prev")


@pytest.mark.parametrize("kwargs,problem", [
    (dict(schedule="zb", pp=4), "schedule must be one of"),
    (dict(schedule="1f1b", pp=0), "pp must be"),
    (dict(schedule="1f1b", pp=4, vpp=2), "vpp must be 1"),
    (dict(schedule="interleaved", pp=4, vpp=1), "needs vpp >= 2"),
    (dict(schedule="1f1b", pp=4, mode="grouped"), "mode must be one of"),
    (dict(schedule="1f1b", pp=4, lanes=3), "lanes must be 1 or 2"),
    (dict(schedule="1f1b", pp=4, overlap=True), "does not support|raises ValueError with overlap"),
    (dict(schedule="interleaved", pp=4, vpp=2, microbatches=17), "RuntimeError"),
    (dict(schedule="interleaved", pp=4, vpp=2, microbatches=3), "fewer than"),
])
def test_bad_arguments_and_configs_megatron_core_refuses_raise_naming_the_problem(kwargs, problem):
    with pytest.raises(ValueError, match=problem):
        generate(**kwargs)


def test_a_config_megatron_core_accepts_generates():
    assert generate("interleaved", 4, vpp=2, microbatches=16).num_calls() > 0


def test_lane_count_changes_only_the_expansion():
    one = generate("interleaved", 3, vpp=2, microbatches=6, lanes=1)
    two = generate("interleaved", 3, vpp=2, microbatches=6, lanes=2)
    assert {o[2] for r in expanded(one) for c in r for o in c[3]} == {0}
    assert {o[2] for r in expanded(two) for c in r for o in c[3]} == {0, 1}
    assert [[c[:3] for c in r] for r in expanded(one)] == [[c[:3] for c in r] for r in expanded(two)]


def test_grid_covers_the_issue_and_marks_what_megatron_core_refuses():
    grid = grid_configs()
    params = set(inspect.signature(generate).parameters)
    assert all(set(c) - {"skip"} <= params for c in grid)
    assert {c["pp"] for c in grid} == set(range(1, 65))
    assert {c["vpp"] for c in grid if c["pp"] >= 2} == set(range(1, 9))
    assert {(c["mode"], c["lanes"]) for c in grid} == {("parity", 1), ("parity", 2), ("batched", 1), ("batched", 2)}
    assert {c["overlap"] for c in grid if c["schedule"] == "interleaved"} == {False, True}
    assert all({c["microbatches"] for c in grid if c["pp"] == pp} == {pp, 2 * pp, 4 * pp + 1} for pp in (2, 64))
    skipped = [c for c in grid if "skip" in c]
    assert skipped and all(c["schedule"] == "interleaved" and c["microbatches"] % c["pp"] for c in skipped)
    assert not any("skip" in c for c in grid if c["schedule"] == "1f1b")


def test_reduced_grid_generates_every_config_it_does_not_skip():
    grid = grid_configs(full=False)
    assert max(c["pp"] for c in grid) <= 8 and {c["schedule"] for c in grid} == set(schedules.SCHEDULES)
    assert {(c["overlap"], c["variable_seq_lengths"]) for c in grid if c["schedule"] == "interleaved"} == {
        (False, False), (False, True), (True, False), (True, True)}
    for config in grid:
        args = {k: v for k, v in config.items() if k != "skip"}
        if "skip" in config:
            with pytest.raises(ValueError):
                generate(**args)
        else:
            generate(**args)


# ---- agreement with megatron-core's real schedules ------------------------------------------------


@pytest.fixture(scope="module")
def recording():
    """megatron_p2p.megatron_recording; skips (saying why) where megatron-core does not import."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            importlib.import_module("megatron.core.pipeline_parallel.schedules")
    except Exception as exc:  # not installed, or an import it needs is missing
        pytest.skip(f"megatron-core does not import here ({type(exc).__name__}: {exc})")
    from megatron_p2p import megatron_recording

    with warnings.catch_warnings():  # the rest of megatron-core's imports warn about optional packages
        warnings.simplefilter("ignore")
        megatron_recording.record_calls("1f1b", 1, microbatches=1, mode="parity")
    return megatron_recording


def without_labels(calls):
    """A rank's lowered calls with each slot, or each op of a step, reduced to its payload."""
    def strip(c):
        if c[1] == schedules.STEP:
            lane, ops = c[2]
            return [c[0], c[1], (lane, [op[:4] for op in ops]), *c[3:]]
        return [c[0], *(None if s is None else s[:2] for s in c[1:5]), *c[5:]]
    return [strip(c) for c in calls]


AGREEMENT = [("1f1b", pp, 1, m, False, var, mode) for pp in (1, 2, 3, 4) for m in sorted({pp, 4 * pp + 1})
             for var in (False, True) for mode in MODES]
AGREEMENT += [("interleaved", pp, vpp, m, ov, var, mode) for pp in (2, 3, 4) for vpp in (2, 3) for m in (pp, 2 * pp)
              for ov in (False, True) for var in (False, True) for mode in MODES
              if (pp + vpp + m + ov + var) % 2 == (mode == "batched")]  # each config once, modes alternating


@pytest.mark.parametrize("schedule,pp,vpp,microbatches,overlap,variable,mode", AGREEMENT)
def test_generator_agrees_with_megatron_core_call_for_call(recording, schedule, pp, vpp, microbatches, overlap,
                                                           variable, mode):
    """Op kinds, peers, bytes, dtypes, call names, waits and awaits (by op) are the same."""
    recorded = recording.record_calls(schedule, pp, vpp=vpp, microbatches=microbatches, mode=mode, overlap=overlap,
                                      variable_seq_lengths=variable, tensor_bytes=TENSOR)
    generated = rank_calls(schedule, pp, vpp=vpp, microbatches=microbatches, overlap=overlap, variable=variable,
                           tensor_bytes=TENSOR, dtype="float32", lanes=2 if variable else None)
    for stage in range(pp):
        assert without_labels(generated[stage]) == without_labels(recorded[stage]), f"stage {stage}"


@pytest.mark.parametrize("lanes", [1, 2])
def test_recorded_program_expands_like_the_generated_one(recording, lanes):
    """Through the builder and the C plan too: same ops, peers, lanes and waits per call."""
    kw = dict(vpp=2, microbatches=6, mode="batched", lanes=lanes, overlap=True, variable_seq_lengths=True)
    strip = lambda p: [[(c[0], c[1], c[2], [o[:5] for o in c[3]]) for c in r] for r in expanded(p)]  # noqa: E731
    assert strip(recording.record("interleaved", 3, **kw)) == strip(generate("interleaved", 3, **kw))


def test_recording_tells_a_different_schedule_apart(recording):
    """The comparison can fail: 1F1B recorded with one microbatch fewer differs."""
    recorded = recording.record_calls("1f1b", 3, microbatches=5, mode="parity")
    generated = rank_calls("1f1b", 3, vpp=1, microbatches=6, overlap=False, variable=False, tensor_bytes=TENSOR,
                           dtype="float32")
    assert without_labels(generated[1]) != without_labels(recorded[1])
