"""The stock algorithm this package replaces, over torch.distributed gloo: megatron-core's own
P2PCommunicator when megatron-core imports, else a replica of its _p2p_ops / _batched_p2p_ops.
`describe()` says which one a run used; the JSON records it.

CPU shim (megatron-core only): P2PCommunicator allocates receive buffers on
`torch.cuda.current_device()` and, after a batched call, runs `torch.cuda.synchronize()`. A CPU
build of torch raises on both, so in a process without CUDA the two are pointed at the CPU
(the device becomes "cpu" and the synchronize a no-op, which is what it is for host memory).
Nothing else of megatron-core is changed."""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist


@functools.lru_cache(maxsize=1)
def _megatron() -> tuple | None:
    try:
        from megatron.core.model_parallel_config import ModelParallelConfig
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    except Exception:  # not installed, or an import that fails on this machine
        return None
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: "cpu"
        torch.cuda.synchronize = lambda device=None: None
    return P2PCommunicator, ModelParallelConfig


def describe() -> dict:
    if _megatron():
        from importlib.metadata import version
        return {"kind": "megatron-core", "version": version("megatron-core"),
                "what": "megatron.core.pipeline_parallel.p2p_communication.P2PCommunicator over a gloo group",
                "shim": "torch.cuda.current_device -> 'cpu', torch.cuda.synchronize -> no-op (CPU-only torch)"}
    return {"kind": "replica", "version": None,
            "what": "replica of megatron-core's _p2p_ops / _batched_p2p_ops over torch.distributed gloo",
            "shim": None}


class _Replica:
    """megatron-core's _communicate for the two 1F1B calls: fresh receive buffers, then either
    every op in one batch_isend_irecv (batch_p2p_comm, its default) or single isend/irecv in
    parity order, where with 2 ranks one direction goes over WORLD so the two can overlap."""

    def __init__(self, group: dist.ProcessGroup, dtype: torch.dtype, batched: bool):
        self.group, self.dtype, self.batched = group, dtype, batched
        ranks = dist.get_process_group_ranks(group)
        me = ranks.index(dist.get_rank())
        self.next_rank = ranks[(me + 1) % len(ranks)]
        self.prev_rank = ranks[(me - 1) % len(ranks)]
        self.even = me % 2 == 0
        self.other = dist.group.WORLD if len(ranks) == 2 else group

    def _ops(self, send_next, recv_next, send_prev, recv_prev) -> list:
        if self.batched:
            ops = [(dist.isend, send_prev, self.prev_rank), (dist.irecv, recv_prev, self.prev_rank),
                   (dist.isend, send_next, self.next_rank), (dist.irecv, recv_next, self.next_rank)]
            ops = [dist.P2POp(f, t, p, self.group) for f, t, p in ops if t is not None]
            return dist.batch_isend_irecv(ops) if ops else []
        # Even ranks: send_next, recv_prev, send_prev, recv_next; odd ranks mirror them. Sends of
        # even ranks and receives of odd ranks share `group`; the rest use `other`.
        send_group, recv_group = (self.group, self.other) if self.even else (self.other, self.group)
        order = [(dist.isend, send_next, self.next_rank, send_group), (dist.irecv, recv_prev, self.prev_rank, recv_group),
                 (dist.isend, send_prev, self.prev_rank, send_group), (dist.irecv, recv_next, self.next_rank, recv_group)]
        if not self.even:
            order = [order[1], order[0], order[3], order[2]]
        reqs = []
        for post, t, peer, group in order:
            if t is not None:
                reqs.append(post(t, peer, group=group))
        return reqs

    def _communicate(self, send_next, send_prev, recv_prev: bool, recv_next: bool, shape):
        buf_prev = torch.empty(shape, dtype=self.dtype, requires_grad=True) if recv_prev else None
        buf_next = torch.empty(shape, dtype=self.dtype, requires_grad=True) if recv_next else None
        for req in self._ops(send_next, buf_next, send_prev, buf_prev):
            req.wait()
        return buf_prev, buf_next

    def send_forward_recv_backward(self, output, shape, is_last_stage: bool):
        return None if is_last_stage else self._communicate(output, None, False, True, shape)[1]

    def send_backward_recv_forward(self, grad, shape, is_first_stage: bool):
        return None if is_first_stage else self._communicate(None, grad, True, False, shape)[0]


def communicator(group: dist.ProcessGroup, dtype: torch.dtype, batched: bool):
    """An object with megatron-core's send_forward_recv_backward / send_backward_recv_forward."""
    found = _megatron()
    if found is None:
        return _Replica(group, dtype, batched)
    P2PCommunicator, ModelParallelConfig = found
    config = ModelParallelConfig(pipeline_dtype=dtype, batch_p2p_comm=batched,
                                 pipeline_model_parallel_size=dist.get_world_size(group))
    return P2PCommunicator(group, config)
