"""patch_pipelining(): torch.distributed.pipelining's point-to-point traffic over megatron_p2p,
put back by unpatch_pipelining() (or on leaving a `with`).

torch's schedules.py and stage.py reach every p2p call through their module attribute `dist`
(`import torch.distributed as dist`, looked up at each call). The patch points that attribute,
in every loaded `torch.distributed.pipelining.*` module that binds torch.distributed, at a proxy
module: its P2POp, isend, irecv, batch_isend_irecv, send, recv, send_object_list and
recv_object_list are this package's (ops.py), bound to `comm` when one is given, else finding
the communicator registered for each call's group; every other name is torch.distributed's own.
Nothing else in torch.distributed changes, and code outside those modules is untouched.

Layouts. torch allocates each receive buffer with the sender's strides (pipelining/_utils.py),
while this package carries contiguous tensors only (the wire format is a tensor's bytes). Within
the patch a non-contiguous tensor travels as its values in row-major order: a send posts a
contiguous copy, a receive lands in a contiguous staging tensor that wait() copies into the
buffer. Contiguous tensors, the usual case, go as they are, with no copy. (gloo refuses both.)"""
from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from . import ops
from ._patching import Swap

logger = logging.getLogger(__name__)

_PACKAGE = "torch.distributed.pipelining"
_PRELOAD = ("torch.distributed.pipelining.schedules", "torch.distributed.pipelining.stage")
P2P_NAMES = ("P2POp", "isend", "irecv", "batch_isend_irecv", "send", "recv", "send_object_list",
             "recv_object_list")


def _contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if not isinstance(tensor, torch.Tensor) or tensor.is_contiguous() else tensor.contiguous()


class _StagedReceive:
    """A posted receive into a non-contiguous buffer: the message lands in a contiguous staging
    tensor, copied into the buffer by the first wait() (so the buffer holds it after wait(), as
    torch's code expects). Otherwise it is the Request."""

    _staging: torch.Tensor | None  # None once copied

    def __init__(self, request: ops.Request, staging: torch.Tensor, buffer: torch.Tensor):
        self._request, self._staging, self._buffer = request, staging, buffer

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        done = self._request.wait(*args, **kwargs)
        if self._staging is not None:
            with torch.no_grad():  # torch's buffers are autograd leaves; a receive writes under autograd
                self._buffer.copy_(self._staging)
            self._staging = None
        return done

    @property
    def tensor(self) -> torch.Tensor:
        return self._buffer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._request, name)


def _staged(tensor: torch.Tensor) -> torch.Tensor | None:
    """The contiguous tensor a receive into `tensor` lands in, or None when it can land there."""
    if not isinstance(tensor, torch.Tensor) or tensor.is_contiguous():
        return None
    return torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)


def _receive(post: Callable[[torch.Tensor], ops.Request], tensor: torch.Tensor) -> ops.Request | _StagedReceive:
    staging = _staged(tensor)
    if staging is None:
        return post(tensor)
    return _StagedReceive(post(staging), staging, tensor)


def _proxy(comm: ops.Communicator | None) -> ModuleType:
    """torch.distributed as the pipelining modules see it while patched."""
    proxy = _DistProxy()

    def isend(tensor: torch.Tensor, dst: int | None = None, group: dist.ProcessGroup | None = None,
              tag: int = 0, group_dst: int | None = None) -> ops.Request:
        return ops.isend(_contiguous(tensor), dst, group, tag, group_dst, comm=comm)

    def irecv(tensor: torch.Tensor, src: int | None = None, group: dist.ProcessGroup | None = None,
              tag: int = 0, group_src: int | None = None) -> ops.Request | _StagedReceive:
        return _receive(lambda t: ops.irecv(t, src, group, tag, group_src, comm=comm), tensor)

    def send(tensor: torch.Tensor, dst: int | None = None, group: dist.ProcessGroup | None = None,
             tag: int = 0, group_dst: int | None = None) -> None:
        isend(tensor, dst, group, tag, group_dst).wait()

    def recv(tensor: torch.Tensor, src: int | None = None, group: dist.ProcessGroup | None = None,
             tag: int = 0, group_src: int | None = None) -> int:
        req = irecv(tensor, src, group, tag, group_src)
        req.wait()
        return req.peer

    class P2POp(ops.P2POp):
        """torch.distributed.P2POp's signature, over this package; `op` is the proxy's isend or
        irecv (what torch's code passes, and compares p.op with)."""

        def __init__(self, op: Callable[..., Any], tensor: torch.Tensor, peer: int | None = None,
                     group: dist.ProcessGroup | None = None, tag: int = 0, group_peer: int | None = None):
            own = {isend: ops.isend, irecv: ops.irecv}.get(op, op)
            super().__init__(own, tensor, peer, group, tag, group_peer, comm=comm)
            self.op = op

    def batch_isend_irecv(p2p_op_list: Sequence[ops.P2POp]) -> list[Any]:
        plain, staged = [], []
        for i, p in enumerate(p2p_op_list):
            if not isinstance(p, ops.P2POp):
                raise TypeError(f"p2p_op_list[{i}] must be a megatron_p2p P2POp, not {type(p).__name__}")
            staging = None if p.is_send else _staged(p.tensor)
            wire = _contiguous(p.tensor) if staging is None else staging
            staged.append(staging)
            plain.append(p if wire is p.tensor else
                         ops.P2POp(ops.isend if p.is_send else ops.irecv, wire, p.peer, tag=p.tag, comm=p.comm))
        reqs = ops.batch_isend_irecv(plain)
        return [r if s is None else _StagedReceive(r, s, p.tensor) for r, s, p in zip(reqs, staged, p2p_op_list)]

    def send_object_list(object_list: list[Any], dst: int | None = None,
                         group: dist.ProcessGroup | None = None, device: Any = None,
                         group_dst: int | None = None, use_batch: bool = False) -> None:
        ops.send_object_list(object_list, dst, group, device, group_dst, use_batch, comm=comm)

    def recv_object_list(object_list: list[Any], src: int | None = None,
                         group: dist.ProcessGroup | None = None, device: Any = None,
                         group_src: int | None = None, use_batch: bool = False) -> int:
        return ops.recv_object_list(object_list, src, group, device, group_src, use_batch, comm=comm)

    functions = {"isend": isend, "irecv": irecv, "batch_isend_irecv": batch_isend_irecv, "send": send,
                 "recv": recv, "send_object_list": send_object_list, "recv_object_list": recv_object_list}
    for name, fn in functions.items():
        fn.__doc__ = f"torch.distributed.{name}'s signature, over megatron_p2p (see megatron_p2p.ops.{name})."
        setattr(proxy, name, fn)
    proxy.P2POp = P2POp
    return proxy


class _DistProxy(ModuleType):
    """torch.distributed with its p2p names replaced (set on the instance); any other name is
    looked up on torch.distributed itself at each access."""

    P2POp: type[ops.P2POp]  # set by _proxy, as are the functions

    def __init__(self) -> None:
        super().__init__("torch.distributed", "torch.distributed as torch.distributed.pipelining sees it "
                         "under megatron_p2p.patch_pipelining()")

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)


class PipeliningPatch:
    """The active swap: `swapped` lists (module name, attribute) pairs; `dist` is the proxy they
    now hold. A context manager whose exit calls unpatch_pipelining()."""

    def __init__(self, comm: ops.Communicator | None):
        self.comm = comm
        self.dist = _proxy(comm)
        # (torch's object, ours): the module itself, and its p2p functions in case a module
        # bound them by name.
        self._swap = Swap(_PACKAGE, [(dist, self.dist)] + [(getattr(dist, n), getattr(self.dist, n))
                                                            for n in P2P_NAMES])

    @property
    def swapped(self) -> list[tuple[str, str]]:
        return self._swap.swapped

    def __enter__(self) -> PipeliningPatch:
        return self

    def __exit__(self, *exc: Any) -> None:
        unpatch_pipelining()


_active: PipeliningPatch | None = None


def patch_pipelining(comm: ops.Communicator | None = None) -> PipeliningPatch:
    """Sends torch.distributed.pipelining's point-to-point traffic (schedules and stages: the
    first-step vote, the metadata round, the schedule's own ops) over megatron_p2p (see the
    module doc). `comm`: the communicator every call uses (its ranks must be the stages'
    group's); None: each call's group finds its registered one, and a group without one raises
    an error saying how to create it. Idempotent while patched with the same `comm`; returns the
    active patch, usable as a context manager."""
    global _active
    if comm is not None and not isinstance(comm, ops.Communicator):
        raise TypeError(f"patch_pipelining takes a megatron_p2p Communicator or None, not {type(comm).__name__}")
    if _active is not None:
        if _active.comm is not comm:
            raise RuntimeError("patch_pipelining() is already active with another communicator; "
                               "call unpatch_pipelining() first")
        return _active
    for name in _PRELOAD:
        importlib.import_module(name)
    patch = PipeliningPatch(comm)
    patch._swap.apply()
    logger.info("patch_pipelining: swapped %d bindings in %d modules", len(patch.swapped),
                len({m for m, _ in patch.swapped}))
    _active = patch
    return patch


def unpatch_pipelining() -> None:
    """Puts torch.distributed back wherever patch_pipelining() swapped it (and in pipelining
    modules imported since). Idempotent."""
    global _active
    if _active is None:
        return
    _active._swap.restore()
    _active = None
    logger.info("unpatch_pipelining: torch.distributed.pipelining's own communication restored")

