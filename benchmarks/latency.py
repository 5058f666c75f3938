"""Latency: a 2-rank ping-pong, reported as half the round trip (median and p99), through this
package (unpinned, and pinned: each rank with all its threads on a core of its own), through
torch.distributed gloo (isend/irecv and batch_isend_irecv), and the two floors the latency goal
divides by:
- the C floor: the two ranks bounce a counter through one shared page in C
  (megatron_p2p._testing.pingpong), each placement taking its turn between this package's round
  trips, so it sees the same processes, cores and moment (on a VM the crossing between two vCPUs
  moves between 0.07 and 0.25 us within seconds);
- the Python call floor: the same round-trip function, timed the same way, over the
  benchmark-only null transport, which completes every op when it is posted (what the
  interpreter and the binding layer cost before any byte moves), timed by rank 0 between this
  package's round trips while rank 1 spins in C, as a waiting rank does.
Floors measured minutes apart would compare different machines: on this VM the Python floor
moves between 0.9 and 1.6 us with the host's load."""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import goals
import torch
import torch.distributed as dist
from timing import human_bytes, median, percentile, say

from megatron_p2p import _testing

ROUNDS = 4  # contenders of a phase take turns, so a burst of load on a shared machine hits them alike
PYTHON_FLOOR = "python_floor"
PINNED = goals.PLACED["pinned"]
C_FLOOR = {goals.PLACED[pl]: c for pl, c in goals.C_FLOOR.items()}  # each placement's contender's C floor
SETTLE_TRIPS = 10000  # untimed round trips first (~40 ms): the first size timed read the launch, 2-4x
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


class _CFloor:
    """The C floor's turns: each a fresh shared page, named after rank 0's pid and the turn."""

    def __init__(self, group) -> None:
        token = [os.getpid()]
        dist.broadcast_object_list(token, src=0, group=group)
        self.prefix = f"/mp2p-latency-floor-{token[0]}"
        self.turns = 0

    def timed(self, warmup: int, iterations: int) -> list[float]:
        """Rank 0's one-way samples after the warm-up; rank 1 takes part and gets none."""
        self.turns += 1
        return _testing.pingpong(f"{self.prefix}-{self.turns}", dist.get_rank(), warmup + iterations)[warmup:]

    def spin_while(self, work: Callable[[], list[float]]) -> list[float]:
        """Rank 0 runs `work` while rank 1 spins for the page of the trip that ends it."""
        out = work() if dist.get_rank() == 0 else []
        self.timed(0, 1)
        return out


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
    """This package's placements and the Python call floor take turns first, every size, each
    placement followed by its C floor; gloo's contenders follow. Gloo's sleeping waits pull the
    two ranks onto one core (its wakes place the wakee beside its waker), and ranks that wait by
    polling are not moved apart again for many milliseconds: measured right after gloo, this
    package would read that placement, 4x its own (PROFILE.md)."""
    peer = 1 - dist.get_rank()
    pinnable = len(os.sched_getaffinity(0)) >= 2
    phases = (("megatron_p2p", *([PINNED] if pinnable else []), PYTHON_FLOOR), GLOO)
    per_round = max(1, cfg["iterations"] // ROUNDS)
    warmup = cfg["warmup"] // ROUNDS + 1
    buffers = {n: (torch.zeros(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)) for n in cfg["sizes"]}
    samples: dict[int, dict[str, list[float]]] = {n: {} for n in cfg["sizes"]}
    c_floor = _CFloor(group)
    null = _testing.null_communicator(f"latency-floor-{os.getpid()}", 0, [0, 1])  # rank 0's is timed
    try:
        _timed(_round_trip(comm, phases[0][0], *buffers[cfg["sizes"][0]], peer), SETTLE_TRIPS, 0)
        for contenders in phases:
            for nbytes, (send, recv) in buffers.items():
                for _ in range(ROUNDS):
                    for c in contenders:
                        with placed(c):
                            if c == PYTHON_FLOOR:
                                trip = _round_trip(null, c, send, recv, 1)
                                timed = c_floor.spin_while(lambda: _timed(trip, warmup, per_round))
                            else:
                                timed = _timed(_round_trip(comm, c, send, recv, peer), warmup, per_round)
                            samples[nbytes].setdefault(c, []).extend(timed)
                            if c in C_FLOOR:
                                floor = c_floor.timed(warmup, per_round)
                                samples[nbytes].setdefault(C_FLOOR[c], []).extend(floor)
    finally:
        null.close()
    points = []
    for nbytes, by in samples.items():  # rank 1 has no floors; rank 0's figures are reported
        figures = {c: {"median_us": median(s), "p99_us": percentile(s, 0.99)} for c, s in by.items() if s}
        points.append({"bytes": nbytes, "samples": len(by["megatron_p2p"]), "us": figures})
        say(f"latency {human_bytes(nbytes):>8}  " + "  ".join(
            f"{c} {f['median_us']:7.2f} us (p99 {f['p99_us']:7.2f})" for c, f in figures.items()))
    return points
