"""Creating a communicator: the group's rank 0 makes a unique id, the torch.distributed store
carries it to the other ranks, and every rank attaches."""
from __future__ import annotations

import functools
import logging
import os
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from . import _C, _env, _registry, _watchdog, flight_recorder, nccl
from ._stall import StallWatch

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence
    from typing import TypedDict

    # torch.distributed imports Store without re-exporting it; distributed_c10d lists it in __all__.
    from torch.distributed.distributed_c10d import Store

    class _CommonArgs(TypedDict):
        """The Communicator arguments both backends get."""

        lanes: int
        timeout: float
        peer_failed: Callable[[], str | None]

BACKENDS = ("shm", "nccl", "auto")
LANES = tuple(range(1, _C.MAX_LANES + 1))
ENV_ARENA_BYTES = "MEGATRON_P2P_SHM_ARENA_BYTES"
ENV_SINGLE_COPY = "MEGATRON_P2P_SHM_SINGLE_COPY"
ENV_CHECK = "MEGATRON_P2P_CHECK"
_STORE_PREFIX = "megatron_p2p"
# Creation polls the store for the other ranks' keys, backing off to this period, so that Ctrl-C (any
# Python signal handler) gets a turn while it waits. (A timed-out store.wait() logs a warning.)
_STORE_POLL_MAX = 0.01
_log = logging.getLogger(__name__)
_told_no_single_copy = False


def _arena_bytes(given: int | None) -> int:
    """The arena size an shm communicator gets: `given`, else $MEGATRON_P2P_SHM_ARENA_BYTES, else
    the default; an error names where a wrong value came from."""
    if given is None:
        return _env.nbytes(ENV_ARENA_BYTES)
    # Checked here, not only by the C binding: its unsigned conversion wraps -1 and takes True.
    if isinstance(given, bool) or not isinstance(given, int) or not 0 <= given <= _C.MAX_ARENA_BYTES:
        raise ValueError(f"arena_bytes must be an int in [0, {_C.MAX_ARENA_BYTES}], got {given!r}")
    return given


def _store_and_ranks(group: dist.ProcessGroup | None) -> tuple[Store, int, list[int]]:
    """The store to bootstrap through, this process's global rank, and the group's global ranks."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None, not {type(group).__name__}")
    if dist.is_initialized():
        store = dist.distributed_c10d._get_default_store()
        me = dist.get_rank()
        ranks = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
        if me not in ranks:
            raise ValueError(f"global rank {me} is not a member of the group {ranks}")
        return store, me, ranks
    if group is not None:
        raise ValueError("a group was given but torch.distributed is not initialised")
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if v not in os.environ]
    if missing:
        raise RuntimeError(
            "init_communicator needs torch.distributed initialised or torchrun's environment; "
            f"missing {', '.join(missing)}"
        )
    store, me, world = _env_rendezvous()
    return store, me, list(range(world))


def _store_get(store: Store, key: str, timeout: float, rank: int, rank0_pid: int | None) -> bytes:
    """The value of `key` once global rank `rank` has set it. A store that is gone means its host
    died: rank 0's process, or torchrun's agent; either way the group cannot form."""
    deadline = time.monotonic() + timeout
    pause = 0.001
    try:
        while not store.check([key]):
            if time.monotonic() >= deadline:
                raise _C.P2PTimeoutError(f"rank {rank} did not reach init_communicator within {timeout:g} s "
                                         f"(store key {key})")
            time.sleep(pause)
            pause = min(2 * pause, _STORE_POLL_MAX)
        return store.get(key)
    except dist.DistNetworkError as e:
        host = f"rank 0 (pid {rank0_pid})" if rank0_pid is not None else "rank 0 (pid not yet published)"
        raise _C.PeerFailureError(
            f"the torch.distributed store is gone while waiting for rank {rank}: its host exited ({host}, or "
            f"torchrun's agent where the job uses its store) ({e})"
        ) from None


@functools.lru_cache(maxsize=1)
def _env_rendezvous() -> tuple[Store, int, int]:
    """torchrun's store, reached once per process (each rendezvous costs a round of connects)."""
    # Imported here, as torch.distributed does only where it is available; its handlers are unannotated.
    from torch.distributed.rendezvous import rendezvous

    handler: Iterator[tuple[Store, int, int]] = rendezvous("env://")
    return next(handler)


def init_communicator(
    group: dist.ProcessGroup | None = None,
    backend: str = "shm",
    timeout: float = 300.0,
    *,
    lanes: int = 2,
    eager_threshold: int = 0,
    device: torch.device | str | int | None = None,
    high_priority: bool = False,
    arena_bytes: int | None = None,
) -> _C.Communicator:
    """Creates a communicator over `group` (None: every rank). Collective: every member calls it.

    backend: "shm" (processes on one host, CPU tensors), "nccl" (CUDA tensors: NCCL grouped
        send/recv on CUDA streams), or "auto" (nccl for a CUDA device, shm for the CPU).
    timeout: seconds any wait may block before raising P2PTimeoutError and aborting.
    lanes: 2 runs forward ops (send_next / recv_prev) and backward ops on independent queues
        (NCCL: two communicators, two streams); 1 runs everything on one queue, as megatron-core
        does on one stream.
    eager_threshold: shm only. Sends up to this many bytes complete before their receive is
        posted (NCCL may buffer small sends; the default 0 is strict rendezvous, which exposes
        ordering bugs at every size).
    device: the tensors' device; None picks the current CUDA device when there is one, else
        the CPU. It decides "auto", and is the device an NCCL communicator serves.
    high_priority: nccl only. Lane streams get the device's greatest stream priority, so that
        communication kernels are scheduled ahead of compute.
    arena_bytes: shm only. Size of this rank's receive arena: shared memory its peers map once,
        from which `comm.empty()` (and megatron-core's receive buffers, through P2PCommunicator)
        allocates, so that a send into such a buffer is one copy by the sender. Only the blocks
        handed out take room in /dev/shm. None: $MEGATRON_P2P_SHM_ARENA_BYTES, else 1 GiB;
        0: no arena.
    """
    # These are checked before the collective part, although _C.Communicator checks most of them too
    # (in the same words where it does): a wrong argument must fail on the rank that passed it, at
    # once, not after this rank has joined the rendezvous that its peers then wait in.
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if lanes not in LANES:
        raise ValueError(f"lanes must be 1 (one ordered queue) or {_C.MAX_LANES} (one per direction), got {lanes!r}")
    if not isinstance(eager_threshold, int) or not 0 <= eager_threshold <= _C.MAX_EAGER_THRESHOLD:
        raise ValueError(f"eager_threshold must be an int in [0, {_C.MAX_EAGER_THRESHOLD}], got {eager_threshold!r}")
    if arena_bytes is not None:
        _arena_bytes(arena_bytes)
    shm_arena_bytes = 0  # the size an shm communicator gets, found below
    dev = nccl.requested_device(device, backend)
    if backend == "auto":
        backend = "nccl" if dev.type == "cuda" else "shm"
    if backend == "nccl":
        if eager_threshold:
            raise ValueError("eager_threshold is a property of the shm backend; NCCL decides its own buffering")
        if arena_bytes:
            raise ValueError("arena_bytes is a property of the shm backend: NCCL receives into device memory")
        dev = nccl.require_gpu(dev)
        nccl.nccl_version()  # loads libnccl, or says why it cannot
    elif dev.type != "cpu":
        raise ValueError(f"backend 'shm' carries CPU tensors; device {dev} needs backend 'nccl' or 'auto'")
    else:
        shm_arena_bytes = _arena_bytes(arena_bytes)
    # Each backend's variable, read before the collective part too: a wrong value fails here.
    single_copy = backend == "shm" and _env.flag(ENV_SINGLE_COPY)
    check = _env.flag(ENV_CHECK)

    store, me, ranks = _store_and_ranks(group)
    group_rank = ranks.index(me)
    base = f"{_STORE_PREFIX}/{'-'.join(map(str, ranks))}"
    # Creation is collective and ends in a barrier inside the transport, so the n-th call of
    # every member lands in the same generation.
    generation = (store.add(f"{base}/count", 1) - 1) // len(ranks)
    key = f"{base}/{generation}/id"
    # Every rank's pid, so that a rank that dies before attaching is reported by name and pid.
    pid_key = f"{base}/{generation}/pid"
    proc_key = f"{base}/{generation}/proc"  # NCCL: what the watchdog needs to see a local peer die
    if backend == "nccl":
        identity = nccl.ProcessIdentity.this_process().encode()
        store.set(f"{proc_key}/{group_rank}", identity)  # type: ignore[arg-type]  # torch's stub says str; bytes work
    store.set(f"{pid_key}/{group_rank}", str(os.getpid()))
    if group_rank == 0:
        pids = [int(_store_get(store, f"{pid_key}/{r}", timeout, g, os.getpid())) for r, g in enumerate(ranks)]
        unique_id = _C.new_unique_id() if backend == "shm" else b"".join(_C.nccl_unique_id() for _ in range(lanes))
        store.set(key, unique_id)  # type: ignore[arg-type]  # nccl's is bytes, which Store.set takes
    else:
        rank0_pid = int(_store_get(store, f"{pid_key}/0", timeout, ranks[0], None))
        unique_id = _store_get(store, key, timeout, ranks[0], rank0_pid)
        pids = [int(_store_get(store, f"{pid_key}/{r}", timeout, g, rank0_pid)) for r, g in enumerate(ranks)]
        if backend == "shm":
            unique_id = unique_id.decode()
    failures = _CreationFailures(store, f"{base}/{generation}/failed", group_rank, ranks)
    common: _CommonArgs = dict(lanes=lanes, timeout=float(timeout), peer_failed=failures.of_peers)
    try:
        if backend == "shm":
            comm = _C.Communicator(
                "shm", unique_id, group_rank, ranks, eager_threshold=eager_threshold,
                single_copy=single_copy, pids=pids, arena_bytes=shm_arena_bytes, check=check,
                **common,
            )
        else:
            # Each rank set its proc key before its pid key, and every pid key has been read.
            procs = [nccl.ProcessIdentity.decode(_store_get(store, f"{proc_key}/{r}", timeout, g, pids[0]))
                     for r, g in enumerate(ranks)]
            relay = nccl.AbortRelay(store, f"{base}/{generation}/abort", me)
            peers = nccl.PeerWatch(relay, procs[group_rank], dict(zip(ranks, procs)))
            stall = StallWatch(store, f"{base}/{generation}/stall", ranks, me)  # a wrong setting fails here
            with torch.cuda.device(dev.index):
                comm = _C.Communicator(
                    "nccl", unique_id, group_rank, ranks, device=dev.index, stream=nccl.stream_handle(dev.index),
                    high_priority=high_priority, on_abort=relay.publish,
                    check=check, **common,
                )
    except BaseException as e:
        failures.publish(e)
        raise
    if backend == "shm" and single_copy:
        _tell_if_no_single_copy(comm, ranks)
    if backend == "nccl":
        _watchdog.watch(comm, relay, peers, stall)
    _registry.add(comm)
    flight_recorder.install(comm)
    return comm


class _CreationFailures:
    """A member whose creation fails (no room in /dev/shm, no descriptors left, Ctrl-C) says so
    through the store, so that the others, still waiting for it to attach, stop at once with its
    reason instead of at the timeout."""

    def __init__(self, store: Store, key: str, rank: int, ranks: Sequence[int]) -> None:
        self._store, self._key, self._rank, self._ranks = store, key, rank, ranks
        self._from_peer = False

    def publish(self, error: BaseException) -> None:
        if self._from_peer:
            return  # the peer that failed first has said why
        try:
            self._store.set(f"{self._key}/{self._rank}", f"{type(error).__name__}: {error}")
            self._store.add(self._key, 1)
        except dist.DistError:
            pass  # the store is gone too: the others learn of it themselves

    def of_peers(self) -> str | None:
        """Polled while creation waits: why another member failed, or None."""
        try:
            if self._store.add(self._key, 0) == 0:
                return None
            for r, g in enumerate(self._ranks):
                key = f"{self._key}/{r}"
                if r != self._rank and self._store.check([key]):
                    self._from_peer = True
                    return (f"rank {g} could not create its side of the communicator, so this rank "
                            f"cannot either: {self._store.get(key).decode()}")
        except dist.DistError:
            pass  # a vanished store is reported where the pids and the segment are watched
        return None


def _tell_if_no_single_copy(comm: _C.Communicator, ranks: list[int]) -> None:
    """Once per process: single copy (process_vm_readv) was refused, e.g. by ptrace rules or a
    seccomp filter, so transfers take the bounce path through shared memory (two copies)."""
    global _told_no_single_copy
    refused = [ranks[p] for p in range(len(ranks)) if p != comm.rank and not comm.single_copy(ranks[p])]
    if refused and not _told_no_single_copy:
        _told_no_single_copy = True
        _log.warning(
            "megatron_p2p: single copy from ranks %s is refused by the kernel (process_vm_readv denied); "
            "their messages take the bounce path through shared memory (two copies)", refused,
        )


def _close_live() -> None:
    # A rank that exits with its communicator closed is not reported to its peers as dead.
    for comm in _registry.live():
        comm.close()


_registry.at_exit(_registry.EXIT_CLOSE, _close_live)
