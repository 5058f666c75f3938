"""The NCCL backend with two processes on one GPU, where NCCL allows it (NCCL 2.30 and later,
with NCCL_MULTI_RANK_GPU_ENABLE=1), else with one rank exchanging with itself: launches
two_process_worker.py under torchrun and judges each part from what every rank wrote.

- main job (MEGATRON_P2P_ASYNC_ERROR_HANDLING=raise): exact bytes, 1F1B, debug matching and
  its cost, a captured 1F1B step replayed against eager execution, a capture (global mode)
  after eager steps waited on the stream only, the watchdog raising, and comm.abort() and
  comm.close() with a captured graph still alive (each bounded, within 1 s);
- end job (the handling's default under torchrun): the watchdog ends the stalled rank with
  status 70 and torchrun ends the job within END_WITHIN_S of the stall.

With --model, the same jobs run on the model of libcuda and libnccl under tests/fakes/ (the dry
run; `make fakes` builds it): only the libraries differ (see target.py).

Prints one PASS/FAIL line per check with its time, writes <out>/two_process.json, and exits
nonzero when a check failed. Every job has a wall-clock limit inside the budget.

    python tests/gpu/two_process_checks.py [--model] [--out DIR] [--budget SECONDS]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE.parents[1]))  # the source tree, when not installed
sys.path.append(str(HERE.parents[1] / "benchmarks"))
import megatron_p2p as mp  # noqa: E402
import target  # noqa: E402
from launch import job_pids  # noqa: E402

WORKER = HERE / "two_process_worker.py"
# graph_abort last: a rank that hangs in it (each call is bounded by a thread join) loses no other part.
MAIN_PARTS = ["setup", "exact_bytes", "one_f_one_b", "debug_matching", "cuda_graph", "capture_after_wait",
              "watchdog_raise", "graph_abort"]
MULTI_RANK_NCCL = (2, 30, 0)
ENV_MULTI_RANK = "NCCL_MULTI_RANK_GPU_ENABLE"
ENV_HANDLING = "MEGATRON_P2P_ASYNC_ERROR_HANDLING"
MAIN_LIMIT_S = 110.0
END_LIMIT_S = 40.0
END_WITHIN_S = 10.0


@dataclass
class Job:
    nproc: int
    returncode: Optional[int]  # None: killed at its limit
    output: str
    ranks: list[dict[str, Any]] = field(default_factory=list)  # per rank: part -> result ({} if none)
    ended_at: float = 0.0  # time.time() when the launcher was done


def _signal_job(token: str, sig: int, spare: Optional[int] = None) -> None:
    for pid in job_pids(f"MP_GPU_JOB_TOKEN={token}"):
        if pid == spare:
            continue
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


_running: list[str] = []  # the token of the job under way


def _end_running_job(signum: int, frame: Any) -> None:
    """Ranks live in sessions of their own: a limit that ends this launcher ends them too."""
    for token in _running:
        _signal_job(token, signal.SIGKILL)
    sys.exit(128 + signum)


def launch(nproc: int, parts: list[str], out: Path, limit: float, env: dict[str, Optional[str]]) -> Job:
    """Runs the worker on `nproc` ranks, echoing its output as it comes; past `limit` seconds the
    ranks dump their stacks and the job is killed. env: variables to set (None: to unset)."""
    out.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex
    job_env = dict(os.environ, MP_GPU_JOB_TOKEN=token, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    for k, v in env.items():
        if v is None:
            job_env.pop(k, None)
        else:
            job_env[k] = v
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "--monitor-interval=0.2", str(WORKER), "--parts", ",".join(parts), "--out", str(out)]
    print(f"$ {' '.join(f'{k}={v}' for k, v in env.items() if v is not None)} torchrun --nproc-per-node={nproc} "
          f"{WORKER.name} --parts {','.join(parts)}   (limit {limit:.0f} s)", flush=True)
    _running[:] = [token]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=job_env,
                            start_new_session=True)
    lines: list[str] = []

    def echo() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            print(f"  | {line}", end="", flush=True)

    reader = threading.Thread(target=echo, daemon=True)
    reader.start()
    try:
        returncode: Optional[int] = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        print(f"  the job passed its {limit:.0f} s limit: stacks, then kill", flush=True)
        _signal_job(token, signal.SIGUSR1, spare=proc.pid)  # SIGUSR1 would end torchrun and its store
        time.sleep(2.0)
        _signal_job(token, signal.SIGKILL)
        proc.wait()
        returncode = None
    ended_at = time.time()
    _signal_job(token, signal.SIGKILL)  # a rank that outlived its launcher
    _running.clear()
    reader.join(timeout=5.0)
    ranks = []
    for r in range(nproc):
        path = out / f"rank{r}.json"
        ranks.append(json.loads(path.read_text()) if path.exists() else {})
    return Job(nproc, returncode, "".join(lines), ranks, ended_at)


def verdict(job: Job, part: str) -> dict[str, Any]:
    """A part passes when every rank ran it and passed."""
    results = [r.get(part) for r in job.ranks]
    ok = all(res is not None and res.get("ok") for res in results)
    seconds = max((res["seconds"] for res in results if res), default=0.0)
    details = [f"rank {r}: " + (res["detail"] if res else "no result (the rank died or was killed first)")
               for r, res in enumerate(results)]
    return {"ok": ok, "seconds": seconds, "details": details, "ranks": results}


def end_verdict(job: Job) -> dict[str, Any]:
    posted = re.search(r"STALL_POSTED rank=0 ([0-9.]+)", job.output)
    ended_after = job.ended_at - float(posted.group(1)) if posted else None
    status_70 = re.search(r"exitcode\s*:\s*70\b", job.output) is not None
    problems = []
    if job.returncode in (None, 0):
        problems.append("killed at its limit" if job.returncode is None else "torchrun returned 0")
    if not status_70:
        problems.append("no rank ended with status 70")
    if ended_after is None:
        problems.append("the stall was never posted")
    elif ended_after > END_WITHIN_S:
        problems.append(f"the job ended {ended_after:.1f} s after the stall (limit {END_WITHIN_S:.0f} s)")
    detail = (f"torchrun returned {job.returncode}, a rank ended with status 70: {status_70}, job over "
              + (f"{ended_after:.1f} s after the stall" if ended_after is not None else "(no stall seen)"))
    return {"ok": not problems, "detail": detail + ("; " + "; ".join(problems) if problems else ""),
            "ended_after_s": ended_after, "returncode": job.returncode}


def choose_ranks() -> tuple[int, str, dict[str, Any]]:
    """Two ranks when megatron_p2p's libnccl allows two processes on one GPU, else one."""
    ours = mp.nccl_version()
    try:
        theirs = torch.cuda.nccl.version()
    except Exception as exc:  # noqa: BLE001 - only reported
        theirs = f"unknown ({exc})"
    versions = {"megatron_p2p": list(ours.version), "megatron_p2p_path": ours.path, "torch": str(theirs)}
    print(f"NCCL: megatron_p2p loads {'.'.join(map(str, ours.version))} ({ours.source}: {ours.path}); "
          f"torch was built with {theirs}", flush=True)
    named = "NCCL " + ".".join(map(str, ours.version))
    if ours.version >= MULTI_RANK_NCCL:
        return 2, f"{named} >= 2.30: two processes on cuda:0 ({ENV_MULTI_RANK}=1)", versions
    return 1, f"{named} < 2.30 has no multi-rank GPU: the self-loop (one rank)", versions


def run_all(out: Path, budget: float, model: bool = False) -> dict[str, Any]:
    """Runs both jobs within `budget` seconds, on the model when `model`; prints and returns every
    verdict."""
    if model:
        os.environ.update(target.model_env())  # this process's own NCCL version, and the ranks'
    deadline = time.monotonic() + budget
    nproc, why, versions = choose_ranks()
    print(why, flush=True)

    def multi(n: int) -> dict[str, Optional[str]]:
        return {ENV_MULTI_RANK: "1"} if n > 1 else {}

    def main_job(n: int) -> Job:
        limit = max(10.0, min(MAIN_LIMIT_S, deadline - time.monotonic() - END_LIMIT_S))
        return launch(n, MAIN_PARTS, out / f"main_{n}rank", limit, {**multi(n), ENV_HANDLING: "raise"})

    start = time.monotonic()
    job = main_job(nproc)
    if nproc == 2 and not verdict(job, "setup")["ok"] and deadline - time.monotonic() > END_LIMIT_S + 30:
        print("two processes on one GPU did not come up: falling back to the self-loop (one rank)", flush=True)
        failure = " | ".join(verdict(job, "setup")["details"])[:800]
        why += f"; they did not come up ({failure}), so the self-loop ran"
        nproc = 1
        job = main_job(nproc)
    print(f"main job: {time.monotonic() - start:.1f} s, torchrun returned {job.returncode}", flush=True)
    checks = {part: verdict(job, part) for part in MAIN_PARTS}

    start = time.monotonic()
    end_limit = max(10.0, min(END_LIMIT_S, deadline - time.monotonic()))
    end_job = launch(nproc, ["watchdog_end"], out / f"end_{nproc}rank", end_limit, {**multi(nproc), ENV_HANDLING: None})
    checks["watchdog_end"] = {**end_verdict(end_job), "seconds": round(time.monotonic() - start, 1)}

    where = "the model" if target.on_model() else "the GPU"
    print(f"--- two-process checks on {where}, {nproc} rank(s): {why}", flush=True)
    for name, v in checks.items():
        print(f"{'PASS' if v['ok'] else 'FAIL'} two_process.{name} ({v['seconds']:.1f} s)", flush=True)
        for line in v.get("details", [v.get("detail", "")]):
            print(f"    {line}", flush=True)
    summary = {"target": target.name(), "ranks": nproc, "why": why, "nccl": versions,
               "checks": {k: {kk: vv for kk, vv in v.items() if kk != "details"} for k, v in checks.items()}}
    (out / "two_process.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="gpu-results")
    parser.add_argument("--budget", type=float, default=170.0, help="seconds for both jobs")
    parser.add_argument("--model", action="store_true", help="on the model under tests/fakes/ (the dry run)")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _end_running_job)
    summary = run_all(Path(args.out), args.budget, model=args.model)
    failed = [k for k, v in summary["checks"].items() if not v["ok"]]
    print(f"{len(summary['checks']) - len(failed)} passed, {len(failed)} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
