"""The package's environment variables: one table (VARIABLES), and one reader per type.

Every MEGATRON_P2P_* variable the package reads is a row of VARIABLES, with its type, its
default and what it means; Python code reads them only through the readers below (flag,
seconds, nbytes, choice, directory, path), which give one error message per misuse: the
variable, the wrong value and what its type expects. Variables the C core reads itself (getenv)
keep being read there; their row says so. DEVELOPER_VARIABLES lists, apart, those only the
build and the tests read (setup.py, the Makefile, tests/).

`make docs` writes the tables into docs/environment.md (write_docs; tests/test_env_table.py
keeps the two equal).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from . import _C

PYTHON = "Python"
C_CORE = "the C core"

# What each type accepts, in the words of the docs' table and of the error messages.
_FLAG_TRUE = ("1", "true", "yes", "on")
_FLAG_FALSE = ("0", "false", "no", "off")
EXPECTED = {
    "flag": "1/0, true/false, yes/no or on/off",
    "seconds": "a positive number of seconds",
    "bytes": f"a whole number of bytes from 0 to {_C.MAX_ARENA_BYTES}",
    "choice": "one of {choices}",
    "directory": "a directory this process can create and write",
    "path": "the path of a shared library",
}


@dataclass(frozen=True)
class Variable:
    """One environment variable: `default` is the value it has when unset (and, except for
    "bytes", when empty), written as it would be set; None where unset means off, or where the
    meaning says what decides."""

    name: str
    type: str
    default: str | None
    meaning: str
    read_by: str = PYTHON
    choices: tuple[str, ...] = ()
    shown_default: str | None = None  # the docs' text for the default, where `default` is not it

    @property
    def expected(self) -> str:
        return EXPECTED[self.type].format(choices=", ".join(self.choices))


VARIABLES: tuple[Variable, ...] = (
    Variable("MEGATRON_P2P_NCCL_LIBRARY", "path", None,
             "The libnccl.so.2 the NCCL backend loads, and nothing else when set: an unusable path is an error, "
             "never silently replaced (unset: the copy already in the process, torch's nvidia-nccl wheel, then "
             "the system's).", shown_default="unset: searched"),
    Variable("MEGATRON_P2P_CUDA_LIBRARY", "path", None,
             "The CUDA driver library loaded instead of libcuda.so.1; an unusable path is an error naming the "
             "variable (the tests point it, with the NCCL variable, at the model in tests/fakes/).",
             read_by=C_CORE, shown_default="unset: libcuda.so.1"),
    Variable("MEGATRON_P2P_TRACE_DIR", "directory", None,
             "Every rank dumps its communicators' flight recorders there on a P2PError, a watchdog abort, at exit "
             "and on SIGUSR1 (docs/trace-format.md); a directory that cannot be created or written is an error at "
             "communicator creation.", shown_default="unset: no dumps"),
    Variable("MEGATRON_P2P_ASYNC_ERROR_HANDLING", "choice", None,
             "What the NCCL watchdog does after its report: end exits the process (status 70) so that torchrun "
             "tears the job down, raise leaves the error for the communicator's next call.",
             choices=("end", "raise"), shown_default="end under torchrun, else raise"),
    Variable("MEGATRON_P2P_CHECK", "flag", "0",
             "Debug matching: on NCCL each step's descriptors are compared with the receiver's before its data "
             "moves; shm, which always compares bytes and dtype, compares shapes too. A disagreement is a "
             "MismatchError naming both sides on both ranks."),
    Variable("MEGATRON_P2P_SHM_SINGLE_COPY", "flag", "1",
             "0: large shm messages go through a shared bounce buffer (two copies) instead of single-copy "
             "process_vm_readv reads, which the transport also falls back to by itself, per peer, where the kernel "
             "refuses them."),
    Variable("MEGATRON_P2P_SHM_ARENA_BYTES", "bytes", str(_C.DEFAULT_ARENA_BYTES),
             "Size of each rank's shm receive arena (address space: only the blocks handed out take room in "
             "/dev/shm), 0 for none; init_communicator(arena_bytes=...) overrides it.",
             shown_default=f"{_C.DEFAULT_ARENA_BYTES} (1 GiB)"),
    Variable("MEGATRON_P2P_STALL_SECONDS", "seconds", "1",
             "NCCL: how long an op makes no progress on its lane before the rank publishes its pending ops for the "
             "run-time deadlock analysis (docs/deadlocks-and-tools.md)."),
)


@dataclass(frozen=True)
class DeveloperVariable:
    """A variable only the build or the tests read; they read it themselves."""

    name: str
    read_by: str
    meaning: str


DEVELOPER_VARIABLES: tuple[DeveloperVariable, ...] = (
    DeveloperVariable("MEGATRON_P2P_TESTING", "setup.py",
                      "Set: the build also makes megatron_p2p._testing, the hooks only the tests and benchmarks use."),
    DeveloperVariable("MEGATRON_P2P_SANITIZE", "setup.py", "Set: the extension is built with ASan and UBSan."),
    DeveloperVariable("MEGATRON_P2P_EXPECT_SANITIZED", "tests",
                      "Set by `make sanitize`: the tests expect the sanitized build (and the soak test skips its memory "
                      "bounds)."),
    DeveloperVariable("MEGATRON_P2P_FAST_TESTS", "tests",
                      "Set by `make test-fast`: the tests' run_job refuses to launch multi-process jobs."),
    DeveloperVariable("MEGATRON_P2P_VERIFY_PROGRAMS", "tests", "How many random programs tests/test_check.py checks."),
    DeveloperVariable("MEGATRON_P2P_VERIFY_REPLAYS", "tests", "How many random programs tests/test_replay.py replays."),
    DeveloperVariable("MEGATRON_P2P_FUZZ_EXAMPLES", "tests",
                      "How many random argument sets tests/test_fuzz_arguments.py tries."),
    DeveloperVariable("MEGATRON_P2P_SOAK_EXCHANGES", "tests", "Exchanges per rank in the soak test."),
    DeveloperVariable("MEGATRON_P2P_SOAK_COMMUNICATORS", "tests", "Communicators created and closed in the soak test."),
    DeveloperVariable("MEGATRON_P2P_SOAK_RANKS", "tests", "Ranks of the soak test."),
    DeveloperVariable("MEGATRON_P2P_SOAK_SEED", "tests", "Seed of the soak test's random draw."),
    DeveloperVariable("MEGATRON_P2P_RMA_CHECK", "tests",
                      "Set by tests/gpu/run_device_checks.sh: tests/test_nccl_model_rma.py runs this build of "
                      "tests/c/nccl_rma_check.c (linked to the real libnccl and libcuda) instead of the model's."),
)

BY_NAME = {v.name: v for v in VARIABLES}


def _variable(name: str, kind: str) -> Variable:
    var = BY_NAME[name]  # a KeyError here: a variable missing from the table
    if var.type != kind:
        raise TypeError(f"{name} is a {var.type} variable, not a {kind} one")
    return var


def _wrong(var: Variable, value: str, why: str = "") -> ValueError:
    """The one error of a misused variable: its name, the value, and what its type expects."""
    return ValueError(f"${var.name}={value!r}: expected {var.expected}" + (f" ({why})" if why else ""))


def _given(var: Variable) -> str | None:
    """The variable's value; None when unset or empty."""
    return os.environ.get(var.name) or None


def flag(name: str) -> bool:
    """A flag variable: 1/0, true/false, yes/no or on/off (any case); unset or empty: its default."""
    var = _variable(name, "flag")
    value = _given(var)
    word = (value if value is not None else str(var.default)).lower()
    if word in _FLAG_TRUE:
        return True
    if word in _FLAG_FALSE:
        return False
    raise _wrong(var, str(value))


def seconds(name: str) -> float:
    """A positive number of seconds; unset or empty: its default."""
    var = _variable(name, "seconds")
    value = _given(var)
    text = value if value is not None else str(var.default)
    try:
        got = float(text)
    except ValueError:
        got = -1.0
    if not got > 0:
        raise _wrong(var, text)
    return got


def nbytes(name: str) -> int:
    """A whole number of bytes up to _C.MAX_ARENA_BYTES; unset: its default. Empty is an error,
    not the default: a size left empty is a mistake (an unset shell variable), never a choice."""
    var = _variable(name, "bytes")
    value = os.environ.get(name)
    text = value if value is not None else str(var.default)
    try:
        got = int(text)
    except ValueError:
        raise _wrong(var, text) from None
    if not 0 <= got <= _C.MAX_ARENA_BYTES:
        raise _wrong(var, text)
    return got


def choice(name: str) -> str | None:
    """One of the variable's choices; None when unset or empty (its caller applies the default
    the table describes)."""
    var = _variable(name, "choice")
    value = _given(var)
    if value is None:
        return None
    if value not in var.choices:
        raise _wrong(var, value)
    return value


def directory(name: str) -> Path | None:
    """A directory, created if missing, that this process can write; None when unset or empty."""
    var = _variable(name, "directory")
    value = _given(var)
    if value is None:
        return None
    path = Path(value)
    if path.exists() and not path.is_dir():
        raise _wrong(var, value, "not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _wrong(var, value, f"cannot create it: {exc.strerror}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise _wrong(var, value, "it is not writable")
    return path


def path(name: str) -> str | None:
    """A library path, checked by its loader (which names the variable); None when unset or empty."""
    return _given(_variable(name, "path"))


READERS = {"flag": flag, "seconds": seconds, "bytes": nbytes, "choice": choice, "directory": directory, "path": path}


def markdown() -> str:
    """The tables docs/environment.md holds between its markers."""
    rows = ["| variable | type | default | read by | meaning |", "|---|---|---|---|---|"]
    for v in VARIABLES:
        default = v.shown_default if v.shown_default is not None else v.default
        rows.append(f"| `{v.name}` | {v.expected} | {default} | {v.read_by} | {v.meaning} |")
    rows += ["", "For developers (read by the build and the tests themselves, not by the package):", "",
             "| variable | read by | meaning |", "|---|---|---|"]
    rows += [f"| `{v.name}` | {v.read_by} | {v.meaning} |" for v in DEVELOPER_VARIABLES]
    return "\n".join(rows) + "\n"


DOC_BEGIN = "<!-- BEGIN generated by `make docs`: edit megatron_p2p/_env.py, not this table -->"
DOC_END = "<!-- END generated table -->"


def write_docs(path: str | Path) -> None:
    """Puts markdown() between the markers of the page at `path`, keeping the rest of it."""
    page = Path(path)
    text = page.read_text()
    start, end = text.index(DOC_BEGIN) + len(DOC_BEGIN) + 1, text.index(DOC_END)
    page.write_text(text[:start] + markdown() + text[end:])
