"""Bandwidth between 2 ranks, 64 KiB and up: a one-way stream and the bidirectional pipeline
exchange (rank 0 sends forward and receives backward while rank 1 does the opposite), through
this package and gloo. This package receives twice: into plain torch tensors (the CMA path,
what a buffer a user allocates gets) and into tensors from `comm.empty` (its shared arena,
where megatron-core's receive buffers come from), when the communicator has one.

The baseline is what a transport that copies once can at best do, measured right before every
transport measurement in the same processes, so the two see the same machine; each
repetition's ratio is the transport's figure over the baseline measured beside it:
- one way, a single-thread memcpy of the same bytes (rank 0 copies while its peer waits);
- the exchange, two concurrent memcpys (both ranks copy the same bytes at once, started by a
  barrier): both directions copy at once there, sharing the memory bus."""
from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from timing import human_bytes, median, repetitions, say, slowest_rank, spread, timed_loop

CONTENDERS = ("megatron_p2p", "megatron_p2p_arena", "gloo_isend_irecv", "gloo_batch_isend_irecv")
PATTERNS = ("one_way", "exchange")
WINDOW = 4  # one-way messages in flight per round


def _memcpy_gbps(src: torch.Tensor, dst: torch.Tensor, nbytes: int, copies: int, group, concurrent: bool) -> float:
    """libc memcpy of `copies` x `nbytes`, per rank: on rank 0 alone (rank 1 waits in a barrier,
    which sleeps), or `concurrent`ly on both ranks, started together and timed to the slower."""
    seconds = 0.0
    if concurrent:
        dist.barrier(group=group)
    if concurrent or dist.get_rank() == 0:
        start = time.perf_counter()
        for _ in range(copies):
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
        seconds = time.perf_counter() - start
    dist.barrier(group=group)
    return nbytes * copies / slowest_rank(seconds, group) / 1e9


def _one_way(comm, contender: str, send: torch.Tensor, recv: torch.Tensor, window: int) -> Callable[[], None]:
    """`window` messages from rank 0 to rank 1, posted together, then waited for."""
    sender = dist.get_rank() == 0
    peer = 1 - dist.get_rank()
    buf = send if sender else recv
    if contender.startswith("megatron_p2p"):
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
    if contender.startswith("megatron_p2p"):
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


def _arena_note(comm) -> tuple[list[str], dict[str, Any]]:
    """The contenders this communicator can run, and what the JSON says about its arena."""
    if getattr(comm, "empty", None) is None:
        return ([c for c in CONTENDERS if c != "megatron_p2p_arena"],
                {"available": False, "arena_bytes": None,
                 "note": "this build's communicator has no empty(): the arena column is left out"})
    arena_bytes = int(getattr(comm, "arena_bytes", 0))
    note = ("receive buffers from comm.empty; a size above arena_bytes falls back to plain memory (CMA)"
            if arena_bytes else "the arena is disabled (arena_bytes 0): comm.empty gives plain memory")
    return list(CONTENDERS), {"available": True, "arena_bytes": arena_bytes, "note": note}


def run(comm, group, cfg: dict[str, Any]) -> dict[str, Any]:
    contenders, arena = _arena_note(comm)
    points: dict[str, list[dict[str, Any]]] = {p: [] for p in PATTERNS}
    memcpy: list[dict[str, Any]] = []  # the one-way baseline
    memcpy_concurrent: list[dict[str, Any]] = []  # the exchange's
    for nbytes in cfg["sizes"]:
        messages = repetitions(nbytes, cfg["target_bytes"], cfg["min_reps"], cfg["max_reps"])
        window = min(WINDOW, messages)
        rounds = max(1, messages // window)
        messages = rounds * window
        send = torch.ones(nbytes, dtype=torch.uint8)
        plain = torch.zeros(nbytes, dtype=torch.uint8)  # touched: no page faults inside the timing
        recv = {c: plain for c in contenders}
        if "megatron_p2p_arena" in contenders:
            recv["megatron_p2p_arena"] = comm.empty((nbytes,), torch.uint8)
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.zeros_like(src)
        bodies = {}
        for c in contenders:  # (body, iterations): both move `messages` messages of nbytes
            bodies["one_way", c] = (_one_way(comm, c, send, recv[c], window), rounds)
            bodies["exchange", c] = (_exchange(comm, c, send, recv[c]), messages)
        for body, _ in bodies.values():  # warm: first touch of every buffer, connections
            body()
        _memcpy_gbps(src, dst, nbytes, 1, group, concurrent=True)
        gbps: dict[tuple[str, str], list[float]] = {key: [] for key in bodies}
        copy: dict[tuple[str, str], list[float]] = {key: [] for key in bodies}
        for _ in range(cfg["repeats"]):
            for key, (body, iterations) in bodies.items():
                copy[key].append(_memcpy_gbps(src, dst, nbytes, messages, group, concurrent=key[0] == "exchange"))
                seconds = timed_loop(body, iterations, 0, group) * iterations
                gbps[key].append(nbytes * messages / seconds / 1e9)
        for pattern, baseline in zip(PATTERNS, (memcpy, memcpy_concurrent)):
            copies = [g for (p, _), v in copy.items() if p == pattern for g in v]
            baseline.append({"bytes": nbytes, "gbps": median(copies), "spread": spread(copies)})
        for pattern in PATTERNS:
            points[pattern].append({
                "bytes": nbytes, "messages": messages,
                "gbps": {c: median(gbps[pattern, c]) for c in contenders},
                "of_memcpy": {c: spread([g / m for g, m in zip(gbps[pattern, c], copy[pattern, c])])
                              for c in contenders},
                "repeats": {c: {"gbps": gbps[pattern, c], "memcpy_gbps": copy[pattern, c]} for c in contenders},
            })
        say(f"bandwidth {human_bytes(nbytes):>8}  memcpy {memcpy[-1]['gbps']:6.2f}, two at once "
            f"{memcpy_concurrent[-1]['gbps']:6.2f} GB/s each | " + " | ".join(
            f"{pattern} " + "  ".join(f"{c} {points[pattern][-1]['gbps'][c]:6.2f} "
                                      f"({points[pattern][-1]['of_memcpy'][c]['median']:.2f})" for c in contenders)
            for pattern in PATTERNS) + "  GB/s (of memcpy)")
    return {**points, "memcpy": memcpy, "memcpy_concurrent": memcpy_concurrent, "repeats": cfg["repeats"], "arena": arena}
