"""The NCCL backend's Python side: finding libnccl, and what init_communicator needs for it."""
from __future__ import annotations

import functools
import importlib.util
import json
import os
import warnings
from typing import Callable, NamedTuple, Optional

import torch
import torch.distributed as dist

from . import _C

ENV_LIBRARY = "MEGATRON_P2P_NCCL_LIBRARY"


class NcclVersion(NamedTuple):
    """The libnccl this process uses: version (major, minor, patch), NCCL's version code, the
    file, and how it was found ("env", "loaded", "bundled" or "system")."""

    version: tuple[int, int, int]
    code: int
    path: str
    source: str


def bundled_libraries() -> list[str]:
    """libnccl.so.2 files of the nvidia-nccl wheels in this Python environment, torch's first."""
    dirs = [os.path.join(os.path.dirname(os.path.dirname(torch.__file__)), "nvidia", "nccl")]
    spec = importlib.util.find_spec("nvidia.nccl") if importlib.util.find_spec("nvidia") else None
    if spec and spec.submodule_search_locations:
        dirs += list(spec.submodule_search_locations)
    found: list[str] = []
    for d in dirs:
        path = os.path.realpath(os.path.join(d, "lib", "libnccl.so.2"))
        if os.path.isfile(path) and path not in found:
            found.append(path)
    return found


def _split(code: int) -> tuple[int, int, int]:
    if code < 10000:  # the scheme of releases up to 2.8
        return code // 1000, code % 1000 // 100, code % 100
    return code // 10000, code % 10000 // 100, code % 100


@functools.lru_cache(maxsize=1)
def nccl_version() -> NcclVersion:
    """Loads libnccl (once per process) and says which one: see NcclVersion.

    The search order: $MEGATRON_P2P_NCCL_LIBRARY (and nothing else when it is set), the copy
    already loaded in the process (torch's), the nvidia-nccl wheel torch depends on, then
    libnccl.so.2 on the system path. Raises BackendUnavailableError when none can be used.
    Warns when torch reports a different NCCL: two copies in one process cannot share
    communicators.
    """
    code, path, source = _C.nccl_load(os.environ.get(ENV_LIBRARY) or None, bundled_libraries())
    found = NcclVersion(_split(code), code, path, source)
    torch_version = _torch_nccl_version()
    if torch_version is not None and torch_version != found.version:
        warnings.warn(
            f"megatron_p2p loaded NCCL {'.'.join(map(str, found.version))} from {path}, but torch uses NCCL "
            f"{'.'.join(map(str, torch_version))}; two libnccl copies in one process cannot share communicators. "
            f"Unset {ENV_LIBRARY} or point it at torch's copy.",
            RuntimeWarning,
            stacklevel=2,
        )
    return found


def _torch_nccl_version() -> Optional[tuple[int, int, int]]:
    if not torch.cuda.is_available():
        return None
    try:
        v = torch.cuda.nccl.version()
    except (RuntimeError, AttributeError):
        return None
    return tuple(v) if isinstance(v, tuple) else _split(int(v))  # type: ignore[return-value]


def requested_device(device: "torch.device | str | int | None", backend: str) -> torch.device:
    """The device a communicator serves: the given one (an int is a CUDA ordinal); else a CUDA
    device for "nccl", and for "auto" when CUDA is available; else the CPU."""
    if device is None:
        wants_cuda = backend == "nccl" or (backend == "auto" and torch.cuda.is_available())
        return torch.device("cuda" if wants_cuda else "cpu")
    try:
        return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except RuntimeError as e:  # torch's word for a malformed device
        raise ValueError(f"device {device!r} names no device: {e}") from None


def require_gpu(device: torch.device) -> torch.device:
    """`device` with its index filled in; BackendUnavailableError, saying what is missing and
    what to do, when NCCL cannot run here."""
    if device.type != "cuda":
        raise ValueError(f"backend 'nccl' carries CUDA tensors; device {device} is not a CUDA device")
    if not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise _C.BackendUnavailableError(
            f"backend 'nccl' needs a CUDA GPU, and {why} (torch.cuda.is_available() is False). "
            "Use backend='shm' (or 'auto') for CPU tensors, or run on a GPU machine with a CUDA build of torch."
        )
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise ValueError(f"device {device} does not exist: {torch.cuda.device_count()} CUDA device(s) visible")
    return torch.device("cuda", index)


def stream_handle(device: int) -> Callable[[], int]:
    """The communicator's view of the caller's current stream on `device`."""
    current = torch.cuda.current_stream
    return lambda: current(device).cuda_stream


class AbortRelay:
    """Carries an abort between the ranks of an NCCL communicator through the store, which
    NCCL itself never does: a rank that gives up writes the key; the watchdog of every rank
    polls it."""

    def __init__(self, store, key: str, rank: int):
        self._store = store
        self._key = key
        self._rank = rank  # this process's global rank: the cause its peers will name

    def publish(self, message: Optional[str]) -> None:
        try:
            self._store.set(self._key, json.dumps({"rank": self._rank, "message": message or "aborted"}).encode())
        except dist.DistError:
            pass  # the store's host is gone: the job is ending, and its peers learn of it themselves

    def relayed(self) -> Optional[tuple[int, str]]:
        """The global rank that published an abort and the first line of its reason, or None while
        none has."""
        if not self._store.check([self._key]):
            return None
        told = json.loads(self._store.get(self._key))
        return int(told["rank"]), str(told["message"]).split("\n", 1)[0]
