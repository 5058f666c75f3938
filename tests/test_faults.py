"""The fault matrix: a peer killed (SIGKILL) at each place of a communicator's life, a stopped
peer, the store's host exiting during creation, creation without room in /dev/shm or without
file descriptors, and single copy refused. Each row names the error it must raise and bounds
the time to raise it; the job always ends; no /dev/shm entry, thread or descriptor is left.

Every row's measured time to report goes into FIGURES, printed as a table at the end of the
module and written to fault_matrix.json in pytest's base temporary directory."""
from __future__ import annotations

import json
import os
import subprocess
from typing import Any

import conftest
import pytest
from conftest import run_job, shm_segments

SLACK = 10.0  # a loaded 2-core machine: never assert tight timings
KILL_TIMEOUT = 20.0  # communicator timeout of the kill rows: a report well within it is liveness
STOP_TIMEOUT = 2.0  # the stopped peer's partner times out after this
NOFILE_TIMEOUT = 3.0  # how long rank 0 waits for the rank that ran out of descriptors
BIG = 512 << 20  # the large message of the copy rows: its copy lasts far longer than 30 ms

# row -> seconds the reporting call blocked, from its start (the fault comes during it, so this
# bounds the time from fault to report from above); for the store's host, from its exit.
FIGURES: dict[str, float] = {}


@pytest.fixture(scope="module", autouse=True)
def figures_table(request, tmp_path_factory):
    yield
    path = tmp_path_factory.getbasetemp() / "fault_matrix.json"
    path.write_text(json.dumps(FIGURES, indent=2, sort_keys=True))
    lines = ["", f"fault matrix, seconds to report ({path}):"]
    lines += [f"  {row:<48} {seconds:8.3f}" for row, seconds in sorted(FIGURES.items())]
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter and capture:
        with capture.global_and_fixture_disabled():  # shown whether or not the last test failed
            reporter.write_line("\n".join(lines))


def leaked_segments(before: set[str]) -> set[str]:
    """Segments that appeared since `before` and whose creator is gone: a finished job's leftovers."""
    return {n for n in shm_segments() - before if not os.path.exists(f"/proc/{n.split('-')[1]}")}


def assert_raised(record: dict[str, Any], exc_type: str, *fragments: str) -> None:
    assert record["type"] == exc_type, record
    for fragment in fragments:
        assert fragment in record["msg"], (fragment, record["msg"])


def value_of(job: conftest.Job, rank: int) -> dict[str, Any]:
    res = job.ranks[rank]
    if res is None or not res.get("ok"):
        pytest.fail(f"rank {rank} did not report:\n{(res or {}).get('traceback', '')}\n{job.output[-4000:]}")
    return res["value"]


# ---- SIGKILL ----------------------------------------------------------------------------------


def kill_row(where: str, victim: int, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Runs fault_kill.py's `where` and returns the survivor's report, after checking what every
    row must: the victim died, the survivor reported within SLACK of the death although its
    timeout is KILL_TIMEOUT, and it holds no new thread, descriptor or shared-memory mapping,
    and no segment or arena is left in /dev/shm."""
    before = shm_segments()
    job = run_job("fault_kill.py", 2, params={"where": where, "timeout": KILL_TIMEOUT, "nbytes": BIG},
                  timeout=120, env=env)
    assert job.ranks[victim] is None, job.ranks[victim]  # it died before it could report
    survivor = value_of(job, 1 - victim)
    FIGURES[f"sigkill {where}" + (" (bounce)" if env else "")] = survivor["call"]["elapsed"]
    assert survivor["call"]["elapsed"] < SLACK, survivor["call"]
    assert survivor["left"] == {}, survivor["left"]
    assert leaked_segments(before) == set()
    return survivor


def test_sigkill_before_attach_is_a_peer_failure_naming_the_rank_and_pid():
    """Rank 1 has the segment's name and dies before it opens the segment; rank 0, waiting in
    creation for it to attach, raises PeerFailureError naming it and its pid, not a timeout."""
    survivor = kill_row("before_attach", victim=1)
    assert_raised(survivor["call"], "PeerFailureError", "rank 1", str(survivor["peer_pid"]))


def test_sigkill_during_attach_is_a_peer_failure_naming_the_rank_and_pid():
    """Rank 0 dies right after it created and initialised the segment; rank 1 attaches to the
    orphan and raises PeerFailureError naming rank 0 and its pid."""
    survivor = kill_row("during_attach", victim=0)
    assert_raised(survivor["call"], "PeerFailureError", "rank 0", str(survivor["peer_pid"]))


def test_sigkill_mid_rendezvous_is_a_peer_failure_naming_the_rank_and_pid():
    """Rank 0's 512 MiB send is posted; rank 1 dies before it posts the receive: the send's wait
    raises PeerFailureError naming rank 1 and its pid."""
    survivor = kill_row("mid_rendezvous", victim=1)
    assert_raised(survivor["call"], "PeerFailureError", "isend to rank 1", f"rank 1 (pid {survivor['peer_pid']})")


def test_sigkill_of_the_sender_mid_single_copy_is_a_peer_failure_naming_it():
    """Rank 0 dies 30 ms into rank 1's single-copy read of its 512 MiB: rank 1's receive raises
    PeerFailureError naming rank 0 and its pid."""
    survivor = kill_row("sender_dies_mid_copy", victim=0)
    assert survivor["single_copy"]
    assert_raised(survivor["call"], "PeerFailureError", "irecv from rank 0", f"rank 0 (pid {survivor['peer_pid']})")


def test_sigkill_of_the_receiver_mid_single_copy_is_a_peer_failure_naming_it():
    """Rank 0 kills rank 1 30 ms into rank 1's single-copy read of 512 MiB: the send's wait
    raises PeerFailureError naming rank 1 and its pid (a finished send would mean the copy was
    over before the kill)."""
    survivor = kill_row("receiver_dies_mid_copy", victim=1)
    assert survivor["single_copy"]
    assert_raised(survivor["call"], "PeerFailureError", "isend to rank 1", f"rank 1 (pid {survivor['peer_pid']})")


def test_sigkill_of_the_sender_mid_bounce_copy_is_a_peer_failure_naming_it():
    """The same kill with single copy off (MEGATRON_P2P_SHM_SINGLE_COPY=0): the receiver, draining
    the bounce buffer, raises PeerFailureError naming rank 0 and its pid."""
    survivor = kill_row("sender_dies_mid_copy", victim=0, env={"MEGATRON_P2P_SHM_SINGLE_COPY": "0"})
    assert not survivor["single_copy"]
    assert_raised(survivor["call"], "PeerFailureError", "irecv from rank 0", f"rank 0 (pid {survivor['peer_pid']})")


def test_sigkill_of_the_sender_mid_arena_copy_is_a_peer_failure_naming_it():
    """Rank 1 receives 512 MiB into a buffer from its arena and kills rank 0 as soon as rank 0's
    copy into it has begun: rank 1's receive raises PeerFailureError naming rank 0 and its pid,
    and the arena goes with the buffer (no mapping is left)."""
    survivor = kill_row("sender_dies_mid_arena_copy", victim=0)
    assert survivor["in_arena"] and survivor["mid_copy"], survivor
    assert_raised(survivor["call"], "PeerFailureError", "irecv from rank 0", f"rank 0 (pid {survivor['peer_pid']})")


def test_sigkill_of_the_receiver_mid_arena_copy_is_a_peer_failure_naming_it():
    """Rank 1 is killed while rank 0 copies 512 MiB into its arena: rank 0's send raises
    PeerFailureError naming rank 1 and its pid, and unmaps the dead rank's arena."""
    survivor = kill_row("receiver_dies_mid_arena_copy", victim=1)
    assert survivor["in_arena"] and survivor["mid_copy"], survivor
    assert_raised(survivor["call"], "PeerFailureError", "isend to rank 1", f"rank 1 (pid {survivor['peer_pid']})")


def test_sigkill_right_after_abort_relays_the_abort_naming_the_rank_and_why():
    """Rank 1 aborts with a reason and dies at once: the abort came first, so rank 0's pending
    receive raises P2PError naming rank 1 and quoting its reason, not a PeerFailureError."""
    survivor = kill_row("right_after_abort", victim=1)
    assert_raised(survivor["call"], "P2PError", "aborted by rank 1", "fault matrix: rank 1 gave up")


def test_sigkill_right_after_close_reports_the_close_with_ops_pending():
    """Rank 1 closes with a receive pending and dies at once: rank 0's pending receive raises
    P2PError saying rank 1 closed the communicator with ops pending."""
    survivor = kill_row("right_after_close", victim=1)
    assert_raised(survivor["call"], "P2PError", "rank 1 closed it with ops pending")


# ---- rows that leave the job running ----------------------------------------------------------


@pytest.fixture(scope="module")
def matrix():
    """fault_matrix.py on 2 ranks: per rank, a dict of rows."""
    before = shm_segments()
    params = {"timeout": 30.0, "stop_timeout": STOP_TIMEOUT, "nofile_timeout": NOFILE_TIMEOUT}
    values = [r["value"] for r in run_job("fault_matrix.py", 2, params=params, timeout=180).ok()]
    assert leaked_segments(before) == set()
    return values


def nothing_left(matrix, row: str) -> None:
    for rank, v in enumerate(matrix):
        assert v[row]["left"] == {}, (rank, v[row]["left"])


def test_stopped_peer_times_out_its_partner_after_the_timeout(matrix):
    """Rank 1 is stopped (SIGSTOP): rank 0's receive from it raises P2PTimeoutError after the
    2 s timeout (a stopped process is alive: not a PeerFailureError), naming the op; once
    resumed, rank 1's next op reports the abort as a timeout."""
    waiter, stopped = matrix[0]["stopped_peer"], matrix[1]["stopped_peer"]
    assert_raised(waiter["call"], "P2PTimeoutError", "irecv from rank 1", f"{STOP_TIMEOUT}")
    assert STOP_TIMEOUT * 0.9 <= waiter["call"]["elapsed"] < STOP_TIMEOUT + SLACK, waiter["call"]
    FIGURES["sigstop: partner's timeout"] = waiter["call"]["elapsed"]
    assert stopped["after_resume"]["type"] == "P2PTimeoutError", stopped["after_resume"]
    nothing_left(matrix, "stopped_peer")


def test_exhausted_descriptors_fail_creation_at_once_with_a_clear_error(matrix):
    """Rank 1 has no file descriptor left (RLIMIT_NOFILE): its creation raises P2PError at once
    saying which open failed and why; rank 0, waiting for it to attach, stops at once with that
    reason (published through the store), not at its timeout. Both communicators that follow
    work (the descriptors were given back)."""
    starved, waiter = matrix[1]["descriptors_exhausted"], matrix[0]["descriptors_exhausted"]
    assert_raised(starved["call"], "P2PError", "shared-memory segment", "Too many open files", "RLIMIT_NOFILE")
    assert starved["call"]["elapsed"] < SLACK, starved["call"]
    FIGURES["RLIMIT_NOFILE exhausted: the starved rank"] = starved["call"]["elapsed"]
    assert_raised(waiter["call"], "P2PError", "rank 1 could not create", "Too many open files")
    assert waiter["call"]["elapsed"] < NOFILE_TIMEOUT, waiter["call"]
    FIGURES["RLIMIT_NOFILE exhausted: its peer"] = waiter["call"]["elapsed"]
    nothing_left(matrix, "descriptors_exhausted")


SINGLE_COPY_LOG = ("single copy", "bounce")


def single_copy_logs(records: list[dict[str, str]]) -> list[dict[str, str]]:
    return [r for r in records if all(w in r["msg"] for w in SINGLE_COPY_LOG)]


def test_refused_single_copy_falls_back_to_the_bounce_path_and_says_so_once(matrix):
    """process_vm_readv/writev fail with EPERM (a seccomp filter in both ranks): 8 MiB still
    arrive exactly, single_copy(peer) is False, and each rank logs one WARNING from
    megatron_p2p.communicator saying single copy is unavailable and the bounce path is used."""
    for rank, v in enumerate(matrix):
        row = v["single_copy_refused"]
        assert row["exact"] and row["single_copy"] is False, (rank, row)
        logs = single_copy_logs(row["records"])
        assert len(logs) == 1 and logs[0]["level"] == "WARNING", (rank, row["records"])
    nothing_left(matrix, "single_copy_refused")


def test_allowed_single_copy_is_used_and_not_logged(matrix):
    for rank, v in enumerate(matrix):
        row = v["single_copy_allowed"]
        assert row["exact"] and row["single_copy"] is True, (rank, row)
        assert single_copy_logs(row["records"]) == [], (rank, row["records"])
    nothing_left(matrix, "single_copy_allowed")


# ---- the store's host exits -------------------------------------------------------------------


def test_store_host_exiting_during_creation_is_a_peer_failure_naming_rank_0():
    """Rank 0 hosts the TCPStore the ranks bootstrap through and exits while rank 1 waits in
    init_communicator (timeout 20 s): rank 1 raises PeerFailureError naming rank 0 within
    seconds of the exit, and the job ends."""
    before = shm_segments()
    job = run_job("fault_store_host.py", 2, params={"timeout": KILL_TIMEOUT, "delay": 1.0}, timeout=120)
    v = value_of(job, 1)
    assert_raised(v["call"], "PeerFailureError", "rank 0")
    assert v["after_exit"] is not None and v["after_exit"] < SLACK, v
    FIGURES["store host exits during creation"] = v["after_exit"]
    assert leaked_segments(before) == set()


# ---- /dev/shm without room --------------------------------------------------------------------


PRIVATE_SHM = 'mount -t tmpfs -o size=64m,mode=1777 tmpfs /dev/shm && exec "$@"'


def private_shm_prefix() -> list[str]:
    """The command prefix giving a job a private 64 MiB tmpfs on /dev/shm; skips when this
    process may not make a mount namespace (not root, or a container that forbids it)."""
    prefix = ["unshare", "-m", "--propagation", "private", "sh", "-c"]
    try:
        probe = subprocess.run(prefix + [PRIVATE_SHM, "sh", "true"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot run unshare: {exc}")
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a private /dev/shm: {probe.stderr.strip()}")
    return prefix + [PRIVATE_SHM, "sh"]


def run_in_private_shm(row: str) -> conftest.Job:
    """fault_shm_space.py's `row` on 2 ranks, under a private mount namespace: torchrun under the
    prefix (its limit, stack dumps and kill stay as they are)."""
    return run_job("fault_shm_space.py", 2, params={"row": row, "timeout": NOFILE_TIMEOUT}, timeout=120,
                   prefix=private_shm_prefix())


def test_full_dev_shm_fails_creation_saying_how_much_is_free_and_needed():
    """/dev/shm has no room: rank 0's creation raises P2PError naming /dev/shm, the MiB free and
    the MiB needed; rank 1, waiting for the segment, stops at once with that reason (published
    through the store), not at its timeout; no segment is left."""
    job = run_in_private_shm("full")
    creator, attacher = value_of(job, 0), value_of(job, 1)["full"]
    assert_raised(creator["full"]["create"], "P2PError", "/dev/shm has 0 MiB free", "needs up to", "MiB")
    FIGURES["/dev/shm full: the creator"] = creator["full"]["create"]["elapsed"]
    assert_raised(attacher["create"], "P2PError", "rank 0 could not create", "/dev/shm has 0 MiB free")
    assert attacher["create"]["elapsed"] < NOFILE_TIMEOUT, attacher["create"]
    FIGURES["/dev/shm full: its peer"] = attacher["create"]["elapsed"]
    assert creator["segments_left"] == []


def test_too_small_dev_shm_is_reported_not_a_crash():
    """/dev/shm has a quarter of the room the segment needs at most, and both ranks exchange
    4 MiB each way on both lanes through the bounce buffers, which needs more than that: no rank
    may die of SIGBUS. Rank 0, the creator, either completes exactly or raises P2PError naming
    /dev/shm and the MiB it lacks, at creation or at the exchange; rank 1 completes exactly or
    raises a P2PError; no segment is left."""
    job = run_in_private_shm("too_small")
    for rank in (0, 1):
        if job.ranks[rank] is None:
            pytest.fail(f"rank {rank} died (SIGBUS?):\n{job.output[-3000:]}")
    for rank in (0, 1):
        row = value_of(job, rank)["too_small"]
        failed = row["create"] if row["create"]["type"] else row["exchange"]
        if failed["type"] is None:
            assert row["exact"], row
            continue
        assert "P2PError" in failed["mro"], failed
        if rank == 0:
            assert "/dev/shm" in failed["msg"] and "MiB" in failed["msg"], failed
        FIGURES[f"/dev/shm too small: rank {rank}"] = failed["elapsed"]
    assert value_of(job, 0)["needed_mib"] > 0
    assert value_of(job, 0)["segments_left"] == []
