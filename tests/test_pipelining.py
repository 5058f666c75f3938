"""torch.distributed.pipelining over megatron_p2p (patch_pipelining): what the patch swaps and
puts back, and real runs of the seven schedule classes, over gloo and over megatron_p2p (shm) in
the same worker with the same seeds, compared bit for bit (workers/pipelining_runs.py: one job
per world size, every configuration in it)."""
import pytest
import torch.distributed as dist
from conftest import run_job

import megatron_p2p as mp

CLASSES = [("GPipe", 1), ("1F1B", 1), ("LoopedBFS", 1), ("LoopedBFS", 2), ("Interleaved1F1B", 1),
           ("Interleaved1F1B", 2), ("InterleavedZeroBubble", 1), ("InterleavedZeroBubble", 2),
           ("ZBVZeroBubble", 2), ("DualPipeV", 2)]
# The cycle of pytorch#172668, and a reordering that gloo delivers into the wrong buffers.
DEFER = [["Interleaved1F1B", 2, 2, False], ["ZBVZeroBubble", 2, 4, True]]


def configs(pp):
    runs = [[c, spr, 2 * pp, given] for c, spr in CLASSES for given in (True, False)]
    if pp == 2:
        runs.append(["Interleaved1F1B", 2, 2, True])  # the DEFER configuration in the default order
    return runs


def name(cfg):
    return "{} spr{} mb{} {}".format(cfg[0], cfg[1], cfg[2], "given" if cfg[3] else "inferred")


@pytest.fixture(scope="module")
def jobs():
    """Per world size, every rank's result."""
    out = {}
    for pp in (2, 4):
        params = {"timeout": 20.0, "configs": configs(pp), "peers": pp == 2,
                  "layout_configs": [["1F1B", 1, 4, True], ["Interleaved1F1B", 2, 2 * pp, False]],
                  "defer": DEFER if pp == 2 else []}
        out[pp] = [r["value"] for r in run_job("pipelining_runs.py", pp, params=params, timeout=240).ok()]
    return out


ALL = [(pp, name(cfg)) for pp in (2, 4) for cfg in configs(pp)]


@pytest.mark.parametrize("pp,config", ALL, ids=[f"pp{pp}-{c}" for pp, c in ALL])
def test_schedule_is_bitwise_equal_to_gloo(jobs, pp, config):
    """Losses (two steps and the eval between), eval outputs and gradients, on every rank."""
    for rank, res in enumerate(jobs[pp]):
        run = res["runs"][config]
        assert run["messages"] > 0, f"rank {rank}: nothing went over megatron_p2p"
        assert all(run["equal"][k] for k in ("losses", "eval", "grads")), f"rank {rank}: {run['equal']}"
    # the comparison had something to compare: the last stage's rank holds losses
    assert max(res["runs"][config]["equal"]["n_losses"] for res in jobs[pp]) > 0


def test_a_different_run_compares_unequal(jobs):
    """The comparison can fail: other data, the same configuration, differs on every rank."""
    for res in jobs[2] + jobs[4]:
        assert not res["control"]["grads"]


@pytest.mark.parametrize("pp", [2, 4])
def test_metadata_round_runs_over_megatron_p2p_when_examples_are_inferred(jobs, pp):
    """Without example tensors the stages exchange metadata (send_object_list / recv_object_list):
    more messages than with them; with them, none of those."""
    for res in jobs[pp]:
        for c, spr in CLASSES:
            given, inferred = (res["runs"][name([c, spr, 2 * pp, g])]["messages"] for g in (True, False))
            assert inferred > given, (c, spr, given, inferred)


@pytest.mark.parametrize("pp", [2, 4])
def test_non_contiguous_activations_and_gradients_travel_as_their_values(jobs, pp):
    """Stage 0 sends a transposed activation (torch gives stage 1's buffer its strides) and gets a
    transposed gradient back: the same results as gloo's run with contiguous ones (gloo refuses
    non-contiguous tensors)."""
    for res in jobs[pp]:
        for cfg, eq in res["layouts"].items():
            assert all(eq[k] for k in ("losses", "eval", "grads")), (cfg, eq)


def test_a_group_without_a_communicator_is_named(jobs):
    for res in jobs[2]:
        err = res["no_comm"]
        assert err["type"] == "P2PError" and "no megatron_p2p communicator spans global ranks [0, 1]" in err["msg"]
        assert "init_communicator" in err["msg"] and "was closed" not in err["msg"]


def test_a_group_whose_communicator_was_closed_is_told_so(jobs):
    for res in jobs[2]:
        err = res["closed_comm"]
        assert err["type"] == "P2PError", err
        assert "the communicator over global ranks [0, 1] was closed" in err["msg"] and "init_communicator" in err["msg"]


def test_defer_pp_recv_cycle_raises_deadlock_error_naming_it_within_a_second(jobs):
    """Interleaved1F1B, pp=2, 2 microbatches, defer_pp_recv=True: both ranks raise DeadlockError
    naming the cycle; the same configuration in torch's default order runs (bitwise equal to
    gloo, above). gloo's buffered sends get through this one: its results equal the default's."""
    assert "Interleaved1F1B spr2 mb2 given" in jobs[2][0]["runs"]
    for res in jobs[2]:
        case = res["defer"]["Interleaved1F1B spr2 mb2"]
        ours = case["ours"]
        assert ours["type"] == "DeadlockError", ours
        assert "ranks 0 -> 1 -> 0" in ours["msg"] and "wait-for cycle" in ours["msg"]
        assert ours["elapsed"] < 1.0
        assert all(case["gloo"][k] for k in ("losses", "grads"))


def test_defer_pp_recv_misdelivery_is_silent_on_gloo_and_stopped_here(jobs):
    """ZBVZeroBubble, pp=2, 4 microbatches, defer_pp_recv=True, all widths equal: gloo completes
    with other losses or gradients (messages landed in the wrong buffers, silently); under strict
    rendezvous the reordering is a cycle, and megatron_p2p raises DeadlockError."""
    gloo = [res["defer"]["ZBVZeroBubble spr2 mb4 uniform"]["gloo"] for res in jobs[2]]
    assert any(not (g["losses"] and g["grads"]) for g in gloo), gloo
    for res in jobs[2]:
        assert res["defer"]["ZBVZeroBubble spr2 mb4 uniform"]["ours"]["type"] == "DeadlockError"


def test_p2pop_fills_group_peer_and_ops_take_group_dst_and_group_src(jobs):
    for rank, res in enumerate(jobs[2]):
        p = res["peers"]
        assert p["group_peer_filled"] == [1 - rank, 1 - rank]
        assert p["group_filled"] == [True, True]  # the default group when none is given; a given one kept
        assert p["not_a_member"]["type"] == "ValueError", p["not_a_member"]
        assert "peer = 5 is not a rank of this communicator" in p["not_a_member"]["msg"], p["not_a_member"]
        assert p["group_dst_src"] == [float(1 - rank)] * 3
        assert p["recv_returns"] == 1 - rank


def test_object_lists_have_torchs_wire_format(jobs):
    """The bytes rank 1 reads raw (int64 sizes, then the pickles as uint8) are the same from
    torch's send_object_list over gloo and from ours; ours round-trips and returns the sender."""
    p = jobs[2][1]["peers"]
    assert p["wire"]["ours"] == p["wire"]["torch"]
    assert len(p["wire"]["ours"][0]) == 3 and p["wire"]["ours"][0][1] > 300
    assert p["object_list"] == {"sender": 0, "equal": True}


def _pipelining_modules():
    from torch.distributed.pipelining import schedules, stage

    return schedules, stage


def test_patch_swaps_dist_in_the_pipelining_modules_only_and_back():
    schedules, stage = _pipelining_modules()
    isend = dist.isend
    with mp.patch_pipelining() as patch:
        for mod in (schedules, stage):
            assert mod.dist is patch.dist and mod.dist is not dist
            assert mod.dist.isend is not isend and mod.dist.P2POp is not dist.P2POp
            assert mod.dist.get_rank is dist.get_rank and mod.dist.ProcessGroup is dist.ProcessGroup
        assert dist.isend is isend and dist.P2POp.__module__.startswith("torch")
        assert {m for m, _ in patch.swapped} >= {schedules.__name__, stage.__name__}
        assert mp.patch_pipelining() is patch  # idempotent
    assert schedules.dist is dist and stage.dist is dist
    mp.unpatch_pipelining()  # idempotent
    assert schedules.dist is dist


def test_patch_pipelining_takes_a_communicator_or_none():
    with pytest.raises(TypeError, match="megatron_p2p Communicator or None"):
        mp.patch_pipelining("shm")  # type: ignore[arg-type]
    mp.patch_pipelining(None)
    mp.unpatch_pipelining()
