"""What a user installing the package gets beside the code: one version, read by the package, the
tools and pip's metadata alike, and a declared licence."""
from __future__ import annotations

import subprocess
import sys
import tomllib

import pytest
from conftest import ROOT

import megatron_p2p
from megatron_p2p import _version

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
