"""Failure modes: every misuse, disagreement, timeout and death is reported with a clear error,
fast, on every rank concerned, and leaves nothing behind; and each "must be reported" case has
its "must not be reported" twin.

Each torchrun job costs seconds, so one job (fail_cases.py) runs many two-rank cases, each on a
communicator of its own, and the tests below read their part of its result."""
import os

import pytest
from conftest import run_job, shm_segments

SLACK = 10.0  # a loaded 2-core machine: never assert tight timings
CASE_TIMEOUT = 3.0  # the communicator timeout of the "timeout" section


def _job_segments(names, pids):
    """The names among `names` made by this job's ranks (other jobs may run concurrently)."""
    return {n for n in names if any(n.startswith(f"mp2p-{pid}-") for pid in pids)}


def leaked_segments(before):
    """Segments that appeared since `before` and whose creator ("mp2p-<pid>-...") is gone: a
    finished job's leftovers, not the short-lived segment of a job still starting up."""
    return {n for n in shm_segments() - before if not os.path.exists(f"/proc/{n.split('-')[1]}")}


@pytest.fixture(scope="module")
def cases():
    """fail_cases.py on 2 ranks: per rank, a dict of sections (see the worker's docstring)."""
    before = shm_segments()
    ranks = run_job("fail_cases.py", 2, params={"timeout": CASE_TIMEOUT}, timeout=180).ok()
    values = [r["value"] for r in ranks]
    pids = [v["pid"] for v in values]
    for v in values:
        v["segments_left"] = sorted(leaked_segments(before))
        v["segments_after_init"] = sorted(_job_segments(v["segments_after_init"], pids))
    return values


def section(cases, name):
    """Both ranks' results of one section, failing on an unexpected exception in it."""
    out = []
    for rank, v in enumerate(cases):
        res = v[name]
        assert "unexpected" not in res, f"rank {rank}, section {name}:\n{res.get('traceback')}"
        out.append(res)
    return out


def assert_raised(res, exc_type, *fragments):
    assert res["type"] == exc_type, res
    for fragment in fragments:
        assert fragment in res["msg"], (fragment, res["msg"])


# ---- mismatch -------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["size", "size_large"])
def test_size_mismatch_raises_on_both_ranks_naming_ranks_and_sizes(cases, case):
    """Rank 0 sends 4 KiB (or 1 MiB), rank 1 receives into 8 KiB (or 2 MiB): both raise
    MismatchError (a P2PError) naming both ranks and both byte counts."""
    sizes = {"size": ("4096", "8192"), "size_large": ("1048576", "2097152")}[case]
    for res in section(cases, "mismatch"):
        r = res[case]
        assert_raised(r, "MismatchError", "rank 0", "rank 1", *sizes)
        assert "P2PError" in r["mro"]


@pytest.mark.parametrize("size, sent, expected", [("small", "[10, 20]", "[20, 10]"),
                                                  ("large", "[512, 1024]", "[1024, 512]")])
def test_with_debug_matching_a_shape_disagreement_of_the_same_bytes_fails_on_both_ranks_naming_both(cases, size, sent,
                                                                                                     expected):
    sender, receiver = (r[f"check=1 {size} transposed"] for r in section(cases, "shapes"))
    for res in (sender, receiver):
        assert_raised(res, "MismatchError", f"shape {sent}", f"shape {expected}", "debug matching compares shapes")
    assert "rank 1's irecv expects shape" in sender["msg"] and "rank 0's isend sent shape" in receiver["msg"]


@pytest.mark.parametrize("size", ["small", "large"])
def test_with_debug_matching_agreeing_shapes_deliver(cases, size):
    sender, receiver = (r[f"check=1 {size} agree"] for r in section(cases, "shapes"))
    assert sender["type"] is None and receiver["type"] is None and receiver["arrived"], (sender, receiver)


@pytest.mark.parametrize("size", ["small", "large"])
def test_without_debug_matching_the_same_bytes_in_another_shape_are_delivered(cases, size):
    sender, receiver = (r[f"check=0 {size} transposed"] for r in section(cases, "shapes"))
    assert sender["type"] is None and receiver["type"] is None and receiver["arrived"], (sender, receiver)


def test_a_mismatch_stays_a_mismatch_error_for_the_sender_when_the_receiver_then_closes(cases):
    """The receiver answers with a mismatch and closes with an op pending before the sender's
    engine runs again: the sender still gets MismatchError, not the close's abort."""
    sender, receiver = section(cases, "answered_then_closed")
    assert_raised(receiver["mismatch"], "MismatchError", "4096", "8192")
    assert_raised(sender["mismatch"], "MismatchError", "rank 1", "4096", "8192")


def test_a_send_answered_before_the_receiver_closes_completes(cases):
    sender, receiver = section(cases, "answered_then_closed")
    assert receiver["matched"]["type"] is None, receiver["matched"]
    assert sender["matched"]["type"] is None, sender["matched"]


def test_dtype_mismatch_raises_on_both_ranks(cases):
    """Same byte count, float32 sent, int32 expected: MismatchError on both ranks naming both dtypes."""
    for res in section(cases, "mismatch"):
        assert_raised(res["dtype"], "MismatchError", "float32", "int32")


def test_matched_send_and_receive_are_not_reported(cases):
    """The same 4 KiB message with matching sizes and dtypes completes with the exact bytes."""
    sender, receiver = section(cases, "mismatch")
    assert sender["matched"]["type"] is None and receiver["matched"]["type"] is None
    assert receiver["matched"]["received_exactly"]


def test_communicator_still_exchanges_correctly_after_a_mismatch(cases):
    for res in section(cases, "mismatch"):
        assert all(res[case]["after_ok"] for case in ("size", "dtype", "size_large", "matched")), res


# ---- bad input --------------------------------------------------------------------------------


BAD_INPUTS = {
    # case: (exception type, message fragments)
    "non_contiguous": ("ValueError", ["contiguous"]),
    "meta_device": ("ValueError", ["meta"]),
    "peer_out_of_range": ("ValueError", ["7", "not a rank"]),
    "peer_out_of_range_in_batch": ("ValueError", ["99", "not a rank"]),
    "self_send": ("ValueError", ["itself"]),
    "non_tensor": ("TypeError", ["torch.Tensor", "list"]),
    "non_tensor_in_exchange": ("TypeError", ["recv_prev", "torch.Tensor"]),
    "bad_mode": ("ValueError", ["mode", "interleaved"]),
    "closed_isend": ("P2PError", ["closed"]),
    "closed_exchange": ("P2PError", ["closed"]),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_rejected_with_a_clear_error(cases, case):
    """Non-contiguous, meta-device and non-tensor arguments, peers outside the group, a lone self
    send, an unknown mode and a closed communicator each raise the documented exception with a
    message that says what is wrong."""
    exc_type, fragments = BAD_INPUTS[case]
    for res in section(cases, "bad_input"):
        assert_raised(res[case], exc_type, *fragments)


def test_bad_input_posts_nothing_and_the_communicator_stays_usable(cases):
    """No op of a rejected call is posted (not even the valid ones next to the bad one), and the
    same communicator then exchanges exact payloads, twice."""
    for res in section(cases, "bad_input"):
        assert res["posted_nothing"]
        assert res["after_ok"] and res["after_ok_again"]


# ---- lifetime ---------------------------------------------------------------------------------


@pytest.mark.parametrize("nbytes", [4096, 8 << 20])
def test_send_delivers_exact_bytes_after_its_tensor_and_request_are_dropped(cases, nbytes):
    """The sender keeps no reference to the tensor or the Request, collects garbage and fills
    new tensors of the same size before the receive is even posted; the receiver still gets the
    exact bytes (at 8 MiB, read straight from the sender's memory when single copy is on)."""
    sender, receiver = section(cases, "lifetime")
    assert sender[f"{nbytes}-dropped"]["ack"] == 1
    got = receiver[f"{nbytes}-dropped"]
    assert got["exact"], f"{got['wrong_bytes']} of {nbytes} bytes wrong"


def test_send_delivers_exact_bytes_after_its_tensors_storage_is_swapped(cases):
    """megatron-core's deallocate_output_tensor does `out.data = torch.empty(1)` while the send
    of `out` may be in flight (Megatron-LM PR #4047): the request holds the storage itself, so
    the 8 MiB still arrive exactly."""
    sender, receiver = section(cases, "lifetime")
    assert sender[f"{8 << 20}-swapped"]["ack"] == 1
    got = receiver[f"{8 << 20}-swapped"]
    assert got["exact"], f"{got['wrong_bytes']} bytes wrong"


# ---- close / abort ----------------------------------------------------------------------------


def test_abort_and_close_are_idempotent(cases):
    for res in section(cases, "lifecycle"):
        assert res["abort_twice"]["type"] is None
        assert res["close_twice"]["type"] is None
        assert res["abort_after_close"]["type"] is None
        assert res["closed_after_close"] is True
        assert_raised(res["use_after_abort"], "P2PError", "aborted")


def test_context_manager_closes_the_communicator(cases):
    for res in section(cases, "lifecycle"):
        assert res["ctx_closed_inside"] is False and res["ctx_exchange_ok"]
        assert res["ctx_closed_after"] is True
        assert_raised(res["ctx_use_after"], "P2PError", "closed")


def test_abort_on_one_rank_fails_the_peers_pending_wait_fast(cases):
    """Rank 0 aborts after 1 s; rank 1, waiting on a receive from it with a 60 s timeout, raises
    P2PError within seconds quoting rank 0's reason, and rank 0 can no longer post."""
    aborter, waiter = section(cases, "abort")
    r = waiter["pending_wait"]
    assert_raised(r, "P2PError", "irecv from rank 0")
    assert "aborted by rank 0 (communicator aborted): the loss went NaN" in r["msg"], r["msg"]
    assert r["elapsed"] < 1.0 + SLACK, r["elapsed"]
    assert_raised(aborter["use_after_abort"], "P2PError", "aborted")


# ---- timeout ----------------------------------------------------------------------------------


def test_receive_without_sender_times_out_with_a_report_of_the_pending_op(cases):
    """irecv of 4096 bytes from rank 1, which computes and never sends: P2PTimeoutError (also a
    TimeoutError, and not a DeadlockError: the peer is not waiting) within the timeout plus
    slack, naming the op's kind, peer, size, lane and message number."""
    receiver = section(cases, "timeout")[0]
    assert receiver["timeout"] == CASE_TIMEOUT
    r = receiver["no_sender"]
    assert_raised(r, "P2PTimeoutError", "irecv", "rank 1", "4096 bytes", "lane 0", "message #1")
    assert "TimeoutError" in r["mro"] and "P2PError" in r["mro"]
    assert CASE_TIMEOUT * 0.9 <= r["elapsed"] < CASE_TIMEOUT + SLACK, r["elapsed"]


def test_late_sender_within_the_timeout_is_not_reported(cases):
    """The same receive, with the send posted a second late (inside the 3 s timeout), completes."""
    receiver = section(cases, "timeout")[0]
    assert receiver["late_sender"]["type"] is None, receiver["late_sender"]
    assert receiver["late_sender_exact"]


def test_silent_peer_sees_the_timeout_abort_fast(cases):
    """Rank 1 computes past rank 0's 3 s timeout, then waits (timeout 120 s) on a receive from
    rank 0: the abort is already there, and it raises P2PTimeoutError at once, listing its own
    pending op."""
    r = section(cases, "timeout")[1]["silent_peer"]
    assert_raised(r, "P2PTimeoutError", "irecv from rank 0", "timed out")
    assert r["elapsed"] < CASE_TIMEOUT + SLACK, r["elapsed"]


# ---- peers that exit --------------------------------------------------------------------------


def test_peer_that_closes_and_exits_is_not_reported_as_dead(cases):
    """Rank 1 closes its communicator and its process exits; rank 0 keeps using its own
    communicator (a self exchange) without any PeerFailureError."""
    survivor = section(cases, "clean_exit")[0]
    assert survivor["peer_gone"]
    assert survivor["self_exchange"]["type"] is None, survivor["self_exchange"]
    assert survivor["self_exchange_exact"]


def test_dead_peer_fails_the_others_fast_and_leaves_no_segment():
    """After three good ring exchanges, rank 1 calls os._exit(1) instead of the fourth; the
    others raise PeerFailureError naming it within seconds although their timeout is 30 s, and
    no shared-memory segment is left behind."""
    before = shm_segments()
    params = {"victim": 1, "how": "exit", "exchanges": 6, "die_at": 3, "timeout": 30.0}
    job = run_job("fail_dead_peer.py", 3, params=params, timeout=120)
    assert job.ranks[1] is None, job.ranks[1]  # it wrote nothing: it died
    for rank in (0, 2):
        res = job.ranks[rank]
        assert res is not None and res["ok"], job.output[-4000:]
        v = res["value"]
        assert (v["completed"], v.get("failed_at")) == (3, 3), v
        assert v["error_type"] == "PeerFailureError", v
        assert "rank 1" in v["error"] and "exited" in v["error"], v["error"]
        assert v["elapsed"] < 5.0, v["elapsed"]
    assert leaked_segments(before) == set()


def test_a_sender_killed_mid_single_copy_is_a_peer_failure_naming_it_and_its_pid():
    """SIGKILL while the receiver reads the sender's 512 MiB with process_vm_readv: the failed
    read (ESRCH or EFAULT) is the sender's death, PeerFailureError with its rank and pid, not a
    bare P2PError; the intact transfer is test_one_gibibyte_message_arrives_intact."""
    before = shm_segments()
    job = run_job("fail_dead_peer.py", 2, params={"victim": 0, "how": "sigkill_mid_copy", "nbytes": 512 << 20,
                                                  "timeout": 30.0}, timeout=120)
    assert job.ranks[0] is None  # it died
    v = job.ranks[1]["value"] if job.ranks[1] and job.ranks[1]["ok"] else pytest.fail(job.output[-4000:])
    assert v["single_copy"], v
    assert v["wait"]["type"] == "PeerFailureError", v["wait"]
    assert "rank 0 (pid " in v["wait"]["msg"], v["wait"]["msg"]  # the failed read says so; liveness may be first
    assert v["elapsed"] < 5.0, v
    assert leaked_segments(before) == set()


# ---- shared-memory hygiene --------------------------------------------------------------------


def test_no_segment_outlives_init_or_a_job_that_ends_normally(cases):
    """Every rank unlinks the segment's name before init returns, so none is visible after
    init, and none is left once the job has ended."""
    for v in cases:
        assert v["segments_after_init"] == []
        assert v["segments_left"] == []


def test_rank_killed_right_after_init_leaves_no_segment_and_is_reported():
    """Rank 0 (the segment's creator) is SIGKILLed right after init: the survivor's exchange
    raises PeerFailureError fast, and no segment is left."""
    before = shm_segments()
    params = {"victim": 0, "how": "sigkill", "exchanges": 2, "die_at": -1, "timeout": 30.0}
    job = run_job("fail_dead_peer.py", 2, params=params, timeout=120)
    assert job.ranks[0] is None
    survivor = job.ranks[1]
    assert survivor is not None and survivor["ok"], job.output[-4000:]
    v = survivor["value"]
    assert v["error_type"] == "PeerFailureError" and v["completed"] == 0, v
    assert v["elapsed"] < 5.0, v["elapsed"]
    assert leaked_segments(before) == set()


# ---- large tensors ----------------------------------------------------------------------------


def test_one_gibibyte_message_arrives_intact():
    """1 GiB + 1 byte of uint8 in one message between 2 ranks: same SHA-256, same first and last
    bytes and same strided sample on both sides."""
    nbytes = (1 << 30) + 1
    sender, receiver = (r["value"] for r in run_job(
        "fail_large.py", 2, params={"nbytes": nbytes, "timeout": 120.0}, timeout=300).ok())
    assert sender["nbytes"] == receiver["nbytes"] == nbytes
    assert (receiver["first"], receiver["last"]) == (0xAB, 0xCD)
    assert receiver["sample"] == sender["sample"]
    assert receiver["sha256"] == sender["sha256"]


# ---- what a failure's first line names --------------------------------------------------------
# One rank exchanging with itself, in this process: a size mismatch fails both ops at once.

def self_mismatch(check: bool, call: str | None) -> dict[str, str]:
    import torch

    from megatron_p2p import _C

    with _C.Communicator("shm", _C.new_unique_id(), 0, [0], timeout=10.0, check=check) as comm:
        reqs = comm.exchange(send_next=torch.ones(8), recv_prev=torch.zeros(4, 3), call=call)
        errors = {}
        for name, req in reqs.items():
            with pytest.raises(_C.MismatchError) as exc:
                req.wait()
            errors[name] = str(exc.value).splitlines()[0]
        return errors


def test_a_failure_names_the_call_that_posted_the_op_and_the_shape_debug_matching_read():
    errors = self_mismatch(check=True, call="send_forward_recv_forward")
    assert errors["send_next"].startswith("rank 0: send_next to rank 0 (32 bytes of float32 in shape [8], lane 0, "
                                          "message #0, posted by send_forward_recv_forward) failed: "), errors
    assert errors["recv_prev"].startswith("rank 0: recv_prev from rank 0 (48 bytes of float32 in shape [4, 3], lane 0, "
                                          "message #0, posted by send_forward_recv_forward) failed: "), errors


def test_a_failure_of_an_op_posted_without_a_call_name_or_shape_check_names_neither():
    errors = self_mismatch(check=False, call=None)
    assert errors["send_next"].startswith("rank 0: send_next to rank 0 (32 bytes of float32, lane 0, message #0) "
                                          "failed: "), errors
    assert all("posted by" not in e and "in shape" not in e for e in errors.values()), errors


def test_an_op_failed_by_a_peers_abort_names_that_peer_by_its_global_rank_never_its_group_rank():
    """Global ranks 5 and 7 (group ranks 0 and 1), both in this process, each on a thread of its own
    while they create their communicator; rank 7 aborts while rank 5's receive from it is pending."""
    import threading

    import torch

    from megatron_p2p import _C

    uid, made = _C.new_unique_id(), {}

    def create(group_rank: int) -> None:
        made[group_rank] = _C.Communicator("shm", uid, group_rank, [5, 7], timeout=10.0, pids=[os.getpid()] * 2)

    peer = threading.Thread(target=create, args=(1,))
    peer.start()
    create(0)
    peer.join()
    with made[0] as mine, made[1] as theirs:
        req = mine.irecv(torch.zeros(4), 7)
        theirs.abort(reason="it gave up")
        with pytest.raises(_C.P2PError) as exc:
            req.wait()
    first = str(exc.value).splitlines()[0]
    assert first.startswith("rank 5: irecv from rank 7 ") and "aborted by rank 7 " in first, first
    assert "rank 1" not in first and "group rank" not in first, first
