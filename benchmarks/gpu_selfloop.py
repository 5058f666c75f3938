"""One GPU, one rank, sending to itself: megatron_p2p's NCCL backend against torch.distributed's
NCCL batch_isend_irecv, in the same run. Bandwidth from 1 MiB to 1 GiB (bytes / time), and the
host time to post and wait for one small exchange.

    torchrun --standalone --nproc-per-node 1 benchmarks/gpu_selfloop.py [--out results.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the source tree, when not installed
import megatron_p2p as mp  # noqa: E402

SIZES = [1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30]


def mp_step(comm, src, dst):
    return list(comm.exchange(send_next=src, recv_prev=dst, mode="batched").values())


def torch_step(src, dst):
    return dist.batch_isend_irecv([dist.P2POp(dist.isend, src, 0), dist.P2POp(dist.irecv, dst, 0)])


def device_seconds(step, iters: int) -> float:
    for _ in range(3):
        for w in step():
            w.wait()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        for w in step():
            w.wait()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def host_seconds(step, iters: int) -> float:
    for _ in range(20):
        for w in step():
            w.wait()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        for w in step():
            w.wait()
    host = (time.perf_counter() - start) / iters
    torch.cuda.synchronize()
    return host


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
               "bandwidth": [], "host": {}}
    torch_ok = True
    try:
        a = torch.ones(4, device="cuda")
        for w in torch_step(a, torch.empty_like(a)):
            w.wait()
    except Exception as exc:  # torch may refuse a self send/recv
        torch_ok = False
        results["torch_error"] = str(exc)
        print(f"torch.distributed refused the self send/recv: {exc}", flush=True)

    print(f"{'bytes':>12} {'megatron_p2p GB/s':>18} {'torch GB/s':>11} {'ratio':>6}", flush=True)
    for nbytes in SIZES:
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        iters = max(5, min(200, (4 << 30) // nbytes))
        ours = nbytes / device_seconds(lambda: mp_step(comm, src, dst), iters) / 1e9
        assert torch.equal(src, dst)
        theirs = nbytes / device_seconds(lambda: torch_step(src, dst), iters) / 1e9 if torch_ok else float("nan")
        results["bandwidth"].append({"bytes": nbytes, "megatron_p2p_GBps": ours, "torch_GBps": theirs})
        print(f"{nbytes:>12} {ours:>18.1f} {theirs:>11.1f} {ours / theirs:>6.2f}", flush=True)
        del src, dst
    small = torch.ones(256, device="cuda")
    small_in = torch.empty_like(small)
    ours = host_seconds(lambda: mp_step(comm, small, small_in), 2000)
    theirs = host_seconds(lambda: torch_step(small, small_in), 2000) if torch_ok else float("nan")
    results["host"] = {"megatron_p2p_us": ours * 1e6, "torch_us": theirs * 1e6}
    print(f"host time per 1 KiB exchange (post + wait): megatron_p2p {ours * 1e6:.1f} us, "
          f"torch.distributed {theirs * 1e6:.1f} us, ratio {theirs / ours:.2f}x", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    comm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
