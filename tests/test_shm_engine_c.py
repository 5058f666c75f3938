"""The shm engine driven from C without Python (tests/c/shm_engine_stress.c): ranks as forked
processes, a posting thread per lane in each, sizes over every copy path, every byte checked.
`make tsan` runs it under ThreadSanitizer for longer; here it runs plain, so `make test` covers it."""
from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Run:
    returncode: int
    summary: dict[str, float]
    errors: str


@pytest.fixture(scope="module")
def stress(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built by the Makefile's rule, into a directory of this test's own."""
    binary = tmp_path_factory.mktemp("engine") / "shm_engine_stress"
    subprocess.run(["make", "-s", str(binary)], cwd=ROOT, check=True, timeout=300)
    return binary


def run(binary: Path, *args: str) -> Run:
    proc = subprocess.run([str(binary), "-l", "120", *args], capture_output=True, text=True, timeout=180)
    summary = {k: float(v) for k, v in re.findall(r"(\w+)=([\d.]+)", proc.stdout)}
    return Run(proc.returncode, summary, proc.stderr)


def test_every_message_arrives_exact_across_ranks_threads_and_copy_paths(stress: Path) -> None:
    """A fixed plan (its seed and rounds), so what it covers is fixed too: inline, single-copy,
    bounce-buffer and arena messages, self exchanges, mismatches both sides report, and ranks that
    dawdle while their peers block (the deadlock detector must not call that a deadlock), and
    bursts of 10 arena receives per channel in one step, more than its 8 offer slots, with more
    posted behind them (burst_arena: those that landed in the arena, each checked)."""
    r = run(stress, "-r", "4", "-n", "250", "-s", "1")
    assert r.returncode == 0, r.errors[-6000:]
    s = r.summary
    assert s["failures"] == 0 and s["messages"] > 2000, s
    for covered in ("inline", "single_copy", "bounce", "arena", "burst_arena", "self", "mismatched", "dawdles"):
        assert s[covered] > 0, (covered, s)


def test_a_corrupted_byte_is_reported(stress: Path) -> None:
    """The check itself: one received byte flipped on rank 0 fails the job and names the message."""
    r = run(stress, "-r", "2", "-n", "50", "-c")
    assert r.returncode == 1, r.errors[-6000:]
    assert re.search(r"rank 0 lane 0 round \d+: the receive from rank \d \(\d+ bytes\) has a wrong byte at offset \d+",
                     r.errors), r.errors[-6000:]
