"""The NCCL backend (csrc/nccl/ and its Python side), run on CPU over the fake libcuda and
libnccl of tests/fakes/: the loader takes them through MEGATRON_P2P_NCCL_LIBRARY and
MEGATRON_P2P_CUDA_LIBRARY, and the real transport code moves exact bytes, reports a mismatch,
times out on a peer that never posts, and gets through every ncclInProgress answer."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, WORKERS, run_job

from megatron_p2p import _stall

FAKES = ROOT / "build" / "fakes"
FAKE_ENV = {
    "MEGATRON_P2P_NCCL_LIBRARY": str(FAKES / "libnccl.so.2"),
    "MEGATRON_P2P_CUDA_LIBRARY": str(FAKES / "libcuda.so.1"),
    # Failures are asserted as exceptions; tests/test_watchdog.py covers ending the process.
    "MEGATRON_P2P_ASYNC_ERROR_HANDLING": "raise",
}



@pytest.fixture(autouse=True)
def fakes_built() -> None:
    if not (FAKES / "libnccl.so.2").exists() or not (FAKES / "libcuda.so.1").exists():
        pytest.fail(f"the fake libraries are not built in {FAKES}: run `make fakes`")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_one(worker: str, params: dict[str, Any], env: dict[str, str] | None = None, timeout: float = 60) -> dict:
    """Runs a worker as the only rank of a job, without torchrun (a second or two cheaper)."""
    with tempfile.TemporaryDirectory(prefix="mp2p-model-") as tmp:
        run_env = {k: v for k, v in os.environ.items() if not k.startswith("MPFAKE_")}
        run_env.update(FAKE_ENV, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), MP_RESULT_DIR=tmp,
                       MP_PARAMS=json.dumps(params), **(env or {}))
        done = subprocess.run([sys.executable, str(WORKERS / worker)], env=run_env, capture_output=True, text=True,
                              timeout=timeout)
        path = Path(tmp) / "rank0.json"
        assert path.exists(), done.stdout + done.stderr
        result = json.loads(path.read_text())
        assert result.get("ok"), result.get("traceback", "") + done.stderr[-3000:]
        return result["value"]


def run_ranks(worker: str, nproc: int, params: dict[str, Any], env: dict[str, str] | None = None,
              timeout: float = 90) -> list[dict]:
    return [r["value"] for r in run_job(worker, nproc, params, timeout=timeout, env={**FAKE_ENV, **(env or {})}).ok()]


def delivered_exactly(ranks: list[dict]) -> None:
    by_rank = {v["rank"]: v for v in ranks}
    assert len({len(v["runs"]) for v in ranks}) == 1 and ranks[0]["runs"], ranks
    for v in ranks:
        prev, nxt = by_rank[v["prev"]], by_rank[v["next"]]
        for mine, theirs_prev, theirs_next in zip(v["runs"], prev["runs"], nxt["runs"]):
            assert mine["fwd_got"] == theirs_prev["fwd_sent"], (v["rank"], mine["mode"], mine["round"])
            assert mine["bwd_got"] == theirs_next["bwd_sent"], (v["rank"], mine["mode"], mine["round"])


# ---- the model keeps the libraries' promises ---------------------------------------------------------

@pytest.fixture(scope="module")
def promises() -> dict:
    done = subprocess.run([sys.executable, str(WORKERS / "nccl_model_promises.py"), str(FAKES)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def test_the_driver_refuses_calls_before_cuinit_and_without_a_current_context(promises):
    assert promises["before_init"] == 3  # CUDA_ERROR_NOT_INITIALIZED
    assert promises["stream_without_context"] == promises["still_without_context"] == 201  # INVALID_CONTEXT
    assert promises["stream_with_context"] == 0


def test_an_event_is_not_ready_until_the_work_before_it_has_run(promises):
    assert promises["query_while_work_runs"] == 600 and promises["query_after_work"] == 0


def test_a_stream_waiting_on_an_event_runs_after_the_work_before_it(promises):
    assert promises["order_while_blocked"] == [] and promises["order"] == ["a", "b"]


def test_a_self_send_alone_is_refused_and_paired_in_a_group_delivers(promises):
    assert promises["lone_self_send"] == 5  # ncclInvalidUsage
    assert promises["paired_self_send"] == 0 and promises["self_bytes"] == list(range(8))


def test_unbalanced_group_end_is_refused(promises):
    assert promises["group_end_without_start"] == 5


def test_nccl_calls_need_the_context_and_a_live_communicator(promises):
    assert promises["send_without_context"] == 1  # ncclUnhandledCudaError
    assert promises["send_before_abort"] == [0, 0, 0, 0]
    assert promises["send_after_abort"] == 5 and "aborted" in promises["after_abort_says"]


def test_a_call_on_a_communicator_still_in_progress_is_an_invalid_argument(promises):
    """As NCCL's ncclCommEnsureReady (src/init.cc), with a warning saying why."""
    assert promises["send_on_comm_in_progress"] == 4  # ncclInvalidArgument
    assert "still in progress" in promises["in_progress_says"], promises["in_progress_says"]


def test_a_call_on_a_communicator_in_error_returns_that_error_and_warns_of_nothing(promises):
    assert promises["joined_twice"] == promises["send_on_comm_in_error"] == 5  # its failed init's ncclInvalidUsage
    assert not promises["send_on_comm_in_error_warned"]


def test_the_last_error_is_the_processs_the_same_through_any_communicator_or_none(promises):
    """As NCCL's (src/debug.cc ncclLastError, src/init.cc ncclGetLastError): an aborted
    communicator's error is what every other communicator's ncclGetLastError returns too."""
    said = promises["after_abort_says"]
    assert "aborted" in said
    assert promises["says_through_another_comm"] == promises["says_through_no_comm"] == said


def test_an_error_of_no_communicator_is_the_last_error_of_every_communicator(promises):
    assert promises["says_after_group_end_without_start"] == "ncclGroupEnd without ncclGroupStart"


def test_a_later_successful_call_leaves_the_last_error_as_it_was(promises):
    assert promises["success_after_abort"] == [0, 0]
    assert promises["says_after_success"] == promises["after_abort_says"]


# ncclCommAbort and CUDA graphs (NCCL 2.30: src/enqueue.cc ncclLaunchPrepare, persistentDestructor;
# src/init.cc commDestroySync waits for comm->localPersistentRefs == 0).

def test_abort_returns_at_once_when_no_graph_captured_work_on_the_communicator(promises):
    assert promises["abort_without_graph_s"] < 0.1


def test_abort_blocks_while_a_graph_or_an_instance_that_captured_work_on_the_communicator_lives(promises):
    assert promises["captured_bytes"] == list(range(8))
    assert not promises["abort_returned_with_graph_and_instance"]
    assert not promises["abort_returned_with_instance_only"]


def test_abort_returns_right_after_the_last_graph_holder_is_destroyed(promises):
    assert promises["abort_with_graph_result"] == 0 and promises["abort_after_last_holder_s"] < 0.2


# ncclGroupEnd (NCCL 2.30: src/group.cc ncclGroupEndInternal; src/init.cc ncclCommGetAsyncError,
# ncclCommEnsureReady, ncclCommAbort).

def test_a_nonblocking_group_end_with_work_answers_in_progress_on_a_new_thread_every_time(promises):
    """The model's default, as NCCL."""
    assert promises["nonblocking_group_end"] == [7] * 5  # ncclInProgress
    assert promises["nonblocking_group_threads"] == [1] * 5
    assert promises["nonblocking_group_bytes"] == list(range(8))


def test_with_group_thread_off_an_undelayed_nonblocking_group_launches_on_the_caller(promises):
    """MPFAKE_NCCL_GROUP_THREAD=0, an option."""
    assert promises["undelayed_group_end_without_group_thread"] == [0, 0]


def test_a_blocking_group_end_launches_on_the_calling_thread_and_returns_its_result(promises):
    assert promises["blocking_group_end"] == 0 and promises["blocking_group_threads"] == 0


def test_a_nonblocking_group_end_without_work_starts_no_thread(promises):
    assert promises["empty_nonblocking_group_end"] == 0 and promises["empty_group_threads"] == 0


def test_a_send_while_a_group_is_in_progress_is_an_invalid_argument(promises):
    assert promises["slow_group_end"] == 7
    assert promises["send_while_group_in_progress"] == 4  # ncclInvalidArgument
    assert "still in progress" in promises["send_while_group_in_progress_says"]


def test_a_send_after_the_group_settled_is_accepted(promises):
    assert promises["send_after_group_settled"] == 0


def test_abort_joins_a_group_thread_still_waiting_at_once_and_launches_nothing(promises):
    assert promises["abort_during_group_thread_s"] < 0.5
    assert promises["aborted_group_bytes"] == [0] * 8


# ncclCommSplit and connecting launches (NCCL 2.30: src/init.cc ncclCommSplit, ncclCommInitChildComm;
# src/group.cc ncclAsyncLaunch; src/channel.cc initChannel; src/transport.cc ncclTransportP2pSetup;
# src/bootstrap.cc checkAbort; the user guide's "Fault Tolerance").

def test_a_split_of_a_nonblocking_parent_runs_in_progress_and_delivers_the_child(promises):
    for case in ("split_shared", "split_child_only", "split_unshared"):
        assert promises[case]["split_answer"] == 7 and promises[case]["parent_during_split"] == 7, case
        assert promises[case]["child_delivered"], case


def test_a_blocking_launch_waits_for_a_peer_that_has_not_reached_the_connection(promises):
    for case in ("split_shared", "split_child_only", "split_unshared"):
        assert promises[case]["launch_waits_for_the_peer"], case


def test_a_parent_made_with_split_share_shares_its_abort_flag_but_aborting_it_during_the_childs_call_is_unsafe(
        promises):
    """NCCL 2.30 src/init.cc ncclCommInitChildComm: sharing is the parent's config.splitShare. The
    shared abort flag ends the child's stuck launch, and the user guide (usage/threadsafety.rst)
    forbids exactly that call in parallel with the child's, which the model counts."""
    shared = promises["split_shared"]
    assert shared["parent_abort_ends_the_launch"] and shared["ended_after_s"] < 0.5
    assert shared["launch_result"] == 3  # ncclInternalError, as bootstrap's checkAbort
    assert shared["unsafe_aborts"] == 1 and shared["group_threads"] == 0


def test_split_share_in_the_childs_config_alone_shares_nothing_and_the_parents_abort_leaves_its_launch_stuck(
        promises):
    """The mistake the transport made before: the split's own splitShare matters only for its
    children (NCCL 2.30 src/init.cc ncclCommInitChildComm reads the parent's)."""
    child_only = promises["split_child_only"]
    assert not child_only["parent_abort_ends_the_launch"]
    assert child_only["launch_result"] == 3 and child_only["unsafe_aborts"] == 1


def test_without_split_share_only_an_abort_of_the_child_itself_ends_it_which_nccl_calls_unsafe(promises):
    unshared = promises["split_unshared"]
    assert not unshared["parent_abort_ends_the_launch"]
    assert unshared["launch_result"] == 3
    assert unshared["unsafe_aborts"] == 1


def test_a_blocking_childs_launch_with_its_peer_connects_delivers_and_starts_no_thread(promises):
    connected = promises["split_connected"]
    assert connected["answers"] == [0, 0] and connected["group_threads"] == 0
    assert connected["bytes"] == list(range(8))


# Buffered small sends, MPFAKE_NCCL_EAGER_BYTES (NCCL 2.30: src/device/prims_simple.h waitPeer;
# src/transport.cc ncclTransportP2pSetup).

def test_with_eager_bytes_a_small_send_completes_before_its_receive_is_posted(promises):
    assert promises["eager_small"] == {"completed_without_receive": True, "exact": True}


def test_without_eager_bytes_a_send_waits_for_its_receive(promises):
    assert promises["eager_off"] == {"completed_without_receive": False, "exact": True}


def test_a_send_above_the_eager_threshold_waits_for_its_receive(promises):
    assert promises["eager_above"] == {"completed_without_receive": False, "exact": True}


def test_buffered_sends_arrive_exactly_and_in_order_when_their_receives_are_posted(promises):
    assert promises["eager_several_in_order"] == {"completed_without_receive": True, "exact": True}


# Launch order, MPFAKE_NCCL_LAUNCH_ORDER_IMPLICIT (NCCL 2.30: src/enqueue.cc getImplicitOrder,
# ncclLaunchPrepare, ncclLaunchFinish): rank 0 issues comm A then B, rank 1 B then A.

def test_without_implicit_launch_order_two_communicators_issued_in_opposite_orders_complete(promises):
    assert promises["launch_order_none"] == {"completed": True, "ended_after_abort": True}


def test_with_serial_implicit_launch_order_opposite_orders_stall_until_aborted(promises):
    assert promises["launch_order_serial"] == {"completed": False, "ended_after_abort": True}


def test_with_launch_completion_order_opposite_orders_complete(promises):
    """CUDA 12.3+: a kernel waits only for the previous one to start; the model has no limit on
    resident kernels, so no stall (on a GPU it may still stall if the kernels cannot co-reside)."""
    assert promises["launch_order_launch"] == {"completed": True, "ended_after_abort": True}


# ---- the loader --------------------------------------------------------------------------------

LOAD = """
import json
import megatron_p2p as mp
from megatron_p2p import _C
v = mp.nccl_version()
try:
    _C.Communicator("nccl", _C.nccl_unique_id() + _C.nccl_unique_id(), 0, [0], device=0, stream=lambda: 0, timeout=10.0).close()
    made = None
except Exception as exc:
    made = [type(exc).__name__, str(exc)]
print("RESULT " + json.dumps([v.path, v.source, v.code, made]))
"""


def load(env: dict[str, str]) -> list:
    run_env = {k: v for k, v in os.environ.items() if not k.startswith(("MPFAKE_", "MEGATRON_P2P_"))}
    run_env.update(env)
    done = subprocess.run([sys.executable, "-c", LOAD], env=run_env, capture_output=True, text=True,
                          timeout=60)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stdout + done.stderr
    return json.loads(lines[-1][len("RESULT "):])


def test_the_loader_takes_the_fakes_through_the_two_variables():
    path, source, code, made = load(FAKE_ENV)
    assert (path, source, code) == (FAKE_ENV["MEGATRON_P2P_NCCL_LIBRARY"], "env", 23007)
    assert made is None  # a one-rank communicator opened and closed on the fake driver


def test_a_wrong_cuda_library_path_is_an_error_naming_the_variable(tmp_path):
    missing = str(tmp_path / "no" / "libcuda.so.1")
    *_, made = load({**FAKE_ENV, "MEGATRON_P2P_CUDA_LIBRARY": missing})
    assert made is not None and made[0] == "BackendUnavailableError", made
    assert "MEGATRON_P2P_CUDA_LIBRARY" in made[1] and missing in made[1], made[1]


# ---- exchanges ---------------------------------------------------------------------------------

@pytest.mark.parametrize("lanes", [1, 2])
def test_one_rank_exchanges_with_itself_exact_bytes_in_both_modes(lanes):
    v = run_one("nccl_model_exchange.py", {"lanes": lanes, "rounds": 2})
    assert {r["mode"] for r in v["runs"]} == {"parity", "batched"}
    delivered_exactly([v])


@pytest.mark.parametrize("nproc", [2, 4])
def test_ranks_exchange_exact_bytes_with_both_neighbours_in_both_modes(nproc):
    # 100000 elements: more than one chunk of the fake's channel, so the copy loop is exercised
    delivered_exactly(run_ranks("nccl_model_exchange.py", nproc, {"rounds": 2, "numel": 100_000}))


# ---- failures, each paired with its passing case -------------------------------------------------

def test_a_count_that_differs_from_the_receive_raises_on_both_ranks_naming_them():
    ranks = run_ranks("nccl_model_faults.py", 2, {"case": "mismatch", "wait": 10.0})
    for v in ranks:
        assert v["wait"]["type"] is not None and "P2PError" in v["wait"]["mro"], v["wait"]
        # the package quotes NCCL's last error (as possibly unrelated), which here names both ranks and counts
        assert "rank 0 sent 1000 x int32 to rank 1, which receives 999 x int32" in v["wait"]["msg"], v["wait"]["msg"]
        assert v["wait"]["elapsed"] < 5.0, v["wait"]


def test_a_count_that_agrees_with_the_receive_is_delivered():
    ranks = run_ranks("nccl_model_faults.py", 2, {"case": "mismatch", "agree": True})
    assert all(v["wait"]["type"] is None and v["exact"] for v in ranks), ranks


@pytest.fixture(scope="module")
def silent_peer() -> list[dict]:
    """Rank 1 posts nothing after each lane's two warm-up ops; rank 0 waits 1 s, rank 1 would
    wait 10 s."""
    return run_ranks("nccl_model_faults.py", 2, {"case": "silent", "wait": [1.0, 10.0]},
                     env={"MPFAKE_NCCL_SILENT_RANK": "1", "MPFAKE_NCCL_SILENT_AFTER": "2"})


def test_a_peer_that_never_posts_makes_synchronize_time_out_with_the_report_and_abort(silent_peer):
    wait = silent_peer[0]["wait"]
    assert wait["type"] == "P2PTimeoutError", wait
    assert 1.0 <= wait["elapsed"] < 4.0, wait
    assert "pending ops of rank 0" in wait["msg"] and "send_next to rank 1" in wait["msg"], wait["msg"]
    assert silent_peer[0]["next_call"]["type"] is not None, silent_peer[0]  # the communicator is aborted
    assert silent_peer[0]["close_seconds"] < 2.0, silent_peer[0]


def test_a_rank_that_times_out_aborts_its_peer_through_the_relay_naming_itself(silent_peer):
    """Rank 0's abort reaches rank 1, long before rank 1's own 10 s, through the store and the
    relay thread (a thread with no CUDA context of its own), and says which rank gave up."""
    relayed = silent_peer[1]["wait"]
    assert relayed["type"] is not None and relayed["elapsed"] < 5.0, relayed
    assert "communicator aborted (rank 0)" in relayed["msg"], relayed["msg"]


# ncclRemoteError, and kernels stall, once the first op after each lane's 2 warm-up ops has completed
REMOTE_ERROR_AFTER_WARM_UP = {"MPFAKE_NCCL_ASYNC_ERROR_AFTER": "3"}
# The data communicators nonblocking, as NCCL_COMM_BLOCKING=0 makes them: each group end answers
# ncclInProgress, and the transport settles it.
NONBLOCKING_DATA = {"NCCL_COMM_BLOCKING": "0"}


def test_an_asynchronous_remote_error_fails_the_communicator_at_once_as_a_peer_failure():
    """Whether the watchdog sees it first (and the exchange raises) or the host wait does."""
    v = run_one("nccl_model_faults.py", {"case": "silent", "wait": 10.0},
                env={**REMOTE_ERROR_AFTER_WARM_UP, "MPFAKE_NCCL_GROUP_IN_PROGRESS_MS": "0"})
    assert v["wait"]["type"] == "PeerFailureError" and v["wait"]["elapsed"] < 2.0, v["wait"]
    assert "injected asynchronous error" in v["wait"]["msg"], v["wait"]["msg"]


def test_a_remote_error_seen_while_a_group_end_settles_is_a_peer_failure_too():
    """The same ncclRemoteError, met by ncclGroupEnd's ncclInProgress wait instead of a host wait."""
    v = run_one("nccl_model_faults.py", {"case": "silent", "wait": 10.0},
                env={**REMOTE_ERROR_AFTER_WARM_UP, **STUCK_GROUP_END, "MPFAKE_NCCL_GROUP_IN_PROGRESS_MS": "50",
                     **NONBLOCKING_DATA})
    assert v["wait"]["type"] == "PeerFailureError", v["wait"]


def test_a_peer_that_posts_completes_within_the_same_wait():
    ranks = run_ranks("nccl_model_faults.py", 2, {"case": "silent", "wait": 1.0})
    assert all(v["wait"]["type"] is None and v["next_call"]["type"] is None for v in ranks), ranks


# ---- ncclInProgress ----------------------------------------------------------------------------------

def in_progress_log(tmp_path, env: dict[str, str]) -> tuple[dict, list[str]]:
    log = tmp_path / "in_progress.log"
    v = run_one("nccl_model_exchange.py", {"rounds": 2}, env={"MPFAKE_NCCL_LOG": str(log), **env})
    return v, log.read_text().split() if log.exists() else []


def test_init_that_answers_in_progress_for_a_while_completes(tmp_path):
    v, log = in_progress_log(tmp_path, {"MPFAKE_NCCL_INIT_IN_PROGRESS_MS": "300", "MPFAKE_NCCL_GROUP_IN_PROGRESS_MS": "0"})
    delivered_exactly([v])
    assert log[0::2] == ["init-in-progress"] * 2, log  # one nonblocking init per lane


def test_group_end_that_answers_in_progress_completes_every_exchange(tmp_path):
    v, log = in_progress_log(tmp_path, {"MPFAKE_NCCL_GROUP_IN_PROGRESS_MS": "20",
                                        "MPFAKE_NCCL_GROUP_IN_PROGRESS_EVERY": "1", **NONBLOCKING_DATA})
    delivered_exactly([v])
    assert log.count("group-in-progress") >= 8, log  # warm-up and every exchange's groups


# ---- the review findings (reviews/nccl_path.md) --------------------------------------------------

SILENT_SELF = {"MPFAKE_NCCL_SILENT_RANK": "0", "MPFAKE_NCCL_SILENT_AFTER": "2"}  # after each lane's warm-up


def test_an_op_waited_on_the_stream_only_is_still_timed():
    """Finding 1: Request.wait() on CUDA only orders the current stream. An op whose peer never
    posts must still fail the communicator once its timeout has passed, or the job hangs in the
    next host sync, outside this package."""
    v = run_one("nccl_model_findings.py", {"case": "watch", "timeout": 1.0, "idle": 2.0}, env=SILENT_SELF)
    assert v["wait"]["type"] is None and v["wait"]["elapsed"] < 0.5, v["wait"]  # stream-ordered: no host block
    assert v["next_call"]["type"] == "P2PTimeoutError", v["next_call"]


def test_an_op_that_completes_after_a_stream_wait_leaves_the_communicator_usable():
    v = run_one("nccl_model_findings.py", {"case": "watch", "timeout": 1.0, "idle": 2.0})
    assert v["wait"]["type"] is None and v["next_call"]["type"] is None, v


@pytest.mark.parametrize("torch_context", [False, True], ids=["no-context", "torch-made-it-current"])
def test_every_call_leaves_the_threads_current_context_as_it_found_it(torch_context):
    """Finding 4: the model refuses every driver call made without the right current context, so
    these calls passing means none is made so; and the caller's context comes back unchanged."""
    v = run_one("nccl_model_findings.py", {"case": "context", "torch_context": torch_context})
    assert v["had_context"] == torch_context
    assert all(v["unchanged"].values()), v["unchanged"]


@pytest.mark.parametrize("torch_context", [False, True], ids=["no-context", "torch-made-it-current"])
def test_a_context_the_driver_refuses_to_make_current_fails_the_call_saying_so(torch_context):
    """Finding 4: a failing cuCtxSetCurrent must stop the calls that would follow it with no
    context; when the thread has the device's context current already, none is needed."""
    v = run_one("nccl_model_findings.py", {"case": "refused", "torch_context": torch_context})
    if torch_context:
        assert v["exchange"]["type"] is None and v["exact"], v
    else:
        assert v["exchange"]["type"] == "P2PError", v["exchange"]
        assert "primary context current failed" in v["exchange"]["msg"], v["exchange"]["msg"]


def test_ctrl_c_leaves_a_host_wait_within_200_ms_leaving_the_op_pending_for_abort():
    """Issue 10's interrupt rule on the NCCL backend: its host waits run Python's signal handlers
    as shm's do."""
    v = run_one("nccl_model_findings.py", {"case": "interrupt", "timeout": 20.0}, env=SILENT_SELF)
    assert v["interrupted"] and 0.3 <= v["left_after"] < 0.55, v  # signalled at 0.3 s: 200 ms, and some jitter
    assert v["pending_after"], v
    assert v["after_abort"]["type"] is not None and v["after_abort"]["elapsed"] < 0.5, v


def test_ctrl_c_leaves_creation_whose_peer_never_joins_within_200_ms():
    v = run_one("nccl_model_findings.py", {"case": "create_interrupt"})
    assert v["interrupted"] and 0.3 <= v["left_after"] < 0.55, v


STUCK_GROUP_END = {  # every group after each lane's warm-up answers ncclInProgress for 3 s
    "MPFAKE_NCCL_GROUP_IN_PROGRESS_MS": "3000",
    "MPFAKE_NCCL_GROUP_IN_PROGRESS_EVERY": "1",
    "MPFAKE_NCCL_GROUP_IN_PROGRESS_AFTER": "1",
}


def test_abort_reaches_a_group_stuck_in_progress_at_once():
    """Finding 2: an abort (from the relay or a watchdog thread) while ncclGroupEnd is still in
    progress must not wait for the launch to settle."""
    v = run_one("nccl_model_findings.py", {"case": "abort", "abort_after": 0.5, "timeout": 10.0},
                env={**STUCK_GROUP_END, **NONBLOCKING_DATA})
    assert v["exchange"]["type"] is not None, v
    assert v["abort_returned_after"] < 0.5, v
    assert v["exchange"]["since_start"] < 1.5, v


def test_abort_with_no_group_in_progress_returns_at_once():
    v = run_one("nccl_model_findings.py", {"case": "abort", "abort_after": 0.5, "timeout": 10.0}, env=SILENT_SELF)
    assert v["exchange"]["type"] is not None and v["abort_returned_after"] < 0.5, v


# ---- a failed op's buffers outlive its kernel (workers/nccl_model_abort_buffers.py) ------------------

LATE_KERNEL_MS = 2000  # rank 0's kernels start this late, as behind the caller's device work
BUFFERED_SMALL = {"MPFAKE_NCCL_EAGER_BYTES": "4096"}
ABORT_CASES = {"idle": {"case": "idle"}, "late": {"case": "late"}, "late-close": {"case": "late", "close": True}}


@pytest.fixture(scope="module")
def abort_buffers() -> dict[str, dict]:
    """Rank 0's record of each case (one 2-rank job runs them all, in order)."""
    (rank0, _) = run_ranks("nccl_model_abort_buffers.py", 2, {"cases": list(ABORT_CASES.values()),
                                                               "delay_ms": LATE_KERNEL_MS},
                           env=BUFFERED_SMALL, timeout=120)
    return dict(zip(ABORT_CASES, rank0))


@pytest.mark.parametrize("case", ["late", "late-close"])
def test_a_failed_receive_keeps_its_buffer_until_its_late_kernel_has_written_it(abort_buffers, case):
    """NCCL's kernel reads the abort flag only while it waits, so one that starts after the abort
    with its bytes ready writes them (nccl_drain.c): the package must hold the buffer until then;
    close() itself waits for the kernel, then lets go."""
    v = abort_buffers[case]
    assert v["written"] and v["writes_after_abort"] >= 1, v  # the hazard happened
    assert v["held_after_abort"] or case == "late-close", v
    assert v["released_after_post_s"] is not None and v["released_after_post_s"] >= LATE_KERNEL_MS / 1000, v


def test_a_failed_receive_whose_kernel_ends_at_the_abort_flag_lets_its_buffer_go_at_once(abort_buffers):
    v = abort_buffers["idle"]
    assert not v["written"] and v["writes_after_abort"] == 0, v
    assert v["released_after_abort_s"] is not None and v["released_after_abort_s"] < 1.0, v


def test_close_with_work_that_never_completes_waits_out_the_timeout_then_aborts():
    """Finding 3, as the code behaves today: close() gives pending work the communicator's
    timeout (at exit too, through the atexit hook), then aborts."""
    v = run_one("nccl_model_findings.py", {"case": "close", "timeout": 2.0}, env=SILENT_SELF)
    assert 2.0 <= v["close_seconds"] < 3.0, v


def test_close_with_nothing_pending_returns_at_once():
    v = run_one("nccl_model_findings.py", {"case": "close", "timeout": 2.0})
    assert v["close_seconds"] < 0.5, v


def test_a_close_with_an_op_pending_tells_the_peers_at_once():
    """The peer, whose timeout is 60 s, fails as soon as rank 0's close() gives up on its send
    (after rank 0's 2 s timeout), naming rank 0, instead of at its own timeout."""
    ranks = run_ranks("nccl_model_faults.py", 2, {"case": "close_tells", "timeouts": [2.0, 60.0]})
    wait = ranks[1]["wait"]  # run_ranks: in rank order
    assert wait["type"] == "P2PError" and "rank 0 closed the communicator with 1 op(s) pending" in wait["msg"], wait
    assert wait["elapsed"] < ranks[0]["close_seconds"] + 5.0, (wait, ranks[0])


def test_a_close_with_every_op_finished_tells_the_peers_nothing():
    ranks = run_ranks("nccl_model_faults.py", 2, {"case": "close_tells", "idle": True, "timeouts": [2.0, 60.0],
                                                  "wait": 2.0})
    wait = ranks[1]["wait"]
    assert wait["type"] == "P2PTimeoutError" and "closed the communicator" not in wait["msg"], wait


# ---- NCCL's last error is the process's, not the communicator's ------------------------------------
# ncclGetLastError(comm) ignores comm: it returns the last warning of any communicator or thread in
# the process, never cleared (NCCL 2.30: src/debug.cc ncclDebugLogV, src/init.cc ncclGetLastError).
# So a report leads with its own result code's string, and quotes the last error only as such.

MAY_BE_UNRELATED = "NCCL's last error message, which may come from another call"
STALE = "ncclGroupEnd without ncclGroupStart"  # what tests/workers/nccl_model_errors.py leaves behind
QUIET_REMOTE_ERROR = {  # ncclRemoteError after each lane's warm-up, with no warning of its own
    **REMOTE_ERROR_AFTER_WARM_UP,
    "MPFAKE_NCCL_ASYNC_ERROR_QUIET": "1",
    "MPFAKE_NCCL_GROUP_IN_PROGRESS_MS": "0",
}
REMOTE_ERROR = "remote process exited or there was a network error"  # ncclGetErrorString(ncclRemoteError)


def test_a_failure_is_reported_by_its_own_result_code_and_a_stale_last_error_only_as_possibly_unrelated():
    v = run_one("nccl_model_errors.py", {"case": "async", "stale": True}, env=QUIET_REMOTE_ERROR)
    assert v["stale"] == STALE, v
    msg = v["wait"]["msg"]
    assert v["wait"]["type"] == "PeerFailureError", v["wait"]
    assert f"lane 0: {REMOTE_ERROR} ({MAY_BE_UNRELATED}: {STALE})" in msg, msg
    assert msg.count(STALE) == 1 and "invalid usage" not in msg, msg  # nor the stale error's own code


def test_a_failure_with_no_last_error_is_reported_by_its_result_code_alone():
    v = run_one("nccl_model_errors.py", {"case": "async"}, env=QUIET_REMOTE_ERROR)
    msg = v["wait"]["msg"]
    assert v["wait"]["type"] == "PeerFailureError", v["wait"]
    assert f"lane 0: {REMOTE_ERROR}" in msg and f"{REMOTE_ERROR} (" not in msg and MAY_BE_UNRELATED not in msg, msg


@pytest.mark.parametrize("stale", [True, False], ids=["stale-last-error", "no-last-error"])
def test_creation_that_times_out_says_so_and_quotes_a_last_error_only_as_possibly_unrelated(stale):
    """Waiting for ranks that never join fails no NCCL call: the last error, whatever it is, did
    not cause it."""
    v = run_one("nccl_model_errors.py", {"case": "create", "stale": stale, "timeout": 1.0})
    msg = v["create"]["msg"]
    assert v["create"]["type"] == "P2PTimeoutError", v["create"]
    said = "lane 0: not every rank joined the NCCL communicator in time: timed out"
    assert msg.endswith(f"{said} ({MAY_BE_UNRELATED}: {STALE})" if stale else said), msg


# ---- NCCL_COMM_BLOCKING ---------------------------------------------------------------------------

def nonblocking_inits(start: str | None, late: str) -> list[int]:
    """The results of two one-rank nonblocking inits in a fresh process (nccl_model_params.py): one
    under NCCL_COMM_BLOCKING=start (None: unset), one after setting it to `late`."""
    env = {k: v for k, v in os.environ.items() if k != "NCCL_COMM_BLOCKING"}
    if start is not None:
        env["NCCL_COMM_BLOCKING"] = start
    done = subprocess.run([sys.executable, str(WORKERS / "nccl_model_params.py"), str(FAKES), late], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize("start, result", [("1", 0), ("1x", 0), ("0", 7), ("yes", 7), ("2", 7), (None, 7)])
def test_nccl_comm_blocking_overrides_a_nonblocking_config_as_nccl_parses_it(start, result):
    """src/init.cc envConfigOverride: 0 or 1 override; NCCL parses with strtoll and no end pointer
    (src/misc/param.cc ncclLoadParam), so "1x" reads 1 and "yes" reads 0. ncclInProgress is 7."""
    assert nonblocking_inits(start, late="0" if start == "1" else "1")[0] == result


@pytest.mark.parametrize("start", ["1", None])
def test_nccl_comm_blocking_set_after_the_first_init_changes_nothing(start, promises):
    """NCCL reads each parameter once per process and keeps it (src/include/param.h NCCL_PARAM)."""
    first, second = nonblocking_inits(start, late="0" if start == "1" else "1")
    assert first == second, (first, second)
    assert promises["nonblocking_init_with_NCCL_COMM_BLOCKING=1_set_late"] == 7


@pytest.mark.parametrize("value", ["1", "1x"])
def test_a_communicator_is_refused_when_the_environment_forces_blocking_nccl(value):
    """Blocking NCCL calls could not be ended by a timeout, a peer's failure or Ctrl-C."""
    v = run_one("nccl_model_errors.py", {"case": "one_rank"}, env={"NCCL_COMM_BLOCKING": value})
    assert v["create"]["type"] == "P2PError", v["create"]
    assert "NCCL_COMM_BLOCKING=1 in the environment makes NCCL's communicators blocking" in v["create"]["msg"]
    assert "unset it, or set it to 0" in v["create"]["msg"]


@pytest.mark.parametrize("value", ["0", "yes"])
def test_a_communicator_is_made_when_the_environment_leaves_nccl_nonblocking(value):
    v = run_one("nccl_model_errors.py", {"case": "one_rank"}, env={"NCCL_COMM_BLOCKING": value})
    assert v["create"]["type"] is None, v["create"]



# ---- the data path's launches: each lane one nonblocking communicator, every call under the lock ----
# NCCL 2.30: a nonblocking communicator's group end starts a thread every time (src/group.cc
# ncclGroupEndInternal), which does the launch, and a launch that connects a new pair waits there
# for the peer (src/transport.cc ncclTransportP2pSetup) until the abort flag. NCCL forbids calls on
# one communicator in parallel (user guide, usage/threadsafety.rst), and completes a finished group
# job inside ncclCommGetAsyncError with no lock (src/init.cc ncclCommGetAsyncError).

def test_every_group_end_is_launched_on_a_thread_of_nccls_own():
    v = run_one("nccl_model_launch.py", {"case": "threads", "exchanges": 50})
    assert v["group_threads"] >= 50, v


def test_no_nccl_call_runs_in_parallel_with_another_on_one_communicator_while_the_watchdog_polls():
    """NCCL_COMM_BLOCKING=0 as well: before, it made the data communicators nonblocking, and their
    launches settled unlocked beside the watchdog's polls (19-22 overlaps in 3000 exchanges at the
    watchdog's own period in the review's probe)."""
    v = run_one("nccl_model_launch.py", {"case": "threads", "exchanges": 200, "poll_every": 0.0005},
                env={"NCCL_COMM_BLOCKING": "0", "MPFAKE_NCCL_JOIN_US": "50"})
    assert v["parallel_calls"] == 0 and v["unsafe_aborts"] == 0, v


def test_the_communicators_config_covers_only_the_fields_it_sets():
    """D5: a size past the version's fields hands NCCL bytes nothing set (2.26 reads them as
    trafficClass); the transport's split config did, with 4 bytes of padding."""
    v = run_one("nccl_model_launch.py", {"case": "threads", "exchanges": 1})
    assert v["config_overreach"] == 0, v


def test_the_model_counts_a_config_whose_size_covers_bytes_past_its_versions_fields(promises):
    assert promises["config_overreach"] == {"padded": 1, "exact": 0}, promises["config_overreach"]


def test_the_model_counts_a_call_made_in_parallel_with_another_on_one_communicator(promises):
    """The must-report case: a poll of a child while another thread's launch is inside it."""
    for case in ("split_shared", "split_child_only", "split_unshared"):
        assert promises[case]["parallel_calls"] == 1, (case, promises[case])


def test_a_launch_stuck_connecting_to_a_silent_peer_ends_at_the_timeout_without_an_unsafe_abort():
    ranks = run_ranks("nccl_model_launch.py", 4, {"case": "connect", "peer_delay": None, "timeout": 2.0, "idle": 4.0})
    send = ranks[0]["send"]
    assert send["type"] == "P2PTimeoutError" and 2.0 <= send["since_start"] < 4.0, send
    assert "launch has not completed" in send["msg"], send["msg"]
    assert [r["unsafe_aborts"] for r in ranks] == [0] * 4, ranks


def test_a_launch_connecting_to_a_peer_that_posts_late_delivers():
    ranks = run_ranks("nccl_model_launch.py", 4, {"case": "connect", "peer_delay": 1.0, "timeout": 10.0})
    assert ranks[0]["send"]["type"] is None and ranks[2]["recv"]["type"] is None, ranks
    assert ranks[2]["exact"] and [r["unsafe_aborts"] for r in ranks] == [0] * 4, ranks


# ---- deadlocks named on NCCL (megatron_p2p/_stall.py) ---------------------------------------------

# NCCL may buffer a send of up to Communicator.buffered_at_most bytes (csrc/nccl/nccl_buffering.c),
# and the analysis names only cycles that no buffering resolves. NCCL's defaults allow 256 MiB
# (64 channels of 8 steps of 512 KiB); the job sets NCCL's own parameters so that the bound is
# 1 MiB (1 channel, 8 steps of 128 KiB), and its deadlocks send 4 MiB.
STALL_ENV = {"NCCL_MAX_P2P_NCHANNELS": "1", "NCCL_BUFFSIZE": str(1 << 20)}
STALL_BOUND = 1 << 20
ABOVE_BOUND = 1 << 20  # floats: 4 MiB
BUFFERED = {"MPFAKE_NCCL_EAGER_BYTES": "4096"}  # the model's buffering of NCCL's, for sends of 1 KiB
# The stall window: a case meant to be left unreported lasts at least twice it, so that the
# analysis has run on it several times, whatever the load.
STALL_S = _stall.DEFAULT_SECONDS
STALL_CASES = {  # one 3-rank job runs them all, in this order (workers/nccl_model_stall.py)
    "ring": {"case": "ring", "timeout": 300.0, "numel": ABOVE_BOUND},
    "ring_buffered": {"case": "ring", "timeout": 30.0, "numel": 256, "env": BUFFERED},
    "send_send": {"case": "send_send", "timeout": 300.0, "numel": ABOVE_BOUND},
    "send_send_stream_wait": {"case": "send_send", "timeout": 4.0, "numel": ABOVE_BOUND, "stream_wait": True},
    "computing": {"case": "computing", "timeout": 60.0, "numel": 256, "compute": 3 * STALL_S},
    "slow": {"case": "slow", "timeout": 60.0, "numel": 256, "env": {"MPFAKE_NCCL_DELAY_MS": str(int(2000 * STALL_S))}},
}
# The sends' kernels start 2 s late (the old analysis named a cycle at 1.2 s) (the lane waits behind local
# device work), so for 3 s nothing
# is buffered and both hosts wait on sends whose receives are not posted. Two ranks alone: a third
# that publishes no wait would keep any cycle from being named, and the case would prove nothing.
BUFFERED_LATE = {"case": "send_send", "timeout": 30.0, "numel": 256,
                 "env": {**BUFFERED, "MPFAKE_NCCL_DELAY_MS": "2000"}}
BUFFERED_LATE_DELAY_S = 2.0


@pytest.fixture(scope="module")
def stalls() -> dict[str, list[dict]]:
    """Per case, each rank's record of what its wait raised."""
    ranks = run_ranks("nccl_model_stall.py", 3, {"cases": list(STALL_CASES.values())}, env=STALL_ENV, timeout=600)
    assert {r[0]["buffered_at_most"] for r in ranks} == {STALL_BOUND}, ranks
    return {name: [r[i]["wait"] for r in ranks] for i, name in enumerate(STALL_CASES)}


def test_the_naive_ring_is_named_as_a_deadlock_on_every_rank_within_3_s_whatever_the_timeout(stalls):
    for rank, wait in enumerate(stalls["ring"]):
        assert wait["type"] == "DeadlockError" and wait["elapsed"] < 3.0, (rank, wait)
        assert "this wait-for cycle can never resolve" in wait["msg"], wait["msg"]
        assert "is blocked on isend to rank" in wait["msg"], wait["msg"]


def test_a_ring_of_buffered_small_sends_completes_unreported(stalls):
    for rank, wait in enumerate(stalls["ring_buffered"]):
        assert wait["type"] is None, (rank, wait)


def test_two_ranks_sending_to_each_other_more_than_nccl_can_buffer_in_host_waits_are_a_deadlock(stalls):
    for rank, wait in enumerate(stalls["send_send"][:2]):
        assert wait["type"] == "DeadlockError" and wait["elapsed"] < 3.0, (rank, wait)


def test_buffered_send_send_delayed_by_local_device_work_is_not_a_deadlock():
    """NCCL completes a send it can buffer without its receive, however late its kernel starts:
    both ranks wait out the kernels' delay and finish, where a rendezvous analysis names a cycle."""
    ranks = run_ranks("nccl_model_stall.py", 2, {"cases": [BUFFERED_LATE]}, env=STALL_ENV, timeout=120)
    for rank, (out,) in enumerate(ranks):
        wait = out["wait"]
        assert wait["type"] is None and wait["elapsed"] >= BUFFERED_LATE_DELAY_S * 0.8, (rank, wait)


def test_a_send_send_cycle_through_a_rank_not_in_a_host_wait_is_only_a_timeout(stalls):
    """Rank 1 could still post its receive: never called a deadlock before the timeout."""
    wait = stalls["send_send_stream_wait"][0]
    assert wait["type"] == "P2PTimeoutError" and wait["elapsed"] >= 4.0, wait
    # the timeout's report carries the group's side: rank 1's send, which nobody receives either
    assert "the group as its stalled ranks published it" in wait["msg"], wait["msg"]
    assert "send to rank 0" in wait["msg"].split("the group as its stalled ranks")[1], wait["msg"]


def test_a_rank_computing_for_three_stall_windows_before_posting_is_not_reported(stalls):
    for rank, wait in enumerate(stalls["computing"][:2]):
        assert wait["type"] is None, (rank, wait)


def test_a_slow_transfer_is_not_reported(stalls):
    for rank, wait in enumerate(stalls["slow"][:2]):
        assert wait["type"] is None and wait["elapsed"] >= 1.6 * STALL_S, (rank, wait)


@pytest.mark.parametrize("value", ["abc", "0", "-1", "nan"])
def test_a_stall_window_that_is_not_a_positive_number_is_an_error_naming_the_variable(monkeypatch, value):
    from megatron_p2p import _stall

    monkeypatch.setenv(_stall.ENV_SECONDS, value)
    with pytest.raises(ValueError, match=f"MEGATRON_P2P_STALL_SECONDS={value!r}"):
        _stall.stall_seconds()


def test_a_positive_stall_window_is_taken_and_unset_is_one_second(monkeypatch):
    from megatron_p2p import _stall

    monkeypatch.setenv(_stall.ENV_SECONDS, "2.5")
    assert _stall.stall_seconds() == 2.5
    monkeypatch.delenv(_stall.ENV_SECONDS)
    assert _stall.stall_seconds() == 1.0
