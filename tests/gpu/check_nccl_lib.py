"""Checks that a libnccl.so.2 is one megatron_p2p can use: it loads (dlopen with RTLD_NOW, as
the package loads it), ncclGetVersion reports the expected version (23007: NCCL 2.30.7, the
version tests/gpu/build_nccl.sh builds), and it exports every symbol csrc/nccl/libraries.c
resolves. The symbols are read from that file's NCCL_SYM table, so that the list is kept in one
place: a symbol added there is checked here without an edit.

Prints what it found, then the library's size and sha256, then PASS, or FAIL with every problem
named. Exit status: 0 PASS, 1 FAIL, 2 when the table cannot be read. Needs only Python's
standard library (it runs where torch is not installed too):

    python3 tests/gpu/check_nccl_lib.py LIB [--expect-version 23007] [--sources csrc/nccl/libraries.c]

(tests/gpu/build_nccl.sh --check LIB runs it.)
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import re
import sys
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]
LIBRARIES_C = ROOT / "csrc" / "nccl" / "libraries.c"
EXPECTED_VERSION = 23007
# The table as csrc/nccl/libraries.c writes it: static const symbol nccl_symbols[] = { NCCL_SYM(field, "name", optional), ... };
TABLE = re.compile(r"nccl_symbols\s*\[\s*\]\s*=\s*\{(.*?)\};", re.S)
ENTRY = re.compile(r'NCCL_SYM\(\s*\w+\s*,\s*"(\w+)"\s*,\s*([01])\s*\)')


class Symbol(NamedTuple):
    name: str
    optional: bool  # the package loads a library without it (and does without what it gives)


def package_symbols(source: Path) -> list[Symbol]:
    """The symbols the package resolves in libnccl, in its order; raises ValueError when the
    table is not where it was (a refactor of libraries.c must update this reader, not silently
    leave nothing to check)."""
    text = source.read_text()
    table = TABLE.search(text)
    if table is None:
        raise ValueError(f"{source}: no `nccl_symbols[] = {{ ... }};` table")
    symbols = [Symbol(name, flag == "1") for name, flag in ENTRY.findall(table.group(1))]
    entries = table.group(1).count("NCCL_SYM(")
    if not symbols or len(symbols) != entries:
        raise ValueError(f"{source}: read {len(symbols)} of the table's {entries} NCCL_SYM entries")
    return symbols


def check(lib: Path, symbols: list[Symbol], expect_version: int) -> list[str]:
    """Prints what `lib` has; returns the problems (none: usable)."""
    problems: list[str] = []
    print(f"library: {lib}")
    try:
        handle = ctypes.CDLL(str(lib), mode=os.RTLD_NOW | os.RTLD_LOCAL)
    except OSError as exc:
        print(f"  loads: no ({exc})")
        return [f"it does not load: {exc}"]
    print("  loads: yes (dlopen RTLD_NOW)")

    missing = []
    print(f"  symbols csrc/nccl/libraries.c resolves ({len(symbols)}):")
    for sym in symbols:
        present = hasattr(handle, sym.name)
        print(f"    {sym.name:<28} {'present' if present else 'MISSING'}{' (optional)' if sym.optional else ''}")
        if not present:
            missing.append(sym.name + (" (optional for the package)" if sym.optional else ""))
    if missing:
        problems.append(f"missing {len(missing)} of the {len(symbols)} symbols: {', '.join(missing)}")

    if hasattr(handle, "ncclGetVersion"):
        version = ctypes.c_int(-1)
        rc = handle.ncclGetVersion(ctypes.byref(version))
        print(f"  ncclGetVersion: returned {rc}, version {version.value} (expected {expect_version})")
        if rc != 0:
            problems.append(f"ncclGetVersion returned {rc}")
        elif version.value != expect_version:
            problems.append(f"ncclGetVersion reports {version.value}, not {expect_version}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("lib", type=Path, help="the libnccl.so.2 to check")
    parser.add_argument("--expect-version", type=int, default=EXPECTED_VERSION,
                        help=f"what ncclGetVersion must report (default {EXPECTED_VERSION})")
    parser.add_argument("--sources", type=Path, default=LIBRARIES_C,
                        help="the C file holding the package's nccl_symbols table (default: this tree's)")
    args = parser.parse_args(argv)
    try:
        symbols = package_symbols(args.sources)
    except (OSError, ValueError) as exc:
        print(f"check_nccl_lib: cannot read the package's symbols: {exc}", file=sys.stderr)
        return 2
    problems = check(args.lib, symbols, args.expect_version)
    if args.lib.is_file():
        data = args.lib.read_bytes()
        print(f"  size: {len(data)} bytes ({len(data) / 1e6:.1f} MB)")
        print(f"  sha256: {hashlib.sha256(data).hexdigest()}")
    else:
        problems.append("it is not a file")
    if problems:
        print("FAIL: " + "; ".join(problems))
        return 1
    print(f"PASS: NCCL {args.expect_version}, every symbol megatron_p2p resolves")
    return 0


if __name__ == "__main__":
    sys.exit(main())
