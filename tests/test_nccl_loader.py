"""Finding libnccl at run time: the order of the search, what each failure says, and the version
read from the library. Each case runs in a fresh interpreter, because a process loads libnccl
once."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from typing import Any

import pytest
from conftest import ROOT
from nccl_wheel import header_version, wheel_dir

WHEEL_LIB = str((wheel_dir() / "lib" / "libnccl.so.2").resolve())


def load(code: str, env: dict[str, str] | None = None) -> Any:
    """Runs `code` (which leaves its answer in `out`) with a clean NCCL environment."""
    run_env = {k: v for k, v in os.environ.items() if k not in ("MEGATRON_P2P_NCCL_LIBRARY", "LD_LIBRARY_PATH")}
    run_env.update(env or {})
    script = "import json, ctypes\nimport megatron_p2p as mp\nfrom megatron_p2p import _C\nout = None\n"
    script += textwrap.dedent(code)
    script += "\nprint('RESULT ' + json.dumps(out))\n"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=run_env, cwd=ROOT,
                          timeout=120)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout + done.stderr
    return json.loads(lines[-1][len("RESULT "):])


def attempt(call: str) -> str:
    return f"""
try:
    out = {{"ok": list({call})}}
except Exception as exc:
    out = {{"error": type(exc).__name__, "message": str(exc), "p2p": isinstance(exc, mp.P2PError)}}
"""


@pytest.fixture
def copy_dir(tmp_path):
    """A second copy of libnccl.so.2 in a directory of its own."""
    shutil.copy(WHEEL_LIB, tmp_path / "libnccl.so.2")
    return tmp_path


def test_environment_variable_comes_first(copy_dir):
    """With the variable set, its library is used even though a copy is already loaded."""
    mine = str(copy_dir / "libnccl.so.2")
    out = load(f"ctypes.CDLL({WHEEL_LIB!r})\n" + attempt(f"_C.nccl_load({mine!r}, [{WHEEL_LIB!r}])"))
    assert out["ok"][1:] == [mine, "env"]


def test_wrong_path_in_the_environment_variable_is_a_clear_error_without_fallback(tmp_path):
    missing = str(tmp_path / "no" / "libnccl.so.2")
    out = load(attempt("mp.nccl_version()"), env={"MEGATRON_P2P_NCCL_LIBRARY": missing})
    assert out["error"] == "BackendUnavailableError" and out["p2p"], out
    assert "MEGATRON_P2P_NCCL_LIBRARY" in out["message"] and missing in out["message"], out["message"]


def test_a_right_path_in_the_environment_variable_is_not_an_error():
    out = load(attempt("mp.nccl_version()"), env={"MEGATRON_P2P_NCCL_LIBRARY": WHEEL_LIB})
    assert out["ok"][2:] == [WHEEL_LIB, "env"]


def test_a_copy_already_in_the_process_comes_before_the_bundled_one(copy_dir):
    mine = str(copy_dir / "libnccl.so.2")
    out = load(f"ctypes.CDLL({mine!r})\n" + attempt(f"_C.nccl_load(None, [{WHEEL_LIB!r}])"))
    assert out["ok"][1:] == [mine, "loaded"]


def test_the_bundled_wheel_comes_before_the_system_path(copy_dir):
    out = load(attempt(f"_C.nccl_load(None, [{WHEEL_LIB!r}])"), env={"LD_LIBRARY_PATH": str(copy_dir)})
    assert out["ok"][1:] == [WHEEL_LIB, "bundled"]


def test_the_system_path_is_the_last_resort(copy_dir):
    out = load(attempt("_C.nccl_load(None, [])"), env={"LD_LIBRARY_PATH": str(copy_dir)})
    assert out["ok"][2] == "system"
    assert os.path.samefile(out["ok"][1], copy_dir / "libnccl.so.2")


def test_no_library_anywhere_says_how_to_install_one():
    out = load(attempt("_C.nccl_load(None, [])"))
    if "ok" in out:
        pytest.skip(f"this machine has a system libnccl ({out['ok'][1]}), so the search cannot come up empty")
    assert out["error"] == "BackendUnavailableError", out
    assert "nvidia-nccl-cu13" in out["message"] and "MEGATRON_P2P_NCCL_LIBRARY" in out["message"]


def test_nccl_version_is_read_from_the_wheels_library():
    out = load("v = mp.nccl_version()\nout = [list(v.version), v.code, v.path, v.source]")
    major, minor, patch = header_version()
    assert out[0] == [major, minor, patch]
    assert out[1] == major * 10000 + minor * 100 + patch
    assert out[2:] == [WHEEL_LIB, "bundled"]


def test_import_never_fails_for_a_missing_library(tmp_path):
    out = load("out = sorted(n for n in ('init_communicator', 'nccl_version') if hasattr(mp, n))",
               env={"MEGATRON_P2P_NCCL_LIBRARY": str(tmp_path / "missing.so")})
    assert out == ["init_communicator", "nccl_version"]


@pytest.mark.parametrize("torch_has", ["same", "other"])
def test_a_libnccl_other_than_torchs_is_warned_about(torch_has):
    """Two libnccl copies in one process cannot share communicators: a version that differs
    from torch.cuda.nccl.version() warns, the same version does not. (torch's version is
    stood in for here: this machine's torch has no CUDA.)"""
    major, minor, patch = header_version()
    theirs = (major, minor, patch) if torch_has == "same" else (major, minor - 1, 0)
    out = load(f"""
import warnings
import megatron_p2p.nccl as n
n._torch_nccl_version = lambda: {theirs!r}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    n.nccl_version()
out = [str(w.message) for w in caught]
""")
    if torch_has == "same":
        assert out == []
    else:
        assert len(out) == 1 and "two libnccl copies" in out[0], out
