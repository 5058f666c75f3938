"""The NCCL backend's watchdog (megatron_p2p/_watchdog.py), over the fake libcuda and libnccl: an
op waited on the stream only, whose peer never posts, still ends in a report at its timeout,
and by default under torchrun the report ends the process so the job is torn down."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
from conftest import WORKERS, run_job
from test_nccl_model import FAKE_ENV, fakes_built, run_one  # noqa: F401 - fakes_built is an autouse fixture

SILENT_PEER = {"MPFAKE_NCCL_SILENT_RANK": "1", "MPFAKE_NCCL_SILENT_AFTER": "2"}  # after each lane's warm-up
# The default handling under torchrun: FAKE_ENV sets "raise" for the other model tests.
DEFAULT_HANDLING = {k: v for k, v in FAKE_ENV.items() if k != "MEGATRON_P2P_ASYNC_ERROR_HANDLING"}


def test_a_stalled_stream_ends_the_job_at_the_timeout_with_the_report_and_a_dump(tmp_path):
    start = time.monotonic()
    job = run_job("nccl_model_watchdog.py", 2, {"timeout": [1.0, 30.0], "idle": 40.0}, timeout=90,
                  env={**DEFAULT_HANDLING, **SILENT_PEER, "MEGATRON_P2P_TRACE_DIR": str(tmp_path)})
    elapsed = time.monotonic() - start
    # Not after the 40 s idle; the margin is the start-up of torch in each process on a loaded machine
    # (16 s under make sanitize beside another test file).
    assert job.returncode != 0 and elapsed < 30.0, (elapsed, job.output[-3000:])
    assert "exitcode  : 70" in job.output, job.output[-3000:]  # rank 0 ended itself, torchrun ended the job
    report = job.output[job.output.index("megatron_p2p watchdog: rank 0"):]
    assert "an op past its timeout" in report and "send_next to rank 1" in report, report[:2000]
    assert "ending the process" in report, report[:2000]
    dump = json.loads(next(tmp_path.glob("rank0.*.json")).read_text())
    assert dump["reason"] == "watchdog" and "an op past its timeout" in dump["error"], dump["error"]


def test_work_that_completed_never_wakes_the_watchdog_however_long_the_host_idles():
    job = run_job("nccl_model_watchdog.py", 2, {"timeout": 1.0, "idle": 2.0}, timeout=60, env=DEFAULT_HANDLING)
    for v in (r["value"] for r in job.ok()):
        assert v["wait"]["type"] is None and v["next_call"]["type"] is None and v["exact"], v
    assert "watchdog" not in job.output, job.output[-3000:]


def test_raise_mode_keeps_the_process_and_the_next_calls_raise_the_report_here_and_at_the_peer():
    job = run_job("nccl_model_watchdog.py", 2, {"timeout": [1.0, 30.0], "idle": 3.0}, timeout=60,
                  env={**FAKE_ENV, **SILENT_PEER})
    mine, peer = (r["value"] for r in job.ok())
    assert mine["wait"]["type"] is None, mine  # stream-ordered: the host was never blocked
    assert mine["next_call"]["type"] == "P2PTimeoutError", mine["next_call"]
    assert "aborted by the watchdog" in mine["next_call"]["msg"], mine["next_call"]["msg"]
    assert "send_next to rank 1" in mine["next_call"]["msg"], mine["next_call"]["msg"]
    # rank 1 (timeout 30 s) learns of it through the store within the idle, long before its own timeout
    assert peer["next_call"]["type"] is not None and "(rank 0)" in peer["next_call"]["msg"], peer["next_call"]
    assert peer["next_call"]["elapsed"] < 1.0, peer["next_call"]


@pytest.mark.parametrize("value", ["abort", "1"])
def test_a_wrong_handling_value_is_refused_at_creation_naming_the_variable(value):
    with pytest.raises(AssertionError, match=f"MEGATRON_P2P_ASYNC_ERROR_HANDLING={value!r}"):
        run_one("nccl_model_watchdog.py", {"timeout": 1.0, "idle": 0.0},
                env={"MEGATRON_P2P_ASYNC_ERROR_HANDLING": value})


@pytest.mark.parametrize("thread", ["watchdog", "bare"])
def test_a_process_exits_cleanly_while_the_watchdog_polls_the_store(thread):
    """The watchdog thread is stopped and joined at exit, before finalization: a daemon thread
    returning from a store call during finalization ends the process with std::terminate (the
    bare thread, which shows that the case reaches that window)."""
    done = subprocess.run([sys.executable, str(WORKERS / "watchdog_exit.py"), thread],
                          capture_output=True, text=True, timeout=60)
    assert "body done" in done.stdout, done.stdout + done.stderr[-3000:]
    if thread == "watchdog":
        assert done.returncode == 0 and "terminate called" not in done.stderr, (done.returncode, done.stderr[-3000:])
    else:
        assert done.returncode == -signal.SIGABRT and "terminate called" in done.stderr, (done.returncode,
                                                                                          done.stderr[-3000:])
