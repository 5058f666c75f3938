"""torch.distributed-style ops over megatron_p2p communicators, and how code which passes a
process group (or nothing) finds its communicator (from _registry.py's live ones).

Communicators are never created here: creation is collective, and creating them lazily at
first use lets ranks reach it in different orders and hang (Megatron-LM PR #5240). Create one
per group up front with `init_communicator(group)` (keep it) or `register_communicator`."""
from __future__ import annotations

import operator
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from . import _C, _registry

Request = _C.Request
Communicator = _C.Communicator

def group_ranks(group: dist.ProcessGroup | None) -> tuple[int, ...]:
    """Global ranks of `group` (None: every rank), in group-rank order."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: a process group cannot be resolved to ranks")
    if group is None or group is dist.GroupMember.WORLD:
        return tuple(range(dist.get_world_size()))
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None, not {type(group).__name__}")
    return tuple(dist.get_process_group_ranks(group))


def register_communicator(comm: Communicator) -> Communicator:
    """Makes `comm` the communicator that group arguments over its ranks resolve to, and keeps
    it alive until it is closed or replaced. Returns `comm`."""
    if not isinstance(comm, Communicator):
        raise TypeError(f"register_communicator takes a megatron_p2p Communicator, not {type(comm).__name__}")
    _registry.name(comm)
    return comm


def find_communicator(ranks: tuple[int, ...]) -> Communicator | None:
    """The open communicator over exactly `ranks`: the registered one, else the only live one
    that `init_communicator` made; None if there is none. Several unregistered ones: an error."""
    comm = _registry.named(ranks)
    if comm is not None:
        return comm
    live = [c for c in _registry.live() if not c.closed and tuple(c.ranks) == ranks]
    if len(live) > 1:
        raise RuntimeError(
            f"{len(live)} open megatron_p2p communicators span global ranks {list(ranks)}; choose one with "
            "megatron_p2p.register_communicator(comm)"
        )
    return live[0] if live else None


def get_communicator(group: dist.ProcessGroup | None = None) -> Communicator:
    """The open communicator over `group`'s ranks (see find_communicator); an error saying how
    to create it when there is none."""
    ranks = group_ranks(group)
    comm = find_communicator(ranks)
    if comm is not None:
        return comm
    raise _C.P2PError(
        f"no megatron_p2p communicator spans global ranks {list(ranks)}"
        + (f": the communicator over global ranks {list(ranks)} was closed" if _registry.was_closed(ranks) else "")
        + ". Create it on every member of the group, "
        "before the first exchange: comm = megatron_p2p.init_communicator(group) (keep a reference) or "
        "megatron_p2p.register_communicator(megatron_p2p.init_communicator(group)). Communicators are never "
        "created at first use: ranks that reach first use in different orders would hang."
    )


def _resolve(group: dist.ProcessGroup | None, comm: Communicator | None, tag: int, fn: str) -> Communicator:
    if tag != 0:
        raise ValueError(
            f"{fn}: tag={tag!r} is not supported; messages between two ranks match in issue order (tag 0). "
            "Use a separate communicator for a separate stream of messages."
        )
    if comm is None:
        return get_communicator(group)
    if group is not None and tuple(comm.ranks) != group_ranks(group):
        raise ValueError(f"{fn}: comm spans ranks {list(comm.ranks)} but group spans {list(group_ranks(group))}")
    return comm


def _peer(comm: Communicator, peer: int | None, group_peer: int | None, names: tuple[str, str]) -> int:
    if (peer is None) == (group_peer is None):
        raise ValueError(f"give exactly one of {names[0]} (a global rank) and {names[1]} (a rank in the group)")
    if peer is not None:
        return peer
    assert group_peer is not None  # exactly one of the two was given
    if not 0 <= group_peer < comm.size:
        raise ValueError(f"{names[1]}={group_peer} is outside a group of {comm.size} ranks")
    return comm.ranks[group_peer]


def _group_rank(comm: Communicator, peer: int, name: str) -> int:
    """`peer`'s rank within the communicator's group. P2POp needs it when it is made (torch's code
    reads its group_peer), before the communicator's own check of the peer: in that check's words."""
    try:
        return list(comm.ranks).index(operator.index(peer))
    except TypeError:
        raise TypeError(f"{name} must be an int global rank, not {type(peer).__name__}") from None
    except ValueError:
        raise ValueError(f"{name} = {peer} is not a rank of this communicator (global ranks {list(comm.ranks)})") from None


def isend(
    tensor: torch.Tensor,
    dst: int | None = None,
    group: dist.ProcessGroup | None = None,
    tag: int = 0,
    group_dst: int | None = None,
    *,
    comm: Communicator | None = None,
) -> Request:
    """torch.distributed.isend's signature: posts a send of `tensor` to global rank `dst` (or to
    `group_dst` within `group`). Ops of one communicator run one by one in call order.
    `comm=` names the communicator; otherwise `group`'s registered one is used."""
    c = _resolve(group, comm, tag, "isend")
    return c.isend(tensor, _peer(c, dst, group_dst, ("dst", "group_dst")))


def irecv(
    tensor: torch.Tensor,
    src: int | None = None,
    group: dist.ProcessGroup | None = None,
    tag: int = 0,
    group_src: int | None = None,
    *,
    comm: Communicator | None = None,
) -> Request:
    """torch.distributed.irecv's signature: posts a receive into `tensor` from global rank `src`
    (or `group_src` within `group`). There is no wildcard source: `src` is required."""
    c = _resolve(group, comm, tag, "irecv")
    return c.irecv(tensor, _peer(c, src, group_src, ("src", "group_src")))


def _is_send_op(op: Callable[..., Any]) -> bool:
    if op is isend or op is dist.isend:
        return True
    if op is irecv or op is dist.irecv:
        return False
    raise ValueError(f"P2POp's op must be isend or irecv (megatron_p2p's or torch.distributed's), got {op!r}")


class P2POp:
    """One op for batch_isend_irecv, with torch.distributed.P2POp's signature. `op` is
    megatron_p2p's or torch.distributed's isend / irecv."""

    __slots__ = ("op", "tensor", "peer", "group", "tag", "group_peer", "comm", "is_send")

    def __init__(
        self,
        op: Callable[..., Any],
        tensor: torch.Tensor,
        peer: int | None = None,
        group: dist.ProcessGroup | None = None,
        tag: int = 0,
        group_peer: int | None = None,
        *,
        comm: Communicator | None = None,
    ):
        self.is_send = _is_send_op(op)
        self.op = op
        self.tensor = tensor
        self.tag = tag
        self.comm = _resolve(group, comm, tag, "P2POp")
        # The default group when none is given, as torch's P2POp fills it: torch's own code reads
        # its group (pipelining's _batch_p2p takes op.group.group_name).
        self.group = group if group is not None or not dist.is_initialized() else dist.group.WORLD
        self.peer = _peer(self.comm, peer, group_peer, ("peer", "group_peer"))
        # Filled as torch's is: torch's own code passes it on as group_dst= / group_src=.
        self.group_peer = _group_rank(self.comm, self.peer, "peer") if group_peer is None else group_peer

    def __repr__(self) -> str:
        kind = "isend" if self.is_send else "irecv"
        return f"P2POp({kind}, peer={self.peer}, shape={tuple(self.tensor.shape)})"


def batch_isend_irecv(p2p_op_list: Sequence[P2POp]) -> list[Request]:
    """Posts every op as one group: they progress together, so their order cannot deadlock.
    Returns one Request per op, in list order."""
    if not p2p_op_list:  # here, not left to comm.batch(): the communicator is found from the first op
        raise ValueError("batch_isend_irecv needs at least one P2POp")
    for i, p in enumerate(p2p_op_list):
        if not isinstance(p, P2POp):
            raise TypeError(f"p2p_op_list[{i}] must be a megatron_p2p P2POp, not {type(p).__name__}")
    comm = p2p_op_list[0].comm
    if any(p.comm is not comm for p in p2p_op_list):
        raise ValueError("every P2POp in one batch must use the same communicator")
    return comm.batch([(p.is_send, p.tensor, p.peer) for p in p2p_op_list])


def send(
    tensor: torch.Tensor,
    dst: int | None = None,
    group: dist.ProcessGroup | None = None,
    tag: int = 0,
    group_dst: int | None = None,
    *,
    comm: Communicator | None = None,
) -> None:
    """torch.distributed.send's signature: isend, then wait."""
    isend(tensor, dst, group, tag, group_dst, comm=comm).wait()


def recv(
    tensor: torch.Tensor,
    src: int | None = None,
    group: dist.ProcessGroup | None = None,
    tag: int = 0,
    group_src: int | None = None,
    *,
    comm: Communicator | None = None,
) -> int:
    """torch.distributed.recv's signature: irecv, then wait. Returns the sender's global rank."""
    req = irecv(tensor, src, group, tag, group_src, comm=comm)
    req.wait()
    return req.peer


def _object_device(comm: Communicator, device: torch.device | str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    return torch.device("cpu") if comm.device < 0 else torch.device("cuda", comm.device)


def send_object_list(
    object_list: list[Any],
    dst: int | None = None,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
    group_dst: int | None = None,
    use_batch: bool = False,
    *,
    comm: Communicator | None = None,
) -> None:
    """torch.distributed.send_object_list's signature and wire format: one int64 size per
    object, then the pickles concatenated as uint8, two messages. `use_batch` is accepted and
    changes nothing (a group of one op is that op here). Pickle: send only to trusted peers."""
    c = _resolve(group, comm, 0, "send_object_list")
    peer = _peer(c, dst, group_dst, ("dst", "group_dst"))
    dev = _object_device(c, device)
    payloads = [pickle.dumps(obj) for obj in object_list]
    sizes = torch.tensor([len(p) for p in payloads], dtype=torch.int64, device=dev)
    joined = bytearray(b"".join(payloads))
    data = (torch.frombuffer(joined, dtype=torch.uint8) if joined else torch.empty(0, dtype=torch.uint8)).to(dev)
    c.isend(sizes, peer).wait()
    c.isend(data, peer).wait()


def recv_object_list(
    object_list: list[Any],
    src: int | None = None,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
    group_src: int | None = None,
    use_batch: bool = False,
    *,
    comm: Communicator | None = None,
) -> int:
    """torch.distributed.recv_object_list's signature and wire format (see send_object_list):
    fills `object_list` in place, which must be as long as the sender's, and returns the
    sender's global rank. Unpickles what arrives: receive only from trusted peers."""
    c = _resolve(group, comm, 0, "recv_object_list")
    peer = _peer(c, src, group_src, ("src", "group_src"))
    dev = _object_device(c, device)
    sizes = torch.empty(len(object_list), dtype=torch.int64, device=dev)
    c.irecv(sizes, peer).wait()
    data = torch.empty(int(sizes.sum().item()), dtype=torch.uint8, device=dev)
    c.irecv(data, peer).wait()
    raw = data.cpu().numpy().tobytes()
    offset = 0
    for i, size in enumerate(sizes.tolist()):
        object_list[i] = pickle.loads(raw[offset:offset + size])
        offset += size
    return peer
