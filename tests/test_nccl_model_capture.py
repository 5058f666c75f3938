"""The fake libcuda and libnccl (tests/fakes/) keep the promises of CUDA stream capture and graphs
that the real driver and NCCL make, so that the NCCL backend's capture path can be checked on
CPU: captured work runs only when its graph is launched, every call the driver refuses during
capture is refused (and invalidates the capture) and logged, and captured NCCL exchanges
replay. Observed through ctypes by tests/workers/nccl_model_capture_promises.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, WORKERS

FAKES = ROOT / "build" / "fakes"
WORKER = WORKERS / "nccl_model_capture_promises.py"

NONE, ACTIVE, INVALIDATED = 0, 1, 2
UNSUPPORTED, INVALIDATED_ERROR, MERGE, UNMATCHED, UNJOINED, ISOLATION, IMPLICIT, CAPTURED_EVENT, WRONG_THREAD = (
    900, 901, 902, 903, 904, 905, 906, 907, 908)
NCCL_INVALID_USAGE, NCCL_IN_PROGRESS = 5, 7


def worker_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("MPFAKE_")}


@pytest.fixture(scope="module")
def seen(tmp_path_factory: pytest.TempPathFactory) -> dict:
    if not (FAKES / "libcuda.so.1").exists():
        pytest.fail(f"the fake libraries are not built in {FAKES}: run `make fakes`")
    log = tmp_path_factory.mktemp("capture") / "refusals.log"
    done = subprocess.run([sys.executable, str(WORKER), str(FAKES), str(log)], capture_output=True, text=True,
                          timeout=60, env=worker_env())
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("capture-ranks")
    ranks = [subprocess.Popen([sys.executable, str(WORKER), str(FAKES), str(tmp / f"log{rank}"), str(rank),
                               str(tmp / "unique-id")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=worker_env()) for rank in (0, 1)]
    outputs = [rank.communicate(timeout=60) for rank in ranks]
    assert all(rank.returncode == 0 for rank in ranks), outputs
    return [json.loads(out) for out, _ in outputs]


# ---- capture and replay ---------------------------------------------------------------------------

def test_work_on_a_capturing_stream_runs_only_when_its_graph_is_launched(seen):
    v = seen["captured_work"]
    assert (v["before"], v["during"], v["after"]) == (NONE, ACTIVE, NONE)
    assert v["enqueued"] == 0 and v["ran_during_capture"] == 0 and v["end"] == 0
    assert v["runs_after_3_launches"] == 3


def test_each_capture_has_an_id_of_its_own(seen):
    (status1, id1), (status2, id2) = seen["capture_ids"]["ids"]
    assert status1 == status2 == ACTIVE and 0 < id1 != id2


def test_a_stream_joined_back_into_the_origin_ends_the_capture_and_replays_in_captured_order(seen):
    v = seen["joined"]
    assert v["side_joined"] == ACTIVE and v["ran_during_capture"] == []
    assert v["end"] == 0 and v["graph"] and v["side_after"] == NONE
    assert v["order"] == ["A", "B", "C", "after"] * 3  # B is slow: C and later work wait for it


def test_a_stream_forked_into_the_capture_and_never_joined_back_fails_it(seen):
    v = seen["unjoined"]
    assert v["side_joined"] == ACTIVE
    assert v["end"] == UNJOINED and not v["graph"] and v["side_after"] == NONE


def test_a_capture_ends_only_on_the_stream_that_began_it(seen):
    assert seen["joined"]["end_on_side"] == seen["unjoined"]["end_on_side"] == UNMATCHED
    assert seen["joined"]["end"] == 0


def test_a_capture_ends_only_on_its_thread_unless_it_is_relaxed(seen):
    assert seen["end_other_thread_global"] == {"end": WRONG_THREAD, "status_after": ACTIVE,
                                               "log": ["cuStreamEndCapture 908"]}
    assert seen["end_other_thread_relaxed"] == {"end": 0, "status_after": NONE, "log": []}


# ---- what a capture refuses ---------------------------------------------------------------------

@pytest.mark.parametrize("case, call, error", [
    ("query_captured_event", "cuEventQuery", CAPTURED_EVENT),
    ("synchronize_captured_event", "cuEventSynchronize", CAPTURED_EVENT),
    ("synchronize_capturing_stream", "cuStreamSynchronize", UNSUPPORTED),
    ("query_capturing_stream", "cuStreamQuery", UNSUPPORTED),
])
def test_waiting_on_captured_work_is_refused_and_invalidates_the_capture_but_is_fine_after_it(seen, case, call,
                                                                                              error):
    v = seen[case]
    assert v["during"] == error and v["status"] == INVALIDATED
    assert v["later_work"] == INVALIDATED_ERROR and v["end"] == INVALIDATED_ERROR
    assert v["after_end"] == 0
    assert v["log"] == [f"{call} {error}", f"mpfake_stream_enqueue {INVALIDATED_ERROR}",
                        f"cuStreamEndCapture {INVALIDATED_ERROR}"]


@pytest.mark.parametrize("case, call", [("global_query", "cuEventQuery"), ("global_synchronize", "cuStreamSynchronize"),
                                        ("global_alloc", "cuMemAlloc_v2")])
def test_a_global_capture_forbids_unsafe_calls_to_every_thread_not_relaxed(seen, case, call):
    v = seen[case]
    assert v["other_thread_relaxed"] == 0 and v["status_after_relaxed"] == ACTIVE
    assert v["other_thread_global"] == UNSUPPORTED and v["status_after_global"] == INVALIDATED
    assert v["capturing_thread"] == UNSUPPORTED
    assert v["capturing_thread_relaxed"] == 0
    assert v["end"] == INVALIDATED_ERROR
    assert v["log"] == [f"{call} {UNSUPPORTED}"] * 2 + [f"cuStreamEndCapture {INVALIDATED_ERROR}"]


def test_a_thread_local_capture_forbids_unsafe_calls_only_to_its_own_thread(seen):
    v = seen["thread_local_query"]
    assert v["other_thread_global"] == 0 and v["status_after_global"] == ACTIVE
    assert v["capturing_thread"] == UNSUPPORTED and v["status_after_own"] == INVALIDATED
    assert v["capturing_thread_relaxed"] == 0


def test_a_relaxed_capture_forbids_no_unsafe_call(seen):
    v = seen["relaxed_capture_query"]
    assert v["other_thread_global"] == v["capturing_thread"] == 0
    assert v["status_after_own"] == ACTIVE and v["end"] == 0 and v["log"] == []


def test_a_capturing_stream_may_wait_only_on_events_of_its_own_capture(seen):
    v = seen["waits"]
    assert v["never_recorded"] == 0 and v["recorded_inside"] == 0 and v["status_before"] == ACTIVE
    assert v["recorded_outside"] == ISOLATION and v["status_after"] == INVALIDATED and v["end"] == INVALIDATED_ERROR
    assert v["other_capture"] == MERGE and v["merge_ends"] == [INVALIDATED_ERROR] * 2


def test_the_legacy_stream_is_unusable_while_a_blocking_stream_captures_but_not_a_nonblocking_one(seen):
    blocking, nonblocking = seen["legacy_blocking"], seen["legacy_nonblocking"]
    assert blocking["legacy_work"] == IMPLICIT and blocking["end"] == INVALIDATED_ERROR and blocking["ran"] == 0
    assert nonblocking == {"legacy_work": 0, "end": 0, "ran": 1, "log": []}


def test_the_null_stream_cannot_be_captured(seen):
    assert seen["null_stream_capture"] == {"begin": UNSUPPORTED, "log": [f"cuStreamBeginCapture_v2 {UNSUPPORTED}"]}


def test_refusals_are_logged_and_clean_captures_log_nothing(seen):
    assert seen["waits"]["log"] == [f"cuStreamWaitEvent {ISOLATION}", f"cuStreamEndCapture {INVALIDATED_ERROR}",
                                    f"cuStreamWaitEvent {MERGE}"] + [f"cuStreamEndCapture {INVALIDATED_ERROR}"] * 2
    assert seen["unjoined"]["log"] == [f"cuStreamEndCapture {UNMATCHED}", f"cuStreamEndCapture {UNJOINED}"]
    for clean in ("captured_work", "capture_ids", "nccl_self_replays", "nccl_group_same_capture",
                  "nccl_nonblocking_settled"):
        assert seen[clean]["log"] == [], clean


# ---- libnccl under capture ------------------------------------------------------------------------

def test_a_captured_self_exchange_moves_nothing_until_launched_then_moves_the_bytes_at_each_of_100_replays(seen):
    v = seen["nccl_self_replays"]
    assert v["group_end"] == 0 and v["end"] == 0 and not v["moved_during_capture"]
    assert v["replays_delivered"] == 100
    assert v["eager_after"] == 0 and v["eager_delivered"]  # eager work after the replays still matches


def test_a_communicators_group_may_span_streams_of_one_capture_but_not_captured_and_uncaptured_ones(seen):
    same, mixed = seen["nccl_group_same_capture"], seen["nccl_group_mixed"]
    assert (same["send"], same["recv"], same["group_end"], same["end"]) == (0, 0, 0, 0)
    assert same["delivered"] == list(range(8))
    assert mixed["send"] == 0 and mixed["recv"] == mixed["group_end"] == NCCL_INVALID_USAGE
    assert "all uncaptured or all captured by the same capture" in mixed["says"]


def test_a_nonblocking_group_in_progress_during_capture_must_be_launched_before_the_capture_ends(seen):
    settled, unsettled = seen["nccl_nonblocking_settled"], seen["nccl_nonblocking_unsettled"]
    assert settled["group_end"] == NCCL_IN_PROGRESS and settled["state"] == 0 and settled["end"] == 0
    assert settled["delivered"] == list(range(8))
    assert unsettled["group_end"] == NCCL_IN_PROGRESS and unsettled["state"] == NCCL_INVALID_USAGE
    assert "launched after that capture ended" in unsettled["says"]


def test_two_ranks_launching_a_captured_exchange_100_times_back_to_back_match_replay_for_replay(two_ranks):
    for v in two_ranks:
        assert v == {"end": 0, "replays": 100, "in_order": True, "log": []}
