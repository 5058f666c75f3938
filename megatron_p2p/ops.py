"""torch.distributed-style ops over a megatron_p2p communicator."""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch

from . import _C

Request = _C.Request


def isend(tensor: torch.Tensor, dst: int, *, comm: _C.Communicator) -> Request:
    """Posts a send of `tensor` to global rank `dst`; ops run one by one in call order."""
    return comm.isend(tensor, dst)


def irecv(tensor: torch.Tensor, src: int, *, comm: _C.Communicator) -> Request:
    """Posts a receive into `tensor` from global rank `src`; ops run one by one in call order."""
    return comm.irecv(tensor, src)


class P2POp:
    """One op for batch_isend_irecv: `op` is megatron_p2p.isend or megatron_p2p.irecv."""

    __slots__ = ("op", "tensor", "peer", "comm")

    def __init__(self, op: Callable[..., Request], tensor: torch.Tensor, peer: int, *, comm: _C.Communicator):
        if op is not isend and op is not irecv:
            raise ValueError(f"P2POp's op must be megatron_p2p.isend or megatron_p2p.irecv, got {op!r}")
        self.op = op
        self.tensor = tensor
        self.peer = peer
        self.comm = comm

    def __repr__(self) -> str:
        return f"P2POp({self.op.__name__}, peer={self.peer}, shape={tuple(self.tensor.shape)})"


def batch_isend_irecv(p2p_op_list: Sequence[P2POp]) -> list[Request]:
    """Posts every op as one group: they progress together, so their order cannot deadlock."""
    if not p2p_op_list:
        raise ValueError("batch_isend_irecv needs at least one P2POp")
    comm = p2p_op_list[0].comm
    for i, p in enumerate(p2p_op_list):
        if not isinstance(p, P2POp):
            raise TypeError(f"p2p_op_list[{i}] must be a P2POp, not {type(p).__name__}")
        if p.comm is not comm:
            raise ValueError("every P2POp in one batch must use the same communicator")
    return comm.batch([(p.op is isend, p.tensor, p.peer) for p in p2p_op_list])
