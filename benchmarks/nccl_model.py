"""The NCCL backend's host layer, measured over the model of libcuda and libnccl (tests/fakes,
`make fakes`): what this package adds around NCCL calls, which is all of its cost on a GPU's
host that this machine can measure. Two ranks exchange 64 KiB both ways, 4 ops per call:

- posting: CPU time of the calling thread to post one exchange (binding, plan, NCCL groups,
  fences), median over the run;
- round trip: wall time to post and synchronize one exchange;
each for a plain communicator and one with debug matching (MEGATRON_P2P_CHECK=1), whose ratio
is the mode's cost on the model. The model's kernels are host threads, so round trips measure
the model as much as this package; postings do not.

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

import megatron_p2p as mp  # noqa: E402
from timing import median  # noqa: E402

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
    if dist.get_rank() == 0:
        for name in ("plain", "check"):
            f = figures[name]
            print(f"nccl over the model, {name:5s}: posting {f['posting_cpu_us']:7.1f} us cpu, "
                  f"round trip {f['round_trip_us']:8.1f} us")
        c = figures["check_cost"]
        print(f"debug matching / plain: posting x{c['posting_cpu_us']:.2f}, round trip x{c['round_trip_us']:.2f}")
        if args.out:
            args.out.write_text(json.dumps(figures, indent=1) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
