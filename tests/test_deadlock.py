"""Deadlocks at run time: a wait-for cycle among ranks that are all blocked in waits is raised as
DeadlockError on exactly the ranks of the cycle, within a second, whatever the timeout (60 s
here), naming every rank and op of the cycle. Ranks that compute, or wait on a busy peer, are
never reported. One 4-rank job runs every case (tests/workers/deadlock_cases.py); a C program
(tests/c/shm_fence_order.c) stages a cycle's fencing by hand, and a peer's garbage `waiting` count,
which no job can do on purpose."""
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT, run_job

DETECTION_LIMIT = 1.0  # seconds from the cycle forming to the error; the goal is 0.1


@pytest.fixture(scope="module")
def cases():
    job = run_job("deadlock_cases.py", 4, timeout=240).ok()
    return [res["value"] for res in job]


def test_two_rank_cycle_inside_four_raises_deadlock_error_on_exactly_those_two_within_a_second(cases):
    for rank in (0, 1):
        res = cases[rank]["partial"]
        assert res["type"] == "DeadlockError", (rank, res)
        assert "P2PTimeoutError" in res["mro"] and "TimeoutError" in res["mro"]
        assert res["elapsed"] < DETECTION_LIMIT, (rank, res["elapsed"])
        msg = res["msg"]
        assert "deadlock: ranks 0 -> 1 -> 0" in msg, msg
        for me, peer in ((0, 1), (1, 0)):
            assert f"rank {me} (pid" in msg and f"is blocked on isend to rank {peer}: 4096 bytes of float32, lane 0, " \
                   f"message #0, posted by send_forward_recv_forward" in msg, msg


def test_ranks_exchanging_beside_a_cycle_finish_undisturbed(cases):
    for rank in (2, 3):
        assert cases[rank]["partial"]["type"] is None, cases[rank]["partial"]


def test_three_rank_cycle_names_every_rank_and_op(cases):
    for rank in (0, 1, 2):
        res = cases[rank]["three"]
        assert res["type"] == "DeadlockError" and res["elapsed"] < DETECTION_LIMIT, (rank, res)
        msg = res["msg"]
        assert "deadlock: ranks 0 -> 1 -> 2 -> 0" in msg, msg
        for me in range(3):
            assert f"rank {me} (pid" in msg and f"blocked on isend to rank {(me + 1) % 3}" in msg, msg
        assert "has posted the matching receive, but it is queued on lane 0" in msg


def test_a_cycle_whose_ranks_entered_their_waits_out_of_step_is_reported_within_a_second(cases):
    """Each rank confirms a cycle in two watch rounds of one wait. Rank 1 starts waiting 25 ms
    after rank 0: when a wait was cut into 50 ms slices for Python's signal handlers, each slice
    began a new search and left the wait between slices, so ranks out of step never saw each
    other blocked twice in a row (found after seconds, or never, in about 1 round in 60)."""
    for rank in (0, 1):
        res = cases[rank]["staggered"]
        assert res["type"] == "DeadlockError" and res["elapsed"] < DETECTION_LIMIT, (rank, res)
        assert "deadlock: ranks 0 -> 1 -> 0" in res["msg"], res["msg"]


def test_cycle_through_lane_order_is_reported(cases):
    """Each rank waits on a send queued on lane 1 behind a receive whose sender is queued the same
    way: no rank lacks a posted op, yet lane order makes it a cycle."""
    for rank in (0, 1):
        res = cases[rank]["lane_order"]
        assert res["type"] == "DeadlockError" and res["elapsed"] < DETECTION_LIMIT, (rank, res)
        assert f"is blocked on irecv from rank {1 - rank}: 256 bytes of float32, lane 1, message #0, posted by " \
               "recv_backward" in res["msg"], res["msg"]


def test_rank_waiting_on_a_cycle_member_gets_the_report_as_a_p2p_error(cases):
    res = cases[2]["waiter"]
    assert res["type"] == "P2PError", res
    assert res["elapsed"] < DETECTION_LIMIT + 1.0, res
    assert "rank 0, which this op needs, is in a wait-for cycle" in res["msg"]
    assert "deadlock: ranks 0 -> 1 -> 0" in res["msg"]
    for rank in (0, 1):
        assert cases[rank]["waiter"]["type"] == "DeadlockError", cases[rank]["waiter"]


def test_rank_computing_for_three_seconds_before_posting_is_not_reported(cases):
    sender, receiver = cases[0]["compute"], cases[1]["compute"]
    assert sender["type"] is None and receiver["type"] is None, (sender, receiver)
    assert sender["elapsed"] > 2.5  # it did wait for the computing rank, unreported
    assert receiver["exact"]


def test_waiting_on_a_peer_that_waits_on_a_computing_peer_is_not_reported(cases):
    for rank in (0, 1, 2):
        assert cases[rank]["busy_chain"]["type"] is None, (rank, cases[rank]["busy_chain"])


def test_a_cycle_behind_a_40_op_group_is_reported_within_a_second(cases):
    """Rank 0's group of 40 ops holds 20 receives from a computing rank (which make no edge) before
    the 20 sends to rank 1 that close the cycle: a blocked rank publishes its pending ops as runs
    (alike ops of one group with following seqs; at most 16 runs), so the sends are seen too."""
    for rank in (0, 1):
        res = cases[rank]["behind_batch"]
        assert res["type"] == "DeadlockError" and res["elapsed"] < DETECTION_LIMIT, (rank, res)
        msg = res["msg"]
        assert "deadlock: ranks 0 -> 1 -> 0" in msg, msg
        assert "is blocked on isend to rank 1: 4096 bytes of float32, lane 0, message #0, posted by forward_batch" \
            in msg, msg
        assert "is blocked on isend to rank 0: 4096 bytes of float32, lane 0, message #0, posted by send_first" in msg


def test_a_40_op_group_waiting_on_a_computing_rank_completes_unreported(cases):
    """The same group on rank 0, with rank 1's receives queued behind a receive from the computing
    rank: a chain, no cycle; everything arrives once rank 2 sends."""
    for rank in (0, 1, 2):
        res = cases[rank]["batch_waits"]
        assert res["type"] is None and res["exact"], (rank, res)
    assert cases[0]["batch_waits"]["elapsed"] > 0.5  # it did wait, blocked, for the computing rank


@pytest.fixture(scope="module")
def fence_order(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/c/shm_fence_order.c, built by the Makefile's rule into a directory of this test's own."""
    binary = tmp_path_factory.mktemp("fence") / "shm_fence_order"
    subprocess.run(["make", "-s", str(binary)], cwd=ROOT, check=True, timeout=300)
    return binary


ROUNDS = 20  # each on a new communicator: whether a close finds a failed step still on its lane is timing


def fence_order_says(binary: Path, case: str, rounds: int = ROUNDS) -> str:
    """The program's line for `case` over `rounds` rounds, once it exited 0 (every round as expected)."""
    proc = subprocess.run([str(binary), case, str(rounds)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.parametrize("case, result", [("member", "deadlock"), ("waiter", "communicator aborted")])
def test_a_rank_woken_while_its_cycle_is_being_fenced_waits_for_the_verdict(fence_order: Path, case: str,
                                                                           result: str) -> None:
    """A cycle's ranks are fenced one by one. A member that looks between its peer's fence and its
    own is still reported as a member (DeadlockError), never as a rank waiting on one (P2PError);
    a rank left unfenced once the fencing ends is the latter. The C program holds the fencing
    half-done for 0.2 s, then finishes it with or without rank 1. Either way rank 1 then closes,
    its op failed, and that must not abort the communicator: in CI a waiter's close did, and the
    cycle's members got "closed it with ops pending" instead of their deadlock."""
    said = fence_order_says(fence_order, case)
    assert said.startswith(f"{case}: {result} after "), said


def test_a_deadlock_verdict_outlives_an_abort_that_follows_it(fence_order: Path) -> None:
    """Once a rank is fenced as a cycle member, an abort written after the fence (a peer closing
    with ops pending) still leaves it DeadlockError with its report; the waiter case above is the
    rank the abort may reach unfenced."""
    said = fence_order_says(fence_order, "abort_after")
    assert said.startswith("abort_after: deadlock after "), said


def test_a_peer_that_never_waited_is_not_read_as_a_published_wait_whatever_its_waiting_count(fence_order: Path) -> None:
    """A `waiting` count a peer overwrote (here 1, a value a valid state holds) on a rank that
    never published a wait leaves that rank's wait area all zeros, which describe no wait: the
    search finds no cycle and reports nothing corrupt, and rank 1's wait times out. It once read
    the zeros as a wait whose wait_index (0) is past its nops (0), a report naming neither field
    the peer overwrote (test_hostile_peer.py's flake). One round is deterministic; three for luck."""
    said = fence_order_says(fence_order, "unpublished", rounds=3)
    assert said.startswith("unpublished: wait timed out after ") and "not aborted" in said, said
