"""Host overhead: CPU time of the calling thread to post one four-op pipeline exchange
(send_next, recv_prev, send_prev, recv_next), not counting its completion: one call into this
package against the four torch.distributed isend/irecv calls megatron-core's _p2p_ops makes
(and against batch_isend_irecv of the same four ops). Rank 0 posts first and alone, while its
peer waits in a barrier, so nothing it posts can already progress: this package's post (which
also drives progress when there is some) then does only the posting.

The binding layer alone (argument checks, tensor reads, the plan, Requests) is measured on rank
0 through the benchmark-only "null" transport, which completes every op when it is posted: CPU
time per four-op exchange over batches of exchanges (one CPU-clock read, itself a syscall of
about 0.6 us here, per batch), beside torch's batch_isend_irecv posting cost of the same run."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from timing import human_bytes, median, say

from megatron_p2p import _testing

CONTENDERS = ("megatron_p2p", "torch_isend_irecv", "torch_batch_isend_irecv")
BINDING_BATCH = 200  # exchanges per CPU-time sample of the binding layer


def _poster(comm, contender: str, t: dict[str, torch.Tensor]) -> Callable[[], list]:
    """Returns a function that posts the exchange and returns its requests (waited untimed)."""
    peer = 1 - dist.get_rank()  # with 2 ranks, prev and next are the same peer
    even = dist.get_rank() % 2 == 0
    if contender == "megatron_p2p":
        return lambda: list(comm.exchange(mode="parity", **t).values())
    if contender == "torch_isend_irecv":
        if even:
            return lambda: [dist.isend(t["send_next"], peer), dist.irecv(t["recv_prev"], peer),
                            dist.isend(t["send_prev"], peer), dist.irecv(t["recv_next"], peer)]
        return lambda: [dist.irecv(t["recv_prev"], peer), dist.isend(t["send_next"], peer),
                        dist.irecv(t["recv_next"], peer), dist.isend(t["send_prev"], peer)]
    return lambda: dist.batch_isend_irecv([
        dist.P2POp(dist.isend, t["send_prev"], peer), dist.P2POp(dist.irecv, t["recv_prev"], peer),
        dist.P2POp(dist.isend, t["send_next"], peer), dist.P2POp(dist.irecv, t["recv_next"], peer)])


def run(comm, group, cfg: dict[str, Any]) -> dict[str, Any]:
    nbytes = cfg["bytes"]
    tensors = {name: torch.ones(nbytes, dtype=torch.uint8)
               for name in ("send_next", "recv_prev", "send_prev", "recv_next")}
    cpu: dict[str, list[float]] = {c: [] for c in CONTENDERS}
    wall: dict[str, list[float]] = {c: [] for c in CONTENDERS}
    for rnd in range(cfg["rounds"] + 1):  # round 0 warms up
        for c in CONTENDERS:
            post = _poster(comm, c, tensors)
            for _ in range(cfg["iterations"]):
                if dist.get_rank(group) != 0:
                    dist.barrier(group=group)
                w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
                reqs = post()
                c1, w1 = time.thread_time_ns(), time.perf_counter_ns()
                if dist.get_rank(group) == 0:
                    dist.barrier(group=group)
                for req in reqs:
                    req.wait()
                if rnd:
                    cpu[c].append((c1 - c0) / 1e3)
                    wall[c].append((w1 - w0) / 1e3)
    figures = {c: {"cpu_median_us": median(cpu[c]), "wall_median_us": median(wall[c])} for c in CONTENDERS}
    say(f"host overhead per four-op exchange of {human_bytes(nbytes)} tensors  " + "  ".join(
        f"{c} {f['cpu_median_us']:7.2f} us cpu ({f['wall_median_us']:7.2f} wall)" for c, f in figures.items()))
    out = {"bytes": nbytes, "samples": len(cpu["megatron_p2p"]), "us": figures}
    if dist.get_rank(group) == 0:
        out["binding_layer"] = _binding_layer(tensors, cfg, figures["torch_batch_isend_irecv"]["cpu_median_us"])
    return out


def _binding_layer(tensors: dict[str, torch.Tensor], cfg: dict[str, Any], torch_batch_us: float) -> dict[str, Any]:
    """CPU and wall microseconds per four-op exchange on the null transport (rank 0 of a group
    of 2 that no other process joins), and its ratio to torch's batch_isend_irecv posting."""
    comm = _testing.null_communicator("overhead-binding-layer", 0, [0, 1])
    exchange = comm.exchange
    cpu: list[float] = []
    wall: list[float] = []
    try:
        for rnd in range(cfg["rounds"] + 1):  # round 0 warms up
            for _ in range(max(5, cfg["iterations"] // 10)):
                w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
                for _ in range(BINDING_BATCH):
                    exchange(mode="parity", **tensors)
                c1, w1 = time.thread_time_ns(), time.perf_counter_ns()
                if rnd:
                    cpu.append((c1 - c0) / 1e3 / BINDING_BATCH)
                    wall.append((w1 - w0) / 1e3 / BINDING_BATCH)
    finally:
        comm.close()
    fig = {"cpu_us": median(cpu), "wall_us": median(wall), "samples": len(cpu),
           "exchanges_per_sample": BINDING_BATCH, "torch_batch_isend_irecv_cpu_us": torch_batch_us,
           "ratio_to_torch_batch_isend_irecv": median(cpu) / torch_batch_us}
    say(f"binding layer (null transport) per four-op exchange  {fig['cpu_us']:6.2f} us cpu "
        f"({fig['wall_us']:6.2f} wall), {fig['ratio_to_torch_batch_isend_irecv']:.3f} of torch "
        f"batch_isend_irecv's {torch_batch_us:.2f} us")
    return fig
