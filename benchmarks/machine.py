"""What a result was measured on: CPU, cores, kernel, library versions, the package's commit,
and the package's environment variables (MEGATRON_P2P_*, such as the arena's size), which
change what is measured."""
from __future__ import annotations

import os
import platform
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _version(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def describe() -> dict:
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    return {
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "kernel": platform.release(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "megatron_core": _version("megatron-core"),
        "commit": (_git("rev-parse", "HEAD") or "unknown") + ("-dirty" if dirty else ""),
        "load_average": list(os.getloadavg()),
        "package_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("MEGATRON_P2P_")},
    }
