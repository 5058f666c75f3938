"""Runs one torchrun job of benchmarks/worker.py with a wall-clock limit, echoing its output
line by line. Past the limit every rank's stacks are dumped (faulthandler) and the whole job
is killed, so a benchmark run can fail but never hang."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WORKER = Path(__file__).resolve().parent / "worker.py"


@dataclass
class JobResult:
    name: str
    ranks: int
    returncode: int
    seconds: float
    timed_out: bool
    result: dict[str, Any] | None  # what rank 0 wrote, None when it wrote nothing
    output: str


def job_pids(marker: str) -> list[int]:
    """Every other process whose environment holds `marker` ("NAME=value"): torchrun puts each
    rank in a session of its own, so killing the launcher's process group would miss them."""
    wanted = marker.encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if wanted in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def _signal_job(token: str, sig: int) -> None:
    for pid in job_pids(f"MP_BENCH_TOKEN={token}"):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def run_job(name: str, ranks: int, params: dict[str, Any], out_dir: Path, limit_s: float) -> JobResult:
    """Runs the sections in `params` on `ranks` ranks; rank 0's results land in out_dir/<name>.json."""
    token = uuid.uuid4().hex
    result_path = out_dir / f"{name}.json"
    result_path.unlink(missing_ok=True)
    env = dict(os.environ)
    env.update(
        MP_BENCH_TOKEN=token,
        MP_BENCH_PARAMS=json.dumps(params),
        MP_BENCH_RESULT=str(result_path),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
           "--monitor-interval=0.2", str(WORKER)]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    timed_out = threading.Event()

    def on_limit() -> None:
        timed_out.set()
        print(f"[{name}] passed its {limit_s:.0f} s limit: dumping stacks and killing the job", flush=True)
        _signal_job(token, signal.SIGUSR1)  # worker.py dumps every thread's stack
        time.sleep(2.0)
        _signal_job(token, signal.SIGKILL)

    timer = threading.Timer(limit_s, on_limit)
    timer.start()
    lines = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            print(line, end="", flush=True)
        proc.wait()
    finally:
        timer.cancel()
        _signal_job(token, signal.SIGKILL)  # a rank that outlived its launcher
    result = json.loads(result_path.read_text()) if result_path.exists() else None
    return JobResult(name, ranks, proc.returncode, time.monotonic() - start, timed_out.is_set(), result,
                     "".join(lines))
