"""The Python package's layout: the runtime apart from the verification tools (megatron_p2p.verify),
which `import megatron_p2p` does not load; the tools' old import paths and `python -m` commands
kept by shims that are the moved modules themselves; no import circle among the modules."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megatron_p2p"
TOOLS = ["program", "simulate", "check", "replay", "trace", "timeline", "schedules", "torch_schedules",
         "megatron_recording"]
COMMANDS = ["check", "replay", "trace"]


def loaded_by(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys\nprint(' '.join(sys.modules))"],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
    return {m for m in out.split() if m.startswith("megatron_p2p")}


def test_importing_the_package_loads_no_verification_tool():
    loaded = loaded_by("import megatron_p2p")
    assert "megatron_p2p.communicator" in loaded, loaded
    assert not {m for m in loaded if m.startswith("megatron_p2p.verify") or m.split(".")[-1] in TOOLS}, loaded


def test_importing_a_tool_loads_the_verification_package():
    assert "megatron_p2p.verify.trace" in loaded_by("import megatron_p2p.trace")


@pytest.mark.parametrize("tool", TOOLS)
def test_a_tools_old_import_path_is_the_moved_module_itself(tool):
    import importlib

    old, new = importlib.import_module(f"megatron_p2p.{tool}"), importlib.import_module(f"megatron_p2p.verify.{tool}")
    assert old is new


def command_modules() -> list[str]:
    """Every `python -m megatron_p2p.<module>` the package has: the modules that run as __main__."""
    return sorted(".".join(p.relative_to(ROOT).with_suffix("").parts) for p in PACKAGE.rglob("*.py")
                  if '__name__ == "__main__"' in p.read_text())


def test_the_tools_commands_run_from_their_old_and_their_new_path():
    assert {f"{where}.{c}" for c in COMMANDS for where in ("megatron_p2p", "megatron_p2p.verify")} <= \
        set(command_modules())


@pytest.mark.parametrize("module", command_modules())
def test_every_command_prints_its_usage_without_a_warning(module):
    done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr
    assert "Warning" not in done.stderr, done.stderr  # runpy's, when the package imports the module first


# The modules a user may import by name; every other module of the package starts with an
# underscore (torch.distributed.pipelining's rule), so a new module is private unless added here.
PUBLIC_MODULES = {
    "communicator", "ops", "nccl", "megatron_patch", "pipelining_patch",  # what __init__ re-exports
    "flight_recorder",  # the dumps `trace` reads
    "p2p_communication",  # megatron-core's module path
    "demo",  # python -m megatron_p2p.demo
    "verify", *TOOLS,  # the verification tools and their old paths
}


def test_every_module_is_public_by_name_or_private_by_its_underscore():
    names = {p.stem for p in PACKAGE.glob("*.py")} | {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert {n for n in names if not n.startswith("_")} == PUBLIC_MODULES


def module_imports(path: Path, root: Path) -> set[str]:
    """The modules (and names, which may be modules) of the package at `root` that `path` imports
    when it is loaded: module-level imports, not those under `if TYPE_CHECKING:` nor in functions."""
    here = path.relative_to(root.parent).with_suffix("").parts[:-1]  # the package `from .` means
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, (ast.If, ast.Try)):
                visit(node.body + node.orelse + getattr(node, "finalbody", []))
            elif isinstance(node, ast.ImportFrom) and node.level:
                base = ".".join(here[: len(here) - node.level + 1] + ((node.module,) if node.module else ()))
                # `from . import x` names modules of the package, which is loaded before them anyway
                found.update(([base] if node.module else []) + [f"{base}.{a.name}" for a in node.names])
            elif isinstance(node, ast.ImportFrom) and node.module:
                found.update([node.module] + [f"{node.module}.{a.name}" for a in node.names])
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)

    visit(ast.parse(path.read_text()).body)
    return found


def import_circles(root: Path) -> list[list[str]]:
    """Every circle of module-level imports among the modules of the package at `root`."""
    modules = {".".join(p.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__"): p
               for p in root.rglob("*.py")}
    graph = {m: sorted(i for i in module_imports(p, root) if i in modules and i != m) for m, p in modules.items()}
    circles, state = [], {}

    def walk(m: str, path: list[str]) -> None:
        state[m] = "open"
        for n in graph[m]:
            if state.get(n) == "open":
                circles.append(path[path.index(n):] + [n])
            elif n not in state:
                walk(n, path + [n])
        state[m] = "done"

    for m in sorted(modules):
        if m not in state:
            walk(m, [m])
    return circles


def test_no_module_of_the_package_imports_itself_through_others():
    assert import_circles(PACKAGE) == []


def test_an_import_circle_is_found_and_a_type_checking_import_is_not_one(tmp_path):
    pkg = tmp_path / "megatron_p2p"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("from .a import x\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import d\n")
    (pkg / "d.py").write_text("from . import c\n")
    assert import_circles(pkg) == [["megatron_p2p.a", "megatron_p2p.b", "megatron_p2p.a"]]
