"""torch.distributed.pipelining's schedules as programs (megatron_p2p.torch_schedules): the
runtime classes' programs, translated from torch's own action lists, agree call for call with
torch's real _PipelineScheduleRuntime loop run over recorders; GPipe and 1F1B are their
recorded loops; every message stream has its own byte count; defer_pp_recv's cycle and
misdelivery are found, the default configuration is not flagged; the first step's vote and
metadata rounds; lazy NCCL communicators catch the older executor's mixed message."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from megatron_p2p import program as prog
from megatron_p2p import torch_schedules as ts
from megatron_p2p.program import load
from megatron_p2p.simulate import simulate

PROGRAMS = Path(__import__("megatron_p2p").__path__[0]) / "programs"  # the shipped programs


def channels(program):
    """{(src, dst, lane): ([send (bytes, dtype, label)...], [recv ...])} in issue order."""
    out: defaultdict[tuple[int, int, int], tuple[list, list]] = defaultdict(lambda: ([], []))
    for rank, calls in enumerate(program.ranks):
        for call in calls:
            for op in (o for step in call.steps for o in step):
                key = (rank, op.peer, op.lane) if op.kind == "send" else (op.peer, rank, op.lane)
                out[key][op.kind == "recv"].append((op.bytes, op.dtype, op.label))
    return out


# ---- generated (torch's action lists) against recorded (torch's loop) ----------------------------

AGREEMENT = [(name, pp, m, spr, defer) for name in ts.RUNTIME for pp in (2, 3, 4) for m in sorted({1, 2, pp, 2 * pp + 1})
             for spr in ((2,) if name in ts.V_SHAPED else (2, 3)) for defer in (False, True)]


def _agreeing(name):
    compared = 0
    for _, pp, m, spr, defer in (c for c in AGREEMENT if c[0] == name):
        try:
            generated = ts.rank_calls(name, pp, microbatches=m, stages_per_rank=spr, defer_pp_recv=defer)
        except ValueError as e:  # torch refuses it: so must its real loop
            assert "torch refuses" in str(e)
            with pytest.raises(ValueError, match="torch refuses"):
                ts.record_calls(name, pp, microbatches=m, stages_per_rank=spr, defer_pp_recv=defer)
            continue
        recorded = ts.record_calls(name, pp, microbatches=m, stages_per_rank=spr, defer_pp_recv=defer)
        assert list(generated) == recorded, f"{name} pp={pp} microbatches={m} stages_per_rank={spr} defer={defer}"
        compared += 1
    return compared


@pytest.mark.parametrize("name", ts.RUNTIME)
def test_action_list_translation_agrees_with_torchs_runtime_loop_call_for_call(name):
    """Ops (kind, peer, bytes, dtype, label), batching, waits and awaits are the same on every
    rank, with and without defer_pp_recv."""
    assert _agreeing(name) >= 6


def test_the_agreement_check_tells_a_different_schedule_apart():
    recorded = ts.record_calls("Interleaved1F1B", 2, microbatches=4, stages_per_rank=2, defer_pp_recv=True)
    assert list(ts.rank_calls("Interleaved1F1B", 2, microbatches=4, stages_per_rank=2, defer_pp_recv=False)) != recorded
    assert list(ts.rank_calls("Interleaved1F1B", 2, microbatches=4, stages_per_rank=2, defer_pp_recv=True)) == recorded


def test_1f1b_steady_state_batches_a_send_with_a_receive_and_warmup_posts_single_ops():
    """torch's Schedule1F1B, recorded: fwd_sends + bwd_recvs and bwd_sends + fwd_recvs go through
    batch_isend_irecv; a list of only receives or only sends is posted op by op."""
    calls = ts.record_calls("1F1B", 3, microbatches=6)[1]
    batches = [c for c in calls if c[0] == "batch_isend_irecv"]
    assert batches and all(sorted(op[0] for op in c[1]) == ["recv", "send"] for c in batches)
    assert all(len(c[1]) == 1 for c in calls if c[0] != "batch_isend_irecv")
    assert calls[0][0] == "irecv" and calls[0][1][0][4] == "act mb0 s0->s1"


def test_gpipe_sends_every_activation_before_any_gradient():
    labels = [op[4] for c in ts.record_calls("GPipe", 2, microbatches=3)[0] for op in c[1]]
    assert labels == [f"act mb{m} s0->s1" for m in range(3)] + [f"grad mb{m} s1->s0" for m in range(3)]


# ---- what the programs carry ---------------------------------------------------------------------

@pytest.mark.parametrize("name", ts.NAMES)
def test_every_send_meets_a_receive_of_the_same_tensor_by_default(name):
    pp, m = 3, 6
    for key, (sends, recvs) in channels(ts.generate(name, pp, microbatches=m, first_step="metadata")).items():
        assert sends == recvs, key


def test_each_message_stream_has_its_own_byte_count():
    """Activations and gradients of every stage pair differ in bytes, so a reorder on a channel
    pairs different byte counts."""
    program = ts.generate("Interleaved1F1B", 4, microbatches=8, stages_per_rank=3, first_step="metadata")
    streams = defaultdict(set)
    for sends, _ in channels(program).values():
        for nbytes, dtype, label in sends:
            streams[(nbytes, dtype)].add(label.split(" mb")[0].split(" ")[0] + " " + label.split()[-1])
    shared = {k: v for k, v in streams.items() if len(v) > 1 and k[1] not in ("int32", "int64")}
    assert not shared and len(streams) >= 2 * 11


def test_v_placement_hands_over_locally_on_the_last_rank():
    """Rank r holds stages r and 2 pp - 1 - r: rank pp - 1 never messages itself, rank 0 sends
    activations of stage 0 and receives them into stage 2 pp - 1."""
    pp = 3
    program = ts.generate("ZBVZeroBubble", pp, microbatches=6)
    assert all(op.peer != pp - 1 for c in program.ranks[pp - 1] for s in c.steps for op in s)
    labels = {op.label.split()[-1] for c in program.ranks[0] for s in c.steps for op in s}
    assert labels == {"s0->s1", "s4->s5", "s1->s0", "s5->s4"}


def test_first_step_vote_is_blocking_int32_along_the_stages_and_back():
    calls = ts.rank_calls("GPipe", 3, microbatches=3, stages_per_rank=1, first_step="vote")[1]
    vote = [(c[0], c[1][0][1], c[1][0][3], c[3]) for c in calls[:4]]
    assert vote == [("recv", 0, "int32", True), ("send", 2, "int32", True),
                    ("recv", 2, "int32", True), ("send", 0, "int32", True)]
    assert calls[4][0] == "irecv"  # then the schedule


def test_first_step_metadata_sends_an_int64_size_then_a_uint8_payload_after_the_vote():
    calls = ts.rank_calls("GPipe", 2, microbatches=2, stages_per_rank=1, first_step="metadata")[0]
    meta = [c for c in calls if c[0].endswith("object_list")]
    assert [(c[0], c[1][0][3], c[2], c[3]) for c in meta] == [
        ("send_object_list", "int64", True, True), ("send_object_list", "uint8", True, True),
        ("recv_object_list", "int64", True, True), ("recv_object_list", "uint8", True, True)]
    assert calls.index(meta[0]) == 2  # after the vote's send and receive
    assert not any(c[0].endswith("object_list")
                   for c in ts.rank_calls("GPipe", 2, microbatches=2, stages_per_rank=1, first_step="vote")[0])


# ---- verdicts ------------------------------------------------------------------------------------

def test_defer_pp_recv_deadlocks_interleaved_1f1b_at_pp2_with_two_microbatches():
    """pytorch#172668's cycle: each rank's send waits behind its own queued send."""
    verdict = simulate(ts.generate("Interleaved1F1B", 2, microbatches=2, defer_pp_recv=True))
    assert verdict.verdict == "deadlock" and verdict.ranks == [0, 1]
    assert all(e.blocked_on.op.kind == "send" for e in verdict.cycle)


def test_without_defer_pp_recv_interleaved_1f1b_at_pp2_completes():
    assert simulate(ts.generate("Interleaved1F1B", 2, microbatches=2)).ok


@pytest.mark.parametrize("name,pp,m", [("ZBVZeroBubble", 2, 4), ("DualPipeV", 3, 6), ("InterleavedZeroBubble", 2, 4)])
def test_defer_pp_recv_reorders_receives_on_a_channel_under_buffering(name, pp, m):
    """Every send buffered (eager): an activation meets a receive posted for a gradient."""
    verdict = simulate(ts.generate(name, pp, microbatches=m, defer_pp_recv=True, eager_threshold=ts.MAX_EAGER))
    assert verdict.verdict == "mismatch" and verdict.mismatch is not None
    send, recv = verdict.mismatch
    assert send.op.label.split()[0] != recv.op.label.split()[0]  # act against grad
    assert simulate(ts.generate(name, pp, microbatches=m, eager_threshold=ts.MAX_EAGER)).ok


def test_default_configuration_is_deadlock_free_for_every_class_on_the_reduced_grid():
    from megatron_p2p import check

    results = check.grid_results(full=False, jobs=1, family="torch")
    default = [r for r in results if not r[0]["defer_pp_recv"] and r[1] != "skip"]
    assert {r[0]["schedule"] for r in default} == {f"torch:{n}" for n in ts.NAMES}
    assert all(r[1] == "ok" for r in default), [r[2] for r in default if r[1] != "ok"][:3]
    assert any(r[1] == "deadlock" for r in results if r[0]["defer_pp_recv"])


def test_lazy_nccl_comms_catch_the_older_executor_posting_one_message_single_and_batched():
    """PipelineScheduleMulti's own loop batches a send with a neighbour's receive: on NCCL the
    send goes over the group communicator and its receive over the pair's, and they never meet."""
    multi = simulate(ts.generate("Interleaved1F1B", 3, microbatches=3, executor="multi", lazy_comms=True))
    assert multi.verdict == "deadlock"
    assert {e.blocked_on.op.lane for e in multi.cycle} == {ts.GROUP_LANE, ts.PAIR_LANE}
    assert simulate(ts.generate("Interleaved1F1B", 3, microbatches=3, executor="multi")).ok
    assert simulate(ts.generate("Interleaved1F1B", 3, microbatches=3, lazy_comms=True)).ok


@pytest.mark.parametrize("kwargs,problem", [
    (dict(name="PipeDream", pp=2), "schedule must be one of"),
    (dict(name="GPipe", pp=1), "pp must be"),
    (dict(name="GPipe", pp=2, microbatches=0), "microbatches must be"),
    (dict(name="1F1B", pp=2, stages_per_rank=2), "one stage per rank"),
    (dict(name="ZBVZeroBubble", pp=2, stages_per_rank=3), "exactly 2 stages"),
    (dict(name="GPipe", pp=2, defer_pp_recv=True), "defer_pp_recv is an option"),
    (dict(name="GPipe", pp=2, first_step="all"), "first_step must be"),
    (dict(name="GPipe", pp=2, executor="multi"), "executor 'multi'"),
    (dict(name="1F1B", pp=4, microbatches=2), "torch refuses 1F1B"),
    (dict(name="DualPipeV", pp=2, microbatches=2), "torch refuses DualPipeV"),
])
def test_bad_arguments_and_configurations_torch_refuses_raise_naming_the_problem(kwargs, problem):
    with pytest.raises(ValueError, match=problem):
        ts.generate(kwargs.pop("name"), kwargs.pop("pp"), **kwargs)


# ---- shipped programs ----------------------------------------------------------------------------

@pytest.mark.parametrize("file,verdict", [
    ("torch_defer_pp_recv_interleaved_pp2.json", "deadlock"), ("torch_interleaved_pp2.json", "ok"),
    ("torch_defer_pp_recv_zbv_pp2_buffered.json", "mismatch"), ("torch_zbv_pp2_buffered.json", "ok"),
    ("torch_multi_executor_lazy_nccl_pp3.json", "deadlock"), ("torch_runtime_lazy_nccl_pp3.json", "ok"),
])
def test_shipped_torch_programs_have_their_verdicts(file, verdict):
    assert simulate(load(PROGRAMS / file)).verdict == verdict


def test_shipped_torch_programs_are_what_the_generator_makes():
    made = {
        "torch_defer_pp_recv_interleaved_pp2.json": ts.generate("Interleaved1F1B", 2, microbatches=2,
                                                                defer_pp_recv=True),
        "torch_defer_pp_recv_zbv_pp2_buffered.json": ts.generate("ZBVZeroBubble", 2, microbatches=4,
                                                                 defer_pp_recv=True, eager_threshold=ts.MAX_EAGER),
        "torch_multi_executor_lazy_nccl_pp3.json": ts.generate("Interleaved1F1B", 3, microbatches=3,
                                                               executor="multi", lazy_comms=True),
    }
    for file, program in made.items():
        assert prog.dumps(load(PROGRAMS / file)) == prog.dumps(program), file


def test_grid_covers_the_issue():
    grid = ts.grid_configs()
    assert {c["pp"] for c in grid} == set(range(2, 33))
    assert {c["microbatches"] for c in grid if c["pp"] == 5} == {1, 2, 5, 10, 11, 20}
    assert {c["stages_per_rank"] for c in grid if c["schedule"] == "torch:Interleaved1F1B"} == {2, 3, 4}
    assert {(c["defer_pp_recv"], c["eager_threshold"]) for c in grid if c["schedule"] == "torch:LoopedBFS"} == {
        (False, 0), (True, 0), (True, ts.MAX_EAGER)}
    assert all(not c["defer_pp_recv"] for c in grid if c["schedule"] in ("torch:GPipe", "torch:1F1B"))
    assert all(set(c) <= {"schedule", "pp", "microbatches", "stages_per_rank", "defer_pp_recv", "eager_threshold"}
               for c in grid)
