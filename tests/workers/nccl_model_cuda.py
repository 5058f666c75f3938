"""CUDA as the fake libcuda models it, seen from torch, for one test process: tensors over CPU
memory that say they live on cuda:0, and torch.cuda's device and stream calls answering for one
device whose current stream is the default one (handle 0). Nothing here touches megatron_p2p:
the package runs unmodified on top."""
from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

FAKES = Path(__file__).resolve().parents[2] / "build" / "fakes"
ENV = {
    "MEGATRON_P2P_NCCL_LIBRARY": str(FAKES / "libnccl.so.2"),
    "MEGATRON_P2P_CUDA_LIBRARY": str(FAKES / "libcuda.so.1"),
}


class FakeCudaTensor(torch.Tensor):
    """A CPU tensor that reports is_cuda and device 0, so the NCCL backend accepts it; its
    data_ptr() is host memory, which the fake driver treats as device memory."""

    # torch's idiom for a subclass that dispatches as a plain tensor: a function where the base has a classmethod.
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    def get_device(self) -> int:
        return 0


def on_device(t: torch.Tensor) -> FakeCudaTensor:
    """`t`'s memory as a tensor the NCCL backend takes for one on cuda:0."""
    return t.contiguous().as_subclass(FakeCudaTensor)


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
    torch.cuda.device = _device  # type: ignore[assignment, misc]
    torch.cuda.set_device = lambda device: None  # the one device is always current
    torch.cuda.current_stream = lambda device=None: _Stream()  # type: ignore[assignment, return-value]
    torch.cuda.synchronize = lambda device=None: None


_p = ctypes.c_void_p
_DRIVER_CALLS = {
    "cuCtxSetCurrent": [_p], "cuStreamCreateWithPriority": [ctypes.POINTER(_p), ctypes.c_uint, ctypes.c_int],
    "cuStreamSynchronize": [_p], "cuStreamBeginCapture_v2": [_p, ctypes.c_int],
    "cuStreamEndCapture": [_p, ctypes.POINTER(_p)],
    "cuGraphInstantiateWithFlags": [ctypes.POINTER(_p), _p, ctypes.c_ulonglong], "cuGraphLaunch": [_p, _p],
    "cuGraphDestroy": [_p], "cuGraphExecDestroy": [_p],
}


def driver() -> ctypes.CDLL:
    """The fake driver, for the calls a test makes itself (captures and graphs), with the primary
    context of device 0 current on this thread."""
    cuda = ctypes.CDLL(ENV["MEGATRON_P2P_CUDA_LIBRARY"])
    for name, argtypes in _DRIVER_CALLS.items():
        getattr(cuda, name).argtypes = argtypes
    ctx = _p()
    assert cuda.cuInit(0) == 0 and cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
    assert cuda.cuCtxSetCurrent(ctx) == 0
    return cuda


def side_stream(cuda: ctypes.CDLL) -> ctypes.c_void_p:
    """A new non-blocking stream, as torch's side streams are, made torch's current stream."""
    stream = _p()
    assert cuda.cuStreamCreateWithPriority(ctypes.byref(stream), 1, 0) == 0
    assert stream.value is not None  # a new stream is never the default one (NULL)
    use_stream(stream.value)
    return stream
