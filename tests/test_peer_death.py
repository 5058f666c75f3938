"""A dead peer on the NCCL backend is reported within a poll of the watchdog, not at the timeout
(megatron_p2p/_watchdog.py, nccl.PeerWatch), over the fake libcuda and libnccl: a peer on this
machine whose process is gone, or the store's host gone, fails this rank's pending ops and later
calls naming the rank, while a slow peer, or a finished job whose processes exit in any order,
is never reported. Every job runs with a communicator timeout of 60 s (tests/workers/nccl_peer_death.py)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
from conftest import Job, run_job
from test_nccl_model import FAKE_ENV, fakes_built  # noqa: F401 - fakes_built is an autouse fixture

from megatron_p2p.nccl import NO_RANK, STORE_HOST_SETTLE_SECONDS, PeerWatch, ProcessIdentity

TIMEOUT = 60.0  # the communicator's: every report asserted below comes long before it
REPORTED_WITHIN = 3.0  # seconds from the death to the failed wait (about 0.1 s on an idle machine)
# The default handling under torchrun ("end"): FAKE_ENV sets "raise" so that failures are exceptions.
DEFAULT_HANDLING = {k: v for k, v in FAKE_ENV.items() if k != "MEGATRON_P2P_ASYNC_ERROR_HANDLING"}


def job(case: str, env: dict[str, str] = FAKE_ENV, **params: Any) -> Job:
    return run_job("nccl_peer_death.py", 2, {"case": case, "timeout": TIMEOUT, **params}, timeout=60, env=env)


def survivor(job: Job, rank: int) -> dict[str, Any]:
    """What `rank` reported; its peer was killed and reported nothing."""
    res = job.ranks[rank]
    assert res is not None and res.get("ok"), (res, job.output[-4000:])
    return res["value"]


@pytest.fixture(scope="module")
def killed() -> Job:
    return job("killed")


@pytest.fixture(scope="module")
def store_killed() -> Job:
    return job("store_killed")


def failed_naming(record: dict[str, Any], *fragments: str) -> None:
    assert record["type"] is not None and "P2PError" in record["mro"], record
    for fragment in fragments:
        assert fragment in record["msg"], (fragment, record["msg"])


# ---- what "gone" means (no job) ----------------------------------------------------------------


def identity_of(pid: int) -> ProcessIdentity:
    start = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[19])
    return ProcessIdentity(pid, "here", ProcessIdentity.this_process().machine, start)


def test_a_process_that_exited_is_gone_before_it_is_reaped_and_a_live_one_is_not():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        peer = identity_of(child.pid)
        assert not peer.gone()
        os.kill(child.pid, signal.SIGKILL)
        while open(f"/proc/{child.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            time.sleep(0.001)
        assert peer.gone()  # a zombie: kill(pid, 0) would still succeed
    finally:
        child.kill()
        child.wait()
    assert peer.gone()


def test_a_pid_that_now_names_another_process_is_gone_and_the_same_process_is_not():
    me = ProcessIdentity.this_process()
    assert me.machine and not me.gone()
    assert me._replace(start=me.start + 1).gone()  # the same pid, started at another time


# ---- a peer's process gone ---------------------------------------------------------------------


def test_a_peer_killed_while_this_rank_waits_on_it_fails_the_wait_within_2_s_naming_it(killed):
    assert killed.ranks[1] is None  # SIGKILLed before it could report
    v = survivor(killed, 0)
    failed_naming(v["wait"], "irecv from rank 1", "rank 1 (pid", "is gone: its process exited")
    assert v["after_death"] < REPORTED_WITHIN, v


def test_a_peer_killed_while_this_rank_waits_on_it_is_a_peer_failure_error(killed):
    assert survivor(killed, 0)["wait"]["type"] == "PeerFailureError", survivor(killed, 0)["wait"]


def test_after_a_peer_died_the_next_call_fails_at_once_naming_it(killed):
    v = survivor(killed, 0)
    failed_naming(v["next_call"], "rank 1 (pid", "is gone")
    assert v["next_call"]["elapsed"] < 0.5, v["next_call"]


def test_a_peer_alive_but_slow_is_not_reported_and_the_exchange_completes():
    slow = job("slow", delay=3.0)
    v = slow.ok()[0]["value"]
    assert v["wait"]["type"] is None and v["exact"], v
    assert v["wait"]["elapsed"] >= 3.0, v["wait"]  # it did wait on the sleeping peer
    assert "megatron_p2p watchdog" not in slow.output, slow.output[-3000:]


def test_a_peer_killed_while_this_rank_is_idle_fails_the_first_op_posted_to_it_within_a_poll():
    idle = job("idle_killed", idle=0.5)
    v = survivor(idle, 0)
    failed_naming(v["wait"], "irecv from rank 1", "rank 1 (pid", "is gone")
    assert v["wait"]["elapsed"] < 1.0, v["wait"]


# ---- the store's host gone ---------------------------------------------------------------------


class StoreRelay:
    """What PeerWatch reads of its AbortRelay: why the store is gone, once it is."""

    store_gone: str | None = None


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def watch_over(child: subprocess.Popen[bytes]) -> tuple[PeerWatch, StoreRelay, Clock]:
    """A PeerWatch of global rank 1 (this process) over global rank 0 (`child`), its relay and clock."""
    relay, clock = StoreRelay(), Clock()
    me = ProcessIdentity.this_process()
    return PeerWatch(relay, me, {0: identity_of(child.pid), 1: me}, clock=clock), relay, clock  # type: ignore[arg-type]


@pytest.fixture
def child():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_store_found_gone_before_its_hosts_process_is_names_that_rank_once_it_is(child):
    """The race a busy machine showed: the store's connection closes while its host is still
    exiting. The loss waits for the process table rather than naming no rank, or this one."""
    watch, relay, clock = watch_over(child)
    relay.store_gone = "Connection reset by peer"
    assert watch.loss() is None  # settling: rank 0's process has not exited yet
    child.kill()
    child.wait()
    clock.now += STORE_HOST_SETTLE_SECONDS / 2
    loss = watch.loss()
    assert loss is not None and loss.rank == 0 and loss.store_gone and loss.dead == {0}, loss
    assert "store's host is gone" in loss.reason and "rank 0 (pid" in loss.reason, loss


def test_a_store_gone_with_every_peer_here_alive_names_no_rank_never_this_one(child):
    watch, relay, clock = watch_over(child)
    relay.store_gone = "Connection reset by peer"
    assert watch.loss() is None
    clock.now += STORE_HOST_SETTLE_SECONDS
    loss = watch.loss()
    assert loss is not None and loss.rank == NO_RANK and loss.store_gone and not loss.dead, loss
    assert "no rank is named" in loss.reason and "(pid" not in loss.reason, loss


def test_a_store_that_answers_with_every_peer_alive_is_no_loss(child):
    watch, _, clock = watch_over(child)
    clock.now += 10 * STORE_HOST_SETTLE_SECONDS
    assert watch.loss() is None




def test_the_store_host_killed_fails_the_pending_wait_within_2_s_saying_the_store_is_gone(store_killed):
    assert store_killed.ranks[0] is None
    v = survivor(store_killed, 1)
    failed_naming(v["wait"], "irecv from rank 0", "the torch.distributed store's host is gone", "rank 0 (pid")
    assert v["after_death"] < REPORTED_WITHIN, v


def test_the_store_host_killed_is_a_peer_failure_error(store_killed):
    assert survivor(store_killed, 1)["wait"]["type"] == "PeerFailureError", survivor(store_killed, 1)["wait"]


def test_a_finished_job_whose_store_host_exits_first_ends_with_status_0_and_reports_nothing():
    """Rank 0 hosts the store, closes and exits; rank 1, done, keeps its communicator open 0.5 s
    more (its watchdog polls the dead store and sees rank 0 gone), then closes. Under the default
    handling ("end"), which would end a rank that the watchdog failed."""
    end = job("normal_end", env=DEFAULT_HANDLING, idle=0.5)
    assert end.returncode == 0, end.output[-4000:]
    for v in (r["value"] for r in end.ok()):
        assert v["exchange"]["type"] is None and v["close"]["type"] is None, v
    assert "megatron_p2p" not in end.output and "Traceback" not in end.output, end.output[-4000:]
