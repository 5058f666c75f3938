"""megatron-core's own schedules, recorded as programs: `record()` runs the real schedule
functions (megatron.core.pipeline_parallel.schedules) once per pipeline rank, in this one
process, with this package's P2PCommunicator over a communicator that only records what is
posted and waited. The result is the program `schedules.generate()` makes, which is how the
tests prove the generator right.

    program = record("interleaved", 4, vpp=2, microbatches=8, mode="parity", lanes=2, overlap=True)

Nothing is communicated: receives get zeros (the shape round's receives get the header of
the tensor every stage sends). megatron-core writes for CUDA; on a CPU-only torch its
"cuda" allocations are moved to the CPU while a schedule runs. torch.distributed is set up as
a one-process gloo group when nothing has set it up, since megatron-core asks it for group
ranks; each stage sees a stand-in pipeline group of `pp` ranks.
"""
from __future__ import annotations

import contextlib
import datetime
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast
from unittest import mock

import torch
import torch.distributed as dist

from .. import _C, p2p_communication
from .._megatron_cpu import megatron_on_cpu
from .program import MODES, SLOTS, Program, ProgramBuilder
from .schedules import DEFAULT_TENSOR_BYTES, SCHEDULES, Rank, RankCall, emit, megatron_refusal

if TYPE_CHECKING:
    from typing import TypeAlias

    # megatron-core's loss function: the loss, and what it reports of it
    _LossFunc: TypeAlias = Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]

_SEQ_LENGTH, _MICRO_BATCH = 2, 2  # the recorded tensors are (seq, micro batch, hidden) float32


class _Group:
    """A stand-in process group: `size` ranks, this stage being `rank` (what megatron-core
    asks of pp_group, tp and cp)."""

    def __init__(self, rank: int, size: int, ranks: tuple[int, ...]):
        self._rank, self._size, self.ranks = rank, size, ranks

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


class _Request:
    """A posted op that completes when waited for; the wait is recorded."""

    __slots__ = ("_rank", "_call", "_slot")

    def __init__(self, rank: Rank, call: int, slot: str | int):  # a slot, or a step's op index
        self._rank, self._call, self._slot = rank, call, slot

    def wait(self) -> None:
        self._rank.wait(self._call, self._slot)

    synchronize = wait

    def is_completed(self) -> bool:
        # A poll does not block the rank, so it is not a wait.
        return True


class RecordingCommunicator:
    """Duck-types megatron_p2p's Communicator for P2PCommunicator (as much of it as
    p2p_communication.CommunicatorLike names): `exchange` records the call into `rank` (a
    schedules.Rank) and returns requests whose waits are recorded."""

    backend = "shm"
    device = torch.device("cpu")
    closed = False
    eager_threshold = 0  # what P2PCommunicator gives its own

    def __init__(self, rank: Rank, group_rank: int, ranks: tuple[int, ...], lanes: int, header: torch.Tensor,
                 mode: str):
        self.recorded = rank
        self.mode = mode
        self.rank, self.size, self.ranks, self.lanes = group_rank, len(ranks), ranks, lanes
        self.prev_rank = ranks[(group_rank - 1) % len(ranks)]
        self.next_rank = ranks[(group_rank + 1) % len(ranks)]
        self.global_rank = ranks[group_rank]
        self._header = header

    @staticmethod
    def empty(shape: Any, dtype: torch.dtype) -> torch.Tensor:
        """A receive buffer, as the communicator it stands for allocates one (plain memory: no
        bytes move while recording)."""
        return torch.empty(shape, dtype=dtype)

    @staticmethod
    def check_tensor(tensor: torch.Tensor, name: str = "tensor") -> None:
        """What the shm communicator it stands for checks of a tensor before posting it."""
        _C.check_tensor(tensor, name)

    def exchange(self, send_next: torch.Tensor | None = None, recv_prev: torch.Tensor | None = None,
                 send_prev: torch.Tensor | None = None, recv_next: torch.Tensor | None = None, *, mode: str = "parity",
                 prev_rank: int | None = None, next_rank: int | None = None,
                 call: str | None = None) -> dict[str, _Request]:
        """Records one exchange (prev_rank / next_rank must be the ring neighbours, as
        P2PCommunicator leaves them); receives are filled so that the schedule can go on."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        # The program records calls without their mode: it must be the one `emit` gives them.
        if mode != self.mode:
            raise ValueError(f"{call or 'exchange'} was posted in mode {mode!r}; the generator emits {self.mode!r}")
        for given, ring, what in ((prev_rank, self.prev_rank, "prev_rank"), (next_rank, self.next_rank, "next_rank")):
            if given is not None and given != ring:
                raise ValueError(f"the recording communicator records ring exchanges; {what}={given}, ring {ring}")
        tensors = (send_next, recv_prev, send_prev, recv_next)
        for slot, t in zip(SLOTS, tensors):
            if t is not None and slot.startswith("recv"):
                self._fill(t)
        sn, rp, sp, rn = (None if t is None else _spec(t, slot) for slot, t in zip(SLOTS, tensors))
        index = self.recorded.post(call or "", sn, rp, sp, rn)
        return {slot: _Request(self.recorded, index, slot) for slot, t in zip(SLOTS, tensors) if t is not None}

    def batch(self, ops: Sequence[tuple[bool, torch.Tensor, int]], *, lane: int = 0,
              call: str | None = None) -> list[_Request]:
        """Records one step of (is_send, tensor, global peer) ops on `lane`."""
        for is_send, t, _ in ops:
            if not is_send:
                self._fill(t)
        step = [("send" if is_send else "recv", self.ranks.index(peer), *_spec(t, "op")) for is_send, t, peer in ops]
        index = self.recorded.post_step(call or "", lane, step)
        return [_Request(self.recorded, index, i) for i in range(len(ops))]

    def _fill(self, t: torch.Tensor) -> None:
        """A receive gets the header of the tensor every stage sends, or zeros."""
        with torch.no_grad():
            if t.dtype == self._header.dtype and t.shape == self._header.shape:
                t.copy_(self._header)
            else:
                t.zero_()


def _spec(t: torch.Tensor, slot: str) -> tuple[int, str, str]:
    return t.numel() * t.element_size(), str(t.dtype).removeprefix("torch."), slot


def _header_of(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The shape round's message for a tensor of `shape` and `dtype`, as P2PCommunicator
    encodes it (ndim, sizes padded, dtype code)."""
    pad = p2p_communication._MAX_DIMS - len(shape)
    return torch.tensor([len(shape), *shape, *([0] * pad), p2p_communication._DTYPE_CODE[dtype]], dtype=torch.int64)


@contextlib.contextmanager
def _megatron_environment() -> Iterator[None]:
    """What megatron-core's schedules need of this process: torch.distributed initialised,
    CUDA allocations on the CPU when torch has no CUDA, our P2PCommunicator resolving the
    stand-in groups; one torch thread meanwhile."""
    created = False
    if not dist.is_initialized():
        from torch._C._distributed_c10d import HashStore  # torch.distributed does not re-export it

        dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=60))
        created = True

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny stage models only lose to thread start-up
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(mock.patch.object(p2p_communication, "group_ranks", lambda group: group.ranks))
            stack.enter_context(megatron_on_cpu())
            yield
    finally:
        torch.set_num_threads(threads)
        if created:
            dist.destroy_process_group()


def _stage_model(config: Any, hidden: int, first: bool) -> torch.nn.Module:
    from megatron.core.enums import ModelType

    class Stage(torch.nn.Module):
        """One model chunk: a linear layer; the first chunk of the pipeline reads the data."""

        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(hidden, hidden)
            self.config, self.first, self.input_tensor = config, first, None
            self.model_type = ModelType.encoder_or_decoder

        def set_input_tensor(self, tensors: Any) -> None:
            self.input_tensor = tensors[0] if isinstance(tensors, list) else tensors

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.linear(x)
            return out

    return Stage()


def _loss(out: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = (out.float() ** 2).mean()
    return loss, {"loss": loss.detach()}


def _forward_step(data_iterator: Iterator[torch.Tensor], model: Any) -> tuple[torch.Tensor, _LossFunc]:
    x = next(data_iterator) if model.first else model.input_tensor
    return model(x), _loss


def record_calls(schedule: str, pp: int, *, vpp: int = 1, microbatches: int, mode: str, overlap: bool = False,
                 variable_seq_lengths: bool = False, tensor_bytes: int = DEFAULT_TENSOR_BYTES,
                 lanes: int = 2) -> list[list[RankCall]]:
    """Every rank's calls, lowered as schedules.rank_calls() lowers the generator's: what
    megatron-core's real `schedule` posts and waits for through P2PCommunicator in `mode`.
    Labels are the slot names (a recording cannot tell which microbatch a receive is for)."""
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.pipeline_parallel import schedules as mcore_schedules
    from megatron.core.process_groups_config import ProcessGroupCollection

    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if (schedule == "interleaved") != (vpp > 1):
        raise ValueError(f"vpp={vpp!r} does not fit the {schedule} schedule (interleaved needs vpp >= 2, 1f1b vpp 1)")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    refusal = megatron_refusal(schedule, pp, vpp=vpp, microbatches=microbatches, overlap=overlap)
    if refusal:
        raise ValueError(refusal)
    if tensor_bytes <= 0 or tensor_bytes % (4 * _SEQ_LENGTH * _MICRO_BATCH):
        raise ValueError(f"tensor_bytes must be a positive multiple of {4 * _SEQ_LENGTH * _MICRO_BATCH}, "
                         f"got {tensor_bytes}")
    hidden = tensor_bytes // (4 * _SEQ_LENGTH * _MICRO_BATCH)
    header = _header_of((_SEQ_LENGTH, _MICRO_BATCH, hidden), torch.float32)
    run = (mcore_schedules.forward_backward_pipelining_with_interleaving if schedule == "interleaved"
           else mcore_schedules.forward_backward_pipelining_without_interleaving)
    out: list[list[RankCall]] = []
    with _megatron_environment():
        me = dist.get_rank()
        for stage in range(pp):
            # Global ranks as this process sees them: it plays `stage`, the others stand in.
            ranks = tuple(me if i == stage else me + 1 + (i - stage - 1) % pp for i in range(pp))
            # megatron-core refuses overlap with batch_p2p_comm; P2PCommunicator takes the mode itself.
            config = ModelParallelConfig(
                pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                pipeline_dtype=torch.float32, batch_p2p_comm=(mode == "batched" and not overlap),
                variable_seq_lengths=variable_seq_lengths, overlap_p2p_comm=overlap)
            config.hidden_size = hidden
            rank = Rank()
            comm = RecordingCommunicator(rank, stage, ranks, lanes, header, mode)
            # A stand-in group: P2PCommunicator reads its ranks through group_ranks, which
            # _megatron_environment patches to take them from it.
            group = cast(dist.ProcessGroup, _Group(stage, pp, ranks))
            p2p = p2p_communication.P2PCommunicator(group, config, mode=mode, comm=comm)
            alone = _Group(0, 1, (me,))
            models = [_stage_model(config, hidden, first=(stage == 0 and c == 0)) for c in range(vpp)]
            data = [itertools.repeat(torch.zeros(_SEQ_LENGTH, _MICRO_BATCH, hidden)) for _ in range(vpp)]
            run(forward_step_func=_forward_step, data_iterator=data if vpp > 1 else data[0],
                model=models if vpp > 1 else models[0], num_microbatches=microbatches, seq_length=_SEQ_LENGTH,
                micro_batch_size=_MICRO_BATCH, p2p_communicator=p2p,
                pg_collection=ProcessGroupCollection(tp=alone, cp=alone))
            out.append(rank.finish())
    return out


def record(schedule: str, pp: int, *, vpp: int = 1, microbatches: int, mode: str, lanes: int,
           overlap: bool = False, variable_seq_lengths: bool = False, tensor_bytes: int = DEFAULT_TENSOR_BYTES,
           eager_threshold: int = 0) -> Program:
    """The program megatron-core's real `schedule` ("1f1b": forward_backward_pipelining_
    without_interleaving, "interleaved": forward_backward_pipelining_with_interleaving) makes
    on `pp` ranks through P2PCommunicator in `mode` over `lanes` lanes, for one training step
    of `microbatches`; activations are tensor_bytes of float32. Needs megatron-core (ImportError
    otherwise); ValueError names a bad
    argument or a configuration megatron-core refuses."""
    calls = record_calls(schedule, pp, vpp=vpp, microbatches=microbatches, mode=mode, overlap=overlap,
                         variable_seq_lengths=variable_seq_lengths, tensor_bytes=tensor_bytes, lanes=lanes)
    builder = ProgramBuilder(pp, lanes, eager_threshold)
    for stage, rank_calls in enumerate(calls):
        emit(builder, stage, rank_calls, mode)
    return builder.build()
