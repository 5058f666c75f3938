"""The NCCL backend with two processes on one GPU, where NCCL allows it (NCCL 2.30 and later,
with NCCL_MULTI_RANK_GPU_ENABLE=1), else with one rank exchanging with itself: launches
two_process_worker.py under torchrun and judges each part from what every rank wrote.

- main job (MEGATRON_P2P_ASYNC_ERROR_HANDLING=raise): exact bytes, 1F1B, debug matching and
  its cost, a captured 1F1B step replayed against eager execution, a capture (global mode)
  after eager steps waited on the stream only, the watchdog raising, megatron-core's and
  torch's pipeline schedules (two_process_schedules.py), and comm.abort() and
  comm.close() with a captured graph still alive (each bounded, within 1 s);
- faults job (CUDA_DEVICE_MAX_CONNECTIONS=1, NCCL's buffering set to 1 MiB): 1F1B again, then
  two_process_faults.py: the naive ring named as a
  deadlock and its buffered case not, a peer that never posts, a size mismatch under
  MEGATRON_P2P_CHECK=1, replay --backend nccl of shipped programs, a peer SIGKILLed;
- end job (the handling's default under torchrun): the watchdog ends the stalled rank with
  status 70 and torchrun ends the job within END_WITHIN_S of the stall.

Where two ranks do not come up, it falls back step by step: NCCL_CUMEM_ENABLE=0, then the
self-loop, and says which path ran.

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
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE.parents[1]))  # the source tree, when not installed
sys.path.append(str(HERE.parents[1] / "benchmarks"))
import target  # noqa: E402
import two_process_faults as faults  # noqa: E402
from launch import job_pids  # noqa: E402

import megatron_p2p as mp  # noqa: E402

WORKER = HERE / "two_process_worker.py"
# graph_abort last: a rank that hangs in it (each call is bounded by a thread join) loses no other part.
MAIN_PARTS = ["setup", "exact_bytes", "one_f_one_b", "debug_matching", "cuda_graph", "capture_after_wait",
              "watchdog_raise", "megatron_schedules", "torch_pipelining", "graph_abort"]
# The faults job runs with CUDA_DEVICE_MAX_CONNECTIONS=1 (one hardware queue, as Megatron sets it),
# 1F1B first; peer_death last: torchrun ends the job once a rank dies.
FAULT_PARTS = ["setup", "one_f_one_b_one_connection", *faults.PARTS]
FAULTS_JOB_ENV = {**faults.FAULTS_ENV, "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
MULTI_RANK_NCCL = (2, 30, 0)
ENV_MULTI_RANK = "NCCL_MULTI_RANK_GPU_ENABLE"
ENV_HANDLING = "MEGATRON_P2P_ASYNC_ERROR_HANDLING"
ENV_CUMEM = "NCCL_CUMEM_ENABLE"
MAIN_LIMIT_S = 110.0
FAULTS_LIMIT_S = 60.0
END_LIMIT_S = 40.0
END_WITHIN_S = 10.0


@dataclass
class Job:
    nproc: int
    returncode: int | None  # None: killed at its limit
    output: str
    ranks: list[dict[str, Any]] = field(default_factory=list)  # per rank: part -> result ({} if none)
    ended_at: float = 0.0  # time.time() when the launcher was done


def _signal_job(token: str, sig: int, spare: int | None = None) -> None:
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


def launch(nproc: int, parts: list[str], out: Path, limit: float, env: dict[str, str | None]) -> Job:
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
        returncode: int | None = proc.wait(timeout=limit)
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
    """A part passes when every rank ran it and passed; where only a survivor reports
    (faults.SURVIVOR), when it passed and the other rank left no result (it was killed)."""
    results = [r.get(part) for r in job.ranks]
    survivor = faults.SURVIVOR.get(part) if job.nproc > 1 else None
    judged = results if survivor is None else [results[survivor]]
    ok = all(res is not None and res.get("ok") for res in judged)
    if survivor is not None:
        ok = ok and all(res is None for r, res in enumerate(results) if r != survivor)
    seconds = max((res["seconds"] for res in results if res), default=0.0)
    details = [f"rank {r}: " + (res["detail"] if res else "no result (killed by the part)" if survivor not in (None, r)
                                else "no result (the rank died or was killed first)")
               for r, res in enumerate(results)]
    skipped = ok and all(res is not None and res.get("skipped") for res in judged)  # a part that needs two ranks, on one
    return {"ok": ok, "skipped": skipped, "seconds": seconds, "details": details, "ranks": results}


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
    """Runs the jobs within `budget` seconds, on the model when `model`; prints and returns every
    verdict."""
    if model:
        os.environ.update(target.model_env())  # this process's own NCCL version, and the ranks'
    elif os.environ.get("MEGATRON_P2P_NCCL_LIBRARY"):
        os.environ["LD_PRELOAD"] = os.environ["MEGATRON_P2P_NCCL_LIBRARY"]  # torch's own NCCL runs, the same library
    deadline = time.monotonic() + budget
    nproc, why, versions = choose_ranks()
    print(why, flush=True)

    def multi(n: int) -> dict[str, str | None]:
        return {ENV_MULTI_RANK: "1"} if n > 1 else {}

    def main_job(n: int, extra: dict[str, str | None]) -> Job:
        limit = max(10.0, min(MAIN_LIMIT_S, deadline - time.monotonic() - FAULTS_LIMIT_S - END_LIMIT_S))
        where = out / f"main_{n}rank{'_nocumem' if extra else ''}"
        return launch(n, MAIN_PARTS, where, limit, {**multi(n), ENV_HANDLING: "raise", **extra})

    # Fall back step by step: two ranks, then two ranks without cuMem, then the self-loop.
    start = time.monotonic()
    paths: list[tuple[int, dict[str, str | None]]] = [(nproc, {})] + (
        [(2, {ENV_CUMEM: "0"}), (1, {})] if nproc == 2 else [])
    failures: list[str] = []
    for nproc, extra in paths:
        if failures and deadline - time.monotonic() < FAULTS_LIMIT_S + END_LIMIT_S + 30:
            break
        if failures:
            print(f"falling back to {nproc} rank(s) {' '.join(f'{k}={v}' for k, v in extra.items())}".rstrip(),
                  flush=True)
        job = main_job(nproc, extra)
        if verdict(job, "setup")["ok"]:
            break
        failures.append(f"{nproc} rank(s) {extra or ''}: " + " | ".join(verdict(job, "setup")["details"])[:600])
    extra = extra if verdict(job, "setup")["ok"] else {}
    path = f"{nproc} rank(s)" + "".join(f", {k}={v}" for k, v in extra.items())
    why += f"; the path that ran: {path}" + (f" (after: {'; '.join(failures)})" if failures else "")
    print(f"main job: {time.monotonic() - start:.1f} s, torchrun returned {job.returncode}; ran on {path}", flush=True)
    os.environ.update({k: v for k, v in extra.items() if v is not None})  # the later jobs take the same path
    checks = {part: verdict(job, part) for part in MAIN_PARTS}

    start = time.monotonic()
    faults_limit = max(10.0, min(FAULTS_LIMIT_S, deadline - time.monotonic() - END_LIMIT_S))
    faults_job = launch(nproc, FAULT_PARTS, out / f"faults_{nproc}rank", faults_limit,
                        {**multi(nproc), ENV_HANDLING: "raise", **FAULTS_JOB_ENV})
    print(f"faults job: {time.monotonic() - start:.1f} s, torchrun returned {faults_job.returncode}", flush=True)
    checks.update({part: verdict(faults_job, part) for part in FAULT_PARTS[1:]})

    start = time.monotonic()
    end_limit = max(10.0, min(END_LIMIT_S, deadline - time.monotonic()))
    end_job = launch(nproc, ["watchdog_end"], out / f"end_{nproc}rank", end_limit, {**multi(nproc), ENV_HANDLING: None})
    checks["watchdog_end"] = {**end_verdict(end_job), "seconds": round(time.monotonic() - start, 1)}

    where = "the model" if target.on_model() else "the GPU"
    print(f"--- two-process checks on {where}, {nproc} rank(s): {why}", flush=True)
    for name, v in checks.items():
        word = "SKIP" if v.get("skipped") else "PASS" if v["ok"] else "FAIL"
        print(f"{word} two_process.{name} ({v['seconds']:.1f} s)", flush=True)
        for line in v.get("details", [v.get("detail", "")]):
            print(f"    {line}", flush=True)
    summary = {"target": target.name(), "ranks": nproc, "path": path, "why": why, "nccl": versions,
               "path_env": [f"{k}={v}" for k, v in extra.items() if v is not None],
               "checks": {k: {kk: vv for kk, vv in v.items() if kk != "details"} for k, v in checks.items()}}
    (out / "two_process.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


def _word(check: dict[str, Any] | None) -> str:
    if check is None:
        return "-"
    return "SKIP" if check.get("skipped") else "PASS" if check["ok"] else "FAIL"


def table(model_json: str, gpu_json: str) -> str:
    """Every check's verdict on the model beside the GPU's, from two runs' two_process.json (a
    path that is empty or missing: that run's column says not run). A check whose verdicts differ
    is marked: either the model or the package is wrong there."""
    runs = [json.loads(Path(p).read_text()) if p and Path(p).exists() else None for p in (model_json, gpu_json)]
    names = list(dict.fromkeys(name for run in runs if run for name in run["checks"]))
    heads = [f"{what} ({run.get('path', '?')})" if run else f"{what} (not run)"
             for what, run in zip(("model", "GPU"), runs)]
    width = max([len("check")] + [len(n) for n in names])
    lines = [f"{'check':<{width}} | {heads[0]:<34} | {heads[1]}"]
    for name in names:
        model, gpu = (_word(run["checks"].get(name)) if run else "-" for run in runs)
        differ = "  <- differ" if runs[0] and runs[1] and model != gpu else ""
        lines.append(f"{name:<{width}} | {model:<34} | {gpu}{differ}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="gpu-results")
    parser.add_argument("--budget", type=float, default=170.0, help="seconds for the jobs")
    parser.add_argument("--model", action="store_true", help="on the model under tests/fakes/ (the dry run)")
    parser.add_argument("--table", nargs=2, metavar=("MODEL_JSON", "GPU_JSON"),
                        help="only print the verdicts of two runs side by side")
    args = parser.parse_args()
    if args.table:
        print(table(*args.table))
        return 0
    signal.signal(signal.SIGTERM, _end_running_job)
    summary = run_all(Path(args.out), args.budget, model=args.model)
    failed = [k for k, v in summary["checks"].items() if not v["ok"]]
    print(f"{len(summary['checks']) - len(failed)} passed, {len(failed)} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
