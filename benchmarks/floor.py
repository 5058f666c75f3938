"""The hardware and scheduler floor of the latency goals: benchmarks/floors/pingpong.c (built by
`make bench`), two processes bouncing a counter through one shared page, run beside the
torchrun jobs in the same run, unpinned and pinned to two cores, once per repetition."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

ROUND_TRIPS = 20000
PLACEMENTS = ("unpinned", "pinned")


def _once(program: Path, placement: str) -> dict[str, float]:
    cpus = sorted(os.sched_getaffinity(0))[:2]
    args = [str(program), str(ROUND_TRIPS)] + ([str(c) for c in cpus] if placement == "pinned" else [])
    proc = subprocess.run(args, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise RuntimeError(f"{program} {placement} exited with status {proc.returncode}: {proc.stderr.strip()}")
    return json.loads(proc.stdout)


def measure(program: Path | None, repeats: int) -> dict[str, Any]:
    """Each placement's figures, once per repetition (pinned only where two CPUs are usable);
    {"available": False} without the program."""
    if program is None:
        return {"available": False, "note": "no --pingpong program: run through `make bench`"}
    if not program.exists():
        raise FileNotFoundError(f"--pingpong {program}: no such program; `make bench` builds it")
    placements = PLACEMENTS if len(os.sched_getaffinity(0)) >= 2 else PLACEMENTS[:1]
    out: dict[str, Any] = {"available": True, "round_trips": ROUND_TRIPS}
    for placement in placements:
        out[placement] = [_once(program, placement) for _ in range(repeats)]
    return out
