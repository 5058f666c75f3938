"""The package's version and the torch releases it is tested with, each in one place:
`megatron_p2p.__version__`, the tools' `--version` and pip's metadata (pyproject.toml reads the
version from here; tests/test_packaging.py holds its torch bound to TESTED_TORCH)."""
from __future__ import annotations

import re
import warnings

__version__ = "0.1.0"

TESTED_TORCH = ((2, 13), (2, 14))  # the oldest and the newest minor release `make test` runs against


def untested_torch(version: str) -> str | None:
    """The warning for a torch release outside TESTED_TORCH; None inside it (local builds such
    as "2.14.1+cu130" and pre-releases count as their release)."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        return f"megatron_p2p cannot read torch's version {version!r}; it is tested with torch {_tested()}"
    if TESTED_TORCH[0] <= (int(match[1]), int(match[2])) <= TESTED_TORCH[1]:
        return None
    return f"megatron_p2p {__version__} is tested with torch {_tested()}, not torch {version}"


def _tested() -> str:
    (a, b), (c, d) = TESTED_TORCH
    return f"{a}.{b} to {c}.{d}"


def warn_if_untested_torch() -> None:
    """One warning at import when the torch in use is outside TESTED_TORCH."""
    import torch

    message = untested_torch(torch.__version__)
    if message is not None:
        warnings.warn(message, stacklevel=3)
