"""The harness itself: results come back per rank, and a hung job is killed with its stacks."""
import pytest
from conftest import run_job


def test_results_come_back_from_every_rank(torchrun):
    ranks = torchrun("hello.py", 3, timeout=60).ok()
    assert [r["value"]["got"] for r in ranks] == [[2] * 4, [0] * 4, [1] * 4]


def test_a_hung_job_is_killed_and_its_stacks_reported():
    with pytest.raises(pytest.fail.Exception) as info:
        run_job("sleeper.py", 1, timeout=20)  # long enough for torch to import under load
    message = str(info.value)
    assert "passed its 20 s limit" in message
    assert "sleep_forever" in message  # a frame of the hung rank's stack
