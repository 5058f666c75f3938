"""Host cost per exchange on the NCCL path, over the model of libcuda and libnccl (tests/fakes/),
split in three: the binding layer, this package's NCCL transport, and the libraries' own calls.

One rank exchanges with itself (prev = next = itself, so every exchange is the full four-op
pipeline exchange on both lanes: send_next, recv_prev, send_prev, recv_next, 256 float32 each),
in a process of its own without torchrun, with the device's primary context current on the
calling thread (as torch leaves it on a GPU). For mode="parity" and mode="batched":

- total: CPU time of the calling thread (CLOCK_THREAD_CPUTIME_ID) to post an exchange and make
  the caller's stream wait on each of its Requests (Request.wait(), as megatron-core does), in
  samples of BATCH exchanges with the stream synchronized (untimed, by the model's
  cuStreamSynchronize) between samples. The bookkeeping of completed work (event queries,
  finishing ops) falls on the next exchange's calls, as it does in training.
- (1) binding layer: the same calls on the `null` transport (megatron_p2p._testing), which does
  the argument handling, the plan and the Requests and completes every op when posted.
- (3) libraries: time inside libnccl and libcuda functions on the calling thread, through a
  timing shim (benchmarks/nccl_timing_shim.c, built here into build/bench/): the measuring
  process's MEGATRON_P2P_NCCL_LIBRARY and MEGATRON_P2P_CUDA_LIBRARY both name it, and it
  forwards every cu*/nccl* function to the model's libraries, reading a clock around each call
  (CLOCK_MONOTONIC through the vDSO by default, about 25 ns; see the shim for why not the
  thread's CPU clock, a syscall of about 570 ns here). The clock's read is subtracted per call.
  A wall clock also counts the time the thread was preempted inside a call, so the share is
  the calls per exchange of each function times that function's mean call over its calls
  shorter than 8 us (from the shim's histograms of the calling thread's calls; a system call
  such as a futex wake stays in, a preemption, which lasts longer, does not).
- (2) transport: what is left of the total: total - (1) - (3). That is the package's csrc/nccl/
  code (begin/post/end, settle polling, events, progress, locks, context checks), plus the
  callback the NCCL path makes to Python for torch's current stream (a trivial lambda on the
  model), plus whatever (1) and (3) miss.

(1) and (3) are measured in one process, the modes interleaved, each NCCL sample beside a
binding-layer sample; the total in processes without the shim, alternating with it; each
process runs several times ("repeats"). On a shared machine (a VM especially, where time
stolen by the host counts as the guest thread's CPU time) disturbance only adds time, so the
figures are those of the least disturbed processes: the lowest total (the median and highest
printed beside it), and the split of the shim process whose own total was lowest. That
process's own total, the shim's cost per call removed, is printed too: it runs slower than the
total without the shim (the shim's reads change how the calling thread and the model's stream
threads interleave), which is why (2) is taken from the total without it.

Three launch behaviours: "steady", the package's own, with its blocking data communicators
(every ncclGroupEnd launches on the caller's thread, its connections made by the warm-up);
"group_thread", nonblocking data communicators (NCCL_COMM_BLOCKING=0, and what the package did
before it split blocking children off), NCCL's thread per ncclGroupEnd answering ncclInProgress
until it has launched the group; and "in_progress", nonblocking data communicators whose every
ncclGroupEnd answers ncclInProgress for 1 ms, which the transport's settle loop polls through
(its CPU time then is mostly that loop's).

Last, a process run under `strace -f --seccomp-bpf -e trace=clone,clone3,nanosleep,
clock_nanosleep` (plus access, for window markers) counts the threads created and the sleeps per
exchange over COUNTED exchanges of each mode after a warm-up, for the calling thread and for
the others (the package's watchdog thread; the model's stream threads, which run its kernels).

    make build/.testing-installed fakes
    .venv/bin/python benchmarks/nccl_host_cost.py [--out FILE.json] [--before benchmarks/nccl_host_cost.before.json]

It prints a Markdown table (one row per launch behaviour and mode), the library calls per
exchange by function, and the RESULTS.md table: with --before, that file's figures as the
before column and this run's as the after one. Every process has a time limit; the whole run
takes about a minute on 2 cores, and fails with a message (exit 1) rather than hang.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FAKES = ROOT / "build" / "fakes"
REAL_CUDA = FAKES / "libcuda.so.1"
REAL_NCCL = FAKES / "libnccl.so.2"
SHIM_SRC = Path(__file__).resolve().parent / "nccl_timing_shim.c"
SHIM_DIR = ROOT / "build" / "bench"
SHIM = SHIM_DIR / "libmp_nccl_timing_shim.so"

MODES = ("parity", "batched")
NUMEL = 256          # float32 per tensor: small, so the model's copies cost little
BATCH = 25           # exchanges per timed sample; the stream is synchronized between samples
NULL_BATCH = 100     # exchanges per sample on the null transport, one such sample before each NCCL one
COUNTED = 1000       # exchanges per mode counted under strace
STRACE_SET = "clone,clone3,nanosleep,clock_nanosleep"
MARKER = "/mp2p-host-cost-marker"
TOTAL_LIMIT_S = 115  # the whole run; each process gets what is left, at most PROCESS_LIMIT_S
PROCESS_LIMIT_S = 45
# How the model answers a launch (its fault-injection settings, tests/fakes/libnccl.c), and how
# much to measure of each: rounds (after one of warm-up) x samples per round per mode, processes.
SCENARIOS: dict[str, dict[str, Any]] = {
    "steady": {"env": {"MPFAKE_NCCL_GROUP_IN_PROGRESS_MS": "0"}, "rounds": 6, "samples": 8, "repeats": 5},
    "in_progress": {"env": {"NCCL_COMM_BLOCKING": "0", "MPFAKE_NCCL_GROUP_IN_PROGRESS_EVERY": "1",
                            "MPFAKE_NCCL_GROUP_IN_PROGRESS_MS": "1"},
                    "rounds": 3, "samples": 3, "repeats": 1},
    # What NCCL does for a nonblocking communicator: a thread per group end, ncclInProgress until
    # it has launched (src/group.cc ncclGroupEndInternal), with no delay added.
    "group_thread": {"env": {"NCCL_COMM_BLOCKING": "0", "MPFAKE_NCCL_GROUP_IN_PROGRESS_MS": "0"},
                     "rounds": 4, "samples": 4, "repeats": 2},
}
# Names the shim must not time: the unique id is passed by value, on the stack.
UNTIMED = {"ncclCommInitRankConfig"}


class Failed(Exception):
    pass


def median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    if not n:
        raise Failed("no samples")
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


# ---- the parent ------------------------------------------------------------------------------

class Budget:
    def __init__(self) -> None:
        self.start = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def limit(self) -> float:
        left = TOTAL_LIMIT_S - self.elapsed()
        if left < 5:
            raise Failed(f"out of time: {self.elapsed():.0f} s spent of the run's {TOTAL_LIMIT_S} s")
        return min(PROCESS_LIMIT_S, left)

    def say(self, what: str) -> None:
        print(f"[{self.elapsed():5.1f} s] {what}", flush=True)


def exported_functions(lib: Path) -> list[str]:
    nm = shutil.which("nm")
    if not nm:
        raise Failed("`nm` (binutils) is needed to list the model's entry points for the timing shim")
    out = subprocess.run([nm, "-D", "--defined-only", str(lib)], capture_output=True, text=True, timeout=30)
    if out.returncode:
        raise Failed(f"nm {lib} failed: {out.stderr.strip()}")
    names = []
    for line in out.stdout.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1] in "TW" and re.match(r"^(cu|nccl)[A-Z]", parts[2]) \
                and parts[2] not in UNTIMED:
            names.append(parts[2])
    return names


def build_shim() -> None:
    names = exported_functions(REAL_CUDA) + exported_functions(REAL_NCCL)
    if "ncclGroupEnd" not in names or "cuEventRecord" not in names:
        raise Failed(f"the model's libraries in {FAKES} lack ncclGroupEnd or cuEventRecord: rebuild with `make fakes`")
    SHIM_DIR.mkdir(parents=True, exist_ok=True)
    header = SHIM_DIR / "shim_symbols.h"
    header.write_text("".join(f"SHIM({n})\n" for n in names))
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise Failed("no C compiler (cc) to build the timing shim")
    cmd = [cc, "-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-fPIC", "-shared", "-pthread",
           f'-DSHIM_SYMBOLS="{header}"', "-o", str(SHIM), str(SHIM_SRC),
           # DT_NEEDED on the real libraries (kept although nothing references them), found by rpath.
           "-Wl,--no-as-needed", f"-L{FAKES}", "-l:libnccl.so.2", "-l:libcuda.so.1", f"-Wl,-rpath,{FAKES}", "-ldl"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if done.returncode:
        raise Failed(f"building the timing shim failed:\n{' '.join(cmd)}\n{done.stderr}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MPFAKE_", "MEGATRON_P2P_", "MP_"))}
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def run_child(budget: Budget, role: str, scenario: str, prefix: Sequence[str] = (),
              extra: dict[str, str] | None = None) -> dict:
    cfg = SCENARIOS[scenario]
    env = {**cfg["env"], "MP_HOST_COST_ROUNDS": str(cfg["rounds"]), "MP_HOST_COST_SAMPLES": str(cfg["samples"]),
           **(extra or {})}
    limit = budget.limit()
    with tempfile.TemporaryDirectory(prefix="mp2p-host-cost-") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [*prefix, sys.executable, str(Path(__file__).resolve()), "--child", role, "--child-out", str(out)]
        try:
            done = subprocess.run(cmd, env=child_env(env), capture_output=True, text=True, timeout=limit)
        except subprocess.TimeoutExpired as exc:
            err = exc.stderr or b""
            err = err.decode(errors="replace") if isinstance(err, bytes) else err
            raise Failed(f"the {role} process ({scenario}) passed its {limit:.0f} s limit and was killed; its "
                         f"stderr ended:\n{err[-3000:]}") from None
        if done.returncode or not out.exists():
            raise Failed(f"the {role} process ({scenario}) failed (exit {done.returncode}):\n{done.stdout[-2000:]}\n"
                         f"{done.stderr[-4000:]}")
        return json.loads(out.read_text())


LINE = re.compile(r"^(\d+)\s+([\d.]+)\s+(\w+)\((.*)$")


def count_strace(log: Path, pid: int) -> dict[str, dict[str, dict[str, int]]]:
    """Per mode: each traced call started inside the mode's marked window, by the calling thread
    (the process's main thread) and by the others."""
    windows: dict[str, dict[str, dict[str, int]]] = {}
    current: str | None = None
    marked: set[str] = set()
    for line in log.read_text(errors="replace").splitlines():
        m = LINE.match(line)
        if not m:
            continue  # "<... resumed>", exits, signals
        tid, call, rest = int(m.group(1)), m.group(3), m.group(4)
        if call in ("access", "faccessat", "faccessat2"):
            hit = re.search(re.escape(MARKER) + r"-(start|end)-(\w+)", rest)
            if hit:
                current = hit.group(2) if hit.group(1) == "start" else None
                if hit.group(1) == "end":
                    marked.add(hit.group(2))
            continue
        if current is None:
            continue
        who = "calling" if tid == pid else "other"
        kind = "threads" if call in ("clone", "clone3") else "sleeps"
        w = windows.setdefault(current, {"calling": {"threads": 0, "sleeps": 0}, "other": {"threads": 0, "sleeps": 0}})
        w[who][kind] += 1
    missing = [m for m in MODES if m not in marked]
    if missing:
        raise Failed(f"strace's log has no window marker for {missing}; its last lines: "
                     f"{log.read_text(errors='replace').splitlines()[-5:]}")
    for m in MODES:  # a window with no traced call in it
        windows.setdefault(m, {"calling": {"threads": 0, "sleeps": 0}, "other": {"threads": 0, "sleeps": 0}})
    return windows


def run_strace(budget: Budget, scenario: str) -> dict[str, Any]:
    strace = shutil.which("strace")
    if not strace:
        raise Failed("strace is not installed (apt-get install strace)")
    with tempfile.TemporaryDirectory(prefix="mp2p-host-cost-strace-") as tmp:
        log = Path(tmp) / "strace.log"
        trace = f"{STRACE_SET},access,faccessat,faccessat2"
        last: Exception | None = None
        for extra in (["--seccomp-bpf"], []):  # the filter spares untraced calls the stop; not everywhere allowed
            prefix = [strace, "-f", *extra, "-qq", "-ttt", "-o", str(log), "-e", f"trace={trace}"]
            try:
                got = run_child(budget, "strace", scenario, prefix=prefix)
            except Failed as exc:
                last = exc
                continue
            got["counts"] = count_strace(log, got["pid"])
            got["strace_flags"] = " ".join(["-f", *extra, "-e", f"trace={STRACE_SET}"])
            return got
        raise Failed(f"strace could not run the counting process: {last}")


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, no GPU (libcuda, libnccl: the model, build/fakes/)"


def cpu_ticks() -> tuple[int, int]:
    """(all, stolen) jiffies of the machine so far, from /proc/stat (0, 0 where unreadable)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        return sum(fields[:8]), fields[7] if len(fields) > 7 else 0
    except (OSError, ValueError, IndexError):
        return 0, 0


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def commit() -> str:
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (head or "unknown") + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


SPLIT_KEYS = ("binding_us", "transport_us", "library_us", "nccl_us", "cuda_us", "shim_cost_us", "split_total_us",
              "library_mean_us", "transport_from_means_us",
              "library_calls")


def figures(clean: list[dict], split: list[dict], traced: dict) -> dict[str, dict[str, Any]]:
    """Per mode. On a shared machine (a VM especially, where time stolen by the host counts as
    the guest thread's CPU time) disturbance only adds time: the least disturbed process is the
    best estimate. So the total is the lowest of the processes' medians (their median and
    highest beside it), and the split is the one of the process whose own total was lowest."""
    out = {}
    n = traced["counted"]
    for mode in MODES:
        totals = sorted(c["modes"][mode]["total_us"] for c in clean)
        quiet = min(split, key=lambda s: s["modes"][mode]["split_total_us"])["modes"][mode]
        f: dict[str, Any] = {"total_us": totals[0], "total_median_us": median(totals), "total_max_us": totals[-1],
                             "wall_us": min(c["modes"][mode]["wall_us"] for c in clean)}
        for k in SPLIT_KEYS:
            f[k] = quiet[k]
        # (2): what is left of the total without the shim, once (1) and (3) are taken out. The
        # shim's process, its own cost removed, runs slower than that total (the shim's reads
        # change how the calling thread and the model's stream threads interleave), so its own
        # remainder ("transport_in_shim_process_us") overstates the transport.
        f["transport_in_shim_process_us"] = f["transport_us"]
        f["transport_us"] = f["total_us"] - f["binding_us"] - f["library_us"]
        f["split_totals_us"] = sorted(s["modes"][mode]["split_total_us"] for s in split)
        f["calls_by_function"] = quiet["by_function"]
        f["ns_per_call"] = quiet["ns_per_call"]
        counts = traced["counts"][mode]
        f.update(threads_calling=counts["calling"]["threads"] / n, threads_other=counts["other"]["threads"] / n,
                 sleeps_calling=counts["calling"]["sleeps"] / n, sleeps_other=counts["other"]["sleeps"] / n)
        out[mode] = f
    return out


ROWS = [  # key, label, format
    ("total_us", "total: CPU us per exchange, calling thread (lowest of the processes without the shim)", "{:.1f}"),
    ("total_median_us", "total: their median", "{:.1f}"),
    ("binding_us", "(1) binding layer (null transport), us", "{:.1f}"),
    ("transport_us", "(2) this package's NCCL transport, us", "{:.1f}"),
    ("library_us", "(3) inside libnccl + libcuda, us", "{:.1f}"),
    ("nccl_us", "(3) of which libnccl, us", "{:.1f}"),
    ("cuda_us", "(3) of which libcuda, us", "{:.1f}"),
    ("split_total_us", "total in the shim's process, the shim's cost removed (a check), us", "{:.1f}"),
    ("library_calls", "library calls per exchange (calling thread)", "{:.1f}"),
    ("threads_calling", "threads created per exchange by the calling thread", "{:.3f}"),
    ("threads_other", "threads created per exchange by other threads", "{:.3f}"),
    ("sleeps_calling", "sleeps per exchange, calling thread", "{:.3f}"),
    ("sleeps_other", "sleeps per exchange, other threads (watchdog; the model's stream threads)", "{:.3f}"),
]


def per_mode_table(f: dict[str, dict[str, dict[str, Any]]]) -> str:
    head = ["launch", "mode", "total us (median, max)", "(1) binding us", "(2) transport us",
            "(3) libraries us (nccl + cuda)", "lib calls", "threads/exch", "sleeps/exch calling thread",
            "sleeps/exch other threads"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for scenario in f:
        for mode in MODES:
            m = f[scenario][mode]
            lines.append(f"| {scenario} | {mode} | {m['total_us']:.1f} ({m['total_median_us']:.1f}, "
                         f"{m['total_max_us']:.1f}) | {m['binding_us']:.1f} | "
                         f"{m['transport_us']:.1f} | {m['library_us']:.1f} "
                         f"({m['nccl_us']:.1f} + {m['cuda_us']:.1f}) | {m['library_calls']:.1f} | "
                         f"{m['threads_calling'] + m['threads_other']:.3f} | {m['sleeps_calling']:.3f} | "
                         f"{m['sleeps_other']:.3f} |")
    return "\n".join(lines)


def before_after_table(before: dict | None, after: dict, after_label: str) -> str:
    """The figures as rows, `before`'s beside them (an empty column without it)."""
    lines = [f"| figure | {'before (' + before['commit'] + ')' if before else 'before'} | {after_label} |",
             "|---|---|---|"]
    for scenario in after:
        for mode in MODES:
            for key, label, fmt in ROWS:
                b = before["figures"].get(scenario, {}).get(mode, {}).get(key) if before else None
                a = after[scenario][mode].get(key)
                lines.append(f"| {scenario}, {mode}: {label} | "
                             f"{fmt.format(b) if b is not None else ('not measured' if before else '')} | "
                             f"{fmt.format(a) if a is not None else 'not measured'} |")
    return "\n".join(lines)


def parent(args: argparse.Namespace) -> int:
    budget = Budget()
    for lib in (REAL_CUDA, REAL_NCCL):
        if not lib.exists():
            raise Failed(f"{lib} is not built: run `make fakes`")
    sys.path.insert(0, str(ROOT))  # the tree this script is in, as the measuring processes use
    try:
        import megatron_p2p._testing  # noqa: F401
    except ImportError as exc:
        raise Failed(f"megatron_p2p._testing is not built ({exc}): run `make build/.testing-installed`") from None
    before = json.loads(args.before.read_text()) if args.before else None
    build_shim()
    load_at_start, ticks0 = load_average(), cpu_ticks()
    if float(load_at_start.split()[0] if load_at_start != "unknown" else 0) > 0.5:
        print(f"warning: load average {load_at_start} at the start: other work on this machine inflates CPU times "
              f"(the figures take the least disturbed process; rerun on an idle machine)", flush=True)
    f: dict[str, Any] = {}
    shim_info: dict[str, float] = {}
    strace_flags, counted = "", 0
    for scenario, cfg in SCENARIOS.items():
        clean, split = [], []
        for r in range(cfg["repeats"]):  # alternated, so that a slow spell of the machine hits both
            budget.say(f"{scenario}: the split, through the timing shim ({r + 1}/{cfg['repeats']})")
            split.append(run_child(budget, "split", scenario, extra={"MP_HOST_COST_SHIM": str(SHIM),
                                                                     "MP_SHIM_CLOCK": args.shim_clock}))
            budget.say(f"{scenario}: the total, on the model's libraries ({r + 1}/{cfg['repeats']})")
            clean.append(run_child(budget, "total", scenario))
        shim_info = {k: split[0][k] for k in ("clock_ns", "overhead_ns")}
        budget.say(f"{scenario}: threads created and sleeps, under strace")
        traced = run_strace(budget, scenario)
        strace_flags, counted = traced["strace_flags"], traced["counted"]
        f[scenario] = figures(clean, split, traced)
    ticks1 = cpu_ticks()
    stolen = (ticks1[1] - ticks0[1]) / max(1, ticks1[0] - ticks0[0])
    result = {"commit": commit(), "machine": machine(), "duration_s": budget.elapsed(), "shim_clock": args.shim_clock,
              "load_average_start": load_at_start, "load_average_end": load_average(), "stolen_fraction": stolen,
              **{f"shim_{k}": v for k, v in shim_info.items()}, "strace": strace_flags, "counted": counted,
              "batch": BATCH, "numel": NUMEL, "scenarios": SCENARIOS, "figures": f}
    print(f"\nHost cost per exchange on the NCCL path (model), commit {result['commit']}, {result['machine']}; "
          f"took {result['duration_s']:.0f} s. CPU us of the calling thread per exchange (4 ops, both lanes), "
          f"medians over samples of {BATCH} exchanges in the least disturbed processes; libraries by the "
          f"shim's {args.shim_clock} clock (a read: {shim_info['clock_ns']:.0f} ns, subtracted per call; the "
          f"shim's whole cost per call, {shim_info['overhead_ns']:.0f} ns, subtracted from its process's total "
          f"for the check row); strace {strace_flags} over {counted} exchanges per mode. Load average "
          f"{load_at_start} at the start, {result['load_average_end']} at the end; "
          f"{100 * stolen:.1f}% of the CPU time stolen by the hypervisor meanwhile.\n")
    print(per_mode_table(f))
    for scenario in f:
        for mode in MODES:
            m = f[scenario][mode]
            calls = ", ".join(f"{k} {v:.2f} x {m['ns_per_call'].get(k, 0):.0f} ns"
                              for k, v in sorted(m["calls_by_function"].items(), key=lambda kv: -kv[1]))
            print(f"\n{scenario}, {mode}: library calls per exchange on the calling thread (calls x ns each): {calls}")
    print()
    print(before_after_table(before, f, f"after ({result['commit']})" if before else f"this run ({result['commit']})"))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


# ---- the measuring processes -----------------------------------------------------------------

def child(role: str, out: Path) -> None:
    sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "workers")]
    import nccl_model_cuda  # the model's torch.cuda stand-ins, for this process only

    nccl_model_cuda.install()
    shim_path = os.environ.get("MP_HOST_COST_SHIM")
    if shim_path:
        os.environ["MEGATRON_P2P_NCCL_LIBRARY"] = os.environ["MEGATRON_P2P_CUDA_LIBRARY"] = shim_path
    os.environ["MEGATRON_P2P_ASYNC_ERROR_HANDLING"] = "raise"
    rounds, samples = int(os.environ["MP_HOST_COST_ROUNDS"]), int(os.environ["MP_HOST_COST_SAMPLES"])
    import torch

    import megatron_p2p as mp
    from megatron_p2p import _testing

    torch.set_num_threads(1)
    p = ctypes.c_void_p
    cuda = ctypes.CDLL(str(REAL_CUDA))  # the model itself (in the shim's process: its dependency), untimed
    cuda.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(p), ctypes.c_int]
    cuda.cuCtxSetCurrent.argtypes = [p]
    cuda.cuStreamSynchronize.argtypes = [p]
    ctx = p()
    if cuda.cuInit(0) or cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) or cuda.cuCtxSetCurrent(ctx):
        raise RuntimeError("the model's libcuda refused cuInit / cuDevicePrimaryCtxRetain / cuCtxSetCurrent")

    def sync() -> None:
        if cuda.cuStreamSynchronize(None):
            raise RuntimeError("cuStreamSynchronize failed")

    on = nccl_model_cuda.on_device
    tensors = {k: on(torch.ones(NUMEL)) for k in ("send_next", "recv_prev", "send_prev", "recv_next")}
    result: dict[str, Any] = {"pid": os.getpid()}

    shim = None
    if shim_path:
        shim = ctypes.CDLL(shim_path)
        shim.mp_shim_name.restype = ctypes.c_char_p
        shim.mp_shim_clock_ns.restype = shim.mp_shim_overhead_ns.restype = ctypes.c_double
        count = shim.mp_shim_count()
        fn_names = [shim.mp_shim_name(i).decode() for i in range(count)]
        is_nccl = [n.startswith("nccl") for n in fn_names]
        ns_buf, calls_buf = (ctypes.c_uint64 * count)(), (ctypes.c_uint64 * count)()
        shim.mp_shim_measure_this_thread()  # before the overhead's measure, which then includes the histogram
        result["clock_ns"] = clock_ns = shim.mp_shim_clock_ns(2001)
        result["overhead_ns"] = overhead_ns = shim.mp_shim_overhead_ns(200000)
        bucket_ns = ctypes.c_int()
        buckets = shim.mp_shim_hist_shape(ctypes.byref(bucket_ns))
        hist_buf = (ctypes.c_uint32 * (count * buckets))()

        def read() -> tuple[list[int], list[int]]:
            shim.mp_shim_read(ns_buf, calls_buf)
            return list(ns_buf), list(calls_buf)

        def histograms() -> list[list[int]]:
            shim.mp_shim_hist(hist_buf)
            flat = list(hist_buf)
            return [flat[i * buckets:(i + 1) * buckets] for i in range(count)]

        def trimmed_mean_ns(h: list[int], mean_ns: float) -> tuple[float, float]:
            """The mean call's duration over the calls shorter than the last bucket (longer ones
            count as preempted), and the fraction that was longer; the plain mean instead when
            most calls were longer (then the function is slow, not its calls disturbed)."""
            total, slow = sum(h), h[-1]
            if not total:
                return 0.0, 0.0
            if 2 * slow > total:
                return mean_ns, slow / total
            kept = total - slow
            return sum((b + 0.5) * bucket_ns.value * n for b, n in enumerate(h[:-1])) / kept, slow / total

    def exchanges(ex, mode: str, n: int) -> None:
        for _ in range(n):
            for r in ex(mode=mode, **tensors).values():
                r.wait()

    null = _testing.null_communicator("host-cost-binding-layer", 0, [0, 1]) if role == "split" else None
    comm = mp.init_communicator(backend="nccl", timeout=30.0, lanes=2)
    try:
        if role == "strace":
            for mode in MODES:
                for _ in range(8):  # warm-up
                    exchanges(comm.exchange, mode, BATCH)
                    sync()
                os.access(f"{MARKER}-start-{mode}", os.F_OK)
                for _ in range(COUNTED // BATCH):
                    exchanges(comm.exchange, mode, BATCH)
                    sync()
                os.access(f"{MARKER}-end-{mode}", os.F_OK)
            result["counted"] = COUNTED // BATCH * BATCH
            return
        got: dict[str, dict[str, list]] = {m: {"null": [], "total": [], "wall": [], "lib": []} for m in MODES}
        hist_of = {}
        for rnd in range(rounds + 1):  # round 0 warms up
            for mode in MODES:
                g = got[mode]
                h0 = histograms() if shim and rnd else None
                for _ in range(samples):
                    if null is not None:  # the binding layer, measured just before each sample it is paired with
                        c0 = time.thread_time_ns()
                        exchanges(null.exchange, mode, NULL_BATCH)
                        c1 = time.thread_time_ns()
                        if rnd:
                            g["null"].append((c1 - c0) / 1e3 / NULL_BATCH)
                    s0 = read() if shim else None
                    w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
                    exchanges(comm.exchange, mode, BATCH)
                    c1, w1 = time.thread_time_ns(), time.perf_counter_ns()
                    s1 = read() if shim else None
                    sync()
                    if not rnd:
                        continue
                    g["total"].append((c1 - c0) / 1e3 / BATCH)
                    g["wall"].append((w1 - w0) / 1e3 / BATCH)
                    if shim:
                        dns = [b - a for a, b in zip(s0[0], s1[0])]
                        dcalls = [b - a for a, b in zip(s0[1], s1[1])]
                        g["lib"].append((dns, dcalls))
                if h0 is not None:  # this round's calls of each function, added to the mode's histograms
                    h1 = histograms()
                    acc = hist_of.setdefault(mode, [[0] * buckets for _ in range(count)])
                    for i in range(count):
                        if h1[i] != h0[i]:
                            acc[i] = [a + y - x for a, x, y in zip(acc[i], h0[i], h1[i])]
        modes: dict[str, Any] = {}
        for mode in MODES:
            g = got[mode]
            fig: dict[str, Any] = {"total_us": median(g["total"]), "wall_us": median(g["wall"])}
            if shim:
                binding = median(g["null"])
                nccl_us, cuda_us, lib_us, calls_n, transport, shim_cost = [], [], [], [], [], []
                for total, binding_now, (dns, dcalls) in zip(g["total"], g["null"], g["lib"]):
                    net = [max(0.0, d - k * clock_ns) / 1e3 / BATCH for d, k in zip(dns, dcalls)]
                    nc = sum(x for x, n in zip(net, is_nccl) if n)
                    cu = sum(x for x, n in zip(net, is_nccl) if not n)
                    k = sum(dcalls) / BATCH
                    nccl_us.append(nc)
                    cuda_us.append(cu)
                    lib_us.append(nc + cu)
                    calls_n.append(k)
                    shim_cost.append(k * overhead_ns / 1e3)
                    transport.append(total - binding_now - (nc + cu) - k * overhead_ns / 1e3)
                by_fn = [median([d[1][i] / BATCH for d in g["lib"]]) for i in range(len(fn_names))]
                # ns per call of each function, the clock's read removed: median over the samples
                per_call = [median([max(0.0, d[0][i] / d[1][i] - clock_ns) for d in g["lib"] if d[1][i]] or [0.0])
                            for i in range(len(fn_names))]
                # The library's share robust to preemption: calls per exchange x each function's mean
                # call, without the calls long enough to have been preempted.
                trimmed = [trimmed_mean_ns(h, m + clock_ns) for h, m in zip(hist_of[mode], per_call)]
                med = [max(0.0, t - clock_ns) for t, _ in trimmed]
                lib_nccl = sum(k * m for k, m, n in zip(by_fn, med, is_nccl) if n) / 1e3
                lib_cuda = sum(k * m for k, m, n in zip(by_fn, med, is_nccl) if not n) / 1e3
                rest = median([t - b - c for t, b, c in zip(g["total"], g["null"], shim_cost)])
                fig.update(binding_us=binding, transport_us=rest - lib_nccl - lib_cuda, library_us=lib_nccl + lib_cuda,
                           nccl_us=lib_nccl, cuda_us=lib_cuda, library_mean_us=median(lib_us),
                           transport_from_means_us=median(transport), library_calls=median(calls_n),
                           shim_cost_us=median(shim_cost),
                           split_total_us=median([t - s for t, s in zip(g["total"], shim_cost)]),
                           by_function={n: k for n, k in zip(fn_names, by_fn) if k},
                           ns_per_call={n: c for n, c, k in zip(fn_names, med, by_fn) if k},
                           mean_ns_per_call={n: c for n, c, k in zip(fn_names, per_call, by_fn) if k},
                           preempted_fraction={n: t[1] for n, t, k in zip(fn_names, trimmed, by_fn) if k})
            modes[mode] = fig
        result["modes"] = modes
    finally:
        comm.close()
        if null is not None:
            null.close()
        out.write_text(json.dumps(result))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the figures here as JSON")
    parser.add_argument("--before", type=Path, help="a JSON this script wrote (--out) before a change: print the "
                        "RESULTS.md table with its figures as the before column and this run's as the after one")
    parser.add_argument("--shim-clock", choices=("monotonic", "thread"), default="monotonic",
                        help="the clock the timing shim reads around each library call (see nccl_timing_shim.c)")
    parser.add_argument("--child", choices=("split", "total", "strace"), help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.child_out)
        return 0
    try:
        return parent(args)
    except Failed as exc:
        print(f"nccl_host_cost: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
