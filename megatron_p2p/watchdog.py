"""The watchdog: one thread per process that keeps every NCCL communicator from hanging silently.

On a GPU, Request.wait() only makes the current stream wait, so nothing in the host ever times
an op whose peer never posts: the stream stalls and the job hangs in the next host sync,
outside this package. Every POLL_SECONDS the watchdog asks each NCCL communicator
(`comm.watchdog_check()`) whether device work has been pending past its timeout or NCCL has
reported an asynchronous error. When one has, in this order:

1. the communicator's lane communicators are aborted (done by watchdog_check), which unblocks
   the stalled streams;
2. the flight recorder is dumped, when MEGATRON_P2P_TRACE_DIR is set;
3. the abort is published to the peers through the store;
4. the report (the pending ops, naming ranks and ops) is logged at error level;
5. with MEGATRON_P2P_ASYNC_ERROR_HANDLING=end, the process ends with status EXIT_STATUS, as
   torch's TORCH_NCCL_ASYNC_ERROR_HANDLING does, so that torchrun tears the job down: a stalled
   CUDA stream may never recover. "raise" keeps the process; the communicator's next call
   raises P2PTimeoutError or PeerFailureError with the report. The default is "end" under
   torchrun and "raise" otherwise.

The same thread carries aborts from the peers (AbortRelay.poll) to their communicators.

At interpreter exit the thread is stopped and joined before finalization begins: a daemon thread
that returns from a store call (torch's bindings release the GIL) while the interpreter
finalizes is ended by pthread_exit, whose unwinding through the bindings' noexcept destructor
calls std::terminate, and the rank would end with SIGABRT after its work had succeeded.
"""
from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import weakref
from typing import Callable, Optional

from . import _C, flight_recorder

ENV_HANDLING = "MEGATRON_P2P_ASYNC_ERROR_HANDLING"
HANDLINGS = ("end", "raise")
POLL_SECONDS = 0.1
EXIT_JOIN_SECONDS = 5.0  # bounds the exit on a store call that blocks (one poll takes microseconds)
EXIT_STATUS = os.EX_SOFTWARE  # 70: what torchrun reports for the rank that ended the job

_log = logging.getLogger(__name__)


def handling() -> str:
    """What a watchdog finding does to the process: MEGATRON_P2P_ASYNC_ERROR_HANDLING, or its
    default ("end" under torchrun, "raise" otherwise). ValueError names a wrong value."""
    value = os.environ.get(ENV_HANDLING, "")
    if not value:
        return "end" if os.environ.get("TORCHELASTIC_RUN_ID") else "raise"
    if value not in HANDLINGS:
        raise ValueError(f"{ENV_HANDLING}={value!r}: expected one of {', '.join(HANDLINGS)}")
    return value


class _Watched:
    def __init__(self, comm: "_C.Communicator", publish: Callable[[str], None],
                 relayed: Callable[[], Optional[tuple[int, str]]]):
        self.comm = weakref.ref(comm)
        self.publish = publish
        self.relayed = relayed

    def open(self) -> bool:
        """Whether its communicator is alive and not closed. A method, so that no reference to it
        outlives the call (a walrus in _run's comprehension would bind one in _run's frame for as
        long as the thread runs, and keep the last communicator from being freed)."""
        comm = self.comm()
        return comm is not None and not comm.closed


class Watchdog:
    """The process's watchdog thread and the communicators it watches (see the module's text)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: list[_Watched] = []
        self._thread: Optional[threading.Thread] = None
        self._stopping = threading.Event()

    def watch(self, comm: "_C.Communicator", publish: Callable[[str], None],
              relayed: Callable[[], Optional[tuple[int, str]]]) -> None:
        """Watches `comm` until it is closed or dropped. `publish(report)` tells the peers about an
        abort; `relayed()` returns the global rank that aborted and why, once a peer has published
        an abort."""
        handling()  # a wrong setting fails at creation, not when the watchdog fires
        with self._lock:
            self._watched.append(_Watched(comm, publish, relayed))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="megatron_p2p-watchdog", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        """Ends the thread and waits for it (bounded): run at interpreter exit, before finalization."""
        self._stopping.set()
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(EXIT_JOIN_SECONDS)

    def _run(self) -> None:
        while not self._stopping.is_set():
            with self._lock:
                self._watched = [w for w in self._watched if w.open()]
                watched = list(self._watched)
                if not watched:
                    self._thread = None
                    return
            for w in watched:
                if self._stopping.is_set():
                    return
                self._check(w)
            del watched
            self._stopping.wait(POLL_SECONDS)

    def _check(self, w: _Watched) -> None:
        comm = w.comm()
        if comm is None or comm.closed:
            return
        try:
            told = w.relayed()
        except Exception:  # noqa: BLE001 - the store is gone: the job is ending
            told = None
        if told is not None:
            comm.abort(rank=told[0], reason=told[1])
            return
        found = comm.watchdog_check()
        if found is None:
            return
        report = str(found)
        flight_recorder.dump(comm, "watchdog", error=f"{type(found).__name__}: {report}")
        try:
            w.publish(report)
        except Exception as exc:  # noqa: BLE001 - telling the peers is best effort
            _log.warning("megatron_p2p watchdog: could not publish the abort to the peers: %s", exc)
        _log.error("megatron_p2p watchdog: %s", report)
        if handling() == "end":
            _log.error("megatron_p2p watchdog: ending the process (%s=end)", ENV_HANDLING)
            for h in logging.getLogger().handlers + _log.handlers:
                h.flush()
            sys.stderr.flush()
            os._exit(EXIT_STATUS)


_watchdog = Watchdog()
# Registered before communicator.py's atexit close of live communicators, so it runs after it.
atexit.register(_watchdog.stop)


def watch(comm: "_C.Communicator", publish: Callable[[str], None],
          relayed: Callable[[], Optional[tuple[int, str]]]) -> None:
    """Puts `comm` under the process's watchdog (see Watchdog.watch)."""
    _watchdog.watch(comm, publish, relayed)
