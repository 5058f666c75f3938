"""megatron_p2p.megatron_on_cpu(): what megatron-core asks of CUDA works on a CPU-only torch inside
the block, and nothing is changed outside it (the end-to-end run is examples/megatron_on_cpu.py,
tests/test_examples.py)."""
import pytest
import torch

import megatron_p2p as mp

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the shim changes nothing where CUDA exists")


@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda"), 0])
def test_a_tensor_asked_for_on_a_cuda_device_is_made_on_the_cpu_inside(device):
    with mp.megatron_on_cpu():
        assert torch.empty(2, device=device).device.type == "cpu"
        assert torch.zeros(2, device=device).device.type == "cpu"


def test_a_tensor_asked_for_on_the_cpu_or_with_no_device_is_untouched_inside():
    with mp.megatron_on_cpu():
        assert torch.ones(2, device="cpu").tolist() == [1.0, 1.0]
        assert torch.arange(3).tolist() == [0, 1, 2]


def test_the_cuda_calls_megatron_core_makes_answer_inside():
    with mp.megatron_on_cpu():
        assert torch.cuda.current_device() == 0
        torch.cuda.synchronize()  # returns, where a CPU-only torch raises
        torch.cuda.nvtx.range_push("step")
        torch.cuda.nvtx.range_pop()


def test_outside_the_block_torch_is_as_it_was():
    with mp.megatron_on_cpu():
        pass
    with pytest.raises((AssertionError, RuntimeError)):
        torch.empty(2, device="cuda")
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_device()
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.synchronize()


def test_an_error_inside_the_block_restores_torch_too():
    with pytest.raises(ValueError), mp.megatron_on_cpu():
        raise ValueError("inside")
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_device()
