"""The latency benchmark's C floor (megatron_p2p._testing.pingpong): two processes bounce a
counter through a shared page that neither leaves behind, and a missing peer is a TimeoutError,
never a hang."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_p2p import _testing


def _page_left(name: str) -> bool:
    return (Path("/dev/shm") / name.lstrip("/")).exists()


def _rank1(name: str, trips: int) -> subprocess.Popen:
    code = f"from megatron_p2p import _testing; print(_testing.pingpong({name!r}, 1, {trips}, timeout=20.0))"
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def test_two_processes_time_every_round_trip_and_leave_no_page():
    name = f"/mp2p-test-floor-{os.getpid()}"
    peer = _rank1(name, 500)
    oneway = _testing.pingpong(name, 0, 500, timeout=20.0)
    out, _ = peer.communicate(timeout=30)
    assert peer.returncode == 0 and out.strip() == "[]"  # rank 1 takes part and reports nothing
    assert len(oneway) == 500 and all(0 < us < 1e5 for us in oneway)
    assert not _page_left(name)


def test_a_peer_that_never_comes_times_out_and_leaves_no_page():
    name = f"/mp2p-test-floor-alone-{os.getpid()}"
    with pytest.raises(TimeoutError, match="waiting for rank 1 to map"):
        _testing.pingpong(name, 0, 10, timeout=0.2)
    assert not _page_left(name)
    with pytest.raises(TimeoutError, match="waiting for rank 0 to create"):
        _testing.pingpong(name, 1, 10, timeout=0.2)


@pytest.mark.parametrize("args, message", [
    (("no-slash", 0, 10), "name must be '/'"),
    (("/a/b", 0, 10), "name must be '/'"),
    (("/ok", 2, 10), "rank must be 0 or 1, got 2"),
    (("/ok", 0, 0), "round_trips must be at least 1, got 0"),
    (("/ok", 0, 10, 0.0), "timeout must be positive"),
])
def test_each_wrong_argument_is_named(args, message):
    with pytest.raises(ValueError, match=message):
        _testing.pingpong(*args)
