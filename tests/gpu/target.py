"""The device the GPU checks run on: a real GPU, or the model of libcuda and libnccl under
tests/fakes/ (the dry run), chosen by MP_GPU_TARGET=gpu|model. The checks touch the device
only through this module, so the dry run takes every path the GPU run takes and only the
libraries differ.

On the model, tensors are CPU memory that says it lives on cuda:0 (see
tests/workers/nccl_model_cuda.py) and host code reads them at once, so every read of device
data goes through `wait_stream()`, where the host waits for the current stream; on a GPU torch
orders such reads on the stream itself and `wait_stream()` does nothing.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

ENV_TARGET = "MP_GPU_TARGET"
sys.path.append(str(Path(__file__).resolve().parents[1] / "workers"))


def name() -> str:
    """gpu or model."""
    target = os.environ.get(ENV_TARGET, "gpu")
    if target not in ("gpu", "model"):
        raise ValueError(f"{ENV_TARGET}={target!r}: expected gpu or model")
    return target


def on_model() -> bool:
    return name() == "model"


def model_env() -> dict[str, str]:
    """What a process needs in its environment to run the checks on the model."""
    import nccl_model_cuda

    return {ENV_TARGET: "model", **nccl_model_cuda.ENV}


class _Gpu:
    torch_device = "cuda"

    def install(self) -> None:
        torch.cuda.set_device(0)  # every rank on the one GPU

    def own(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def wait_stream(self) -> None:
        pass

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def stream_idle(self) -> bool:
        return torch.cuda.current_stream().query()

    def sleep(self, seconds: float) -> None:
        torch.cuda._sleep(int(seconds * 2e9))  # cycles: at least `seconds` at clocks up to 2 GHz

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    @contextlib.contextmanager
    def capture(self) -> Iterator[_GpuGraph]:
        graph = _GpuGraph()
        with torch.cuda.graph(graph.graph):  # capture_error_mode "global", torch's default
            yield graph


class _GpuGraph:
    def __init__(self) -> None:
        self.graph = torch.cuda.CUDAGraph()

    def replay(self) -> None:
        self.graph.replay()

    def destroy(self) -> None:
        del self.graph


class _Model:
    torch_device = "cpu"

    def __init__(self) -> None:
        import nccl_model_cuda

        self._fake = nccl_model_cuda
        self._driver: ctypes.CDLL | None = None
        self._side: ctypes.c_void_p | None = None

    def install(self) -> None:
        self._fake.install()
        self._driver = self._fake.driver()
        self._ctx = ctypes.c_void_p()
        assert self._driver.cuCtxGetCurrent(ctypes.byref(self._ctx)) == 0
        self._driver.cuStreamQuery.argtypes = [ctypes.c_void_p]
        self._driver.mpfake_cuda_sleep.argtypes = [ctypes.c_void_p, ctypes.c_uint]

    @property
    def driver(self) -> ctypes.CDLL:
        assert self._driver is not None, "target.install() first"
        return self._driver

    def _stream(self) -> int:
        return torch.cuda.current_stream().cuda_stream

    def own(self, t: torch.Tensor) -> torch.Tensor:
        return self._fake.on_device(t)

    def wait_stream(self) -> None:
        assert self.driver.cuStreamSynchronize(self._stream()) == 0

    def synchronize(self) -> None:
        self.wait_stream()

    def stream_idle(self) -> bool:
        return self.driver.cuStreamQuery(self._stream()) == 0

    def sleep(self, seconds: float) -> None:
        assert self.driver.mpfake_cuda_sleep(self._stream(), int(seconds * 1000)) == 0

    def empty_cache(self) -> None:
        pass

    @contextlib.contextmanager
    def capture(self) -> Iterator[_ModelGraph]:
        """As torch.cuda.graph does: a side stream captures in the global mode, then the
        previous current stream is current again."""
        cuda = self.driver
        before = self._stream()
        if self._side is None:
            self._side = self._fake.side_stream(cuda)
        assert self._side.value is not None
        self._fake.use_stream(self._side.value)
        graph = _ModelGraph(cuda, before, self._ctx)
        assert cuda.cuStreamBeginCapture_v2(self._side, 0) == 0
        try:
            yield graph
        finally:
            raw = ctypes.c_void_p()
            ended = cuda.cuStreamEndCapture(self._side, ctypes.byref(raw))
            self._fake.use_stream(before)
        assert ended == 0, f"cuStreamEndCapture: {ended}"
        graph.instantiate(raw)


class _ModelGraph:
    def __init__(self, cuda: ctypes.CDLL, stream: int, ctx: ctypes.c_void_p) -> None:
        self.cuda, self.stream, self.ctx = cuda, stream, ctx
        self.raw: ctypes.c_void_p | None = None
        self.exe: ctypes.c_void_p | None = None

    def instantiate(self, raw: ctypes.c_void_p) -> None:
        exe = ctypes.c_void_p()
        assert self.cuda.cuGraphInstantiateWithFlags(ctypes.byref(exe), raw, 0) == 0
        self.raw, self.exe = raw, exe

    def replay(self) -> None:
        assert self.cuda.cuGraphLaunch(self.exe, self.stream) == 0

    def destroy(self) -> None:
        if self.exe is not None:
            assert self.cuda.cuCtxSetCurrent(self.ctx) == 0  # any thread may destroy it, as with torch
            assert self.cuda.cuGraphExecDestroy(self.exe) == 0 and self.cuda.cuGraphDestroy(self.raw) == 0
            self.raw = self.exe = None

    def __del__(self) -> None:
        self.destroy()


def make() -> Any:
    """The target this process runs on (MP_GPU_TARGET)."""
    return _Model() if on_model() else _Gpu()
