"""megatron-core on a machine without CUDA: `with megatron_p2p.megatron_on_cpu():` around its
schedules and P2PCommunicator calls. megatron-core is written for CUDA and a CPU-only torch
raises on the calls it makes even when every tensor is on the CPU."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


def _is_cuda(device: Any) -> bool:
    """A device argument that names CUDA: "cuda", "cuda:N", a CUDA torch.device, or an int (torch
    reads a bare index as a CUDA device; megatron-core passes torch.cuda.current_device())."""
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaToCpu(TorchFunctionMode):
    """Tensor factories and moves asked for a CUDA device get the CPU instead."""

    def __torch_function__(self, func: Callable[..., Any], types: Collection[type], args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[None]:
    """Runs megatron-core on the CPU where torch has no CUDA, and changes nothing where it has.

    Inside the block, and restored after it:
    - torch.cuda.current_device() returns 0, as on a one-GPU machine (megatron-core allocates
      receive buffers and its schedules' counters on it);
    - a tensor asked for on a CUDA device ("cuda", "cuda:N", torch.device("cuda"), or an index
      such as that 0) is made on the CPU;
    - torch.cuda.synchronize() returns at once (host memory needs no synchronization);
    - torch.cuda.nvtx.range_push() and range_pop() do nothing.
    Nothing of megatron-core itself is changed. Use it around the schedule call (for example
    forward_backward_pipelining_without_interleaving) and around P2PCommunicator's methods."""
    if torch.cuda.is_available():
        yield
        return
    with on_cpu():
        yield


@contextlib.contextmanager
def on_cpu() -> Iterator[None]:
    """megatron_on_cpu()'s replacements, whatever torch.cuda.is_available() says (the tests' model
    of CUDA says True, and its tensors are the CPU's)."""
    from unittest import mock  # here: the package's import stays light

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(torch.cuda, "current_device", lambda: 0))
        stack.enter_context(mock.patch.object(torch.cuda, "synchronize", _nothing))
        stack.enter_context(mock.patch.object(torch.cuda.nvtx, "range_push", _nothing))
        stack.enter_context(mock.patch.object(torch.cuda.nvtx, "range_pop", _nothing))
        stack.enter_context(_CudaToCpu())
        yield
