"""Small timing helpers shared by the benchmark sections, and the statistics of a figure
measured several times (its median and min-max spread over the repetitions)."""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

MiB = 1 << 20


def say(line: str) -> None:
    """Prints on rank 0 only: one progress line per measured point."""
    if dist.get_rank() == 0:
        print(line, flush=True)


def percentile(samples: Sequence[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(math.ceil(q * len(ordered))) - 1)]


def median(samples: Sequence[float]) -> float:
    ordered = sorted(samples)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else 0.5 * (ordered[n // 2 - 1] + ordered[n // 2])


def slowest_rank(seconds: float, group=None) -> float:
    """The largest of every rank's value: a collective finishes when its slowest rank does."""
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def timed_loop(body: Callable[[], None], iterations: int, warmup: int, group=None) -> float:
    """Seconds per iteration of `body`, run by every rank of `group` in step, started together
    after a barrier and taken from the slowest rank."""
    for _ in range(warmup):
        body()
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(iterations):
        body()
    return slowest_rank(time.perf_counter() - start, group) / iterations


def repetitions(nbytes: int, target_bytes: int, lo: int, hi: int) -> int:
    """How many messages of `nbytes` move about `target_bytes`, within [lo, hi]."""
    return max(lo, min(hi, target_bytes // max(nbytes, 1)))


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def spread(values: Sequence[float]) -> dict[str, float]:
    """A repeated figure: its median over the repetitions, and their range (min-max)."""
    return {"median": median(values), "min": min(values), "max": max(values)}


def combine_repeats(repeats: Sequence[Any]) -> Any:
    """One result shaped like each repetition's, every number the median over the repetitions
    (a number all of them agree on, such as a size, kept as it is). Sections measured one
    repetition per call (latency, overhead) are combined this way, whatever keys they report."""
    first = repeats[0]
    if isinstance(first, dict):
        return {k: combine_repeats([r[k] for r in repeats]) for k in first}
    if isinstance(first, list):
        return [combine_repeats([r[i] for r in repeats]) for i in range(len(first))]
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return first if all(r == first for r in repeats) else median(repeats)
    return first


def ranged(values: Sequence[float], fmt: str = ".2f") -> str:
    """A repeated figure as text: "median [min-max]"."""
    s = spread(values)
    return f"{s['median']:{fmt}} [{s['min']:{fmt}}-{s['max']:{fmt}}]"
