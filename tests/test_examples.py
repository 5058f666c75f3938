"""The examples the docs point at run as written (under torchrun, as the docs say)."""
import importlib.util

import pytest
from conftest import run_job

# Looked up, not imported: megatron-core's import takes seconds, and only the job needs it.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")


def test_megatron_cores_1f1b_schedule_runs_on_the_cpu_and_matches_one_process():
    job = run_job("../../examples/megatron_on_cpu.py", 2, timeout=180)
    assert job.returncode == 0, job.output[-4000:]
    assert "losses: [" in job.output
    for rank in (0, 1):
        assert f"rank {rank}: gradients equal the one-process run: True" in job.output, job.output[-4000:]
