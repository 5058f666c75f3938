"""The shm suites, run on the NCCL backend over the fake libcuda and libnccl (tests/fakes/):
matching, deadlock freedom, the naive ring's failure, the P2PCommunicator drop-in and
megatron-core's schedules, then teardown at exit.

One 4-rank job (workers/nccl_model_suites.py) runs the suites' own workers with backend "nccl":
a job start costs seconds and megatron-core's import many more. What carries over from shm is
asserted as on shm, with the helpers of the shm tests; what NCCL cannot do (buffered sends,
MismatchError without MEGATRON_P2P_CHECK) is asserted as what NCCL does instead."""
from __future__ import annotations

import importlib.util
from typing import Any

import pytest
from conftest import run_job
from test_matching import (
    ALL_DTYPES,
    CONFIG_IDS,
    CONFIG_PARAMS,
    LANES,
    STEPS,
    configs,
    exchange_problems,
    expected_checks,
    expected_origins,
    group_failures,
    problems,
    recvs,
    report,
)
from test_megatron_dropin import CONFIGS as METHOD_CONFIGS
from test_megatron_dropin import METHODS, SCHEDULES, mcore, section  # noqa: F401 (mcore: a fixture)
from test_nccl_model import ABOVE_BOUND, FAKE_ENV, SILENT_SELF, STALL_ENV, fakes_built, run_one, run_ranks  # noqa: F401 (autouse)

KiB, MiB = 1 << 10, 1 << 20
SLACK = 10.0  # a loaded 2-core machine: never assert tight timings
# ncclInProgress from ncclGroupEnd for up to 1 ms, every other group at random: the path stays
# taken at a fraction of the default's cost.
QUICK_IN_PROGRESS = {"MPFAKE_NCCL_GROUP_IN_PROGRESS_MS": "1"}

WORLD_SUITE = {
    "configs": configs(4), "steps": STEPS, "timeout": 10.0,
    "dtypes": ALL_DTYPES, "dtype_numels": ["one", "4KiB+1"],  # one element: odd byte counts
    "sizes": [["uint8", 0], ["uint8", 1], ["uint8", 4 * KiB], ["float32", MiB]],
    "inflight": [["uint8", 64]], "inflight_depth": 10,
    "isend": [["float32", 4], ["float32", 4 * KiB]],
    "batch": [["float32", 4], ["float32", 4 * KiB]],
}
PARTITION_SUITE = {**WORLD_SUITE, "configs": configs(2), "dtypes": ["bfloat16", "float8_e4m3fn", "bool", "complex64"],
                   "dtype_numels": ["one"], "sizes": [["uint8", 1], ["float32", 4 * KiB]]}
# Group layouts of the 4 ranks, each run one after the other: label -> groups (None: the world)
LAYOUTS = {"4 ranks": None, "strided pairs": [[0, 2], [1, 3]], "3 ranks and 1": [[0, 1, 2], [3]]}
PARTITIONS = [groups for groups in LAYOUTS.values() if groups]
PIPELINE_SIZES = (2, 3, 4)  # on the last `size` ranks, as sched_pipeline.py lays them out
MEGATRON_TIMEOUT = 3.0  # ours in megatron-core's schedules: their waits take milliseconds
# Its sends are larger than NCCL may buffer (STALL_ENV bounds that at 1 MiB): only then is the cycle certain.
NAIVE_RING = {"ranks": [0, 1, 2], "numel": ABOVE_BOUND, "timeout": 30.0}
NAMED_WITHIN = 3.0  # a stall of MEGATRON_P2P_STALL_SECONDS (1 s), then the analysis (megatron_p2p/_stall.py)

PARAMS: dict[str, Any] = {
    "matching": {"suite": WORLD_SUITE, "partitions": [{"groups": g, "suite": PARTITION_SUITE} for g in PARTITIONS]},
    "contiguity": {"timeout": 10.0},
    "pipeline": {"iterations": 10, "small_numel": [16, 1024], "big_numel": 131072, "big_iterations": [7],
                 "microbatches": 8, "timeout": 10.0},
    "megatron": {"timeout": MEGATRON_TIMEOUT, "hidden": 8, "microbatches": 4},
    "naive_ring": NAIVE_RING,
}


@pytest.fixture(scope="module")
def suites() -> list[dict]:
    """Per rank, {part: {"ok", "value" | "error", "traceback"}} (workers/nccl_model_suites.py).
    Without megatron-core the megatron part is left out (its tests skip, saying why)."""
    params = PARAMS if importlib.util.find_spec("megatron") else {k: v for k, v in PARAMS.items() if k != "megatron"}
    return run_ranks("nccl_model_suites.py", 4, params, env={**QUICK_IN_PROGRESS, **STALL_ENV}, timeout=300)


def part(suites: list[dict], name: str) -> list[Any]:
    """Every rank's value of one part, failing with the traceback of any rank it failed on."""
    bad = [f"rank {r}: {v[name]['traceback']}" for r, v in enumerate(suites) if not v[name]["ok"]]
    assert not bad, "\n".join(bad)
    return [v[name]["value"] for v in suites]


def layout(suites: list[dict], label: str) -> tuple[list[dict], dict, str]:
    """The matching results of one group layout, as the shm tests' helpers read them: per rank a
    dict holding the suite result under the returned key; and the suite that ran."""
    matching = part(suites, "matching")
    layout = LAYOUTS[label]
    if layout is None:
        return matching, WORLD_SUITE, "world"
    index = PARTITIONS.index(layout)
    return [{"layout": v["partitions"][index]} for v in matching], PARTITION_SUITE, "layout"


# ---- matching --------------------------------------------------------------------------------

@pytest.mark.parametrize("mode,lanes", CONFIG_PARAMS, ids=CONFIG_IDS)
@pytest.mark.parametrize("label", LAYOUTS)
def test_every_exchange_delivers_each_message_to_its_neighbour(suites, label, mode, lanes):
    """Chains and rings, every kind of exchange (both directions, activations only, gradients
    only), over 4 ranks, two strided pairs, and an odd ring of 3 beside a rank alone: every
    rank gets exactly its neighbours' bytes, activations in recv_prev and gradients in
    recv_next, and each request says its peer, lane, size and number."""
    results, suite, key = layout(suites, label)
    found = []
    for topo in ("chain", "ring"):
        found += exchange_problems(results, suite, topo, mode, lanes, part=key)
    assert not found, report(found)


@pytest.mark.parametrize("lanes", LANES)
@pytest.mark.parametrize("label", LAYOUTS)
def test_isend_irecv_and_batch_isend_irecv_pair_the_kth_send_with_the_kth_receive(suites, label, lanes):
    """isend / irecv one by one on a chain (even ranks sending first), and all four ring ops in
    one batch_isend_irecv listed sends first or receives first: each receive gets the message
    its neighbour sent in the same direction."""
    results, suite, key = layout(suites, label)
    isends = len(suite["isend"]) * STEPS
    found = problems(results, f"isend-chain/lanes{lanes}",  # a rank alone posts nothing on a chain
                     lambda r, n: {"isend": isends * recvs("chain", "both", r, n)} if n > 1 else {},
                     lambda r, n, p, x: expected_origins("chain", r, n, p, x), part=key)
    found += problems(results, f"batch-ring/lanes{lanes}",
                      lambda r, n: {"batch": len(suite["batch"]) * STEPS * 2},
                      lambda r, n, p, x: expected_origins("ring", r, n, p, x), part=key)
    assert not found, report(found)


def test_every_dtype_arrives_bytewise_in_both_directions(suites):
    """Every dtype the package takes (bfloat16, each float8, bool and complex among them: those
    without an NCCL type travel as bytes), at one element and one element past 4 KiB."""
    results, suite, key = layout(suites, "4 ranks")
    found = group_failures(results, {"dtypes", "error"})
    assert not found, report(found)
    for rank, value in enumerate(results):
        res = value[key]
        assert res["dtypes"] == {"recv_prev": sorted(ALL_DTYPES), "recv_next": sorted(ALL_DTYPES)}
        assert sum(c.get("dtypes", 0) for c in res["checks"].values()) == sum(
            expected_checks(suite, topo, rank, 4).get("dtypes", 0) for topo, _, _ in suite["configs"])


def test_messages_of_0_and_1_byte_4_KiB_and_1_MiB_arrive_intact(suites):
    results, suite, key = layout(suites, "4 ranks")
    found = group_failures(results, {"sizes", "error"})
    assert not found, report(found)
    for value in results:
        assert {0, 1, 4 * KiB, MiB} <= set(value[key]["sizes"])


def test_exchanges_posted_before_any_wait_match_in_order(suites):
    """Ten exchanges in flight at once, each with buffers of its own, pair in posting order."""
    results, suite, key = layout(suites, "4 ranks")
    found = group_failures(results, {"inflight", "error"})
    assert not found, report(found)
    for rank, value in enumerate(results):
        for topo, mode, lanes in suite["configs"]:
            got = value[key]["checks"].get(f"{topo}/{mode}/lanes{lanes}", {}).get("inflight")
            assert got == expected_checks(suite, topo, rank, 4)["inflight"]


def test_a_non_contiguous_tensor_is_refused_before_anything_is_posted(suites):
    for value in part(suites, "contiguity"):
        for case in ("non_contiguous_recv", "non_contiguous_send"):
            assert value[case]["type"] == "ValueError" and "not contiguous" in value[case]["msg"], value[case]
        assert value["posted_nothing"]


def test_the_same_exchange_with_contiguous_tensors_is_carried(suites):
    for value in part(suites, "contiguity"):
        assert value["contiguous"]["type"] is None and value["exact"], value


# ---- deadlock freedom ------------------------------------------------------------------------

def pipeline_runs(suites: list[dict], schedule: str, size: int, mode: str, lanes: int) -> list[Any]:
    runs = [(rank, v[f"{schedule} size={size} mode={mode} lanes={lanes}"])
            for rank, v in enumerate(part(suites, "pipeline")) if rank >= 4 - size]
    failures = [f"rank {rank}: {run['traceback']}" for rank, run in runs if not run["ok"]]
    assert not failures, "\n".join(failures)
    return [run["value"] for _, run in runs]


@pytest.mark.parametrize("size", PIPELINE_SIZES, ids=lambda n: f"pp{n}")
@pytest.mark.parametrize("mode,lanes", CONFIG_PARAMS, ids=CONFIG_IDS)
def test_1f1b_completes_with_exact_payloads_in_microbatch_order(suites, mode, lanes, size):
    """megatron's 1F1B call pattern on a chain of 2 to 4 stages (warmup, steady state, cooldown)
    completes under NCCL's rules, every payload element exact; a middle stage makes all six
    calls."""
    calls = pipeline_runs(suites, "1f1b", size, mode, lanes)
    assert "recv_forward" not in calls[0] and "send_forward" not in calls[-1]
    if size >= 3:
        assert len(calls[1]) == 6, calls[1]


@pytest.mark.parametrize("size", PIPELINE_SIZES, ids=lambda n: f"pp{n}")
@pytest.mark.parametrize("mode,lanes", CONFIG_PARAMS, ids=CONFIG_IDS)
def test_ring_exchange_completes_every_iteration_with_exact_payloads(suites, mode, lanes, size):
    assert pipeline_runs(suites, "ring", size, mode, lanes) == [PARAMS["pipeline"]["iterations"]] * size


def test_naive_send_first_ring_is_named_as_a_deadlock_on_every_rank_long_before_the_timeout(suites):
    """isend to next then irecv from prev, on 3 ranks: NCCL itself names nothing, but the ranks'
    stall analysis finds the cycle of posted ops and raises DeadlockError on each of them, with the
    cycle, well before the timeout; nothing was delivered."""
    results = part(suites, "naive_ring")[:3]  # rank 3 is not in the ring
    for rank, res in enumerate(results):
        assert res["error_type"] == "DeadlockError" and res["elapsed"] < NAMED_WITHIN, (rank, res)
        assert "this wait-for cycle can never resolve" in res["error"], res["error"]
        assert res["received"] == [-1.0], (rank, res)


# ---- the P2PCommunicator drop-in and megatron-core's schedules ------------------------------

@pytest.fixture
def megatron(mcore, suites) -> list[dict]:  # noqa: F811 - mcore: the imported fixture, requested
    """Every rank's megatron part; skips where megatron-core does not import (mcore)."""
    return part(suites, "megatron")


@pytest.mark.parametrize("config", METHOD_CONFIGS)
def test_every_method_returns_what_megatron_core_returns(megatron, config):
    """The nine methods and _communicate through ours on NCCL and through megatron-core's own
    over gloo, same calls on 4 ranks: the same tensors, Nones, forms and handle keys."""
    for rank, res in enumerate(section(megatron, "methods")):
        for method in [*METHODS, "_communicate"]:
            mc, mine = res[config]["megatron"][method], res[config]["ours"][method]
            assert mc and mine == mc, (rank, method)


def test_pp2_pairs_activations_gradients_and_their_shapes(megatron):
    """2 stages, both directions at once, fixed shapes and variable_seq_lengths (both modes):
    each rank receives its peer's activation in recv_prev and gradient in recv_next."""
    for rank, res in enumerate(section(megatron, "pp2")):
        for key in ("batched ours", "shapes ours", "shapes ours batched"):
            got = res[key]["value"]
            assert got["recv_prev_is_activation"] and got["recv_next_is_gradient"], (rank, key, got)
        assert res["shapes ours"]["value"]["recv_prev_shape"] == [3, 2, 4]


def test_a_dtype_disagreement_in_the_shape_exchange_raises_mismatch_on_the_receiver(megatron):
    for rank, res in enumerate(section(megatron, "pp2")):
        mine = res["dtype mismatch ours"]
        if rank % 2 == 0:
            assert mine["ok"] and mine["value"] == {"sent": True}, rank
        else:
            assert mine["error_type"] == "MismatchError" and "bfloat16" in mine["error"], (rank, mine)
        assert res["dtype mismatch ours after"]["ok"], rank  # the communicator stays usable


def test_agreeing_dtypes_in_the_shape_exchange_report_nothing(megatron):
    for rank, res in enumerate(section(megatron, "pp2")):
        assert res["dtype match ours"]["ok"], (rank, res["dtype match ours"])
        if rank % 2:
            assert res["dtype match ours"]["value"] == {"dtype": "torch.float16", "values_equal": True}


def test_a_variable_seq_lengths_disagreement_fails_both_ranks_instead_of_hanging(megatron):
    """One stage sends a shape header (8 int64), the other receives data (24 float32): NCCL does
    not check (on a GPU the receive would truncate or hang); the model reports it, and both
    ranks raise a P2PError carrying that report. (MismatchError naming both ranks needs
    MEGATRON_P2P_CHECK=1 on NCCL.)"""
    for rank, res in enumerate(section(megatron, "pp2")):
        got = res["setting mismatch ours"]
        assert not got["ok"] and got["error_type"] in ("P2PError", "MismatchError"), (rank, got)
        assert "sent 8 x int64" in got["error"] and "receives 24 x float32" in got["error"], got["error"]


def test_1f1b_calls_with_overlap_return_handles_and_the_right_tensors(megatron):
    for rank, res in enumerate(section(megatron, "overlap_1f1b")):
        for mode in ("parity", "batched"):
            assert all(rec["right"] for rec in res[mode]), (rank, mode, res[mode])


def schedule_runs(megatron: list[dict], name: str) -> list[dict]:
    return [res[name] for res in section(megatron, "schedules")]


@pytest.mark.parametrize("name", SCHEDULES)
def test_megatron_schedule_over_ours_gives_bitwise_the_one_process_losses_and_grads(megatron, name):
    """megatron-core's own forward_backward function with our P2PCommunicator on NCCL (the
    model): losses and every gradient equal, bit for bit, those of the same model run in one
    process, the comparison test_megatron_dropin.py makes on shm (where they also equal
    megatron-core's own communicator's). The model buffers nothing, so the variable_seq_lengths
    schedules complete because the shape headers ride ahead of their tensors (_shape_headers.py);
    megatron-core's own round deadlocks there (programs/megatron_shape_round_pp2.json)."""
    for rank, runs in enumerate(schedule_runs(megatron, name)):
        assert runs["reference"]["ok"] and runs["swapped"]["ok"], (rank, runs["swapped"].get("traceback"))
        assert runs["swapped"]["value"] == runs["reference"]["value"], rank
        last_stage = rank == 3 or (name.startswith("1f1b pp2") and rank % 2 == 1)
        assert (len(runs["swapped"]["value"]["losses"]) > 0) == last_stage, rank


# ---- teardown at exit ------------------------------------------------------------------------

EXIT_TIMEOUT = 2.0


def test_ranks_that_exit_without_closing_end_at_once_with_status_0():
    """Two ranks exchange, then return with their communicators open: the atexit hook closes
    them at once, nothing left running holds the exit up, and every rank exits with status 0."""
    job = run_job("nccl_model_teardown.py", 2, {"case": "idle", "timeout": 60.0}, timeout=120, env=FAKE_ENV)
    assert job.returncode == 0, job.output[-4000:]
    for rank, res in enumerate(job.ranks):
        assert res is not None and res["ok"] and "exit" in res["value"], job.output[-4000:]
        assert res["value"]["exact"], rank
        exited = res["value"]["exit"]
        assert exited["closed"] and exited["seconds"] < 1.0, (rank, exited)


def test_a_rank_exiting_with_work_pending_ends_within_the_timeout():
    """An exchange whose ops never run (the fake keeps the rank silent), then the rank returns
    without waiting or closing: the atexit hook's close gives the work the communicator's
    timeout at most, aborts it, and the process ends."""
    v = run_one("nccl_model_teardown.py", {"case": "pending", "timeout": EXIT_TIMEOUT}, env=SILENT_SELF)
    assert "exit" in v, v
    assert v["exit"]["closed"] and v["exit"]["seconds"] < EXIT_TIMEOUT + 3.0, v["exit"]
    assert not v["exact"]
