"""Debug matching on the NCCL backend (MEGATRON_P2P_CHECK=1), over the fake libcuda and libnccl:
every transfer is preceded by a descriptor (bytes, dtype, shape, call, message number) that
the receiver compares with its own op before the data is launched."""
from __future__ import annotations

import pytest
from test_nccl_model import FAKE_ENV, fakes_built, run_ranks  # noqa: F401 - fakes_built is an autouse fixture

CHECK = {"MEGATRON_P2P_CHECK": "1"}
CASES = ["agree", "count", "dtype", "shape"]


@pytest.fixture(scope="module")
def checked() -> list[dict]:
    return run_ranks("nccl_model_check.py", 2, {"cases": CASES}, env=CHECK)


@pytest.fixture(scope="module")
def unchecked() -> list[dict]:
    return run_ranks("nccl_model_check.py", 2, {"cases": ["agree", "shape"]})


def test_agreeing_ops_deliver_exact_bytes_under_debug_matching(checked):
    assert checked[0]["agree"]["type"] is None and checked[1]["agree"]["type"] is None, checked
    assert checked[1]["agree"]["arrived"]


@pytest.mark.parametrize("case, says", [("count", "3996 bytes of int32"), ("dtype", "4000 bytes of int32"),
                                        ("shape", "shape [100, 10]")])
def test_a_disagreement_raises_mismatch_on_the_receiver_naming_both_ranks_before_data_lands(checked, case, says):
    got = checked[1][case]
    assert got["type"] == "MismatchError", got
    assert "rank 0's send_next #0 (call check_case)" in got["msg"], got["msg"]
    assert "rank 1's recv_prev #0 (call check_case)" in got["msg"] and says in got["msg"], got["msg"]
    assert not got["arrived"] and got["elapsed"] < 5.0, got


@pytest.mark.parametrize("case", ["count", "dtype", "shape"])
def test_the_sender_of_a_disagreement_hears_of_it_from_the_receiver(checked, case):
    got = checked[0][case]
    assert got["type"] is not None and "P2PError" in got["mro"] and "communicator aborted (rank 1)" in got["msg"], got
    assert "debug matching: rank 0's send_next #0" in got["msg"], got["msg"]  # the receiver's reason
    assert got["elapsed"] < 5.0, got


def test_without_debug_matching_a_shape_disagreement_is_silently_accepted(unchecked):
    """What the mode is for: NCCL (and its model) compare neither shape nor call."""
    assert unchecked[1]["shape"]["type"] is None and unchecked[1]["shape"]["arrived"], unchecked[1]
    assert unchecked[1]["agree"]["type"] is None and unchecked[1]["agree"]["arrived"], unchecked[1]
