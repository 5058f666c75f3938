"""Where the nvidia-nccl-cu13 wheel (libnccl.so.2 and nccl.h) lives in this environment."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def wheel_dir() -> Path:
    spec = importlib.util.find_spec("nvidia.nccl") if importlib.util.find_spec("nvidia") else None
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location)
        if (path / "lib" / "libnccl.so.2").exists() and (path / "include" / "nccl.h").exists():
            return path
    pytest.fail("the nvidia-nccl-cu13 wheel is not installed: `make test` installs it (see the Makefile)")


def header_version() -> tuple[int, int, int]:
    fields = {}
    for line in (wheel_dir() / "include" / "nccl.h").read_text().splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "#define" and parts[1] in ("NCCL_MAJOR", "NCCL_MINOR", "NCCL_PATCH"):
            fields[parts[1]] = int(parts[2])
    return fields["NCCL_MAJOR"], fields["NCCL_MINOR"], fields["NCCL_PATCH"]
