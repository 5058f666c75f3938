"""The one table of the package's environment variables (megatron_p2p/_env.py): the docs hold
what it generates, every MEGATRON_P2P_ name the sources use is in it, and each reader names the
variable when it refuses a value."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron_p2p import _C, _env

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "environment.md"
PREFIX = "MEGATRON_P2P" + "_"  # spelled apart so that this file's own text never reads as a variable
NAME = re.compile(PREFIX + r"[A-Z0-9_]+")
# Where the package and its C core read variables, and where the build, the tests and the docs name them.
PACKAGE_SOURCES = ["megatron_p2p/**/*.py", "csrc/**/*.[ch]"]
OTHER_SOURCES = ["setup.py", "Makefile", "tests/**/*.py", "tests/**/*.[ch]", "benchmarks/**/*.py", "README.md",
                 "docs/*.md"]


def names_in(patterns: list[str]) -> dict[str, str]:
    """Every MEGATRON_P2P_ name in the files `patterns` match (but the table's and this file), with
    one file that names it."""
    found: dict[str, str] = {}
    for pattern in patterns:
        for path in sorted(ROOT.glob(pattern)):
            # The table by its place in the tree: under `make sanitize` the imported _env is a copy elsewhere.
            if path.is_file() and path not in (Path(__file__).resolve(), ROOT / "megatron_p2p" / "_env.py"):
                for name in NAME.findall(path.read_text(errors="replace")):
                    found.setdefault(name, str(path.relative_to(ROOT)))
    return found


def test_the_docs_table_is_the_generated_one():
    text = DOC.read_text()
    start = text.index(_env.DOC_BEGIN) + len(_env.DOC_BEGIN) + 1
    assert text[start:text.index(_env.DOC_END)] == _env.markdown(), "docs/environment.md is stale: run `make docs`"


def test_make_docs_rewrites_only_the_generated_part(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(f"before\n{_env.DOC_BEGIN}\n| a stale table |\n{_env.DOC_END}\nafter\n")
    _env.write_docs(page)
    assert page.read_text() == f"before\n{_env.DOC_BEGIN}\n{_env.markdown()}{_env.DOC_END}\nafter\n"


def test_the_readme_links_the_docs_table():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Environment variables"):]
    section = section[:section.index("\n## ", 1)]
    assert "docs/environment.md" in section
    assert "| `" + PREFIX not in section, "a hand-written table of the variables is back in the README"


def test_every_variable_the_package_reads_is_in_the_table():
    table = set(_env.BY_NAME)
    developer = {v.name for v in _env.DEVELOPER_VARIABLES}
    assert not table & developer
    in_package = names_in(PACKAGE_SOURCES)
    missing = {n: f for n, f in in_package.items() if n not in table}
    assert not missing, f"read by the package but not in megatron_p2p/_env.py's VARIABLES: {missing}"
    # and nothing stale: every row is a variable the package does read
    assert table <= set(in_package), table - set(in_package)


def test_every_other_name_in_the_sources_is_a_variable_of_either_table():
    table = set(_env.BY_NAME) | {v.name for v in _env.DEVELOPER_VARIABLES}
    elsewhere = names_in(OTHER_SOURCES)
    unknown = {n: f for n, f in elsewhere.items() if n not in table}
    assert not unknown, f"not in megatron_p2p/_env.py (VARIABLES, or DEVELOPER_VARIABLES): {unknown}"
    assert {v.name for v in _env.DEVELOPER_VARIABLES} <= set(elsewhere)


def test_the_c_cores_variables_are_read_in_c():
    c_sources = names_in(["csrc/**/*.[ch]"])
    for var in _env.VARIABLES:
        if var.read_by == _env.C_CORE:
            assert var.name in c_sources, var.name


def test_every_type_has_its_reader_and_every_row_a_known_type():
    assert set(_env.READERS) == set(_env.EXPECTED)
    for var in _env.VARIABLES:
        assert var.type in _env.READERS and var.meaning.endswith("."), var
        assert (var.type == "choice") == bool(var.choices), var


# (variable, wrong value, valid value, what the valid value reads as)
CASES = [
    ("MEGATRON_P2P_CHECK", "maybe", "on", True),
    ("MEGATRON_P2P_SHM_SINGLE_COPY", "2", "0", False),
    ("MEGATRON_P2P_STALL_SECONDS", "-1", "2.5", 2.5),
    ("MEGATRON_P2P_STALL_SECONDS", "soon", "1e-3", 1e-3),
    ("MEGATRON_P2P_SHM_ARENA_BYTES", "1.5", "4096", 4096),
    ("MEGATRON_P2P_SHM_ARENA_BYTES", str(_C.MAX_ARENA_BYTES + 1), "0", 0),
    ("MEGATRON_P2P_SHM_ARENA_BYTES", "", str(_C.MAX_ARENA_BYTES), _C.MAX_ARENA_BYTES),
    ("MEGATRON_P2P_ASYNC_ERROR_HANDLING", "abort", "raise", "raise"),
]


@pytest.mark.parametrize("name,wrong,valid,read", CASES, ids=[f"{c[0]}={c[1]!r}" for c in CASES])
def test_a_reader_refuses_a_wrong_value_naming_the_variable_and_takes_a_valid_one(monkeypatch, name, wrong, valid,
                                                                                   read):
    var = _env.BY_NAME[name]
    reader = _env.READERS[var.type]
    monkeypatch.setenv(name, wrong)
    with pytest.raises(ValueError) as caught:
        reader(name)
    assert str(caught.value).startswith(f"${name}={wrong!r}: expected {var.expected}"), caught.value
    monkeypatch.setenv(name, valid)
    assert reader(name) == read


@pytest.mark.parametrize("var", _env.VARIABLES, ids=lambda v: v.name)
def test_unset_reads_as_the_tables_default(monkeypatch, var):
    monkeypatch.delenv(var.name, raising=False)
    got = _env.READERS[var.type](var.name)
    if var.default is None:
        assert got is None
    else:
        monkeypatch.setenv(var.name, var.default)
        assert got == _env.READERS[var.type](var.name)


def test_the_directory_reader_names_the_variable_for_a_file_and_takes_a_directory(monkeypatch, tmp_path):
    name = "MEGATRON_P2P_TRACE_DIR"
    afile = tmp_path / "afile"
    afile.write_text("")
    monkeypatch.setenv(name, str(afile))
    with pytest.raises(ValueError, match=re.escape(f"${name}={str(afile)!r}: expected a directory")):
        _env.directory(name)
    monkeypatch.setenv(name, str(tmp_path / "made"))
    assert _env.directory(name) == tmp_path / "made" and (tmp_path / "made").is_dir()


def test_the_path_reader_leaves_the_check_to_the_loader(monkeypatch):
    monkeypatch.setenv("MEGATRON_P2P_NCCL_LIBRARY", "/nowhere/libnccl.so.2")
    assert _env.path("MEGATRON_P2P_NCCL_LIBRARY") == "/nowhere/libnccl.so.2"
    monkeypatch.setenv("MEGATRON_P2P_NCCL_LIBRARY", "")
    assert _env.path("MEGATRON_P2P_NCCL_LIBRARY") is None


def test_the_package_reads_through_the_table(monkeypatch):
    """The readers the modules kept (stall_seconds, _watchdog.handling, flight_recorder.trace_dir)
    are the table's."""
    from megatron_p2p import _stall, _watchdog, flight_recorder

    monkeypatch.setenv("MEGATRON_P2P_STALL_SECONDS", "0")
    with pytest.raises(ValueError, match=re.escape("$MEGATRON_P2P_STALL_SECONDS='0'")):
        _stall.stall_seconds()
    monkeypatch.delenv("MEGATRON_P2P_STALL_SECONDS")
    assert _stall.stall_seconds() == _stall.DEFAULT_SECONDS == 1.0
    monkeypatch.setenv("MEGATRON_P2P_ASYNC_ERROR_HANDLING", "")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert _watchdog.handling() == "raise"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    assert _watchdog.handling() == "end"
    monkeypatch.delenv("MEGATRON_P2P_TRACE_DIR", raising=False)
    assert flight_recorder.trace_dir() is None
