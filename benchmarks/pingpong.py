"""Small-message ping-pong between 2 ranks: megatron_p2p (shm) against torch.distributed gloo
isend/irecv, measured in the same run. Prints half the round trip (median and p99) and the
ratio, and writes them to benchmarks/results/pingpong.json.

    .venv/bin/torchrun --standalone --nproc-per-node 2 benchmarks/pingpong.py
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

import megatron_p2p as mp

ITERATIONS = 2000
WARMUP = 200
SIZES = (0, 8, 1024, 65536)


def one_way_us(round_trip: Callable[[], None]) -> tuple[float, float]:
    for _ in range(WARMUP):
        round_trip()
    samples = []
    for _ in range(ITERATIONS):
        start = time.perf_counter()
        round_trip()
        samples.append((time.perf_counter() - start) / 2 * 1e6)
    samples.sort()
    return statistics.median(samples), samples[int(len(samples) * 0.99)]


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if dist.get_world_size() != 2:
        raise SystemExit("run with --nproc-per-node 2")
    peer = 1 - rank
    comm = mp.init_communicator(timeout=60.0)
    results = []
    for nbytes in SIZES:
        send = torch.zeros(nbytes, dtype=torch.uint8)
        recv = torch.empty(nbytes, dtype=torch.uint8)

        def round_trip(isend: Callable, irecv: Callable) -> Callable[[], None]:
            first, second = (isend, irecv) if rank == 0 else (irecv, isend)
            buffers = {isend: send, irecv: recv}

            def run() -> None:
                first(buffers[first], peer).wait()
                second(buffers[second], peer).wait()

            return run

        ours = round_trip(comm.isend, comm.irecv)
        gloo = round_trip(dist.isend, dist.irecv)
        mine, gl = one_way_us(ours), one_way_us(gloo)
        results.append({"bytes": nbytes, "megatron_p2p_us": mine, "gloo_us": gl, "speedup": gl[0] / mine[0]})
        if rank == 0:
            print(f"{nbytes:>6} B  megatron_p2p {mine[0]:7.2f} us (p99 {mine[1]:7.2f})   "
                  f"gloo {gl[0]:7.2f} us (p99 {gl[1]:7.2f})   {gl[0] / mine[0]:5.1f}x lower", flush=True)
    if rank == 0:
        out = Path(__file__).resolve().parent / "results"
        out.mkdir(exist_ok=True)
        (out / "pingpong.json").write_text(json.dumps({"iterations": ITERATIONS, "results": results}, indent=2))
    comm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
