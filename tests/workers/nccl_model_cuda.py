"""CUDA as the fake libcuda models it, seen from torch, for one test process: tensors over CPU
memory that say they live on cuda:0, and torch.cuda's device and stream calls answering for one
device whose current stream is the default one (handle 0). Nothing here touches megatron_p2p:
the package runs unmodified on top."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Iterator

import torch

FAKES = Path(__file__).resolve().parents[2] / "build" / "fakes"
ENV = {
    "MEGATRON_P2P_NCCL_LIBRARY": str(FAKES / "libnccl.so.2"),
    "MEGATRON_P2P_CUDA_LIBRARY": str(FAKES / "libcuda.so.1"),
}


class FakeCudaTensor(torch.Tensor):
    """A CPU tensor that reports is_cuda and device 0, so the NCCL backend accepts it; its
    data_ptr() is host memory, which the fake driver treats as device memory."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    def get_device(self) -> int:  # type: ignore[override]
        return 0


def on_device(t: torch.Tensor) -> FakeCudaTensor:
    """`t`'s memory as a tensor the NCCL backend takes for one on cuda:0."""
    return t.contiguous().as_subclass(FakeCudaTensor)  # type: ignore[return-value]


class _Stream:
    cuda_stream = 0  # the context's default stream, as torch's default stream is


def use_stream(handle: int) -> None:
    """Makes `handle` (a CUstream of the fake driver) torch's current stream in this process."""
    _Stream.cuda_stream = handle


@contextlib.contextmanager
def _device(index: Any) -> Iterator[None]:
    yield


def install() -> None:
    """Points the package's loader at the fakes and patches torch.cuda in this process only."""
    os.environ.update(ENV)
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0
    torch.cuda.device = _device  # type: ignore[assignment]
    torch.cuda.current_stream = lambda device=None: _Stream()  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None
