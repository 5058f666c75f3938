"""CUDA graphs on the NCCL backend, over the fake libcuda and libnccl, which refuse and log
every call that capture forbids: a captured 1F1B step replays with the eager step's results,
and a Request made under capture is stream-ordered only."""
from __future__ import annotations

import pytest
from test_nccl_model import fakes_built, run_ranks  # noqa: F401 - fakes_built is an autouse fixture

REPLAYS = 100
CAPTURES = 10


@pytest.fixture(scope="module")
def captured(tmp_path_factory) -> tuple[list[dict], str]:
    log = tmp_path_factory.mktemp("capture") / "forbidden.log"
    ranks = run_ranks("nccl_model_graph.py", 2, {"replays": REPLAYS, "check": True, "captures": CAPTURES},
                      env={"MPFAKE_CUDA_CAPTURE_LOG": str(log)})
    return ranks, log.read_text() if log.exists() else ""


def test_a_captured_1f1b_step_replayed_100_times_equals_eager_execution_bit_for_bit(captured):
    ranks, _ = captured
    for v in ranks:
        assert v["end_capture"] == 0 and len(v["replayed"]) == REPLAYS
        assert v["replayed"] == v["eager"]
    first, last = ranks
    # and what arrived is the peer's values of that run: activations forward, gradients backward
    assert [row[:3] for row in last["eager"]] == [[1000.0 * run + 10.0 * m for m in range(3)] for run in range(REPLAYS)]
    assert [row[:3] for row in first["eager"]] == [[1000.0 * run + 10.0 * m + 1 for m in range(3)]
                                                   for run in range(REPLAYS)]
    assert all(all(row[3:]) for v in ranks for row in v["eager"])  # every element, not just the first


def test_nothing_that_capture_forbids_ran_while_capturing(captured):
    """The model logs every refused call; the only entries allowed are none at all."""
    _, log = captured
    assert log == "", log


def test_a_captured_request_refuses_host_waits_and_eager_calls_still_work_after(captured):
    ranks, _ = captured
    for v in ranks:
        for what in ("synchronize", "is_completed"):
            assert v[what]["type"] == "P2PError" and "CUDA graph capture" in v[what]["msg"], v[what]
        assert v["after"]["type"] is None, v["after"]


def test_debug_matching_refuses_to_post_under_capture_naming_the_variable(captured):
    ranks, _ = captured
    for v in ranks:
        assert v["check"]["type"] == "P2PError" and "MEGATRON_P2P_CHECK" in v["check"]["msg"], v["check"]
        assert v["check"]["end_capture"] == 0, v["check"]  # refused before anything was captured


def test_each_new_capture_of_a_step_delivers_that_runs_values(captured):
    ranks, _ = captured
    for v in ranks:
        assert [c["arrived"] for c in v["captures"]] == v["eager"][:CAPTURES]


def test_a_captures_events_are_reused_once_it_has_ended_so_repeated_captures_hold_no_more(captured):
    """An event recorded during capture is no node of the graph (nccl_post.c recycle_graph_fences):
    each capture reuses the last one's, where keeping them all would grow with every capture."""
    ranks, _ = captured
    for v in ranks:
        live = [c["live_events"] for c in v["captures"]]
        assert len(live) == CAPTURES and live[-1] == live[1], live
