"""The process's live communicators, in one place, and the one exit hook that releases them.

Every communicator init_communicator makes is entered here, weakly: dropping it frees it as
usual. Two uses hold one strongly, each until it no longer needs it:
- register_communicator names a communicator for its ranks (ops.find_communicator resolves a
  group through it) until it is closed or another is named for the same ranks;
- the flight recorder keeps one it traces until exit, so that a communicator closed and dropped
  early still gets its exit dump.

At interpreter exit one hook runs the modules' parts in this order, whatever the order they
were imported in: the flight recorder's exit dumps (EXIT_DUMP, while the ops are still there to
read), close() of every open communicator (EXIT_CLOSE: a rank that exits with its communicators
closed is not reported to its peers as dead), then the watchdog thread's stop (EXIT_STOP: after
the closes, so that nothing it watches is left open).
"""
from __future__ import annotations

import atexit
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._C import Communicator

EXIT_DUMP, EXIT_CLOSE, EXIT_STOP = range(3)  # the exit hook's stages, in the order they run

_lock = threading.Lock()
_live: weakref.WeakSet[Communicator] = weakref.WeakSet()
_named: dict[tuple[int, ...], Communicator] = {}
_closed_named: set[tuple[int, ...]] = set()  # ranks whose named communicator was closed and let go
_kept_to_exit: list[Communicator] = []
_at_exit: dict[int, list[Callable[[], object]]] = {EXIT_DUMP: [], EXIT_CLOSE: [], EXIT_STOP: []}


def add(comm: Communicator) -> None:
    """Enters a communicator init_communicator made."""
    with _lock:
        _live.add(comm)


def live() -> list[Communicator]:
    """Every communicator entered and not yet freed, open or closed."""
    with _lock:
        return list(_live)


def name(comm: Communicator) -> None:
    """Names `comm` for its ranks (register_communicator), in place of any named before."""
    with _lock:
        _named[tuple(comm.ranks)] = comm
        _closed_named.discard(tuple(comm.ranks))


def named(ranks: tuple[int, ...]) -> Communicator | None:
    """The communicator named for exactly `ranks`, while it is open."""
    with _lock:
        comm = _named.get(ranks)
        if comm is not None and comm.closed:
            del _named[ranks]  # closed: no longer kept
            _closed_named.add(ranks)
            comm = None
        return comm


def was_closed(ranks: tuple[int, ...]) -> bool:
    """Whether a communicator over exactly `ranks` was named and closed, or is closed and alive."""
    with _lock:
        return ranks in _closed_named or any(c.closed and tuple(c.ranks) == ranks for c in _live)


def keep_to_exit(comm: Communicator) -> bool:
    """Keeps `comm` alive until exit; False when it already was."""
    with _lock:
        if any(c is comm for c in _kept_to_exit):
            return False
        _kept_to_exit.append(comm)
        return True


def kept_to_exit() -> list[Communicator]:
    with _lock:
        return list(_kept_to_exit)


def at_exit(stage: int, fn: Callable[[], object]) -> None:
    """Runs `fn` at interpreter exit in `stage` (EXIT_DUMP, EXIT_CLOSE or EXIT_STOP)."""
    with _lock:
        _at_exit[stage].append(fn)


@atexit.register
def _exit() -> None:
    for stage in (EXIT_DUMP, EXIT_CLOSE, EXIT_STOP):
        with _lock:
            parts = list(_at_exit[stage])
        for fn in parts:
            fn()
