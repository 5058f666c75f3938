"""The C tree's layers (docs/development.md, "Layout"): csrc/core is pure C; the shm and nccl transports sit on
it, side by side; csrc/python is the only layer of _C that sees Python; csrc/testing is the
separate _testing module. Checked on the includes of every file, and on the symbols of the
objects a plain build makes (what each file really calls), so a call across a layer is caught
even where no header names it."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

CSRC = ROOT / "csrc"
LAYERS = ("core", "shm", "nccl", "python", "testing")
# What each layer may include or call besides itself.
ALLOWED = {
    "core": set(),
    "shm": {"core"},
    "nccl": {"core"},
    "python": {"core", "shm", "nccl"},
    "testing": {"core", "shm", "python"},  # python/capi.h only: its capsule, not _C's code
}
PYTHON_LAYERS = {"python", "testing"}
MAX_C_LINES = 800
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)


def includes(path: Path) -> list[tuple[str, str]]:
    """(kind, name) of each #include of a file: kind '"' or '<'."""
    return INCLUDE.findall(path.read_text())


def layer_violations(root: Path) -> list[str]:
    """Every include under `root` (a csrc tree) that breaks a layer rule, one line each."""
    found = []
    for path in sorted(root.glob("*/*.[ch]")):
        layer, rel = path.parent.name, path.relative_to(root)
        if layer not in LAYERS:
            found.append(f"{rel}: {layer}/ is not a layer ({', '.join(LAYERS)})")
            continue
        for kind, name in includes(path):
            if kind == "<":
                if name in ("Python.h", "structmember.h") and layer not in PYTHON_LAYERS:
                    found.append(f"{rel} includes <{name}> outside the bindings and _testing")
                continue
            target = root / name if "/" in name else path.parent / name
            if not target.is_file():
                found.append(f'{rel} includes "{name}", which is no file of csrc/')
            elif target.parent.name != layer and target.parent.name not in ALLOWED[layer]:
                found.append(f'{rel} ({layer}) includes "{name}" ({target.parent.name})')
    return found


def test_every_include_follows_the_layers():
    assert layer_violations(CSRC) == []


@pytest.mark.parametrize(
    ("path", "line", "reported"),
    [
        ("core/extra.h", '#include "shm/segment.h"', "core/extra.h (core) includes \"shm/segment.h\" (shm)"),
        ("shm/extra.c", '#include "nccl/nccl_abi.h"', "shm/extra.c (shm) includes \"nccl/nccl_abi.h\" (nccl)"),
        ("nccl/extra.c", '#include "shm/segment.h"', "nccl/extra.c (nccl) includes \"shm/segment.h\" (shm)"),
        ("shm/extra.c", "#include <Python.h>", "shm/extra.c includes <Python.h> outside the bindings and _testing"),
        ("core/extra.c", "#include <structmember.h>", "core/extra.c includes <structmember.h> outside"),
        ("python/extra.c", '#include "testing/shm_corrupt.h"', "python/extra.c (python) includes"),
        ("python/extra.c", '#include "no_such.h"', 'python/extra.c includes "no_such.h", which is no file'),
    ],
)
def test_an_include_across_the_layers_is_reported(tmp_path, path, line, reported):
    tree = tmp_path / "csrc"
    for layer in LAYERS:
        (tree / layer).mkdir(parents=True)
    for name in ("shm/segment.h", "nccl/nccl_abi.h", "testing/shm_corrupt.h", "core/op.h"):
        (tree / name).write_text("")
    (tree / path).write_text(line + "\n")
    violations = layer_violations(tree)
    assert len(violations) == 1 and violations[0].startswith(reported), violations


@pytest.mark.parametrize(
    ("path", "line"),
    [
        ("shm/extra.c", '#include "core/op.h"'),
        ("shm/extra.c", '#include "segment.h"'),
        ("python/extra.c", '#include "shm/segment.h"'),
        ("python/extra.c", "#include <Python.h>"),
        ("testing/extra.c", '#include "shm/segment.h"'),
        ("core/extra.c", "#include <stdatomic.h>"),
    ],
)
def test_an_include_within_the_layers_is_not_reported(tmp_path, path, line):
    tree = tmp_path / "csrc"
    for layer in LAYERS:
        (tree / layer).mkdir(parents=True)
    for name in ("shm/segment.h", "core/op.h"):
        (tree / name).write_text("")
    (tree / path).write_text(line + "\n")
    assert layer_violations(tree) == []


def test_no_c_file_is_over_800_lines():
    long = {str(p.relative_to(CSRC)): n for p in CSRC.glob("*/*.[ch]") if (n := len(p.read_text().splitlines())) > MAX_C_LINES}
    assert long == {}


# ---- what the objects call -------------------------------------------------------------------

@pytest.fixture(scope="module")
def plain_build(tmp_path_factory):
    """setup.py as `pip install .` runs it (no MEGATRON_P2P_TESTING), into a scratch folder."""
    out = tmp_path_factory.mktemp("plain_build")
    env = {k: v for k, v in os.environ.items() if k not in ("MEGATRON_P2P_TESTING", "MEGATRON_P2P_SANITIZE")}
    subprocess.run([sys.executable, "setup.py", "--quiet", "build_ext", "-j", "2", "--build-temp", str(out / "temp"),
                    "--build-lib", str(out / "lib")], cwd=ROOT, env=env, check=True, capture_output=True)
    return out


def symbols(objects: list[Path]) -> dict[str, tuple[set[str], set[str]]]:
    """Per object (layer/name): the global symbols it defines and those it uses."""
    table = {}
    for obj in objects:
        defined: set[str] = set()
        used: set[str] = set()
        for line in subprocess.run(["nm", "-P", "-g", str(obj)], capture_output=True, text=True, check=True).stdout.splitlines():
            name, kind = line.split()[:2]
            (used if kind in "Uw" else defined).add(name)
        table[f"{obj.parent.name}/{obj.stem}"] = (defined, used)
    return table


def calls_across(table) -> set[tuple[str, str]]:
    """(caller, callee) for every pair of objects where the first uses a symbol the second defines."""
    owner = {name: obj for obj, (defined, _) in table.items() for name in defined}
    return {(obj, owner[name]) for obj, (_, used) in table.items() for name in used if name in owner and owner[name] != obj}


def test_a_plain_build_makes_the_extension_without_the_test_hooks(plain_build):
    built = sorted(p.name.split(".")[0] for p in (plain_build / "lib" / "megatron_p2p").glob("*.so"))
    assert built == ["_C"]


def test_every_call_goes_down_the_layers(plain_build):
    objects = sorted((plain_build / "temp" / "csrc").glob("*/*.o"))
    assert {o.parent.name for o in objects} == {"core", "shm", "nccl", "python"}
    wrong = sorted(f"{a} calls {b}" for a, b in calls_across(symbols(objects))
                   if a.split("/")[0] != b.split("/")[0] and b.split("/")[0] not in ALLOWED[a.split("/")[0]])
    assert wrong == []


def test_requests_and_the_session_call_nothing_above_them(plain_build):
    """communicator -> request -> session -> errors: each calls only what is below it."""
    objects = sorted((plain_build / "temp" / "csrc" / "python").glob("*.o"))
    order = ["errors", "session", "request", "communicator"]

    def rank(obj):
        stem = obj.split("/")[1]
        return next((i for i, unit in enumerate(order) if stem == unit or stem.startswith(unit + "_")), None)

    upward = sorted(f"{a} calls {b}" for a, b in calls_across(symbols(objects))
                    if rank(a) is not None and rank(b) is not None and rank(b) > rank(a))
    assert upward == []


def test_an_upward_call_is_found_in_the_objects(tmp_path):
    """The symbol check can fail: a core object that calls a bindings function is caught, and
    one that calls only the core is not."""
    (tmp_path / "core").mkdir()
    (tmp_path / "python").mkdir()
    sources = {
        "python/binding.c": "int mp_binding(void) { return 1; }\n",
        "core/low.c": "int mp_low(void) { return 2; }\n",
        "core/wrong.c": "int mp_binding(void);\nint mp_wrong(void) { return mp_binding(); }\n",
        "core/right.c": "int mp_low(void);\nint mp_right(void) { return mp_low(); }\n",
    }
    for rel, text in sources.items():
        (tmp_path / rel).write_text(text)
        subprocess.run(["gcc", "-c", str(tmp_path / rel), "-o", str((tmp_path / rel).with_suffix(".o"))], check=True)
    calls = calls_across(symbols(sorted(tmp_path.glob("*/*.o"))))
    assert calls == {("core/wrong", "python/binding"), ("core/right", "core/low")}
