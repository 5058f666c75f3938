"""A communicator belongs to the process that created it. A fork child (os.fork, multiprocessing's
fork start method, DataLoader workers) cannot use the one it inherits: every call raises P2PError
naming the creating process, at once; and neither its calls, its close() nor its exit (os._exit,
interpreter shutdown, garbage collection) do anything to the parent's communicator: the child
exits 0 without a crash, the parent then exchanges exact payloads with its peer, the peer
receives nothing the child posted, and nothing is left in /dev/shm.

One torchrun job (tests/workers/fork_cases.py, 2 ranks, shm) runs every case in sequence, each
on a communicator of its own, both ranks forking at once; the tests read their case's part.
Children run under a wall-clock limit (killed and reported hung past it), and the job under
another, so that a case can fail but never hang."""

import pytest
from conftest import run_job, shm_segments

CALL_LIMIT = 1.0  # seconds: a call on an inherited communicator raises at once, not at a timeout
CRASH_MARKS = ("fatal python error", "segmentation fault", "bus error", "traceback")

# Every call a fork child makes on the inherited communicator and its Requests (see child_calls).
CHILD_CALLS = (
    "exchange", "exchange_batched", "isend", "irecv", "batch",
    "wait_completed", "synchronize_completed", "is_completed_completed",
    "wait_pending", "synchronize_pending", "is_completed_pending",
    "stats", "empty", "abort",
)


@pytest.fixture(scope="module")
def job():
    """fork_cases.py on 2 ranks: per rank, a dict of sections (see the worker's docstring), and
    what of this job's is left in /dev/shm once it has ended."""
    before = shm_segments()
    result = run_job("fork_cases.py", 2, params={"timeout": 5.0}, timeout=150)
    ranks = result.ok()
    values = [r["value"] for r in ranks]
    pids = {p for v in values for p in v["pids"]}
    for v in values:
        for _name, sec in v.items():
            if isinstance(sec, dict):
                child = sec.get("child") or {}
                pids |= {p for p in [child.get("pid"), *(child.get("pids") or [])] if p}
    left = {n for n in shm_segments() - before if n.split("-")[1].isdigit() and int(n.split("-")[1]) in pids}
    return {"ranks": values, "left": sorted(left), "output": result.output}


def sections(job, name, strict=True):
    """Both ranks' results of one section, failing on an unexpected exception in it (strict)."""
    out = []
    for rank, v in enumerate(job["ranks"]):
        res = v[name]
        if strict and "unexpected" in res:
            pytest.fail(f"rank {rank}, section {name}: {res['unexpected']}\n{res.get('traceback')}")
        out.append(res)
    return out


def assert_parent_intact(rank, res):
    """The parent exchanged exactly before its child; its receive pending across the fork (into
    a buffer from comm.empty()) got exactly the peer's first send after the child; it then
    exchanged exactly, three rounds of four ops and a lane-0 pair each way (the peer's receives
    got exactly the parent's sends, not anything a child posted); it still maps the same shared
    memory; nothing of the job or its children is in /dev/shm; its own close() raised nothing."""
    assert res["before_exact"], f"rank {rank}: the exchange before the fork was wrong"
    if "pending" in res:
        assert res["pending"]["exact"], f"rank {rank}: the receive pending across the fork got {res['pending']}"
    wrong = {(k, op): (got["first"], got["want"]) for k, ops in res["after"].items()
             for op, got in ops.items() if not got["exact"]}
    assert not wrong, f"rank {rank}: (round, op): (first value received, value sent by the peer): {wrong}"
    assert res["maps_before"] and res["maps_after"] == res["maps_before"], (rank, res["maps_before"],
                                                                            res["maps_after"])
    assert res["shm_now"] == [], (rank, res["shm_now"])
    assert res["close"]["type"] is None, (rank, res["close"])


def assert_clean_exit(rank, child, exitcode=None):
    """A child that ended by itself, with status 0 and nothing crash-like on its stderr."""
    code = child["exitcode"] if exitcode is None else exitcode
    assert not child["hung"], f"rank {rank}: the child was still alive after its limit and was killed\n{child}"
    stderr = child["stderr"]
    assert code == 0, f"rank {rank}: the child exited with {code} (negative: killed by that signal)\n{stderr}"
    marks = [m for m in CRASH_MARKS if m in stderr.lower()]
    assert not marks, f"rank {rank}: the child's stderr shows {marks}:\n{stderr}"


def test_a_fork_child_that_exits_with_sys_exit_ends_cleanly_and_the_parent_exchanges_exactly(job):
    """os.fork(), then sys.exit(0) in the child: interpreter shutdown, the atexit hooks (which
    close every live communicator) and garbage collection run over the inherited communicator and
    its Requests. The child exits 0 with no crash on stderr; the parent's communicator is intact."""
    for rank, res in enumerate(sections(job, "sys_exit")):
        assert_clean_exit(rank, res["child"])
        assert_parent_intact(rank, res)


def test_a_fork_child_that_exits_with_os_exit_ends_cleanly_and_the_parent_exchanges_exactly(job):
    """os.fork(), then os._exit(0) in the child (no hook runs): exit 0, the parent intact."""
    for rank, res in enumerate(sections(job, "os_exit")):
        assert_clean_exit(rank, res["child"])
        assert_parent_intact(rank, res)


def test_a_multiprocessing_fork_process_ends_cleanly_and_the_parent_exchanges_exactly(job):
    """multiprocessing.get_context("fork").Process with a target that does nothing: its
    exitcode is 0, no crash on stderr, the parent intact."""
    for rank, res in enumerate(sections(job, "mp_process")):
        assert_clean_exit(rank, res["child"])
        assert_parent_intact(rank, res)


def test_dataloader_fork_workers_end_cleanly_and_the_parent_exchanges_exactly(job):
    """A DataLoader with num_workers=2 and the fork start method, iterated to the end, its workers
    touching nothing of the communicator: every item arrives, from the workers, both workers exit
    0 with no crash on stderr, the parent intact."""
    for rank, res in enumerate(sections(job, "dataloader")):
        child = res["child"]
        assert child["error"] is None, f"rank {rank}: the DataLoader raised {child['error']}\n{child['stderr']}"
        assert child["items_exact"], rank
        assert len(child["pids"]) == 2 and set(child["worker_pids"]) <= set(child["pids"]), (rank, child)
        assert not child["hung"], (rank, child)
        for code in child["exitcodes"]:
            assert_clean_exit(rank, child, exitcode=code)
        assert_parent_intact(rank, res)


def test_every_call_on_an_inherited_communicator_in_a_fork_child_raises_p2p_error_naming_the_creator_at_once(job):
    """In an os.fork child, every call on the inherited communicator (exchange in both modes,
    isend, irecv, batch, stats, empty, abort) and on its Requests (wait, synchronize and
    is_completed, on one completed and one still pending in the parent) raises P2PError within
    1 s saying "was created by process <parent pid>" and "a forked child cannot use it"."""
    for rank, res in enumerate(sections(job, "uses_comm", strict=False)):  # what the parent did later aside
        report = res.get("child", {}).get("report")
        assert report is not None and "calls" in report, (
            f"rank {rank}: the child sent no report (exit {res['child']['exitcode']})\n{res['child']['stderr']}")
        parent = report["parent"]
        assert parent == job["ranks"][rank]["pid"] and report["ppid"] == parent
        bad = {}
        for name in CHILD_CALLS:
            call = report["calls"][name]
            if (call["type"] is None or "P2PError" not in call.get("mro", [])
                    or f"was created by process {parent}" not in call["msg"]
                    or "a forked child cannot use it" not in call["msg"] or not call["elapsed"] < CALL_LIMIT):
                bad[name] = call
        assert not bad, f"rank {rank}: calls in the fork child that did not raise as specified: {bad}"


def test_a_fork_child_that_used_the_communicator_closes_it_exits_cleanly_and_the_peer_receives_nothing_it_posted(job):
    """After the calls above (sends of poison included) the child closes the communicator
    (nothing raised) and exits with sys.exit(0): status 0, no crash. The parent's receive left
    pending across the fork gets exactly the peer's next send, and the parent's exchanges that
    follow are exact both ways: nothing the child posted reached the peer, and the child's
    close(), abort() and exit aborted or closed nothing of the parent's."""
    for rank, res in enumerate(sections(job, "uses_comm")):
        report = res["child"]["report"] or {}
        assert report.get("close", {}).get("type") is None, (rank, report.get("close"))
        assert_clean_exit(rank, res["child"])
        assert_parent_intact(rank, res)


def test_the_creating_process_makes_the_same_calls_without_error(job):
    """The twin of the above: in the process that created it, exchange (both modes), isend,
    irecv, batch, wait, synchronize, is_completed, stats and empty raise nothing and every
    payload is exact."""
    for rank, res in enumerate(sections(job, "parent_calls")):
        raised = {name: call for name, call in res["parent"]["calls"].items() if call["type"] is not None}
        assert not raised, (rank, raised)
        assert all(res["parent"]["exact"].values()), (rank, res["parent"]["exact"])
        assert_parent_intact(rank, res)


def test_nothing_of_the_communicators_is_left_in_dev_shm_after_the_job(job):
    """No /dev/shm entry named after a rank or any child of the job ("mp2p-<pid>-...") outlives it."""
    assert job["left"] == [], job["left"]


def test_a_fork_child_of_an_nccl_rank_gets_p2p_error_and_exits_cleanly_and_the_parent_exchanges_exactly():
    """On the model of libcuda and libnccl: CUDA is unusable in a fork child anyway, so the child's
    call must fail before it reaches either library, and its exit must leave the parent's
    communicators alone."""
    from test_nccl_model import run_one

    v = run_one("nccl_model_fork.py", {})
    assert v["child_call"]["type"] == "P2PError", v["child_call"]
    assert f"was created by process {v['parent']}" in v["child_call"]["msg"], v["child_call"]
    assert v["child_status"] == 0 and "Fatal Python error" not in v["child_stderr"], v
    assert v["exact_after"] == [True, True, True], v
