"""Latency: a 2-rank ping-pong, reported as half the round trip (median and p99), through this
package (unpinned, and pinned: each rank with all its threads on a core of its own), through
torch.distributed gloo (isend/irecv and batch_isend_irecv), and the Python call floor: the same
round-trip function, timed the same way, on rank 0 alone over the benchmark-only null
transport, which completes every op when it is posted (what the interpreter and the binding
layer cost before any byte moves). The C floor beside it is floor.py's."""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from timing import human_bytes, median, percentile, say

from megatron_p2p import _testing

ROUNDS = 4  # contenders of a phase take turns, so a burst of load on a shared machine hits them alike
PYTHON_FLOOR = "python_floor"
PINNED = "megatron_p2p_pinned"
GLOO = ("gloo_isend_irecv", "gloo_batch_isend_irecv")


def _round_trip(comm, contender: str, send: torch.Tensor, recv: torch.Tensor, peer: int) -> Callable[[], None]:
    """One round trip: rank 0 sends then receives, rank 1 receives then sends."""
    if contender.startswith("megatron_p2p") or contender == PYTHON_FLOOR:
        isend, irecv = comm.isend, comm.irecv

        def post(is_send: bool):
            return (isend(send, peer) if is_send else irecv(recv, peer)).wait()
    elif contender == "gloo_isend_irecv":
        def post(is_send: bool):
            return (dist.isend(send, peer) if is_send else dist.irecv(recv, peer)).wait()
    else:
        def post(is_send: bool):
            op = dist.P2POp(dist.isend if is_send else dist.irecv, send if is_send else recv, peer)
            for req in dist.batch_isend_irecv([op]):
                req.wait()

    first = dist.get_rank() == 0

    def run() -> None:
        post(first)
        post(not first)

    return run


def _set_affinity(cpus: set[int]) -> None:
    """Every thread of this process (the progress thread and torch's too) onto `cpus`."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, FileNotFoundError):
            pass  # a thread that ended meanwhile


@contextmanager
def placed(contender: str) -> Iterator[None]:
    """The pinned contender runs with each rank and all its threads on one core: rank r on the
    r-th usable CPU, the placement a launcher's --bind-to core gives."""
    if contender != PINNED:
        yield
        return
    usable = os.sched_getaffinity(0)
    _set_affinity({sorted(usable)[dist.get_rank() % len(usable)]})
    try:
        yield
    finally:
        _set_affinity(usable)


def _timed(trip: Callable[[], None], warmup: int, iterations: int) -> list[float]:
    for _ in range(warmup):
        trip()
    samples = []
    for _ in range(iterations):
        start = time.perf_counter()
        trip()
        samples.append((time.perf_counter() - start) / 2 * 1e6)
    return samples


def run(comm, group, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """This package's placements take turns first, every size; gloo's contenders follow, and the
    Python call floor last. Gloo's sleeping waits pull the two ranks onto one core (its wakes
    place the wakee beside its waker), and ranks that wait by polling are not moved apart again
    for many milliseconds: measured right after gloo, this package would read that placement,
    4x its own (PROFILE.md)."""
    peer = 1 - dist.get_rank()
    pinnable = len(os.sched_getaffinity(0)) >= 2
    phases = (("megatron_p2p", *([PINNED] if pinnable else [])), GLOO)
    per_round = max(1, cfg["iterations"] // ROUNDS)
    warmup = cfg["warmup"] // ROUNDS + 1
    buffers = {n: (torch.zeros(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)) for n in cfg["sizes"]}
    samples: dict[int, dict[str, list[float]]] = {n: {} for n in cfg["sizes"]}
    for contenders in phases:
        for nbytes, (send, recv) in buffers.items():
            for _ in range(ROUNDS):
                for c in contenders:
                    with placed(c):
                        trip = _round_trip(comm, c, send, recv, peer)
                        samples[nbytes].setdefault(c, []).extend(_timed(trip, warmup, per_round))
    if dist.get_rank() == 0:  # rank 0 alone; its peer waits in the barrier below, asleep
        null = _testing.null_communicator(f"latency-floor-{os.getpid()}", 0, [0, 1])
        try:
            for nbytes, (send, recv) in buffers.items():
                trip = _round_trip(null, PYTHON_FLOOR, send, recv, 1)
                samples[nbytes][PYTHON_FLOOR] = _timed(trip, warmup, per_round * ROUNDS)
        finally:
            null.close()
    dist.barrier(group=group)
    points = []
    for nbytes, by in samples.items():  # rank 1 has no floor; rank 0's figures are reported
        figures = {c: {"median_us": median(s), "p99_us": percentile(s, 0.99)} for c, s in by.items()}
        points.append({"bytes": nbytes, "samples": len(by["megatron_p2p"]), "us": figures})
        say(f"latency {human_bytes(nbytes):>8}  " + "  ".join(
            f"{c} {f['median_us']:7.2f} us (p99 {f['p99_us']:7.2f})" for c, f in figures.items()))
    return points
