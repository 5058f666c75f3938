"""What a rank holds outside Python's objects, to show that a communicator leaves nothing
behind: its threads (Python's and the kernel's, which include the transport's C threads), its
open descriptors with what each one points at, and its mappings of shared-memory segments and
receive arenas (its own and its peers')."""
from __future__ import annotations

import os
import threading
from typing import Any


def _fd_targets() -> dict[str, str]:
    targets = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            targets[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the descriptor listdir itself used, closed by now
            pass
    return targets


def _shared_mappings() -> list[str]:
    """The package's shared-memory objects mapped here, one entry per mapping."""
    with open("/proc/self/maps") as maps:
        return sorted(line.split(None, 5)[5] for line in maps if "/dev/shm/mp2p-" in line)


def snapshot() -> dict[str, Any]:
    return {
        "python_threads": sorted(t.name for t in threading.enumerate()),
        "kernel_threads": len(os.listdir("/proc/self/task")),
        "fds": _fd_targets(),
        "mappings": _shared_mappings(),
    }


def left_behind(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What `after` holds that `before` did not; empty when nothing was left."""
    extra: dict[str, Any] = {}
    threads = sorted(set(after["python_threads"]) - set(before["python_threads"]))
    if threads:
        extra["python_threads"] = threads
    if after["kernel_threads"] > before["kernel_threads"]:
        extra["kernel_threads"] = after["kernel_threads"] - before["kernel_threads"]
    fds = {fd: t for fd, t in after["fds"].items() if before["fds"].get(fd) != t}
    if fds:
        extra["fds"] = fds
    mappings = sorted(set(after["mappings"]) - set(before["mappings"]))
    if mappings:
        extra["mappings"] = mappings
    return extra
