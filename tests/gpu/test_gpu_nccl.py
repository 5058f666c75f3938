"""The GPU checks under pytest (see gpu_checks.py); skipped where there is no CUDA device."""
import gpu_checks
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run tests/gpu/run_device_checks.sh)"),
]


@pytest.mark.parametrize("check", gpu_checks.CHECKS, ids=lambda c: c.__name__[len("check_"):])
def test_gpu(check):
    check()
