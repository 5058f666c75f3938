"""A Communicator and its Requests refer to each other (its in-flight list, their `comm`), and a
hook may close over it too: the cyclic garbage collector frees a dropped one, closing its
transport on the way, on both backends (NCCL over the fake libraries), and never one that a
held Request still needs."""
from __future__ import annotations

import pytest
from conftest import ROOT, run_job

FAKES = ROOT / "build" / "fakes"
FAKE_ENV = {
    "MEGATRON_P2P_NCCL_LIBRARY": str(FAKES / "libnccl.so.2"),
    "MEGATRON_P2P_CUDA_LIBRARY": str(FAKES / "libcuda.so.1"),
}
BACKENDS = ["shm", "nccl"]


def dropped(backend: str, case: str) -> dict:
    job = run_job("dropped_communicator.py", 1, {"backend": backend, "case": case}, timeout=90,
                  env=FAKE_ENV if backend == "nccl" else None)
    return job.ok()[0]["value"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_dropped_communicator_is_freed_by_the_garbage_collector(backend):
    assert dropped(backend, "dropped") == {"freed": True}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_communicator_a_held_request_needs_stays_alive_and_open(backend):
    assert dropped(backend, "held") == {"freed": False, "exact": True, "closed": False}
