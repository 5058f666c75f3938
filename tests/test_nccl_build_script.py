"""tests/gpu/build_nccl.sh, the NCCL 2.30.7 build for the device checks, without building NCCL
(that takes 20 minutes): its check of a library (--check), which must pass for the wheel's
libnccl.so.2 and the model's, and fail naming what is wrong with anything else; and its refusal
of any source tree but NVIDIA/nccl's v2.30.7-1."""
from __future__ import annotations

import hashlib
import re
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT
from nccl_wheel import wheel_dir

SCRIPT = ROOT / "tests" / "gpu" / "build_nccl.sh"
LIBRARIES_C = ROOT / "csrc" / "nccl" / "libraries.c"
MODEL_LIB = ROOT / "build" / "fakes" / "libnccl.so.2"
TAG_COMMIT = "73cf112295c33aee2b895f329f592f2a9b4b0f97"  # NVIDIA/nccl's v2.30.7-1


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)


def package_symbols() -> list[str]:
    """Every libnccl symbol name in libraries.c's table, read here independently of the checker."""
    table = LIBRARIES_C.read_text().split("nccl_symbols[] = {", 1)[1].split("};", 1)[0]
    return re.findall(r'"(nccl\w+)"', table)


def stub_library(tmp_path: Path, version: int, exports: list[str]) -> Path:
    """A libnccl.so.2 of our own making: ncclGetVersion reporting `version`, and `exports`."""
    body = [f"int ncclGetVersion(int *v) {{ *v = {version}; return 0; }}"]
    body += [f"int {name}(void) {{ return 0; }}" for name in exports if name != "ncclGetVersion"]
    src = tmp_path / "stub.c"
    src.write_text("\n".join(body) + "\n")
    lib = tmp_path / "libnccl.so.2"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return lib


# ---- --check ---------------------------------------------------------------------------------


def test_the_checker_reads_every_symbol_of_the_package_table():
    assert {"ncclGetVersion", "ncclSend", "ncclRecv", "ncclCommAbort"} <= set(package_symbols())


@pytest.mark.parametrize("which", ["wheel", "model"])
def test_check_passes_a_2_30_7_library_with_every_symbol_and_prints_its_size_and_sha256(which):
    lib = wheel_dir() / "lib" / "libnccl.so.2" if which == "wheel" else MODEL_LIB
    if which == "model" and not lib.exists():
        pytest.fail(f"{lib} is not built: run `make fakes`")
    done = run("--check", str(lib))
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "loads: yes" in out and "version 23007 (expected 23007)" in out, out
    for name in package_symbols():
        assert re.search(rf"^\s+{name}\s+present", out, re.M), (name, out)
    data = lib.resolve().read_bytes()
    assert f"size: {len(data)} bytes" in out and f"sha256: {hashlib.sha256(data).hexdigest()}" in out, out
    assert out.rstrip().endswith("every symbol megatron_p2p resolves"), out


def test_check_fails_naming_each_missing_symbol_and_the_wrong_version(tmp_path):
    symbols = package_symbols()
    kept, dropped = symbols[: len(symbols) // 2], symbols[len(symbols) // 2:]
    assert "ncclGetVersion" in kept and dropped
    done = run("--check", str(stub_library(tmp_path, 22304, kept)))
    assert done.returncode == 1, done.stdout + done.stderr
    verdict = done.stdout.strip().splitlines()[-1]
    assert verdict.startswith("FAIL: ") and "reports 22304, not 23007" in verdict, verdict
    assert f"missing {len(dropped)} of the {len(symbols)} symbols" in verdict, verdict
    missing = verdict.split("symbols: ", 1)[1].split(";", 1)[0]
    assert [name.split()[0] for name in missing.split(", ")] == dropped, verdict


def test_check_fails_on_a_symbol_the_package_adds_that_the_library_lacks(tmp_path):
    """The list is the package's own: a new entry in libraries.c is checked without other edits."""
    sources = tmp_path / "libraries.c"
    sources.write_text(LIBRARIES_C.read_text().replace(
        "static const symbol nccl_symbols[] = {",
        'static const symbol nccl_symbols[] = {\n    NCCL_SYM(Extra, "ncclNotInAnyNccl", 0),', 1))
    done = subprocess.run(["python3", str(ROOT / "tests" / "gpu" / "check_nccl_lib.py"), str(MODEL_LIB),
                           "--sources", str(sources)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "ncclNotInAnyNccl" in done.stdout.splitlines()[-1], done.stdout + done.stderr


def test_check_fails_on_a_file_that_does_not_load(tmp_path):
    junk = tmp_path / "libnccl.so.2"
    junk.write_text("not a library\n")
    done = run("--check", str(junk))
    assert done.returncode == 1 and "it does not load" in done.stdout, done.stdout + done.stderr


# ---- the source tree ------------------------------------------------------------------------


def nccl_tree(path: Path, version: str = "2.30.7", revision: str = "1") -> Path:
    """What the script reads of an NCCL tree: makefiles/version.mk."""
    major, minor, patch = version.split(".")
    (path / "makefiles").mkdir(parents=True)
    (path / "makefiles" / "version.mk").write_text(
        f"##### version\nNCCL_MAJOR   := {major}\nNCCL_MINOR   := {minor}\nNCCL_PATCH   := {patch}\n"
        f"NCCL_SUFFIX  :=\nPKG_REVISION := {revision}\n")
    return path


def git(tree: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(tree), "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
                   check=True, capture_output=True)


def test_a_tree_of_another_version_is_refused(tmp_path):
    done = run("--dry-run", str(nccl_tree(tmp_path / "nccl", "2.30.4")))
    assert done.returncode == 2 and "is NCCL 2.30.4-1" in done.stderr and "builds 2.30.7-1 only" in done.stderr, \
        done.stdout + done.stderr


def test_a_directory_that_is_no_nccl_tree_is_refused(tmp_path):
    done = run("--dry-run", str(tmp_path))
    assert done.returncode == 2 and "not an NCCL source tree" in done.stderr, done.stdout + done.stderr


def test_a_git_tree_tagged_v2_30_7_1_at_another_commit_is_refused(tmp_path):
    tree = nccl_tree(tmp_path / "nccl")
    git(tree, "init", "-q")
    git(tree, "add", ".")
    git(tree, "commit", "-q", "-m", "not NVIDIA's")
    git(tree, "tag", "v2.30.7-1")
    done = run("--dry-run", str(tree))
    assert done.returncode == 2 and f"not NVIDIA/nccl's v2.30.7-1 ({TAG_COMMIT})" in done.stderr, \
        done.stdout + done.stderr


def test_a_tree_without_git_at_2_30_7_gets_the_make_command_with_the_chosen_functions_and_architecture(tmp_path):
    tree = nccl_tree(tmp_path / "nccl")
    out = tmp_path / "out"
    done = run("--dry-run", str(tree), str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "the commit cannot be checked" in done.stdout, done.stdout
    make = next(line for line in done.stdout.splitlines() if line.startswith("make:"))
    assert "src.build" in make and r"NVCC_GENCODE=-gencode=arch=compute_90\,code=sm_90" in make, make
    assert r"ONLY_FUNCS=SendRecv\|AllReduce\ Sum" in make, make
    assert f"out: {out} " in done.stdout and "nothing built" in done.stdout and not out.exists()
    other = run("--dry-run", "--gencode", "100", "--sendrecv-only", "--jobs", "3", str(tree), str(out))
    make = next(line for line in other.stdout.splitlines() if line.startswith("make:"))
    assert r"compute_100\,code=sm_100" in make and "ONLY_FUNCS=SendRecv" in make.split()[-1] and " -j3 " in make, make


@pytest.mark.parametrize("args, says", [
    ([], "usage"), (["--gencode", "sm_90", "X"], "architecture number"), (["--jobs", "0", "X"], "positive number"),
    (["--bogus", "X"], "unknown option"), (["--check"], "usage"), (["a", "b", "c"], "usage"),
])
def test_bad_arguments_are_refused_saying_why(args, says):
    done = run(*args)
    assert done.returncode == 2 and says in (done.stderr + done.stdout).lower(), done.stdout + done.stderr
