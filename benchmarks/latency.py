"""Latency: a 2-rank ping-pong, reported as half the round trip (median and p99), through this
package and through torch.distributed gloo (isend/irecv and batch_isend_irecv)."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from timing import human_bytes, median, percentile, say

ROUNDS = 4  # contenders take turns, so a burst of load on a shared machine hits them alike


def _round_trip(comm, contender: str, send: torch.Tensor, recv: torch.Tensor, peer: int) -> Callable[[], None]:
    """One round trip: rank 0 sends then receives, rank 1 receives then sends."""
    if contender == "megatron_p2p":
        isend, irecv = comm.isend, comm.irecv

        def post(is_send: bool):
            return (isend(send, peer) if is_send else irecv(recv, peer)).wait()
    elif contender == "gloo_isend_irecv":
        def post(is_send: bool):
            return (dist.isend(send, peer) if is_send else dist.irecv(recv, peer)).wait()
    else:
        def post(is_send: bool):
            op = dist.P2POp(dist.isend if is_send else dist.irecv, send if is_send else recv, peer)
            for req in dist.batch_isend_irecv([op]):
                req.wait()

    first = dist.get_rank() == 0

    def run() -> None:
        post(first)
        post(not first)

    return run


def run(comm, group, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    peer = 1 - dist.get_rank()
    contenders = ("megatron_p2p", "gloo_isend_irecv", "gloo_batch_isend_irecv")
    points = []
    for nbytes in cfg["sizes"]:
        send = torch.zeros(nbytes, dtype=torch.uint8)
        recv = torch.empty(nbytes, dtype=torch.uint8)
        samples: dict[str, list[float]] = {c: [] for c in contenders}
        per_round = max(1, cfg["iterations"] // ROUNDS)
        for _ in range(ROUNDS):
            for c in contenders:
                trip = _round_trip(comm, c, send, recv, peer)
                for _ in range(cfg["warmup"] // ROUNDS + 1):
                    trip()
                for _ in range(per_round):
                    start = time.perf_counter()
                    trip()
                    samples[c].append((time.perf_counter() - start) / 2 * 1e6)
        figures = {c: {"median_us": median(s), "p99_us": percentile(s, 0.99)} for c, s in samples.items()}
        points.append({"bytes": nbytes, "samples": len(samples["megatron_p2p"]), "us": figures})
        say(f"latency {human_bytes(nbytes):>8}  " + "  ".join(
            f"{c} {f['median_us']:8.2f} us (p99 {f['p99_us']:8.2f})" for c, f in figures.items()))
    return points
