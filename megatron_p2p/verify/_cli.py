"""The command line the tools share: `python -m megatron_p2p.<tool>`, described by the first
paragraph of the tool's docstring, with --version."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from .._version import __version__


def tool_parser(tool: str, doc: str | None, **kwargs: Any) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"python -m megatron_p2p.{tool}", description=(doc or "").split("\n\n")[0],
                                     **kwargs)
    parser.add_argument("--version", action="version", version=f"megatron_p2p {__version__}")
    return parser


def wrote(tool: str, path: str | Path) -> None:
    """Names a file the tool wrote, on stderr (stdout stays the verdicts, for pipes and --json)."""
    print(f"{tool}: wrote {path}", file=sys.stderr)
