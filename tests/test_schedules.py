"""Schedules: the exchanges a pipeline makes never deadlock under strict rendezvous, and the
ordering bug they avoid is reported rather than hung.

Each multi-rank job starts torchrun (seconds on a small machine), so one job covers many
configurations and the tests below read their part of its result."""
import pytest
from conftest import run_job

WORLD = 8  # ring and chain sizes 2..WORLD run in one job, on sub-communicators
SIZES = list(range(2, WORLD + 1))
CONFIGS = [(mode, lanes) for mode in ("parity", "batched") for lanes in (1, 2)]
CONFIG_IDS = [f"{mode}-lanes{lanes}" for mode, lanes in CONFIGS]
NAIVE_TIMEOUT = 60.0
DETECTION_LIMIT = 1.0  # a deadlock is raised this soon, whatever the timeout
SLACK = 15.0  # a loaded 2-core machine: never assert tight timings


@pytest.fixture(scope="module")
def pipeline_job():
    """sched_pipeline.py on 8 ranks: ring exchanges and 1F1B for every size, mode and lane count."""
    params = {
        "iterations": 22,
        "small_numel": [16, 1024],  # 128 B and 8 KiB: inline and single-copy paths
        "big_numel": 131072,  # 1 MiB of int64
        "big_iterations": [7, 15],
        "microbatches": 8,
        "timeout": 10.0,
    }
    return run_job("sched_pipeline.py", WORLD, params=params, timeout=300).ok()


@pytest.fixture(scope="module")
def naive_ring_job():
    """sched_naive_ring.py on 3 ranks: the isend-then-irecv ring, buffered and then strict."""
    params = {"numel": 256, "eager_threshold": 4096, "timeout": NAIVE_TIMEOUT}
    return run_job("sched_naive_ring.py", 3, params=params, timeout=120).ok()


def _results(job, schedule, size, mode, lanes):
    """[(global rank, outcome)] of one run, from every member rank; fails on any error."""
    results = [(rank, job[rank]["value"][f"{schedule} size={size} mode={mode} lanes={lanes}"])
               for rank in range(WORLD - size, WORLD)]
    failures = [f"rank {rank}: {res['traceback']}" for rank, res in results if not res["ok"]]
    assert not failures, "\n".join(failures)
    return [res["value"] for _, res in results]


@pytest.mark.parametrize("size", SIZES, ids=lambda n: f"size{n}")
@pytest.mark.parametrize("mode,lanes", CONFIGS, ids=CONFIG_IDS)
def test_ring_exchange_completes_under_strict_rendezvous(pipeline_job, mode, lanes, size):
    """The four-op exchange (send_next, recv_prev, send_prev, recv_next) around a ring of
    `size` ranks completes every iteration, and every received element is the one its neighbour
    sent in that iteration and direction (small, 8 KiB and 1 MiB messages)."""
    assert _results(pipeline_job, "ring", size, mode, lanes) == [22] * size


@pytest.mark.parametrize("size", SIZES, ids=lambda n: f"size{n}")
@pytest.mark.parametrize("mode,lanes", CONFIGS, ids=CONFIG_IDS)
def test_1f1b_schedule_completes_on_a_chain_under_strict_rendezvous(pipeline_job, mode, lanes, size):
    """Megatron's 1F1B call pattern on a chain of `size` stages (warmup send_forward /
    recv_forward, steady send_forward_recv_backward / send_backward_recv_forward, cooldown
    recv_backward / send_backward) completes, every payload exact and in microbatch order."""
    calls = _results(pipeline_job, "1f1b", size, mode, lanes)
    # The first stage never receives activations, the last never receives gradients.
    assert "recv_forward" not in calls[0] and "send_backward" not in calls[0]
    assert "send_forward" not in calls[-1] and "recv_backward" not in calls[-1]
    if size >= 3:  # a middle stage makes every one of megatron's six calls
        assert set(calls[1]) == {
            "recv_forward", "send_forward", "send_forward_recv_backward",
            "send_backward_recv_forward", "recv_backward", "send_backward",
        }


def test_naive_ring_deadlock_is_reported_on_every_rank_well_under_the_timeout(naive_ring_job):
    """isend to next then irecv from prev, one by one, under strict rendezvous: no receive is
    ever posted. Every rank raises DeadlockError (a P2PTimeoutError, so a TimeoutError) naming
    the cycle, its pending isend and its peer, within a second of a 60 s timeout."""
    for rank, res in enumerate(naive_ring_job):
        strict = res["value"]["strict"]
        assert strict["eager_threshold"] == 0
        assert strict.get("error_type") == "DeadlockError", (rank, strict)
        assert strict["is_p2p_error"] and strict["is_timeout_error"]
        assert strict["elapsed"] < DETECTION_LIMIT, (rank, strict["elapsed"])
        assert "deadlock: ranks 0 -> 1 -> 2 -> 0" in strict["error"], strict["error"]
        message = strict["error"]
        assert f"isend to rank {strict['next']}" in message, (rank, message)
        assert f"{strict['nbytes']} bytes" in message and "message #0" in message, (rank, message)
        assert f"irecv from rank {strict['prev']}" in message, (rank, message)
        assert strict["received"] == [-1.0]  # nothing was delivered


def test_naive_ring_completes_when_sends_are_buffered(naive_ring_job):
    """The same program with messages under eager_threshold completes: buffered sends hide the
    ordering bug, which is why strict rendezvous is the default."""
    for rank, res in enumerate(naive_ring_job):
        buffered = res["value"]["buffered"]
        assert buffered["nbytes"] <= buffered["eager_threshold"]
        assert "error" not in buffered, (rank, buffered.get("error"))
        assert buffered["received"] == [float(buffered["prev"])]
