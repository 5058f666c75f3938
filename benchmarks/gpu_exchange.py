"""One GPU, megatron_p2p's NCCL backend against torch.distributed's NCCL batch_isend_irecv over the
same libnccl, in the same run: one rank sending to itself, or two ranks on the GPU (NCCL 2.30's
NCCL_MULTI_RANK_GPU_ENABLE=1), each exchanging with the other. Bandwidth from 1 MiB to 1 GiB
(bytes / time), and per exchange of 1 KiB to 1 MiB: the host time to post and wait (median),
and the GPU's time (CUDA events around exchanges queued behind a GPU sleep, so the host's pace
does not count). Last, the host's time to post a four-op exchange on both lanes (parity and
batched mode, against batch_isend_irecv of the same ops), in wall and thread CPU time. Ratios
are megatron_p2p / torch. With two ranks, rank 0 writes the results (the device script shows rank 0's output only).

    torchrun --standalone --nproc-per-node 1|2 benchmarks/gpu_exchange.py [--out results.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the source tree, when not installed
import megatron_p2p as mp  # noqa: E402

SIZES = [1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30]
SMALL_SIZES = [1 << 10, 64 << 10, 1 << 20]
AHEAD_CYCLES = 400_000_000  # a GPU sleep of 0.2 s or more: the host queues all 100 exchanges before the first runs


def peer() -> int:
    """The rank this one exchanges with: itself, or the other of two."""
    return (dist.get_rank() + 1) % dist.get_world_size()


def payload(nbytes: int) -> torch.Tensor:
    """The same bytes on every rank, so that a receive equals its own send buffer."""
    gen = torch.Generator(device="cuda").manual_seed(nbytes)
    return torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda", generator=gen)


def mp_step(comm, src, dst):
    return list(comm.exchange(send_next=src, recv_prev=dst, mode="batched").values())


def torch_step(src, dst):
    return dist.batch_isend_irecv([dist.P2POp(dist.isend, src, peer()), dist.P2POp(dist.irecv, dst, peer())])


def device_seconds(step, iters: int, ahead_cycles: int = 0) -> float:
    """The GPU's time per exchange, from CUDA events around `iters` exchanges; with
    ahead_cycles, queued behind a GPU sleep of that many cycles, so that the host's posting pace
    is not part of it."""
    for _ in range(20):
        for w in step():
            w.wait()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if ahead_cycles:
        torch.cuda._sleep(ahead_cycles)
    start.record()
    for _ in range(iters):
        for w in step():
            w.wait()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def host_median_seconds(step, iters: int) -> float:
    """The host's time to post one exchange and wait() on it, the median of `iters`."""
    for _ in range(20):
        for w in step():
            w.wait()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        for w in step():
            w.wait()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(times)


def ratio(ours: float, theirs: float) -> float:
    return ours / theirs if theirs and theirs == theirs else float("nan")


def per_exchange(comm, torch_ok: bool) -> list[dict]:
    """Host and GPU time per exchange of each small size, both libraries, and their ratios."""
    print(f"{'bytes':>8} | host us: {'megatron_p2p':>12} {'torch':>8} {'ratio':>6} | "
          f"GPU us: {'megatron_p2p':>12} {'torch':>8} {'ratio':>6}", flush=True)
    rows = []
    for nbytes in SMALL_SIZES:
        src = payload(nbytes)
        dst = torch.empty_like(src)
        ours_step, theirs_step = (lambda: mp_step(comm, src, dst)), (lambda: torch_step(src, dst))
        row = {"bytes": nbytes,
               "megatron_p2p_host_us": host_median_seconds(ours_step, 2000) * 1e6,
               "torch_host_us": host_median_seconds(theirs_step, 2000) * 1e6 if torch_ok else float("nan"),
               "megatron_p2p_gpu_us": device_seconds(ours_step, 100, AHEAD_CYCLES) * 1e6,
               "torch_gpu_us": device_seconds(theirs_step, 100, AHEAD_CYCLES) * 1e6 if torch_ok else float("nan")}
        assert torch.equal(src, dst)
        row["host_ratio"] = ratio(row["megatron_p2p_host_us"], row["torch_host_us"])
        row["gpu_ratio"] = ratio(row["megatron_p2p_gpu_us"], row["torch_gpu_us"])
        rows.append(row)
        print(f"{nbytes:>8} | host us: {row['megatron_p2p_host_us']:>12.1f} {row['torch_host_us']:>8.1f} "
              f"{row['host_ratio']:>6.2f} | GPU us: {row['megatron_p2p_gpu_us']:>12.1f} {row['torch_gpu_us']:>8.1f} "
              f"{row['gpu_ratio']:>6.2f}", flush=True)
        src = dst = None  # freed before the next size's
    return rows


POSTING_ITERS = 3000
POSTING_SYNC_EVERY = 50  # exchanges between untimed synchronizations, so the queue stays short


def posting_host_time(comm, torch_ok: bool, nbytes: int = 4096) -> list[dict]:
    """The host's cost to post one four-op exchange on both lanes (send_next, recv_prev,
    send_prev, recv_next; prev == next: itself, or the other rank): megatron_p2p's exchange in parity and batched
    mode against torch's batch_isend_irecv of the same four ops. Timed: the posting call alone,
    in wall time (perf_counter) and in the calling thread's CPU time (thread_time); each
    request's wait() follows untimed, and the device is synchronized every POSTING_SYNC_EVERY
    exchanges. Medians and 90th percentiles over POSTING_ITERS exchanges."""
    t = {k: torch.full((nbytes // 4,), float(i), device="cuda") for i, k in
         enumerate(("send_next", "recv_prev", "send_prev", "recv_next"))}
    contenders = {
        "megatron_p2p parity": lambda: list(comm.exchange(mode="parity", **t).values()),
        "megatron_p2p batched": lambda: list(comm.exchange(mode="batched", **t).values()),
    }
    if torch_ok:
        contenders["torch batch_isend_irecv"] = lambda: dist.batch_isend_irecv([
            dist.P2POp(dist.isend, t["send_next"], peer()), dist.P2POp(dist.irecv, t["recv_prev"], peer()),
            dist.P2POp(dist.isend, t["send_prev"], peer()), dist.P2POp(dist.irecv, t["recv_next"], peer())])
    print(f"host time to post one four-op exchange of {nbytes} B tensors (both lanes), {POSTING_ITERS} exchanges, "
          f"wait() untimed:", flush=True)
    print(f"{'contender':<26} | {'wall us median':>14} {'p90':>8} | {'thread CPU us median':>20} {'p90':>8}",
          flush=True)
    rows = []
    for name, post in contenders.items():
        for _ in range(50):  # warm-up
            for w in post():
                w.wait()
        torch.cuda.synchronize()
        wall, cpu = [], []
        for i in range(POSTING_ITERS):
            w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
            reqs = post()
            c1, w1 = time.thread_time_ns(), time.perf_counter_ns()
            for w in reqs:
                w.wait()
            wall.append((w1 - w0) / 1e3)
            cpu.append((c1 - c0) / 1e3)
            if i % POSTING_SYNC_EVERY == POSTING_SYNC_EVERY - 1:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        assert torch.equal(t["recv_prev"], t["send_next"]) and torch.equal(t["recv_next"], t["send_prev"]), name
        t["recv_prev"].zero_()
        t["recv_next"].zero_()
        wall.sort()
        cpu.sort()
        row = {"contender": name, "wall_us_median": statistics.median(wall), "wall_us_p90": wall[len(wall) * 9 // 10],
               "cpu_us_median": statistics.median(cpu), "cpu_us_p90": cpu[len(cpu) * 9 // 10]}
        rows.append(row)
        print(f"{name:<26} | {row['wall_us_median']:>14.1f} {row['wall_us_p90']:>8.1f} | "
              f"{row['cpu_us_median']:>20.1f} {row['cpu_us_p90']:>8.1f}", flush=True)
    torch_row = next((r for r in rows if r["contender"].startswith("torch")), None)
    if torch_row:
        for r in rows:
            r["wall_ratio_to_torch"] = ratio(r["wall_us_median"], torch_row["wall_us_median"])
            r["cpu_ratio_to_torch"] = ratio(r["cpu_us_median"], torch_row["cpu_us_median"])
        print("ratio to torch (median wall / CPU): " + ", ".join(
            f"{r['contender']} {r['wall_ratio_to_torch']:.2f} / {r['cpu_ratio_to_torch']:.2f}" for r in rows),
            flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    comm = mp.init_communicator(backend="nccl", timeout=120.0)
    v = mp.nccl_version()
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | megatron_p2p libnccl "
          f"{'.'.join(map(str, v.version))} ({v.source})", flush=True)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "nccl": list(v.version),
               "bandwidth": [], "per_exchange": []}
    torch_ok = True
    try:
        a = torch.ones(4, device="cuda")
        for w in torch_step(a, torch.empty_like(a)):
            w.wait()
    except Exception as exc:  # torch may refuse a self send/recv
        torch_ok = False
        results["torch_error"] = str(exc)
        print(f"torch.distributed refused the send/recv: {exc}", flush=True)
    results["ranks"] = dist.get_world_size()
    print(f"{dist.get_world_size()} rank(s) on the GPU", flush=True)

    print("ratios are megatron_p2p / torch: above 1 for bandwidth, or below 1 for time, favours megatron_p2p",
          flush=True)
    start = time.perf_counter()
    print(f"{'bytes':>12} {'megatron_p2p GB/s':>18} {'torch GB/s':>11} {'ratio':>6}", flush=True)
    for nbytes in SIZES:
        src = payload(nbytes)
        dst = torch.empty_like(src)
        iters = max(5, min(200, (4 << 30) // nbytes))
        ours = nbytes / device_seconds(lambda: mp_step(comm, src, dst), iters) / 1e9
        assert torch.equal(src, dst)
        theirs = nbytes / device_seconds(lambda: torch_step(src, dst), iters) / 1e9 if torch_ok else float("nan")
        results["bandwidth"].append({"bytes": nbytes, "megatron_p2p_GBps": ours, "torch_GBps": theirs,
                                     "ratio": ratio(ours, theirs)})
        print(f"{nbytes:>12} {ours:>18.1f} {theirs:>11.1f} {ratio(ours, theirs):>6.2f}", flush=True)
        src = dst = None  # freed before the next size's
    print(f"bandwidth: {time.perf_counter() - start:.1f} s", flush=True)
    start = time.perf_counter()
    results["per_exchange"] = per_exchange(comm, torch_ok)
    print(f"per exchange: {time.perf_counter() - start:.1f} s", flush=True)
    start = time.perf_counter()
    results["posting"] = posting_host_time(comm, torch_ok)
    print(f"posting: {time.perf_counter() - start:.1f} s", flush=True)
    if args.out and dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results, indent=2))
    comm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
