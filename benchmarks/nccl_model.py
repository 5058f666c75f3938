"""The NCCL backend's host layer, measured over the model of libcuda and libnccl (tests/fakes,
`make fakes`): what this package adds around NCCL calls, which is all of its cost on a GPU's
host that this machine can measure. Two ranks exchange 64 KiB both ways, 4 ops per call:

- posting: CPU time of the calling thread to post one exchange (binding, plan, NCCL groups,
  fences), median over the run;
- round trip: wall time to post and synchronize one exchange;
each for a plain communicator and one with debug matching (MEGATRON_P2P_CHECK=1), whose ratio
is the mode's cost on the model. The model's kernels are host threads, so round trips measure
the model as much as this package; postings do not. Last, the watchdog: rank 1 stops posting
(the model's MPFAKE_NCCL_SILENT_RANK), rank 0 waits on the stream only, and the figure is the
time from posting until the watchdog has aborted the op, against the communicator's timeout.

    make fakes && torchrun --standalone --nproc-per-node 2 benchmarks/nccl_model.py [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "workers")]
import nccl_model_cuda  # noqa: E402 - the model's torch.cuda stand-ins, for this process only

nccl_model_cuda.install()
# The model's launches answer ncclInProgress for a random while by default; real ones rarely do.
os.environ.setdefault("MPFAKE_NCCL_GROUP_IN_PROGRESS_MS", "0")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from timing import median  # noqa: E402

import megatron_p2p as mp  # noqa: E402

ITERATIONS = 400
WARMUP = 50


def measure(comm: mp.Communicator) -> dict[str, float]:
    on = nccl_model_cuda.on_device
    t = {k: on(torch.ones(16384)) for k in ("send_next", "recv_prev", "send_prev", "recv_next")}
    posting, round_trip = [], []
    for i in range(WARMUP + ITERATIONS):
        w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        reqs = comm.exchange(**t, mode="batched")
        c1 = time.thread_time_ns()
        for r in reqs.values():
            r.synchronize()
        w1 = time.perf_counter_ns()
        if i >= WARMUP:
            posting.append((c1 - c0) / 1e3)
            round_trip.append((w1 - w0) / 1e3)
    return {"posting_cpu_us": median(posting), "round_trip_us": median(round_trip)}


def watchdog_seconds(timeout: float) -> float:
    """Seconds from posting an exchange that rank 1 never matches until rank 0's watchdog has
    failed it (rank 1 learns of it through the store)."""
    os.environ.update(MPFAKE_NCCL_SILENT_RANK="1", MPFAKE_NCCL_SILENT_AFTER="2",  # after the warm-up
                      MEGATRON_P2P_ASYNC_ERROR_HANDLING="raise", MEGATRON_P2P_CHECK="0")
    on = nccl_model_cuda.on_device
    with mp.init_communicator(backend="nccl", timeout=timeout) as comm:
        t, got = torch.ones(64), torch.zeros(64)
        start = time.monotonic()
        for r in comm.exchange(send_next=on(t), recv_prev=on(got)).values():
            r.wait()  # the stream waits; the host does not
        while not any(op["state"] == "failed" for op in comm.recent_ops()):
            time.sleep(0.002)
        return time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    figures = {}
    for name, check in (("plain", "0"), ("check", "1")):
        os.environ["MEGATRON_P2P_CHECK"] = check
        with mp.init_communicator(backend="nccl", timeout=60.0) as comm:
            figures[name] = measure(comm)
    figures["check_cost"] = {k: figures["check"][k] / figures["plain"][k] for k in figures["plain"]}
    figures["watchdog"] = {"timeout_s": 1.0, "aborted_after_s": watchdog_seconds(1.0)}
    if dist.get_rank() == 0:
        for name in ("plain", "check"):
            f = figures[name]
            print(f"nccl over the model, {name:5s}: posting {f['posting_cpu_us']:7.1f} us cpu, "
                  f"round trip {f['round_trip_us']:8.1f} us")
        c = figures["check_cost"]
        print(f"debug matching / plain: posting x{c['posting_cpu_us']:.2f}, round trip x{c['round_trip_us']:.2f}")
        w = figures["watchdog"]
        print(f"watchdog: an op never matched is aborted {w['aborted_after_s']:.3f} s after posting "
              f"(timeout {w['timeout_s']:.1f} s, x{w['aborted_after_s'] / w['timeout_s']:.3f})")
        if args.out:
            args.out.write_text(json.dumps(figures, indent=1) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
