"""The two-process GPU checks under pytest (see two_process_checks.py): one run of both jobs,
one test per check; skipped where there is no CUDA device."""
import pytest
import torch
import two_process_checks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (tests/gpu/run_device_checks.sh)"),
]


@pytest.fixture(scope="module")
def summary(tmp_path_factory) -> dict:
    return two_process_checks.run_all(tmp_path_factory.mktemp("two_process"), budget=170.0)


@pytest.mark.parametrize("check", two_process_checks.MAIN_PARTS + two_process_checks.FAULT_PARTS[1:] + ["watchdog_end"])
def test_two_process(summary, check):
    result = summary["checks"][check]
    assert result["ok"], json_text(result)


def json_text(result: dict) -> str:
    return "\n".join(f"{k}: {v}" for k, v in result.items())
