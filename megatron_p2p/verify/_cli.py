"""The command line the tools share: `python -m megatron_p2p.<tool>`, described by the first
paragraph of the tool's docstring, with --version."""
from __future__ import annotations

import argparse
from typing import Any

from .._version import __version__


def tool_parser(tool: str, doc: str | None, **kwargs: Any) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"python -m megatron_p2p.{tool}", description=(doc or "").split("\n\n")[0],
                                     **kwargs)
    parser.add_argument("--version", action="version", version=f"megatron_p2p {__version__}")
    return parser
