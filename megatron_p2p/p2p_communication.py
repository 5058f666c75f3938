"""megatron-core's pipeline point-to-point surface over megatron_p2p communicators.

- `P2PCommunicator(pp_group, config)`: megatron-core 0.14+'s class (0.19.2 checked by the
  tests): same attributes, properties, methods, parameters, return values, receive buffers and
  errors; extra keyword-only options pick the backend, mode, timeout and lanes.
- `_p2p_ops` / `_batched_p2p_ops`, `is_single_shape`, `Shape`.
- The module-level functions of megatron-core <= 0.12 (`recv_forward(tensor_shape, config)`)
  and 0.13 (the same with a trailing `is_first_stage` / `is_last_stage`): one function serves
  both; without the flag the stage comes from megatron-core's `parallel_state`.

What differs from megatron-core, on purpose:
- activations and gradients never cross, also with 2 pipeline ranks (its batched order and its
  shape exchange swap them there);
- with variable sequence lengths each shape header travels in the exchange's own steps, right
  ahead of its tensor (_shape_headers.py), so the schedules need no buffering; the exchange is
  then issued in parity order whatever the mode, with no device-wide synchronize, and the header
  announces the dtype, so a disagreement raises MismatchError naming both ranks instead of
  reinterpreting bytes;
- `batch_p2p_sync` is honoured on CUDA but not needed: stream order makes it safe to turn off;
- `send_forward_recv_backward` / `send_backward_recv_forward` take `overlap_p2p_comm=True`
  (keyword-only) and then return `(tensor, handles)`;
- `overlap_p2p_comm=True` also works in batched mode, where megatron-core asserts.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, List, Protocol, Union, cast  # noqa: UP035 - List: megatron-core's Shape alias

import torch
import torch.distributed as dist

from . import _C, _shape_headers
from .communicator import init_communicator
from .ops import find_communicator, get_communicator, group_ranks, register_communicator

logger = logging.getLogger(__name__)

Shape = Union[List[int], torch.Size]  # noqa: UP006, UP007 - equal to megatron-core's own alias
# (The functions take any Sequence[int] as a shape: megatron-core's schedules pass tuples too.)


class RequestLike(Protocol):
    """What P2PCommunicator does with a posted op: waits for it."""

    def wait(self) -> object: ...


class CommunicatorLike(Protocol):
    """What P2PCommunicator uses of its communicator: megatron_p2p's Communicator, or a stand-in
    (verify.megatron_recording's RecordingCommunicator, which records what is posted)."""

    @property
    def ranks(self) -> tuple[int, ...]: ...
    @property
    def global_rank(self) -> int: ...
    @property
    def lanes(self) -> int: ...
    @property
    def backend(self) -> str: ...
    def exchange(self, send_next: torch.Tensor | None = ..., recv_prev: torch.Tensor | None = ...,
                 send_prev: torch.Tensor | None = ..., recv_next: torch.Tensor | None = ..., *, mode: str = ...,
                 prev_rank: int | None = ..., next_rank: int | None = ...,
                 call: str | None = ...) -> Mapping[str, RequestLike]: ...
    def batch(self, ops: Sequence[tuple[bool, torch.Tensor, int]], *, lane: int = ...,
              call: str | None = ...) -> Sequence[RequestLike]: ...
    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor: ...
    def check_tensor(self, tensor: torch.Tensor, name: str = ..., /) -> None: ...


if TYPE_CHECKING:
    from typing import TypeAlias, Unpack

    # _communicate's reqs: the posted requests by op name (wait_on_reqs=False); once waited, None,
    # or [] / {} when nothing was posted.
    _Handles: TypeAlias = Mapping[str, RequestLike] | list[RequestLike] | None
    # What the nine methods receive: a tensor per shape (None where skipped or not received).
    _Received: TypeAlias = torch.Tensor | None | list[torch.Tensor | None]
    # What they send: a tensor or a list of them; None sends nothing.
    _Sent: TypeAlias = torch.Tensor | None | list[torch.Tensor | None]
    # One shape (a list, tuple or torch.Size of ints), or a list of them, one per tensor.
    _Shapes: TypeAlias = Sequence[int] | list[Sequence[int]]
    # overlap_p2p_comm=True: (received, handles), each a list for a list of tensors.
    _Overlapped: TypeAlias = tuple[torch.Tensor | None, _Handles] | tuple[list[torch.Tensor | None], list[_Handles]]


MODES = _C.MODE_NAMES  # the C core's names (csrc/core/plan.c)
SLOTS = _C.SLOT_NAMES

# Shape header of the variable-sequence-length exchange: ndim, up to _MAX_DIMS sizes, dtype code.
_MAX_DIMS = 6
_HEADER_WORDS = _MAX_DIMS + 2
# The shape round's message (_shape_headers.py says how it travels).
HEADER_BYTES = _HEADER_WORDS * 8
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool]
_DTYPE_CODE = {dt: i for i, dt in enumerate(_DTYPES)}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        _DTYPE_CODE[getattr(torch, _name)] = len(_DTYPES)
        _DTYPES.append(getattr(torch, _name))
_UNKNOWN_DTYPE = -1
HEADER_CALL = "_communicate_shapes"  # the name of the header receives in reports


def _slots(send_next: torch.Tensor | None, send_prev: torch.Tensor | None, recv_prev: bool,
           recv_next: bool) -> tuple[dict[str, torch.Tensor], tuple[str, ...]]:
    """megatron-core's four arguments as ({send slot: tensor}, (receive slots))."""
    sends = {s: t for s, t in (("send_next", send_next), ("send_prev", send_prev)) if t is not None}
    return sends, tuple(s for s, wanted in (("recv_prev", recv_prev), ("recv_next", recv_next)) if wanted)


def _buffer_shape(shape: Any, dtype: torch.dtype, name: str) -> list[int]:
    """A receive buffer's shape, checked before anything is allocated or posted: torch would
    raise RuntimeError for a negative or overflowing one."""
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise TypeError(f"{name}: tensor_shape must be a sequence of ints, got {shape!r}")
    dims = list(shape)
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
        raise ValueError(f"{name}: tensor_shape must hold non-negative ints, got {shape!r}")
    numel = 1
    for d in dims:
        numel *= d
    if numel * dtype.itemsize >= 1 << 63:
        raise ValueError(f"{name}: tensor_shape {dims} of {dtype} holds more than 2**63 bytes")
    return dims


def _check_pipeline_dtype(dtype: Any) -> None:
    """Received tensors are made with requires_grad=True, which needs a floating or complex dtype."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"config.pipeline_dtype must be a torch.dtype, got {dtype!r}")
    if not (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"config.pipeline_dtype {dtype} cannot require grad, as received tensors do")


def is_single_shape(x: Any) -> bool:
    """True for one shape (a torch.Size, or a non-empty list / tuple of ints), False for a
    list of shapes."""
    if isinstance(x, torch.Size):
        return True
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(d, int) for d in x)


# ---- megatron-core's op helpers --------------------------------------------------------------


def _exchange_for(
    mode: str,
    tensor_send_prev: torch.Tensor | None,
    tensor_recv_prev: torch.Tensor | None,
    tensor_send_next: torch.Tensor | None,
    tensor_recv_next: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    prev_pipeline_rank: int,
    next_pipeline_rank: int,
    call: str,
) -> dict[str, _C.Request]:
    comm = get_communicator(group)
    return comm.exchange(send_next=tensor_send_next, recv_prev=tensor_recv_prev, send_prev=tensor_send_prev,
                         recv_next=tensor_recv_next, mode=mode, prev_rank=prev_pipeline_rank,
                         next_rank=next_pipeline_rank, call=call)


def _p2p_ops(
    *,
    tensor_send_prev: torch.Tensor | None,
    tensor_recv_prev: torch.Tensor | None,
    tensor_send_next: torch.Tensor | None,
    tensor_recv_next: torch.Tensor | None,
    group: dist.ProcessGroup,
    prev_pipeline_rank: int,
    next_pipeline_rank: int,
) -> dict[str, _C.Request]:
    """megatron-core's `_p2p_ops`: the posted ops in parity order, as a dict of requests keyed
    send_next / recv_prev / send_prev / recv_next. `group`'s communicator must exist
    (`init_communicator(group)`); ranks are global."""
    return _exchange_for("parity", tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next, group,
                         prev_pipeline_rank, next_pipeline_rank, "_p2p_ops")


def _batched_p2p_ops(
    *,
    tensor_send_prev: torch.Tensor | None,
    tensor_recv_prev: torch.Tensor | None,
    tensor_send_next: torch.Tensor | None,
    tensor_recv_next: torch.Tensor | None,
    group: dist.ProcessGroup,
    prev_pipeline_rank: int,
    next_pipeline_rank: int,
) -> list[_C.Request]:
    """megatron-core's `_batched_p2p_ops`: the posted ops as groups, as a list of requests
    (send_prev, recv_prev, send_next, recv_next order; [] when nothing is posted). Unlike
    megatron-core's, the pairing is right with 2 pipeline ranks."""
    reqs = _exchange_for("batched", tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next, group,
                         prev_pipeline_rank, next_pipeline_rank, "_batched_p2p_ops")
    return [reqs[k] for k in ("send_prev", "recv_prev", "send_next", "recv_next") if k in reqs]


# ---- the class ------------------------------------------------------------------------------


class _Span:
    """megatron-core's timer calls (`timers(name, log_level=2).start()` then
    `timers(name).stop()`), plus an NVTX range when CUDA is in use."""

    __slots__ = ("timers", "name", "nvtx")

    def __init__(self, timers: Any, name: str, nvtx: bool):
        self.timers, self.name, self.nvtx = timers, name, nvtx

    def __enter__(self) -> None:
        if self.nvtx:  # (torch leaves torch.cuda.nvtx unannotated)
            torch.cuda.nvtx.range_push(f"megatron_p2p.{self.name}")  # type: ignore[no-untyped-call]
        if self.timers is not None:
            self.timers(self.name, log_level=2).start()

    def __exit__(self, *exc: Any) -> None:
        if self.timers is not None:
            self.timers(self.name).stop()
        if self.nvtx:
            torch.cuda.nvtx.range_pop()  # type: ignore[no-untyped-call]  # torch leaves it unannotated


class P2PCommunicator:
    """megatron-core's P2PCommunicator over a megatron_p2p communicator.

    Constructing it is collective over `pp_group` when no communicator spans the group yet: it
    then creates one (and registers it, so later instances over the group reuse it). `config`
    is duck-typed: megatron-core's ModelParallelConfig or any object with its fields.

    Keyword-only options (not in megatron-core):
      backend: "shm" (CPU tensors) or what init_communicator accepts; default "shm".
      mode: "parity" or "batched"; default follows config.batch_p2p_comm (batched if true).
      timeout: seconds any wait may block; default 300.
      lanes: 2 (activations and gradients on independent queues, the default) or 1.
      comm: an existing communicator over exactly pp_group's ranks.
    """

    def __init__(
        self,
        pp_group: dist.ProcessGroup | None,  # None: the default group, as for init_communicator
        config: Any,
        *,
        backend: str | None = None,
        mode: str | None = None,
        timeout: float | None = None,
        lanes: int | None = None,
        comm: CommunicatorLike | None = None,
    ):
        self.pp_group = pp_group
        self.config = config
        ranks = group_ranks(pp_group)
        if comm is None:
            comm = self._find_or_create(pp_group, ranks, backend, timeout, lanes)
        elif tuple(comm.ranks) != ranks:
            raise ValueError(f"comm spans global ranks {list(comm.ranks)}, pp_group spans {list(ranks)}")
        if mode is None:
            mode = "batched" if getattr(config, "batch_p2p_comm", True) else "parity"
        if mode not in MODES:
            # Checked here as well as by exchange() (in the same words): a wrong mode fails where it is
            # given, not at the first exchange, possibly many steps later.
            raise ValueError(f"mode must be {' or '.join(map(repr, MODES))}, got {mode!r}")
        self.comm: CommunicatorLike = comm
        self.mode: str = mode
        me = ranks.index(dist.get_rank())
        self.next_rank: int = ranks[(me + 1) % len(ranks)]
        self.prev_rank: int = ranks[(me - 1) % len(ranks)]
        self.virtual_pipeline_model_parallel_size = getattr(config, "virtual_pipeline_model_parallel_size", None)
        self._rank_in_group = me
        self._size = len(ranks)
        self._call = "_communicate"  # the megatron-core method being served, named in reports
        self._cuda = comm.backend != "shm"
        logger.debug("P2PCommunicator: global rank %d, stage %d of %d (ranks %s), mode %s, backend %s, %d lane(s)",
                    ranks[me], me, len(ranks), list(ranks), mode, comm.backend, comm.lanes)

    @staticmethod
    def _find_or_create(
        pp_group: dist.ProcessGroup | None,
        ranks: tuple[int, ...],
        backend: str | None,
        timeout: float | None,
        lanes: int | None,
    ) -> _C.Communicator:
        comm = find_communicator(ranks)
        if comm is None:
            logger.info("creating a %s communicator over global ranks %s", backend or "shm", list(ranks))
            comm = init_communicator(pp_group, backend or "shm", 300.0 if timeout is None else timeout,
                                     lanes=2 if lanes is None else lanes)
            return register_communicator(comm)
        wanted = {"backend": backend, "timeout": timeout, "lanes": lanes}
        clash = {k: (v, getattr(comm, k)) for k, v in wanted.items() if v is not None and v != getattr(comm, k)}
        if clash:
            raise ValueError(
                f"the communicator over global ranks {list(ranks)} already exists with "
                + ", ".join(f"{k}={have!r}" for k, (_, have) in clash.items())
                + "; asked for " + ", ".join(f"{k}={want!r}" for k, (want, _) in clash.items())
            )
        return comm

    # -- megatron-core's properties --

    @property
    def is_pp_first_stage(self) -> bool:
        """True on the first pipeline stage."""
        return self._rank_in_group == 0

    @property
    def is_pp_last_stage(self) -> bool:
        """True on the last pipeline stage."""
        return self._rank_in_group == self._size - 1

    @property
    def total_stages(self) -> int:
        """Pipeline stages (the group's size)."""
        return self._size

    @property
    def current_stage(self) -> int:
        """This rank's stage, from 0."""
        return self._rank_in_group

    # -- the exchange --

    def _device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self._cuda else torch.device("cpu")

    def _span(self, name: str) -> _Span:
        return _Span(getattr(self.config, "timers", None), name, self._cuda)

    @contextlib.contextmanager
    def _serving(self, call: str) -> Iterator[None]:
        """Names the exchanges posted inside after megatron-core's method `call`."""
        outer, self._call = self._call, call
        try:
            yield
        finally:
            self._call = outer

    def _exchange(self, **ops: Unpack[_C._ExchangeTensors]) -> Mapping[str, RequestLike]:
        if logger.isEnabledFor(logging.DEBUG):
            # A TypedDict's values() are objects to mypy (a subtype may add keys); these hold tensors.
            tensors = cast("dict[str, torch.Tensor | None]", ops)
            logger.debug("exchange (%s): %s", self.mode,
                         ", ".join(f"{k} {tuple(v.shape)}" for k, v in tensors.items() if v is not None))
        return self.comm.exchange(mode=self.mode, call=self._call, **ops)

    def _header(self, t: torch.Tensor) -> torch.Tensor:
        if t.dim() > _MAX_DIMS:
            raise ValueError(f"variable_seq_lengths carries shapes of at most {_MAX_DIMS} dims, got {tuple(t.shape)}")
        words = [t.dim(), *t.shape, *([0] * (_MAX_DIMS - t.dim())), _DTYPE_CODE.get(t.dtype, _UNKNOWN_DTYPE)]
        return torch.tensor(words, dtype=torch.int64, device=self._device())

    def _exchange_with_headers(
        self, sends: dict[str, torch.Tensor], recvs: tuple[str, ...], allocate: Any | None = None,
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, RequestLike], list[RequestLike]]:
        """Posts an exchange step by step with its shape headers (_shape_headers.round_steps): the
        parity plan's steps, each send preceded by its header, each step with receives by their
        headers' receives, waited for. allocate(slot, header) makes a receive's buffer; without
        it only the headers travel. Returns (headers received, buffers, {slot: data request},
        [header send requests])."""
        present = tuple(s for s in SLOTS if s in sends or s in recvs)
        peers = {"send_next": self.next_rank, "recv_next": self.next_rank,
                 "send_prev": self.prev_rank, "recv_prev": self.prev_rank}
        me = self.comm.global_rank
        plan = _C.plan("parity", self.comm.lanes, self._rank_in_group % 2, present, self.prev_rank == me,
                       self.next_rank == me)
        headers: dict[str, torch.Tensor] = {}
        buffers: dict[str, torch.Tensor] = {}
        reqs: dict[str, RequestLike] = {}
        header_sends: list[RequestLike] = []
        for header_step, lane, ops in _shape_headers.round_steps(plan):
            if header_step:
                got = {s: torch.empty(_HEADER_WORDS, dtype=torch.int64, device=self._device()) for s, _ in ops}
                for r in self.comm.batch([(False, got[s], peers[s]) for s, _ in ops], lane=lane, call=HEADER_CALL):
                    r.wait()
                headers.update(got)
                if allocate is not None:
                    buffers.update((s, allocate(s, got[s])) for s in got)
                continue
            if allocate is None:  # the headers alone
                ops = [op for op in ops if op[1]]
            if not ops:
                continue
            tensors = [self._header(sends[s]) if is_header else sends[s] if s in sends else buffers[s]
                       for s, is_header in ops]
            posted = self.comm.batch([(s in sends, t, peers[s]) for (s, _), t in zip(ops, tensors)], lane=lane,
                                     call=self._call)
            for (s, is_header), r in zip(ops, posted):
                if is_header:
                    header_sends.append(r)
                else:
                    reqs[s] = r
        return headers, buffers, reqs, header_sends

    def _decode(self, header: torch.Tensor | None, peer: int | None) -> tuple[list[int], torch.dtype | None]:
        if header is None:
            return [0, 0, 0], None
        words = header.tolist()
        ndim, code = words[0], words[-1]
        dims = words[1:1 + ndim] if 0 <= ndim <= _MAX_DIMS else []
        if not 0 <= ndim <= _MAX_DIMS or any(d < 0 for d in dims) or not -1 <= code < len(_DTYPES):
            raise _C.MismatchError(
                f"rank {dist.get_rank()}: {self._call}: the shape header from rank {peer} is malformed ({words}); "
                "both ranks must run megatron_p2p with the same variable_seq_lengths setting"
            )
        return dims, (_DTYPES[code] if code >= 0 else None)

    def _communicate_shapes(self, tensor_send_next: torch.Tensor | None, tensor_send_prev: torch.Tensor | None,
                            recv_prev: bool, recv_next: bool) -> tuple[list[int], list[int]]:
        """megatron-core's shape exchange: returns (recv_prev_shape, recv_next_shape), each the
        peer's tensor shape as a list, or [0, 0, 0] where nothing is received. Runs in the
        shape round's parity order (_shape_headers.py), with no device-wide synchronize."""
        got, _, _, header_sends = self._exchange_with_headers(*_slots(tensor_send_next, tensor_send_prev, recv_prev,
                                                                        recv_next))
        for r in header_sends:
            r.wait()
        return self._decode(got.get("recv_prev"), self.prev_rank)[0], self._decode(got.get("recv_next"), self.next_rank)[0]

    def _check_dtype(self, announced: torch.dtype | None, peer: int | None, what: str, shape: Any) -> str | None:
        want = self.config.pipeline_dtype
        if announced is None or want is None or announced == want:
            return None
        return (f"rank {dist.get_rank()}'s {what} expects {want} (config.pipeline_dtype) but rank {peer} "
                f"sends {announced} in shape {list(shape)}")

    def _communicate(
        self,
        *,
        tensor_send_next: torch.Tensor | None,
        tensor_send_prev: torch.Tensor | None,
        recv_prev: bool,
        recv_next: bool,
        tensor_shape: Sequence[int] | None,
        wait_on_reqs: bool = True,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, _Handles]:
        """megatron-core's `_communicate`: returns (tensor_recv_prev, tensor_recv_next, reqs).
        Received tensors are fresh `torch.empty(..., requires_grad=True)` of
        config.pipeline_dtype (None where not received). reqs: None once waited on; with
        wait_on_reqs=False the dict of posted requests keyed by op name; an empty list (batched)
        or dict (parity) when nothing was posted."""
        config = self.config
        variable = bool(getattr(config, "variable_seq_lengths", False) or getattr(config, "mtp_standalone", False))
        # megatron-core checks these after its shape exchange; before it, nothing is posted yet.
        for wanted, name in ((recv_prev, "recv_prev"), (recv_next, "recv_next")):
            if wanted and config.pipeline_dtype is None:
                raise RuntimeError(f"{name} needs a dtype: set config.pipeline_dtype")
            if wanted and tensor_shape is None:
                raise RuntimeError(
                    f"{name} needs tensor_shape, e.g. (seq_length, micro_batch_size, hidden_size)"
                )
            if wanted:
                _check_pipeline_dtype(config.pipeline_dtype)
        header_sends: list[RequestLike] = []
        reqs: Mapping[str, RequestLike]
        problems: list[str] = []

        def buffer(slot: str, shape: Any, announced: torch.dtype | None) -> torch.Tensor:
            peer = self.prev_rank if slot == "recv_prev" else self.next_rank
            problem = self._check_dtype(announced, peer, slot, shape)
            if problem:
                problems.append(problem)
            # On a dtype disagreement, take the peer's message as it is sent (so it does not hang),
            # then raise.
            dtype: torch.dtype = announced if problem and announced is not None else config.pipeline_dtype
            dims = _buffer_shape(shape, dtype, slot)
            return self.comm.empty(dims, dtype).requires_grad_()  # shm: from the arena its peers write into

        if variable:
            # The headers go first: a tensor the data exchange would refuse must be refused before
            # its header leaves, or the peer waits for data that never comes.
            sends, recvs = _slots(tensor_send_next, tensor_send_prev, recv_prev, recv_next)
            for s, t in sends.items():
                self.comm.check_tensor(t, "tensor_" + s)
            _, buffers, reqs, header_sends = self._exchange_with_headers(
                sends, recvs, lambda s, header: buffer(s, *self._decode(header, self.prev_rank if s == "recv_prev"
                                                                         else self.next_rank)))
            tensor_recv_prev, tensor_recv_next = buffers.get("recv_prev"), buffers.get("recv_next")
        else:
            tensor_recv_prev = buffer("recv_prev", tensor_shape, None) if recv_prev else None
            tensor_recv_next = buffer("recv_next", tensor_shape, None) if recv_next else None
            reqs = self._exchange(send_next=tensor_send_next, recv_prev=tensor_recv_prev,
                                  send_prev=tensor_send_prev, recv_next=tensor_recv_next)
        if problems:
            for r in [*header_sends, *reqs.values()]:
                r.wait()
            raise _C.MismatchError(f"rank {dist.get_rank()}: {self._call}: shape exchange: " + "; ".join(problems))
        if wait_on_reqs:
            for r in header_sends:  # first: one the peer refused fails here, not as a hang below
                r.wait()
        handles: _Handles = reqs
        if not reqs:
            handles = [] if self.mode == "batched" and wait_on_reqs else {}
        elif wait_on_reqs:
            for r in reqs.values():
                r.wait()
            handles = None
        if self._cuda and self.mode == "batched" and getattr(config, "batch_p2p_sync", True):
            # Honoured for parity with megatron-core; stream order already makes it unnecessary.
            torch.cuda.synchronize()
        return tensor_recv_prev, tensor_recv_next, handles

    # -- megatron-core's nine methods --

    def _recv_each(self, tensor_shapes: _Shapes, skip: bool, timer: str, prev: bool) -> _Received:
        single = is_single_shape(tensor_shapes)
        shapes: Sequence[Any] = [tensor_shapes] if single else tensor_shapes
        out: list[torch.Tensor | None] = []
        for shape in shapes:
            if skip:
                out.append(None)
                continue
            with self._span(timer):
                recv_p, recv_n, _ = self._communicate(tensor_send_next=None, tensor_send_prev=None, recv_prev=prev,
                                                      recv_next=not prev, tensor_shape=shape)
            out.append(recv_p if prev else recv_n)
        return out[0] if single else out

    def recv_forward(self, tensor_shapes: _Shapes, is_first_stage: bool) -> _Received:
        """Receives activations from the previous stage: one tensor per shape (a single tensor
        for a single shape), None on the first stage."""
        with self._serving("recv_forward"):
            return self._recv_each(tensor_shapes, is_first_stage, "forward-recv", prev=True)

    def recv_backward(self, tensor_shapes: _Shapes, is_last_stage: bool) -> _Received:
        """Receives gradients from the next stage: one tensor per shape (a single tensor for a
        single shape), None on the last stage."""
        with self._serving("recv_backward"):
            return self._recv_each(tensor_shapes, is_last_stage, "backward-recv", prev=False)

    def _send_each(self, tensors: _Sent, skip: bool, timer: str, forward: bool) -> None:
        for t in tensors if isinstance(tensors, list) else [tensors]:
            if skip:
                continue
            with self._span(timer):
                self._communicate(tensor_send_next=t if forward else None, tensor_send_prev=None if forward else t,
                                  recv_prev=False, recv_next=False, tensor_shape=None)

    def send_forward(self, output_tensors: _Sent, is_last_stage: bool) -> None:
        """Sends activations (a tensor or a list) to the next stage; nothing on the last stage."""
        with self._serving("send_forward"):
            self._send_each(output_tensors, is_last_stage, "forward-send", forward=True)

    def send_backward(self, input_tensor_grads: _Sent, is_first_stage: bool) -> None:
        """Sends gradients (a tensor or a list) to the previous stage; nothing on the first stage."""
        with self._serving("send_backward"):
            self._send_each(input_tensor_grads, is_first_stage, "backward-send", forward=False)

    def _send_recv_each(self, tensors: _Sent, tensor_shapes: _Shapes, skip: bool, timer: str, forward: bool,
                        overlap: bool) -> _Received | _Overlapped:
        single = not isinstance(tensors, list)
        tensors = tensors if isinstance(tensors, list) else [tensors]
        # One tensor has one shape, even [] (0-dim); a list of tensors has a list of shapes.
        shapes: Sequence[Any] = [tensor_shapes] if single else tensor_shapes
        if not single and (not isinstance(shapes, list) or len(shapes) != len(tensors)):
            raise ValueError(f"{len(tensors)} tensors need a list of {len(tensors)} shapes, got {tensor_shapes!r}")
        received: list[torch.Tensor | None] = []
        handles: list[_Handles] = []
        for t, shape in zip(tensors, shapes):
            if skip:
                received.append(None)
                handles.append({})
                continue
            with self._span(timer):
                recv_p, recv_n, reqs = self._communicate(
                    tensor_send_next=t if forward else None, tensor_send_prev=None if forward else t,
                    recv_prev=not forward, recv_next=forward, tensor_shape=shape, wait_on_reqs=not overlap)
            received.append(recv_n if forward else recv_p)
            handles.append(reqs)
        if overlap:
            return (received[0], handles[0]) if single else (received, handles)
        return received[0] if single else received

    def send_forward_recv_backward(
        self, output_tensors: _Sent, tensor_shapes: _Shapes, is_last_stage: bool, *, overlap_p2p_comm: bool = False
    ) -> _Received | _Overlapped:
        """Sends activations to the next stage and receives its gradients (None on the last
        stage). With overlap_p2p_comm=True (an addition to megatron-core) returns
        (gradients, handles) without waiting; handles is a dict keyed by op name (a list of
        them for a list of tensors)."""
        with self._serving("send_forward_recv_backward"):
            return self._send_recv_each(output_tensors, tensor_shapes, is_last_stage, "forward-send-backward-recv",
                                        forward=True, overlap=overlap_p2p_comm)

    def send_backward_recv_forward(
        self, input_tensor_grads: _Sent, tensor_shapes: _Shapes, is_first_stage: bool, *, overlap_p2p_comm: bool = False
    ) -> _Received | _Overlapped:
        """Sends gradients to the previous stage and receives its next activations (None on the
        first stage). overlap_p2p_comm=True returns (activations, handles), as above."""
        with self._serving("send_backward_recv_forward"):
            return self._send_recv_each(input_tensor_grads, tensor_shapes, is_first_stage,
                                        "backward-send-forward-recv", forward=False, overlap=overlap_p2p_comm)

    def send_forward_recv_forward(
        self,
        output_tensor: torch.Tensor,
        recv_prev: bool,
        tensor_shape: Sequence[int],
        overlap_p2p_comm: bool = False,
    ) -> torch.Tensor | None | tuple[torch.Tensor | None, _Handles]:
        """Sends activations to the next stage and, if recv_prev, receives the previous stage's.
        overlap_p2p_comm=True returns (tensor, handles) without waiting."""
        with self._span("forward-send-forward-recv"), self._serving("send_forward_recv_forward"):
            got, _, handles = self._communicate(tensor_send_next=output_tensor, tensor_send_prev=None,
                                                recv_prev=recv_prev, recv_next=False, tensor_shape=tensor_shape,
                                                wait_on_reqs=not overlap_p2p_comm)
        return (got, handles) if overlap_p2p_comm else got

    def send_backward_recv_backward(
        self,
        input_tensor_grad: torch.Tensor,
        recv_next: bool,
        tensor_shape: Sequence[int],
        overlap_p2p_comm: bool = False,
    ) -> torch.Tensor | None | tuple[torch.Tensor | None, _Handles]:
        """Sends gradients to the previous stage and, if recv_next, receives the next stage's.
        overlap_p2p_comm=True returns (tensor, handles) without waiting."""
        with self._span("backward-send-backward-recv"), self._serving("send_backward_recv_backward"):
            _, got, handles = self._communicate(tensor_send_next=None, tensor_send_prev=input_tensor_grad,
                                                recv_prev=False, recv_next=recv_next, tensor_shape=tensor_shape,
                                                wait_on_reqs=not overlap_p2p_comm)
        return (got, handles) if overlap_p2p_comm else got

    def send_forward_backward_recv_forward_backward(
        self,
        output_tensor: torch.Tensor,
        input_tensor_grad: torch.Tensor,
        recv_prev: bool,
        recv_next: bool,
        tensor_shape: Sequence[int],
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Both directions at once: returns (input_tensor, output_tensor_grad)."""
        with self._span("forward-backward-send-forward-backward-recv"), \
                self._serving("send_forward_backward_recv_forward_backward"):
            got_prev, got_next, _ = self._communicate(tensor_send_next=output_tensor,
                                                      tensor_send_prev=input_tensor_grad, recv_prev=recv_prev,
                                                      recv_next=recv_next, tensor_shape=tensor_shape)
        return got_prev, got_next


# ---- megatron-core <= 0.13's module-level functions --------------------------------------------


def _legacy(config: Any) -> P2PCommunicator:
    """A P2PCommunicator over megatron-core's pipeline group; its communicator must exist."""
    try:
        from megatron.core import parallel_state
    except ImportError as exc:
        raise RuntimeError(
            "the module-level p2p functions read the pipeline group from megatron.core.parallel_state; install "
            "megatron-core, or use megatron_p2p.P2PCommunicator(pp_group, config)"
        ) from exc
    group = parallel_state.get_pipeline_model_parallel_group()
    if isinstance(group, list):
        if len(group) != 1:
            raise NotImplementedError("several pipeline groups per rank (encoder/decoder pipelines) are not supported")
        group = group[0]
    return P2PCommunicator(group, config, comm=get_communicator(group))


def _stage(flag: bool | None, first: bool) -> bool:
    if flag is not None:
        return flag
    from megatron.core import parallel_state

    stage: bool = parallel_state.is_pipeline_first_stage() if first else parallel_state.is_pipeline_last_stage()
    return stage


def _communicate_shapes(tensor_send_next: torch.Tensor | None, tensor_send_prev: torch.Tensor | None, recv_prev: bool,
                        recv_next: bool, config: Any) -> tuple[list[int], list[int]]:
    """megatron-core <= 0.13's module-level shape exchange."""
    return _legacy(config)._communicate_shapes(tensor_send_next, tensor_send_prev, recv_prev, recv_next)


def _communicate(
    *,
    tensor_send_next: torch.Tensor | None,
    tensor_send_prev: torch.Tensor | None,
    recv_prev: bool,
    recv_next: bool,
    tensor_shape: Sequence[int] | None,
    config: Any,
    wait_on_reqs: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None, _Handles]:
    """megatron-core <= 0.13's module-level `_communicate` (returns the same 3-tuple)."""
    return _legacy(config)._communicate(tensor_send_next=tensor_send_next, tensor_send_prev=tensor_send_prev,
                                        recv_prev=recv_prev, recv_next=recv_next, tensor_shape=tensor_shape,
                                        wait_on_reqs=wait_on_reqs)


@contextlib.contextmanager
def _legacy_span(config: Any, name: str) -> Iterator[None]:
    with _Span(getattr(config, "timers", None), name, False):
        yield


# megatron-core's timer name -> the function it times, named in reports.
_LEGACY_CALLS = {
    "forward-recv": "recv_forward", "backward-recv": "recv_backward", "forward-send": "send_forward",
    "backward-send": "send_backward", "forward-send-backward-recv": "send_forward_recv_backward",
    "backward-send-forward-recv": "send_backward_recv_forward", "forward-send-forward-recv": "send_forward_recv_forward",
    "backward-send-backward-recv": "send_backward_recv_backward",
    "forward-backward-send-forward-backward-recv": "send_forward_backward_recv_forward_backward",
}


def _legacy_call(config: Any, timer: str, **kw: Any) -> tuple[torch.Tensor | None, torch.Tensor | None, _Handles]:
    with _legacy_span(config, timer):
        p2p = _legacy(config)
        with p2p._serving(_LEGACY_CALLS[timer]):
            return p2p._communicate(**kw)


def recv_forward(tensor_shape: Sequence[int], config: Any, is_first_stage: bool | None = None) -> torch.Tensor | None:
    """Receives activations from the previous stage (None on the first stage)."""
    if _stage(is_first_stage, first=True):
        return None
    return _legacy_call(config, "forward-recv", tensor_send_next=None, tensor_send_prev=None, recv_prev=True,
                        recv_next=False, tensor_shape=tensor_shape)[0]


def recv_backward(tensor_shape: Sequence[int], config: Any, is_last_stage: bool | None = None) -> torch.Tensor | None:
    """Receives gradients from the next stage (None on the last stage)."""
    if _stage(is_last_stage, first=False):
        return None
    return _legacy_call(config, "backward-recv", tensor_send_next=None, tensor_send_prev=None, recv_prev=False,
                        recv_next=True, tensor_shape=tensor_shape)[1]


def send_forward(output_tensor: torch.Tensor, config: Any, is_last_stage: bool | None = None) -> None:
    """Sends activations to the next stage (nothing on the last stage)."""
    if not _stage(is_last_stage, first=False):
        _legacy_call(config, "forward-send", tensor_send_next=output_tensor, tensor_send_prev=None, recv_prev=False,
                     recv_next=False, tensor_shape=None)


def send_backward(input_tensor_grad: torch.Tensor, config: Any, is_first_stage: bool | None = None) -> None:
    """Sends gradients to the previous stage (nothing on the first stage)."""
    if not _stage(is_first_stage, first=True):
        _legacy_call(config, "backward-send", tensor_send_next=None, tensor_send_prev=input_tensor_grad,
                     recv_prev=False, recv_next=False, tensor_shape=None)


def send_forward_recv_backward(
    output_tensor: torch.Tensor, tensor_shape: Sequence[int], config: Any, is_last_stage: bool | None = None
) -> torch.Tensor | None:
    """Sends activations to the next stage and receives its gradients (None on the last stage)."""
    if _stage(is_last_stage, first=False):
        return None
    return _legacy_call(config, "forward-send-backward-recv", tensor_send_next=output_tensor, tensor_send_prev=None,
                        recv_prev=False, recv_next=True, tensor_shape=tensor_shape)[1]


def send_backward_recv_forward(
    input_tensor_grad: torch.Tensor, tensor_shape: Sequence[int], config: Any, is_first_stage: bool | None = None
) -> torch.Tensor | None:
    """Sends gradients to the previous stage and receives its activations (None on the first stage)."""
    if _stage(is_first_stage, first=True):
        return None
    return _legacy_call(config, "backward-send-forward-recv", tensor_send_next=None,
                        tensor_send_prev=input_tensor_grad, recv_prev=True, recv_next=False,
                        tensor_shape=tensor_shape)[0]


def send_forward_recv_forward(
    output_tensor: torch.Tensor,
    recv_prev: bool,
    tensor_shape: Sequence[int],
    config: Any,
    overlap_p2p_comm: bool = False,
) -> torch.Tensor | None | tuple[torch.Tensor | None, _Handles]:
    """Sends activations forward and optionally receives the previous stage's;
    overlap_p2p_comm=True returns (tensor, handles)."""
    got, _, handles = _legacy_call(config, "forward-send-forward-recv", tensor_send_next=output_tensor,
                                   tensor_send_prev=None, recv_prev=recv_prev, recv_next=False,
                                   tensor_shape=tensor_shape, wait_on_reqs=not overlap_p2p_comm)
    return (got, handles) if overlap_p2p_comm else got


def send_backward_recv_backward(
    input_tensor_grad: torch.Tensor,
    recv_next: bool,
    tensor_shape: Sequence[int],
    config: Any,
    overlap_p2p_comm: bool = False,
) -> torch.Tensor | None | tuple[torch.Tensor | None, _Handles]:
    """Sends gradients backward and optionally receives the next stage's;
    overlap_p2p_comm=True returns (tensor, handles)."""
    _, got, handles = _legacy_call(config, "backward-send-backward-recv", tensor_send_next=None,
                                   tensor_send_prev=input_tensor_grad, recv_prev=False, recv_next=recv_next,
                                   tensor_shape=tensor_shape, wait_on_reqs=not overlap_p2p_comm)
    return (got, handles) if overlap_p2p_comm else got


def send_forward_backward_recv_forward_backward(
    output_tensor: torch.Tensor,
    input_tensor_grad: torch.Tensor,
    recv_prev: bool,
    recv_next: bool,
    tensor_shape: Sequence[int],
    config: Any,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Both directions at once: returns (input_tensor, output_tensor_grad)."""
    got_prev, got_next, _ = _legacy_call(config, "forward-backward-send-forward-backward-recv",
                                         tensor_send_next=output_tensor, tensor_send_prev=input_tensor_grad,
                                         recv_prev=recv_prev, recv_next=recv_next, tensor_shape=tensor_shape)
    return got_prev, got_next


LEGACY_FUNCTIONS = (
    "recv_forward", "recv_backward", "send_forward", "send_backward", "send_forward_recv_backward",
    "send_backward_recv_forward", "send_forward_recv_forward", "send_backward_recv_backward",
    "send_forward_backward_recv_forward_backward",
)
