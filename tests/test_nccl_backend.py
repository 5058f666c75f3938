"""The NCCL backend on a machine without a GPU: "auto" picks shm, asking for NCCL says what is
missing, and the NCCL transport's issuing code turns the steps an shm communicator ran into
exactly those NCCL groups, lanes and calls."""
from __future__ import annotations

import pytest
from conftest import run_job

import megatron_p2p as mp
from megatron_p2p import _C

RANKS = 4


@pytest.fixture(scope="module")
def job():
    return [r["value"] for r in run_job("nccl_paths.py", RANKS, timeout=240).ok()]


def test_auto_picks_shm_for_cpu_tensors(job):
    assert all(v["auto"] == "shm" for v in job)


@pytest.mark.parametrize("case", ["nccl_without_gpu", "auto_on_cuda_without_gpu"])
def test_nccl_without_a_gpu_raises_backend_unavailable_saying_what_is_missing(job, case):
    e = job[0]["errors"][case]
    assert e["type"] == "BackendUnavailableError", e
    assert "CUDA" in e["message"] and "shm" in e["message"], e["message"]


def test_nccl_without_a_cuda_driver_raises_backend_unavailable():
    """Past the Python checks, the C side finds no libcuda.so.1 and says so."""
    mp.nccl_version()  # the package's search, which finds the wheel's libnccl
    e = None
    try:
        _C.Communicator("nccl", _C.nccl_unique_id() * 2, 0, [0], device=0, stream=lambda: 0)
    except Exception as exc:
        e = exc
    if e is None:
        pytest.skip("this machine has a CUDA driver")
    assert isinstance(e, _C.BackendUnavailableError), repr(e)
    assert "CUDA driver" in str(e)


def test_shm_refuses_a_cuda_device_and_a_meta_tensor(job):
    assert job[0]["errors"]["shm_on_cuda"]["type"] == "ValueError"
    meta = job[0]["errors"]["meta_tensor"]
    assert meta["type"] == "ValueError" and "meta" in meta["message"], meta


# ---- the NCCL transport issues what the plan says ------------------------------------------------

NCCL_TYPES = {  # dtype -> (ncclDataType_t, element size), from nccl.h
    "float64": (8, 8), "float32": (7, 4), "float16": (6, 2), "bfloat16": (9, 2),
    "int8": (0, 1), "uint8": (1, 1), "int32": (2, 4), "uint32": (3, 4), "int64": (4, 8), "uint64": (5, 8),
}
FLOAT8 = {"float8_e4m3fn": 10, "float8_e5m2": 11}


def nccl_type(dtype: str, version: int) -> tuple[int, int]:
    if dtype in FLOAT8:
        return (FLOAT8[dtype], 1) if version >= 22400 else (1, 1)
    return NCCL_TYPES.get(dtype, (1, 1))  # no NCCL type of its own: bytes


def steps_of(ops: list[dict]) -> list[tuple[int, list[dict]]]:
    """The flight recorder's entries, regrouped into the steps (groups) they were posted in."""
    steps, i = [], 0
    while i < len(ops):
        n = ops[i]["group_size"]
        group = ops[i:i + n]
        assert len({(o["lane"], o["step"]) for o in group}) == 1, group
        steps.append((ops[i]["lane"], group))
        i += n
    return steps


def expected_calls(steps, version):
    calls: list[tuple] = []
    for lane, group in steps:
        calls.append(("group_start",))
        for index, o in enumerate(group):
            dtype, size = nccl_type(o["dtype"], version)
            calls.append((o["kind"], lane, o["peer"], o["nbytes"] // size, dtype, index))
        calls.append(("group_end", lane))
    return calls


@pytest.mark.parametrize("version", [23007, 21400], ids=["nccl-2.30", "nccl-2.14-no-float8"])
def test_nccl_issue_makes_one_group_per_step_with_the_steps_ops_lanes_and_order(job, version):
    for value in job:
        for run in value["runs"]:
            steps = steps_of(run["ops"])
            wire = [(lane, [(o["kind"] == "send", o["peer"], o["nbytes"], _C.DTYPE_NAMES.index(o["dtype"]))
                            for o in group]) for lane, group in steps]
            calls = [tuple(c) for c in _C._nccl_issue_trace(wire, version)]
            assert calls == expected_calls(steps, version), (run["mode"], run["lanes"])


def test_the_steps_an_exchange_posts_are_the_plans(job):
    """The shm transport ran each exchange as the plan's steps: same groups, order and lanes."""
    for value in job:
        for run in value["runs"]:
            steps = iter(steps_of(run["ops"]))
            for call in run["calls"]:
                if call["kind"] != "exchange":
                    lane, group = next(steps)
                    assert lane == 0 and len(group) == (2 if call["kind"] == "batch" else 1)
                    continue
                for lane, names in _C.plan(run["mode"], run["lanes"], run["rank"], call["ops"]):
                    got_lane, group = next(steps)
                    assert (got_lane, [o["label"] for o in group]) == (lane, list(names))
            assert next(steps, None) is None
