"""nccl_abi.h against the real nccl.h of the nvidia-nccl-cu13 wheel: every value, the layout of
the config prefix and every prototype must agree, and a wrong value must be caught."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from conftest import ROOT
from nccl_wheel import wheel_dir

ABI = ROOT / "tests" / "abi"


def compile_check(abi_header_dir: Path, out: Path) -> subprocess.CompletedProcess:
    wheel = wheel_dir()
    cmd = [
        "gcc", "-std=c11", "-Wall", "-Wextra", "-Werror", "-I", str(ABI / "stub"), "-iquote", str(abi_header_dir),
        "-isystem", str(wheel / "include"), str(ABI / "check_nccl_abi.c"), "-o", str(out),
        "-L", str(wheel / "lib"), "-l:libnccl.so.2", f"-Wl,-rpath,{wheel / 'lib'}",
    ]
    return subprocess.run(cmd, capture_output=True, text=True)


def test_nccl_abi_header_matches_the_real_nccl_h(tmp_path):
    built = compile_check(ROOT / "csrc" / "nccl", tmp_path / "check")
    assert built.returncode == 0, built.stderr
    ran = subprocess.run([str(tmp_path / "check")], capture_output=True, text=True)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "nccl_abi.h matches nccl.h" in ran.stdout


@pytest.mark.parametrize(
    "wrong",
    [
        ("MP_NCCL_IN_PROGRESS = 7", "MP_NCCL_IN_PROGRESS = 9"),
        ("MP_NCCL_BFLOAT16 = 9", "MP_NCCL_BFLOAT16 = 10"),
        ("    int blocking;", "    int pad;\n    int blocking;"),
        ("mp_ncclComm_t comm, void *stream);\ntypedef mp_ncclResult_t (*mp_ncclRecv_fn)",
         "mp_ncclComm_t comm);\ntypedef mp_ncclResult_t (*mp_ncclRecv_fn)"),
        ("    _Bool hostRmaSupport;", "    int hostRmaSupport;"),
        ("    int sigIdx; /* 0 in 2.30 */\n    int ctx;", "    int ctx;\n    int sigIdx;"),
        ("unsigned int flags, mp_ncclComm_t comm, void *stream);\ntypedef mp_ncclResult_t (*mp_ncclSignal_fn)",
         "mp_ncclComm_t comm, void *stream);\ntypedef mp_ncclResult_t (*mp_ncclSignal_fn)"),
    ],
    ids=["result code", "datatype", "config layout", "prototype", "properties layout", "wait descriptor",
         "put prototype"],
)
def test_a_wrong_abi_value_fails_the_check(tmp_path, wrong):
    header = (ROOT / "csrc" / "nccl" / "nccl_abi.h").read_text()
    assert wrong[0] in header
    (tmp_path / "nccl_abi.h").write_text(header.replace(wrong[0], wrong[1]))
    built = compile_check(tmp_path, tmp_path / "check")
    assert built.returncode != 0, "a wrong nccl_abi.h compiled"
