"""The torchrun harness: each multi-rank test runs a worker script under torchrun in its own
session, with a wall-clock limit. Past the limit every rank's stacks are collected and the
process group is killed, so a test can fail but never hang the suite."""
from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from launcher import Launch

ROOT = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"


ENV_FAST = "MEGATRON_P2P_FAST_TESTS"  # set by make test-fast: run_job refuses to launch


@dataclass
class Job:
    returncode: int
    ranks: list[dict[str, Any] | None]  # per global rank: what the worker returned, or None
    output: str

    def ok(self) -> list[dict[str, Any]]:
        """Every rank's result, failing the test with the job's output if any rank failed."""
        bad = [r for r, res in enumerate(self.ranks) if res is None or not res.get("ok")]
        if bad:
            details = "\n".join(
                f"--- rank {r}: " + ("no result" if (res := self.ranks[r]) is None else res.get("traceback", ""))
                for r in bad
            )
            pytest.fail(f"ranks {bad} failed:\n{details}\n--- job output (tail):\n{self.output[-6000:]}")
        return self.ranks  # type: ignore[return-value]


def _stacks(result_dir: Path) -> str:
    parts = []
    for path in sorted(result_dir.glob("stack*.txt")):
        text = path.read_text(errors="replace").strip()
        parts.append(f"--- {path.stem}:\n{text or '(no stack: the rank had not started or had exited)'}")
    return "\n".join(parts)


def _job_pids(token: str) -> list[int]:
    """Every process carrying the job's token: torchrun starts each rank in a session of its
    own, so the launcher's process group does not reach them."""
    marker = f"MP_JOB_TOKEN={token}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def _signal_job(token: str, sig: int) -> None:
    for pid in _job_pids(token):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def run_job(
    worker: str,
    nproc: int,
    params: dict[str, Any] | None = None,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    prefix: list[str] | None = None,
) -> Job:
    """Runs tests/workers/<worker> on `nproc` ranks; each rank's body gets `params`. `prefix`: a
    command that runs torchrun (it execs the rest), such as one that enters a namespace first."""
    if os.environ.get(ENV_FAST):
        pytest.fail(f"this test launches a torchrun job ({worker}) but is not marked torchrun: "
                    "mark it @pytest.mark.torchrun (make test-fast runs the rest)")
    with tempfile.TemporaryDirectory(prefix="mp2p-job-") as tmp:
        result_dir = Path(tmp)
        job_env = dict(os.environ)
        job_env.update(
            MP_RESULT_DIR=str(result_dir),
            MP_PARAMS=json.dumps(params or {}),
            MP_JOB_TOKEN=result_dir.name,
            OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
            TORCHELASTIC_ERROR_FILE=str(result_dir / "torchelastic.json"),
        )
        job_env.update(env or {})
        args = ["--standalone", f"--nproc-per-node={nproc}", "--monitor-interval=0.2", str(WORKERS / worker)]
        launch = Launch(args, job_env, result_dir / "output.txt", prefix)
        returncode = launch.wait(timeout)
        if returncode is None:
            _signal_job(result_dir.name, signal.SIGUSR1)  # workers dump their stacks (harness.py)
            time.sleep(2.0)
            _signal_job(result_dir.name, signal.SIGKILL)
            launch.kill()
            pytest.fail(
                f"{worker} on {nproc} ranks passed its {timeout:.0f} s limit and was killed.\n"
                f"{_stacks(result_dir)}\n--- job output (tail):\n{launch.output()[-6000:]}"
            )
        output = launch.output()
        _signal_job(result_dir.name, signal.SIGKILL)  # a rank that outlived its launcher
        ranks: list[dict[str, Any] | None] = []
        for r in range(nproc):
            path = result_dir / f"rank{r}.json"
            ranks.append(json.loads(path.read_text()) if path.exists() else None)
        return Job(returncode, ranks, output)


def run_in_session(cmd: list[str], limit: float, *, merge_stderr: bool = False, **popen: Any) -> subprocess.CompletedProcess:
    """Runs `cmd` in a session of its own, so that on the `limit` (seconds) the whole of it is
    killed, every process it started included, and the test fails with its output."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
                            text=True, start_new_session=True, **popen)
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(map(str, cmd))} passed its {limit:.0f} s limit and was killed:\n"
                    f"{out[-5000:]}\n{(err or '')[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture
def torchrun():
    """torchrun(worker, nproc, params=None, timeout=120, env=None) -> Job"""
    return run_job


def shm_segments() -> set[str]:
    """Names of this package's shared-memory segments that exist now."""
    return {p.name for p in Path("/dev/shm").glob("mp2p-*")}


# ---- the torchrun mark --------------------------------------------------------------------------
# A test that launches processes under torchrun is marked `torchrun`, so that `make test-fast`
# (-m "not torchrun") runs the rest in seconds. An explicit mark counts; otherwise the mark is read
# from the source: the test's function or any fixture it uses mentions a launcher, or a function of
# its module that does, called by name. run_job refuses to launch in the fast run, so a test this
# misses fails there rather than slowing it down.
LAUNCHERS = ("run_job", "torch.distributed.run", "torchrun", "run_device_checks")
_launching: dict[str, tuple[str, ...]] = {}  # module name -> what names a launch in its source


def _in_tests(func: Any) -> bool:
    return Path(inspect.getsourcefile(func) or "/").resolve().is_relative_to(ROOT / "tests")


def _launch_words(module: Any) -> tuple[str, ...]:
    if module.__name__ not in _launching:
        sources = {name: inspect.getsource(obj) for name, obj in vars(module).items()
                   if inspect.isfunction(obj) and _in_tests(obj)}  # its own, and helpers it imports
        words, grew = list(LAUNCHERS), True
        while grew:  # a helper that calls a helper that launches
            grew = False
            for name, src in sources.items():
                if f"{name}(" not in words and any(w in src for w in words):
                    words.append(f"{name}(")
                    grew = True
        _launching[module.__name__] = tuple(words)
    return _launching[module.__name__]


def _launches(item: pytest.Function) -> bool:
    words = _launch_words(item.module)
    funcs = [item.function] + [d.func for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs]
    for func in funcs:
        try:
            src = inspect.getsource(func)
        except (OSError, TypeError):  # built-in fixtures
            continue
        if any(w in src for w in words + _launch_words(inspect.getmodule(func) or item.module)):
            return True
    return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if isinstance(item, pytest.Function) and not item.get_closest_marker("torchrun") and _launches(item):
            item.add_marker(pytest.mark.torchrun)
