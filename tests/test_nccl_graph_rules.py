"""The NCCL backend under CUDA graph capture and with graphs alive, on the fakes (which refuse and
log every call CUDA refuses during a capture, and whose ncclCommAbort waits, as NCCL's does, until
every graph that captured work on the communicator is destroyed):

- whether to capture, query or wait is decided per call from the caller's stream, and the event
  queries run in the relaxed capture mode, as NCCL's own do: eager exchanges waited in stream
  order only never break a later capture;
- a capturing stream never waits on an eager op's event, and only a stream in a captured op's
  capture waits on that op: both are refused with a P2PError naming the rule, the communicator
  and the capture left intact;
- ncclCommAbort runs on a thread of its own: abort(), close() and a timeout return within a
  second while a graph lives, and the process exits;
- the transport's locks are never taken holding the GIL."""
from __future__ import annotations

import time

import pytest
from test_nccl_model import fakes_built, run_one  # noqa: F401 - fakes_built is an autouse fixture

WORKER = "nccl_model_capture_rules.py"


def run_case(case: str, tmp_path, env: dict[str, str] | None = None, **params) -> tuple[dict, str]:
    log = tmp_path / "capture.log"
    out = run_one(WORKER, {"case": case, **params}, env={"MPFAKE_CUDA_CAPTURE_LOG": str(log), **(env or {})})
    return out, log.read_text() if log.exists() else ""


def test_a_capture_after_eager_exchanges_waited_in_stream_order_replays_exact_data(tmp_path):
    out, log = run_case("capture_after_eager", tmp_path)
    assert out["synchronized"] == 0 and out["eager_arrived"], out
    assert [w["type"] for w in out["wait_inside"]] == [None, None], out
    assert out["end_capture"] == 0, (out, log)
    assert out["replays_exact"] == [True, True, True], out
    assert log == "", log  # nothing the capture forbids ran


def test_an_eager_op_still_pending_cannot_be_waited_on_a_capturing_stream_and_the_capture_survives(tmp_path):
    out, log = run_case("eager_pending_under_capture", tmp_path, env={"MPFAKE_NCCL_DELAY_MS": "800"})
    refused = out["wait_under_capture"]
    assert refused["type"] == "P2PError" and "before the current stream's CUDA graph capture began" in refused["msg"]
    assert "synchronize() the op before beginning the capture" in refused["msg"], refused
    assert out["end_capture"] == 0, (out, log)  # refused before CUDA saw it: the capture is intact
    assert out["synchronize_after"]["type"] is None and out["eager_arrived"], out
    assert log == "", log


def test_a_captured_op_is_waited_only_in_its_own_capture(tmp_path):
    out, log = run_case("captured_waited_outside", tmp_path)
    assert [w["type"] for w in out["wait_inside"]] == [None, None] and out["end_capture"] == 0, out
    for where in ("wait_after_capture", "wait_in_other_capture"):
        refused = out[where]
        assert refused["type"] == "P2PError" and "posted during a CUDA graph capture" in refused["msg"], (where, out)
    assert out["other_end_capture"] == 0, out  # the other capture was not merged nor invalidated
    assert out["replays_exact"] == [True, True] and out["eager_after"]["type"] is None, out
    assert log == "", log


def test_abort_and_close_return_within_a_second_while_a_captured_graph_lives(tmp_path):
    out, _ = run_case("abort_with_live_graph", tmp_path)
    assert out["end_capture"] == 0 and out["replays_exact"] == [True], out
    assert out["returned"], out
    for call in ("abort", "close"):
        assert out[call]["type"] is None and out[call]["elapsed"] < 1.0, (call, out)
    # NCCL's abort goes on on its own thread until the graph is destroyed, then ends
    assert out["aborting_after_close"] == 1 and out["aborting_0_2_s_after_close"] == 1, out
    assert out["aborting_after_graph_destroyed"] == 0, out


def test_abort_and_close_after_the_graph_is_destroyed_finish_the_abort_before_close_returns(tmp_path):
    out, _ = run_case("abort_after_graph_destroyed", tmp_path)
    assert out["returned"], out
    for call in ("abort", "close"):
        assert out[call]["type"] is None and out[call]["elapsed"] < 1.0, (call, out)
    # the abort returned before close() did: its thread ends at once (a blocked one never would)
    assert out["aborting_0_2_s_after_close"] == 0, out


def test_a_timeout_while_a_graph_lives_raises_at_once_and_the_process_exits(tmp_path):
    start = time.monotonic()
    # each lane's warm-up (a send and a receive) runs; every op after it never does
    silent = {"MPFAKE_NCCL_SILENT_RANK": "0", "MPFAKE_NCCL_SILENT_AFTER": "2"}
    out, _ = run_case("timeout_with_live_graph", tmp_path, env=silent, timeout=20.0)
    took = time.monotonic() - start
    assert out["end_capture"] == 0, out
    timed_out = out["timed_out"]
    assert timed_out["type"] == "P2PTimeoutError" and timed_out["elapsed"] < 1.5, timed_out
    assert out["close"]["type"] is None and out["close"]["elapsed"] < 1.0, out
    assert took < 15.0, took  # the whole process, exit included, with the graph never destroyed


IN_PROGRESS_S = 1.2  # how long the model keeps each group end ncclInProgress in the second case


@pytest.mark.parametrize("case_env", [pytest.param({}, id="groups-launch-at-once"),
                                      pytest.param({"MPFAKE_NCCL_GROUP_IN_PROGRESS_EVERY": "1",
                                                    "MPFAKE_NCCL_GROUP_IN_PROGRESS_MS": str(int(IN_PROGRESS_S * 1000))},
                                                   id="groups-in-progress-1.2s")])
def test_python_threads_run_while_another_threads_exchange_waits_for_the_posting_lock(tmp_path, case_env):
    """A thread holding the GIL through a group end in progress, or through the wait for the
    posting lock behind it, would stop the main thread for IN_PROGRESS_S at least; its longest
    gap stays under half that, which leaves a busy machine's scheduler 0.6 s."""
    out, _ = run_case("gil_while_posting_blocked", tmp_path, env=case_env)
    assert out["first"]["type"] is None and out["second"]["type"] is None and out["arrived"], out
    assert out["longest_gap"] < IN_PROGRESS_S / 2, out
