"""The watchdog: one thread per process that keeps every NCCL communicator from hanging silently.

On a GPU, Request.wait() only makes the current stream wait, so nothing in the host ever times
an op whose peer never posts: the stream stalls and the job hangs in the next host sync,
outside this package. Every POLL_SECONDS the watchdog asks each NCCL communicator
(`comm.watchdog_check()`) whether device work has been pending past its timeout or NCCL has
reported an asynchronous error. When one has, in this order:

1. the abort is published to the peers through the store, and then the communicator's lane
   communicators are aborted, which unblocks the stalled streams (both done by watchdog_check;
   ncclCommAbort itself runs on a thread of its own and may outlive the call);
2. the flight recorder is dumped, when MEGATRON_P2P_TRACE_DIR is set;
3. the report (the pending ops, naming ranks and ops) is logged at error level;
4. with MEGATRON_P2P_ASYNC_ERROR_HANDLING=end, the process ends with status EXIT_STATUS, as
   torch's TORCH_NCCL_ASYNC_ERROR_HANDLING does, so that torchrun tears the job down: a stalled
   CUDA stream may never recover. "raise" keeps the process; the communicator's next call
   raises P2PTimeoutError or PeerFailureError with the report. The default is "end" under
   torchrun and "raise" otherwise.

The same thread carries aborts from the peers (AbortRelay.relayed) to their communicators, and
finds a dead peer within a poll instead of at the timeout (nccl.PeerWatch): a peer on this
machine whose process is gone, or the store's host gone. It aborts the communicator, naming the
rank, when an op is pending on the dead peer (on anyone, for the store), and then reports and
ends the process as above; else it waits, so that a job whose ranks have finished ends quietly
however its processes exit: an op posted to the dead peer later is found at the next poll, and a
communicator whose store is gone is aborted quietly, failing its next call.

At interpreter exit the thread is stopped and joined before finalization begins: a daemon thread
that returns from a store call (torch's bindings release the GIL) while the interpreter
finalizes is ended by pthread_exit, whose unwinding through the bindings' noexcept destructor
calls std::terminate, and the rank would end with SIGABRT after its work had succeeded.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import weakref

import torch.distributed as dist

from . import _C, _env, _registry, flight_recorder, nccl
from ._stall import StallWatch

ENV_HANDLING = "MEGATRON_P2P_ASYNC_ERROR_HANDLING"
HANDLINGS = _env.BY_NAME[ENV_HANDLING].choices  # ("end", "raise")
POLL_SECONDS = 0.1
EXIT_JOIN_SECONDS = 5.0  # bounds the exit on a store call that blocks (one poll takes microseconds)
EXIT_STATUS = os.EX_SOFTWARE  # 70: what torchrun reports for the rank that ended the job

_log = logging.getLogger(__name__)


def handling() -> str:
    """What a watchdog finding does to the process: MEGATRON_P2P_ASYNC_ERROR_HANDLING, or its
    default ("end" under torchrun, "raise" otherwise). ValueError names a wrong value."""
    value = _env.choice(ENV_HANDLING)
    if value is None:
        return "end" if os.environ.get("TORCHELASTIC_RUN_ID") else "raise"
    return value


class _Watched:
    def __init__(self, comm: _C.Communicator, relay: nccl.AbortRelay, peers: nccl.PeerWatch | None,
                 stall: StallWatch | None):
        self.comm = weakref.ref(comm)
        self.relay = relay
        self.peers = peers
        self.stall = stall
        self.lost = False  # aborted for a lost peer or store: nothing more to find

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
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    def watch(self, comm: _C.Communicator, relay: nccl.AbortRelay, peers: nccl.PeerWatch | None = None,
              stall: StallWatch | None = None) -> None:
        """Watches `comm` until it is closed or dropped. watchdog_check() publishes what it finds
        to the peers itself (the communicator's on_abort); `relay.relayed()` returns the global
        rank that aborted and why (an nccl.Relayed), once a peer has published an abort; `peers`
        finds dead peers; `stall` names the deadlocks of a stalled communicator."""
        handling()  # a wrong setting fails at creation, not when the watchdog fires
        with self._lock:
            self._watched.append(_Watched(comm, relay, peers, stall))
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
        if comm is None or comm.closed or w.lost:
            return
        try:
            told = w.relay.relayed()
        except Exception:  # noqa: BLE001 - the store failed: the job is ending
            told = None
        if told is not None:
            if told.peer_failed:
                nccl.abort_for_peer(comm, told.rank, told.message)
            elif comm.global_rank in told.deadlock:  # in the cycle a peer found: the same verdict
                comm.abort(rank=told.rank, reason=told.report, deadlock=True)
            else:
                comm.abort(rank=told.rank, reason=told.message)
            return
        loss = w.peers.loss() if w.peers is not None else None
        found = comm.watchdog_check()  # also finishes the ops whose device work has completed
        if found is None and loss is not None:
            self._lost(w, comm, loss)
        if found is None and loss is None and w.stall is not None:
            self._deadlock(w, comm)
        if found is None:
            return
        report = str(found)
        flight_recorder.dump(comm, "watchdog", error=f"{type(found).__name__}: {report}")
        self._report(report)

    def _deadlock(self, w: _Watched, comm: _C.Communicator) -> None:
        """A certain wait-for cycle through this rank (_stall.StallWatch): the verdict goes to the
        peers with its cycle, whose ranks raise the same DeadlockError, then aborts here."""
        try:
            found = w.stall.check(comm) if w.stall is not None else None
        except dist.DistError:
            return  # the store failed: the peers' loss is found by PeerWatch
        if found is None:
            return
        cycle, report = found
        w.relay.publish(report, deadlock=cycle)
        comm.abort(reason=report, deadlock=True)
        flight_recorder.dump(comm, "watchdog", error=f"DeadlockError: {report}")
        self._report(f"rank {comm.global_rank}: {report}")

    def _lost(self, w: _Watched, comm: _C.Communicator, loss: nccl.Loss) -> None:
        """A peer's process or the store's host is gone: aborts `comm` when an op is pending on
        it (any op, for the store), reporting as for a timeout; quietly when the store is gone and
        nothing is pending (a finished job whose store's host exited first); else waits."""
        pending = [op for op in comm.recent_ops() if op["state"] in ("posted", "matched")]
        hit = pending if loss.store_gone else [op for op in pending if op["peer"] in loss.dead]
        if not hit and not loss.store_gone:
            return  # nothing waits on the dead peer (yet)
        w.lost = True
        if not hit:
            nccl.abort_for_peer(comm, loss.rank, loss.reason)
            _log.info("megatron_p2p watchdog: rank %d: %s; nothing was pending, the next call fails",
                      comm.global_rank, loss.reason)
            return
        ops = "; ".join(f"{op['label']} {'to' if op['kind'] == 'send' else 'from'} rank {op['peer']}" for op in hit)
        report = (f"rank {comm.global_rank}: {loss.reason}; the communicator is aborted, failing its "
                  f"{len(hit)} pending op(s): {ops}")
        if w.peers is not None:
            w.peers.tell(loss)  # the peers first, as for every abort: some may be on other machines
        nccl.abort_for_peer(comm, loss.rank, loss.reason)
        flight_recorder.dump(comm, "watchdog", error=f"PeerFailureError: {report}")
        self._report(report)

    def _report(self, report: str) -> None:
        """Logs a finding and, under "end", ends the process."""
        _log.error("megatron_p2p watchdog: %s", report)
        if handling() == "end":
            _log.error("megatron_p2p watchdog: ending the process (%s=end)", ENV_HANDLING)
            for h in logging.getLogger().handlers + _log.handlers:
                h.flush()
            sys.stderr.flush()
            os._exit(EXIT_STATUS)


_THE_WATCHDOG = Watchdog()
_registry.at_exit(_registry.EXIT_STOP, _THE_WATCHDOG.stop)  # after the closes


def watch(comm: _C.Communicator, relay: nccl.AbortRelay, peers: nccl.PeerWatch | None = None,
          stall: StallWatch | None = None) -> None:
    """Puts `comm` under the process's watchdog (see Watchdog.watch)."""
    _THE_WATCHDOG.watch(comm, relay, peers, stall)
