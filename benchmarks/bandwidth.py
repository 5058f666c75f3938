"""Bandwidth between 2 ranks, 64 KiB and up: a one-way stream and the bidirectional pipeline
exchange (rank 0 sends forward and receives backward while rank 1 does the opposite), through
this package and gloo, beside a single-thread memcpy of the same bytes in one process: the
limit for a transport that copies once."""
from __future__ import annotations

import ctypes
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from timing import human_bytes, repetitions, say, slowest_rank, timed_loop

CONTENDERS = ("megatron_p2p", "gloo_isend_irecv", "gloo_batch_isend_irecv")
WINDOW = 4  # one-way messages in flight per round


def _memcpy_gbps(nbytes: int, reps: int, group) -> float:
    """libc memcpy on rank 0 alone (rank 1 waits in a barrier, which sleeps)."""
    seconds = 0.0
    if dist.get_rank() == 0:
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.zeros(nbytes, dtype=torch.uint8)
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)  # warm
        start = time.perf_counter()
        for _ in range(reps):
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
        seconds = time.perf_counter() - start
    dist.barrier(group=group)
    return nbytes * reps / slowest_rank(seconds, group) / 1e9


def _one_way(comm, contender: str, send: torch.Tensor, recv: torch.Tensor, window: int) -> Callable[[], None]:
    """`window` messages from rank 0 to rank 1, posted together, then waited for."""
    sender = dist.get_rank() == 0
    peer = 1 - dist.get_rank()
    buf = send if sender else recv
    if contender == "megatron_p2p":
        post = comm.isend if sender else comm.irecv

        def run() -> None:
            for req in [post(buf, peer) for _ in range(window)]:
                req.wait()
    elif contender == "gloo_isend_irecv":
        post = dist.isend if sender else dist.irecv

        def run() -> None:
            for req in [post(buf, peer) for _ in range(window)]:
                req.wait()
    else:
        ops = [dist.P2POp(dist.isend if sender else dist.irecv, buf, peer) for _ in range(window)]

        def run() -> None:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
    return run


def _exchange(comm, contender: str, send: torch.Tensor, recv: torch.Tensor) -> Callable[[], None]:
    """1F1B's pair: rank 0 send_forward_recv_backward, rank 1 send_backward_recv_forward."""
    first = dist.get_rank() == 0
    peer = 1 - dist.get_rank()
    if contender == "megatron_p2p":
        kwargs = {"send_next": send, "recv_next": recv} if first else {"send_prev": send, "recv_prev": recv}

        def run() -> None:
            for req in comm.exchange(mode="batched", **kwargs).values():
                req.wait()
    elif contender == "gloo_isend_irecv":
        def run() -> None:  # megatron-core's parity order: even ranks send first
            if first:
                reqs = [dist.isend(send, peer), dist.irecv(recv, peer)]
            else:
                reqs = [dist.irecv(recv, peer), dist.isend(send, peer)]
            for req in reqs:
                req.wait()
    else:
        ops = [dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]

        def run() -> None:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
    return run


def run(comm, group, cfg: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    one_way, exchange, memcpy = [], [], []
    for nbytes in cfg["sizes"]:
        reps = repetitions(nbytes, cfg["target_bytes"], cfg["min_reps"], cfg["max_reps"])
        window = min(WINDOW, reps)
        rounds = max(1, reps // window)
        send = torch.ones(nbytes, dtype=torch.uint8)
        recv = torch.zeros(nbytes, dtype=torch.uint8)  # touched: no page faults inside the timing
        copy = _memcpy_gbps(nbytes, rounds * window, group)
        memcpy.append({"bytes": nbytes, "gbps": copy})
        stream = {}
        both = {}
        for c in CONTENDERS:
            seconds = timed_loop(_one_way(comm, c, send, recv, window), rounds, 1, group)
            stream[c] = nbytes * window / seconds / 1e9
            seconds = timed_loop(_exchange(comm, c, send, recv), rounds * window, 1, group)
            both[c] = nbytes / seconds / 1e9
        one_way.append({"bytes": nbytes, "messages": rounds * window, "gbps": stream})
        exchange.append({"bytes": nbytes, "messages": rounds * window, "gbps": both})
        say(f"bandwidth {human_bytes(nbytes):>8}  memcpy {copy:6.2f} GB/s | one-way " +
            "  ".join(f"{c} {v:6.2f}" for c, v in stream.items()) + " | exchange (per direction) " +
            "  ".join(f"{c} {v:6.2f}" for c, v in both.items()) + " GB/s")
    return {"one_way": one_way, "exchange": exchange, "memcpy": memcpy}
