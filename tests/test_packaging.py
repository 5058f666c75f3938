"""What a user installing the package gets beside the code: one version, read by the package, the
tools and pip's metadata alike, a declared licence, and signatures inspect reads (the stubs are
held to them by `make lint`'s stubtest)."""
from __future__ import annotations

import inspect
import re
import subprocess
import sys
import tomllib

import pytest
from conftest import ROOT

import megatron_p2p
from megatron_p2p import _C, _version

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_version_is_written_once_and_pips_metadata_reads_it_from_there():
    project = PYPROJECT["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "megatron_p2p._version.__version__"}
    assert megatron_p2p.__version__ == _version.__version__


@pytest.mark.parametrize("tool", ["check", "trace", "replay"])
def test_each_tool_prints_the_packages_version(tool):
    done = subprocess.run([sys.executable, "-m", f"megatron_p2p.{tool}", "--version"], capture_output=True, text=True,
                          cwd=ROOT)
    assert done.returncode == 0 and done.stdout == f"megatron_p2p {megatron_p2p.__version__}\n", done.stderr


def test_the_licence_is_bsd_3_clause_in_the_file_and_in_the_metadata():
    assert (ROOT / "LICENSE").read_text().startswith("BSD 3-Clause License\n")
    assert PYPROJECT["project"]["license"] == "BSD-3-Clause" and PYPROJECT["project"]["license-files"] == ["LICENSE"]


def test_the_changelog_has_an_entry_for_this_version():
    assert f"## {megatron_p2p.__version__} " in (ROOT / "CHANGELOG.md").read_text()


@pytest.mark.parametrize("version", ["2.13.0", "2.14.1+cu130", "2.14.0a0+git1234"])
def test_a_torch_in_the_tested_range_gets_no_warning(version):
    assert _version.untested_torch(version) is None


@pytest.mark.parametrize("version", ["2.12.1", "2.15.0", "3.0.0", "nightly"])
def test_a_torch_outside_the_tested_range_gets_a_warning_naming_the_range(version):
    message = _version.untested_torch(version)
    assert message is not None and "tested with torch 2.13 to 2.14" in message and repr(version)[1:-1] in message


def test_importing_the_package_with_an_untested_torch_warns_once():
    code = ("import torch, warnings\ntorch.__version__ = '2.99.0'\nwarnings.simplefilter('always')\n"
            "with warnings.catch_warnings(record=True) as w:\n    import megatron_p2p\n"
            "print([str(x.message) for x in w if 'tested with torch' in str(x.message)])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    expected = f"megatron_p2p {megatron_p2p.__version__} is tested with torch 2.13 to 2.14, not torch 2.99.0"
    assert done.stdout.strip() == repr([expected])


def test_the_declared_torch_bound_is_the_tested_range():
    (lo_major, lo_minor), (hi_major, hi_minor) = _version.TESTED_TORCH
    assert f"torch>={lo_major}.{lo_minor},<{hi_major}.{hi_minor + 1}" in PYPROJECT["project"]["dependencies"]


def test_the_optional_dependencies_are_declared_as_extras():
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert set(extras) == {"megatron", "plot", "nccl"}
    assert extras["megatron"][0].startswith("megatron-core") and extras["plot"] == ["matplotlib"]


def test_the_megatron_extra_asks_for_the_megatron_core_the_suite_tests_or_later():
    """On Python 3.11 an unbounded extra resolved megatron-core 0.16.1, which the suite never runs."""
    [tested] = set(re.findall(r"megatron-core==([0-9.]+)", (ROOT / "Makefile").read_text()))  # one pin, each venv
    assert PYPROJECT["project"]["optional-dependencies"]["megatron"] == [f"megatron-core>={tested}"]


def make_plan(target: str, tmp_path) -> str:
    """What `make <target>` would install on a fresh machine (a virtual environment not yet made):
    its pip and apt-get command lines, without the environment's path."""
    venv = tmp_path / "venv"
    done = subprocess.run(["make", "-n", target, f"VENV={venv}"], capture_output=True, text=True, cwd=ROOT, check=True)
    return "\n".join(line.replace(str(venv), "VENV") for line in done.stdout.splitlines()
                     if "pip install" in line or "apt-get" in line)


def test_make_demo_sets_up_torch_and_the_package_only(tmp_path):
    plan = make_plan("demo", tmp_path)
    assert "torch==2.13.0" in plan
    for test_only in ("pytest", "megatron-core", "triton", "hypothesis", "nvidia-nccl", "apt-get"):
        assert test_only not in plan, test_only


def test_make_test_sets_up_the_test_tools_too(tmp_path):
    plan = make_plan("test", tmp_path)
    for tool in ("torch==2.13.0", "pytest", "megatron-core", "hypothesis", "nvidia-nccl"):
        assert tool in plan, tool


@pytest.mark.parametrize("owner", [_C, _C.Communicator, _C.Request], ids=["module", "Communicator", "Request"])
def test_each_public_callable_of_the_extension_has_a_signature_inspect_reads(owner):
    names = [n for n, v in vars(owner).items() if callable(v) and not n.startswith("_") and not isinstance(v, type)]
    unsigned = []
    for name in names:
        try:
            inspect.signature(getattr(owner, name))
        except ValueError:
            unsigned.append(name)
    assert names and unsigned == [], unsigned


def test_the_communicator_class_has_its_constructors_signature():
    assert list(inspect.signature(_C.Communicator).parameters)[:4] == ["backend", "unique_id", "group_rank", "ranks"]


def test_a_wheel_holds_the_package_its_stub_and_licence_and_no_test_hooks(tmp_path):
    """What `pip install .` installs, built from the tracked files alone (as a clean clone has them)."""
    import zipfile

    src = tmp_path / "src"
    for name in subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes((ROOT / name).read_bytes())
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(src)], check=True, capture_output=True, text=True)
    [wheel] = (tmp_path / "dist").glob("megatron_p2p-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert [n for n in names if n.startswith("megatron_p2p/_C.") and n.endswith(".so")], names
    for shipped in ("megatron_p2p/_C.pyi", "megatron_p2p/py.typed", "megatron_p2p/verify/__init__.py",
                    "megatron_p2p/programs/naive_send_first_ring.json"):
        assert shipped in names, shipped
    assert [n for n in names if n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE")], names
    assert [n for n in names if "_testing" in n or n.startswith("tests/")] == []
