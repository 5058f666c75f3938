"""The NCCL backend's Python side: finding libnccl, and what init_communicator needs for it."""
from __future__ import annotations

import functools
import importlib.util
import json
import os
import socket
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist

from . import _C, _env

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import Store  # torch.distributed does not re-export it

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
    code, path, source = _C.nccl_load(_env.path(ENV_LIBRARY), bundled_libraries())
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


def _torch_nccl_version() -> tuple[int, int, int] | None:
    if not torch.cuda.is_available():
        return None
    try:
        v = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
    except (RuntimeError, AttributeError):
        return None
    # (major, minor, patch), with the build's suffix (a str) after them when it has one
    return (v[0], v[1], v[2]) if isinstance(v, tuple) else _split(int(v))


def requested_device(device: torch.device | str | int | None, backend: str) -> torch.device:
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


class Relayed(NamedTuple):
    """An abort a peer published: the global rank it names as the cause, the first line of why,
    whether the cause is a process of the group (or the store's host) gone, and for a deadlock
    the global ranks of its cycle and the whole report."""

    rank: int
    message: str
    peer_failed: bool = False
    deadlock: tuple[int, ...] = ()
    report: str = ""


class AbortRelay:
    """Carries an abort between the ranks of an NCCL communicator through the store, which
    NCCL itself never does: a rank that gives up writes the key; the watchdog of every rank
    polls it. The first store call that finds the store's host gone is the last one made
    (torch prints a warning with a C++ stack for each): `store_gone` says why from then on."""

    def __init__(self, store: Store, key: str, rank: int):
        self._store = store
        self._key = key
        self._rank = rank  # this process's global rank: the cause its peers will name
        self.store_gone: str | None = None

    def publish(self, message: str | None, rank: int | None = None, peer_failed: bool = False,
                deadlock: tuple[int, ...] = ()) -> None:
        """Tells the peers; `rank` (default: this one) is the global rank their reports name;
        `deadlock`: the global ranks of the cycle `message` reports."""
        if self.store_gone is not None:
            return  # the job is ending, and its peers learn of it themselves
        told = {"rank": self._rank if rank is None else rank, "message": message or "aborted",
                "peer_failed": peer_failed, "deadlock": list(deadlock)}
        try:
            self._store.set(self._key, json.dumps(told).encode())  # type: ignore[arg-type]  # torch's stub: str only
        except dist.DistNetworkError as e:
            self._lost(e)
        except dist.DistError:
            pass

    def relayed(self) -> Relayed | None:
        """The abort a peer published, or None while none has (or once the store is gone)."""
        if self.store_gone is not None:
            return None
        try:
            if not self._store.check([self._key]):
                return None
            told = json.loads(self._store.get(self._key))
        except dist.DistNetworkError as e:
            self._lost(e)
            return None
        message = str(told["message"])
        return Relayed(int(told["rank"]), message.split("\n", 1)[0], bool(told.get("peer_failed")),
                       tuple(int(r) for r in told.get("deadlock", ())), message)

    def _lost(self, error: dist.DistNetworkError) -> None:
        self.store_gone = str(error).split("\n", 1)[0][:120]


# ---- dead peers ----------------------------------------------------------------------------------


def _stat(pid: int) -> tuple[bytes, int] | None:
    """The state letter and start time (clock ticks after boot) of process `pid`, from
    /proc/<pid>/stat; None when there is no such process. OSError when /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(b")") + 2:].split()  # the name, in parentheses, may hold anything
    return fields[0], int(fields[19])  # fields 3 (state) and 22 (starttime) of proc(5)


class ProcessIdentity(NamedTuple):
    """What each rank of an NCCL communicator publishes at creation, so that its peers on the
    same machine can tell at once that its process is gone."""

    pid: int
    host: str
    machine: str  # boot id and pid namespace: equal only where `pid` names the same process; "" if unknown
    start: int  # start time in clock ticks after boot: a reused pid has another

    @classmethod
    def this_process(cls) -> ProcessIdentity:
        host = socket.gethostname()
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                machine = f"{f.read().strip()}/{os.stat('/proc/self/ns/pid').st_ino}"
            start = _stat(os.getpid())[1]  # type: ignore[index]  # this process exists
        except (OSError, ValueError, IndexError):
            return cls(os.getpid(), host, "", 0)  # no /proc: no peer is watched
        return cls(os.getpid(), host, machine, start)

    def encode(self) -> bytes:
        return json.dumps(self._asdict()).encode()

    @classmethod
    def decode(cls, raw: bytes) -> ProcessIdentity:
        return cls(**json.loads(raw))

    def gone(self) -> bool:
        """Whether the process exited (a zombie not yet reaped has) or its pid now names another.
        Only meaningful on its own machine."""
        try:
            stat = _stat(self.pid)
        except (OSError, ValueError, IndexError):
            return False  # cannot tell: never report a live peer
        return stat is None or stat[0] in (b"Z", b"X") or stat[1] != self.start


# The kernel closes a dying process's sockets (exit_files) before it marks the process exited
# (exit_notify), so a store hosted by a rank here is found gone a moment before that rank is. A
# store found gone waits this long for a watched peer to be found gone too, which is then named
# as its host; after it, the host is no process of the group on this machine (another machine,
# or torchrun's agent), and the loss names no rank. Three of the watchdog's polls: a dying
# process's last steps take microseconds, and a busy machine delays them by a scheduler tick.
STORE_HOST_SETTLE_SECONDS = 0.3
NO_RANK = -1  # a Loss's rank when its cause is outside the group: abort(rank=-1) names no rank


class Loss(NamedTuple):
    """What PeerWatch.loss() found: the global rank to name as the cause (NO_RANK when only the
    store is known gone: never this one, which writes the report), why, the global ranks whose
    processes are gone, and whether the store's host is."""

    rank: int
    reason: str
    dead: frozenset[int]
    store_gone: bool


class PeerWatch:
    """What the watchdog polls besides the communicator: whether the process of a peer on this
    machine is gone (one read of /proc/<pid>/stat per peer), and whether the store's host is (the
    relay's poll found its connection closed). A peer on another machine is seen only through
    NCCL's errors, the relay, or the timeout."""

    def __init__(self, relay: AbortRelay, me: ProcessIdentity, peers: dict[int, ProcessIdentity],
                 clock: Callable[[], float] = time.monotonic):
        self._relay = relay
        self._local = {r: p for r, p in peers.items() if p.machine and p.machine == me.machine and p.pid != me.pid}
        self._dead: dict[int, ProcessIdentity] = {}
        self._clock = clock
        self._store_gone_at: float | None = None

    def loss(self) -> Loss | None:
        """None while every watched peer is there and the store answers, and for
        STORE_HOST_SETTLE_SECONDS after the store is first found gone while no peer is."""
        gone = self._relay.store_gone  # read before the processes: its host's death shows there later
        for r, p in self._local.items():
            if r not in self._dead and p.gone():
                self._dead[r] = p
        if not self._dead and gone is None:
            return None
        deaths = "; ".join(f"rank {r} (pid {p.pid} on {p.host}) is gone: its process exited"
                           for r, p in sorted(self._dead.items()))
        first = min(self._dead) if self._dead else NO_RANK
        if gone is None:
            return Loss(first, deaths, frozenset(self._dead), False)
        if not self._dead:
            now = self._clock()
            if self._store_gone_at is None:
                self._store_gone_at = now
            if now - self._store_gone_at < STORE_HOST_SETTLE_SECONDS:
                return None
            deaths = "no process of the group on this machine exited with it: no rank is named"
        reason = f"the torch.distributed store's host is gone ({gone})" + (f"; {deaths}" if deaths else "")
        return Loss(first, reason, frozenset(self._dead), True)

    def tell(self, loss: Loss) -> None:
        """Passes `loss` on to the peers through the relay (they may be on other machines)."""
        self._relay.publish(loss.reason, rank=loss.rank, peer_failed=True)


def abort_for_peer(comm: _C.Communicator, rank: int, reason: str) -> None:
    """Aborts `comm` naming global rank `rank` (NO_RANK: none, the cause is outside the group) as
    the cause: its failures are PeerFailureError quoting `reason`."""
    comm.abort(rank=rank, reason=reason, peer_failed=True)
