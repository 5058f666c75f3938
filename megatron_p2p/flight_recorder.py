"""Trace dumps: with MEGATRON_P2P_TRACE_DIR set, every communicator's flight recorder
(`comm.recent_ops()`) is written there as JSON when a P2PError is raised, when the NCCL
watchdog aborts the communicator, at interpreter exit, and on SIGUSR1, on every backend.
`python -m megatron_p2p.trace DIR` merges a job's dumps.

One file per rank and communicator, `<dir>/rank<global rank>.<comm.id>.json`, replaced
atomically by each later dump; the format is documented in docs/trace-format.md."""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import _env, _registry

ENV = "MEGATRON_P2P_TRACE_DIR"
FORMAT = "megatron_p2p.trace/1"
REASONS = ("error", "exit", "signal", "watchdog", "stall")

_log = logging.getLogger(__name__)
_lock = threading.Lock()
_last_error: dict[str, str] = {}  # communicator id -> the last P2PError raised on it
_hooks_installed = False
_previous_sigusr1: Any = None


def trace_dir() -> Path | None:
    """The dump directory named by MEGATRON_P2P_TRACE_DIR (created if missing), or None when
    the variable is unset or empty. Raises ValueError naming the variable when it cannot be used."""
    return _env.directory(ENV)


def install(comm: Any) -> None:
    """Makes `comm` dump its flight recorder on P2PError, at exit and on SIGUSR1 when
    MEGATRON_P2P_TRACE_DIR is set; does nothing otherwise."""
    if trace_dir() is None:  # a bad directory fails here, not in an error path later
        return
    ref = weakref.ref(comm)  # comm.on_error holding comm itself would be a cycle through the C type

    def on_error(exc: BaseException) -> None:
        target = ref()
        if target is not None:
            _last_error[target.id] = f"{type(exc).__name__}: {exc}"
            dump(target, "error")

    if not _registry.keep_to_exit(comm):  # kept, so that one closed and dropped early gets its exit dump
        return
    comm.on_error = on_error
    _install_hooks()


def dump(comm: Any, reason: str, error: str | None = None) -> Path | None:
    """Writes `comm`'s flight recorder to MEGATRON_P2P_TRACE_DIR and returns the file, or None
    when the variable is unset or the dump failed (logged as a warning, never raised: this runs
    inside error paths). `error` defaults to the last P2PError raised on `comm`, so an exit dump
    keeps it."""
    if reason not in REASONS:
        raise ValueError(f"reason must be one of {REASONS}, got {reason!r}")
    try:
        directory = trace_dir()
        if directory is None:
            return None
        record = to_record(comm, reason, error if error is not None else _last_error.get(comm.id))
        path = directory / f"rank{record['rank']}.{record['communicator']}.json"
        tmp = directory / f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp"
        tmp.write_text(_to_json(record))
        os.replace(tmp, path)
        _log.warning("megatron_p2p: wrote the flight recorder of communicator %s (%s) to %s", record["communicator"],
                     reason, path)
        return path
    except Exception as exc:  # noqa: BLE001 - a failed dump must not replace the error being reported
        _log.warning("megatron_p2p: could not write the trace dump (%s): %s", reason, exc)
        return None


def dump_all(reason: str) -> list[Path]:
    """Dumps every communicator installed in this process; returns the files written."""
    return [p for p in (dump(c, reason) for c in _registry.kept_to_exit()) if p is not None]


def to_record(comm: Any, reason: str, error: str | None = None) -> dict[str, Any]:
    """What a dump holds (docs/trace-format.md): also what a stalled NCCL rank publishes."""
    return {
        "format": FORMAT,
        "communicator": comm.id,
        "rank": comm.global_rank,
        "group_rank": comm.rank,
        "size": comm.size,
        "ranks": list(comm.ranks),
        "backend": comm.backend,
        "lanes": comm.lanes,
        "eager_threshold": comm.eager_threshold,
        "buffered_at_most": comm.buffered_at_most,
        "pid": os.getpid(),
        "hostname": socket.gethostname(),
        "reason": reason,
        "error": error,
        "time": time.time(),
        "ops": comm.recent_ops(),
    }


def _to_json(record: dict[str, Any]) -> str:
    """One op per line: dumps are read by people as well as by the analyser."""
    header = {k: v for k, v in record.items() if k != "ops"}
    ops = ",\n".join("  " + json.dumps(op) for op in record["ops"])
    head = json.dumps(header, indent=1)[:-2]  # drop the closing "\n}"
    return f'{head},\n "ops": [\n{ops}\n ]\n}}\n'


def _install_hooks() -> None:
    global _hooks_installed, _previous_sigusr1
    with _lock:
        if _hooks_installed:
            return
        _hooks_installed = True
    _registry.at_exit(_registry.EXIT_DUMP, lambda: dump_all("exit"))  # before the closes
    try:
        _previous_sigusr1 = signal.signal(signal.SIGUSR1, _on_sigusr1)
    except ValueError:  # not the main thread: Python handlers can only be set from there
        _log.warning("megatron_p2p: %s is set but SIGUSR1 dumps need init_communicator on the main thread", ENV)


def _on_sigusr1(signum: int, frame: Any) -> None:
    dump_all("signal")
    previous: Callable[[int, Any], Any] | None = _previous_sigusr1
    if callable(previous):
        previous(signum, frame)
