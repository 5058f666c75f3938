"""torch.distributed.pipelining's schedules as programs: every p2p op each rank posts through
torch.distributed, and every wait, for one training step.

    program = generate("Interleaved1F1B", 2, microbatches=2, stages_per_rank=2, defer_pp_recv=True)
    calls = record_calls("1F1B", 4, microbatches=8)     # torch's own loop, run with stand-in stages

- The runtime classes (LoopedBFS, Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble,
  DualPipeV) are built with stand-in stages and no model; their lowered action lists
  (`pipeline_order_with_comms`, with `_defer_recv_ops` when defer_pp_recv) are translated with
  _PipelineScheduleRuntime's execution semantics: each SEND / RECV action's ops are posted one
  by one (`_batch_p2p` of only sends or only receives), a receive is waited just before the
  compute that uses it, sends at the end; V placement: rank r holds stages r and 2 pp - 1 - r,
  and the two stages on rank pp - 1 hand over locally.
- GPipe and 1F1B have their own loops: `record_calls` runs torch's `_step_microbatches` once
  per rank in this process, with torch.distributed's isend / irecv / batch_isend_irecv swapped
  for recorders. It also runs the runtime classes' real loop, which is how the tests prove the
  translation above right.
- first_step "vote" prepends the first step's vote (blocking int32 send / recv along the
  stages and back); "metadata" adds the metadata round after it (send_object_list: an int64
  size, then the pickled uint8 payload, each a batch of one op, waited).
- executor "multi" records the older PipelineScheduleMulti loop instead (each time step's
  sends and its neighbours' receives in one `_batch_p2p`), on a runtime class's compute-only
  pipeline_order.
- lazy_comms models torch's lazy NCCL communicators: single ops on lane 1 (the pair
  communicators, all of a rank's in one queue), batched ops on lane 0 (the group's); a message
  posted as a single op on one side and inside a batch on the other never pairs. Without it
  everything is on lane 0, as megatron_p2p's isend / irecv / batch_isend_irecv post it.

Byte counts are unique per message stream: the activation of stage s to s + 1 is
4096 + 16 s bytes of float32, the gradient back 4096 + 16 s + 8, the metadata payloads
512 + 2 s (forward) and 513 + 2 s (backward) bytes of uint8, so a reorder on a channel
pairs different byte counts and shows as MISMATCH.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from unittest import mock

from .. import _C
from .program import Program, ProgramBuilder

NAMES = ("GPipe", "1F1B", "LoopedBFS", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
RUNTIME = NAMES[2:]
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
FIRST_STEPS = ("none", "vote", "metadata")
EXECUTORS = ("runtime", "multi")  # _PipelineScheduleRuntime's, or the older PipelineScheduleMulti's
GROUP_LANE, PAIR_LANE = 0, 1  # lazy_comms: the group communicator's lane, the pair communicators'
_ACT, _META = 4096, 512
MAX_EAGER = _C.MAX_EAGER_THRESHOLD  # every message of these programs is buffered

# One call of a rank: [name, ops, batched, blocking, awaits], ops a list of
# (kind, peer, bytes, dtype, label); awaits are call indices or (call, op) pairs.
TorchCall = list[Any]


def act_spec(stage: int, mb: int) -> tuple[int, str, str]:
    """The activation stage `stage` sends to stage + 1 for microbatch `mb`."""
    return _ACT + 16 * stage, "float32", f"act mb{mb} s{stage}->s{stage + 1}"


def grad_spec(stage: int, mb: int) -> tuple[int, str, str]:
    """The gradient stage `stage` sends back to stage - 1 for microbatch `mb`."""
    return _ACT + 16 * (stage - 1) + 8, "float32", f"grad mb{mb} s{stage}->s{stage - 1}"


class TorchRank:
    """One rank's posts and waits, lowered into program calls as they happen: waits made
    between two posts become the later call's awaits (one right after a post of that call
    makes it blocking); waits after the last post are the program's final wait."""

    def __init__(self) -> None:
        self.calls: list[TorchCall] = []
        self._window: list[Any] = []
        self._done: set[Any] = set()

    def post(self, name: str, ops: Sequence[tuple[str, int, int, str, str]], batched: bool) -> int:
        awaits, self._window = tuple(self._window), []
        self.calls.append([name, list(ops), batched, False, awaits])
        return len(self.calls) - 1

    def wait(self, call: int, op: int) -> None:
        """The rank blocks on op `op` of call `call` (waiting again changes nothing)."""
        whole = len(self.calls[call][1]) == 1
        key = call if whole else (call, op)
        if key in self._done or call in self._done:
            return
        self._done.add(key)
        if call == len(self.calls) - 1 and not self._window and whole:
            self.calls[call][3] = True
        else:
            self._window.append(key)

    def finish(self) -> list[TorchCall]:
        """The rank's calls; its waits after the last post are the program's final wait (so
        the last call is never marked blocking: that wait is the same)."""
        self._window = []
        if self.calls:
            self.calls[-1][3] = False
        return self.calls


# ---- stand-in stages ------------------------------------------------------------------------------

class _Group:
    """The stand-in stages' process group, as far as torch's schedules read it (torch 2.14's
    `_batch_p2p` splits a batch by `group.group_name`)."""

    group_name = "pp"


class _Op:
    """torch.distributed.P2POp's fields, as torch's schedules read them."""

    __slots__ = ("op", "tensor", "peer", "group", "tag", "group_peer")

    def __init__(self, op: Any, spec: tuple[int, str, str], peer: int):
        self.op, self.tensor, self.peer, self.group, self.tag, self.group_peer = op, spec, peer, _Group(), 0, peer


class _Stage:
    """A stand-in pipeline stage: no model; its p2p ops carry specs (bytes, dtype, label)."""

    submod = None
    has_backward = True

    def __init__(self, index: int, num_stages: int, rank: int, size: int, isend: Any = None, irecv: Any = None):
        self.stage_index, self.num_stages, self.group_rank, self.group_size = index, num_stages, rank, size
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.stage_index_to_group_rank: dict[int, int] = {}
        self._isend, self._irecv = isend, irecv

    def _remote(self, other: int) -> bool:
        return self.stage_index_to_group_rank[other] != self.group_rank

    def get_fwd_recv_ops(self, mb: int) -> list[_Op]:
        s = self.stage_index
        if self.is_first or not self._remote(s - 1):
            return []
        return [_Op(self._irecv, act_spec(s - 1, mb), self.stage_index_to_group_rank[s - 1])]

    def get_fwd_send_ops(self, mb: int) -> list[_Op]:
        s = self.stage_index
        if self.is_last or not self._remote(s + 1):
            return []
        return [_Op(self._isend, act_spec(s, mb), self.stage_index_to_group_rank[s + 1])]

    def get_bwd_recv_ops(self, mb: int) -> list[_Op]:
        s = self.stage_index
        if self.is_last or not self._remote(s + 1) or not self.has_backward:
            return []
        return [_Op(self._irecv, grad_spec(s + 1, mb), self.stage_index_to_group_rank[s + 1])]

    def get_bwd_send_ops(self, mb: int) -> list[_Op]:
        s = self.stage_index
        if self.is_first or not self._remote(s - 1) or not self.has_backward:
            return []
        return [_Op(self._isend, grad_spec(s, mb), self.stage_index_to_group_rank[s - 1])]

    # Compute and bookkeeping: nothing to do without a model.
    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> None:
        return None

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> None:
        return None

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> None:
        return None

    def get_local_bwd_output(self, mb: int) -> None:
        return None

    def set_local_fwd_input(self, *args: Any) -> None:
        return None

    set_local_bwd_input = scale_grads = perform_reduce_grad = clear_runtime_states = set_local_fwd_input


def _stages_of(name: str, pp: int, stages_per_rank: int) -> list[list[int]]:
    """Each rank's stage indices, in the order a user passes them (V: r and 2 pp - 1 - r)."""
    if name in V_SHAPED:
        return [[r, 2 * pp - 1 - r] for r in range(pp)]
    return [[r + pp * k for k in range(stages_per_rank)] for r in range(pp)]


def check_config(name: str, pp: int, *, microbatches: int, stages_per_rank: int, defer_pp_recv: bool,
                 first_step: str, executor: str = "runtime") -> None:
    """ValueError naming a bad argument (configurations torch itself refuses are found by
    building the schedule)."""
    if name not in NAMES:
        raise ValueError(f"schedule must be one of {NAMES}, got {name!r}")
    if type(pp) is not int or pp < 2:
        raise ValueError(f"pp must be an int >= 2, got {pp!r}")
    if type(microbatches) is not int or microbatches < 1:
        raise ValueError(f"microbatches must be an int >= 1, got {microbatches!r}")
    if type(stages_per_rank) is not int or stages_per_rank < 1:
        raise ValueError(f"stages_per_rank must be an int >= 1, got {stages_per_rank!r}")
    if name in ("GPipe", "1F1B") and stages_per_rank != 1:
        raise ValueError(f"{name} holds one stage per rank, got stages_per_rank={stages_per_rank}")
    if name in V_SHAPED and stages_per_rank != 2:
        raise ValueError(f"{name} holds exactly 2 stages per rank (V placement), got stages_per_rank={stages_per_rank}")
    if defer_pp_recv and name not in RUNTIME:
        raise ValueError(f"defer_pp_recv is an option of the runtime schedules {RUNTIME}, not of {name}")
    if first_step not in FIRST_STEPS:
        raise ValueError(f"first_step must be one of {FIRST_STEPS}, got {first_step!r}")
    if executor not in EXECUTORS:
        raise ValueError(f"executor must be one of {EXECUTORS}, got {executor!r}")
    if executor == "multi" and (name not in RUNTIME or defer_pp_recv):
        raise ValueError("executor 'multi' (PipelineScheduleMulti's own loop, on the compute-only pipeline_order) "
                         f"runs the runtime schedules {RUNTIME} without defer_pp_recv")


def _schedule(name: str, pp: int, *, microbatches: int, stages_per_rank: int, defer_pp_recv: bool, rank: int = 0,
              isend: Any = None, irecv: Any = None) -> tuple[Any, list[_Stage]]:
    """torch's schedule object for `rank`, over stand-in stages. ValueError carries torch's
    refusal of the configuration."""
    from torch.distributed.pipelining import schedules as ts

    cls = ts.get_schedule_class(name)
    indices = _stages_of(name, pp, stages_per_rank)[rank]
    stages = [_Stage(i, pp * stages_per_rank, rank, pp, isend, irecv) for i in indices]
    try:
        if name in ("GPipe", "1F1B"):
            sched = cls(stages[0], microbatches)
            stages[0].stage_index_to_group_rank = {s: s for s in range(pp)}
        else:
            sched = cls(stages, microbatches, defer_pp_recv=defer_pp_recv)
    except (ValueError, AssertionError, RuntimeError) as e:
        raise ValueError(f"torch refuses {name} pp={pp} microbatches={microbatches} "
                         f"stages_per_rank={stages_per_rank}: {e}") from None
    return sched, stages


# ---- the first step -------------------------------------------------------------------------------

def _first_step(rank: TorchRank, stages: list[_Stage], first_step: str) -> None:
    """The vote of _PipelineSchedule._warmup_p2p (blocking int32 send / recv), then with
    "metadata" the forward and backward metadata rounds of PipelineStage (send_object_list)."""
    if first_step == "none":
        return
    where = stages[0].stage_index_to_group_rank

    def blocking(name: str, kind: str, peer_stage: int, spec: tuple[int, str, str], batched: bool) -> None:
        index = rank.post(name, [(kind, where[peer_stage], *spec)], batched)
        rank.wait(index, 0)

    def meta(kind: str, peer_stage: int, edge: int, forward: bool) -> None:
        call = "send_object_list" if kind == "send" else "recv_object_list"
        way = f"s{edge}->s{edge + 1}" if forward else f"s{edge + 1}->s{edge}"
        blocking(call, kind, peer_stage, (8, "int64", f"meta size {way}"), True)
        blocking(call, kind, peer_stage, (_META + 2 * edge + (not forward), "uint8", f"meta {way}"), True)

    for st in stages:
        s = st.stage_index
        if not st.is_first and st._remote(s - 1):
            blocking("recv", "recv", s - 1, (4, "int32", f"vote s{s - 1}->s{s}"), False)
        if not st.is_last and st._remote(s + 1):
            blocking("send", "send", s + 1, (4, "int32", f"vote s{s}->s{s + 1}"), False)
    for st in reversed(stages):
        s = st.stage_index
        if not st.is_last and st._remote(s + 1):
            blocking("recv", "recv", s + 1, (4, "int32", f"vote result s{s + 1}->s{s}"), False)
        if not st.is_first and st._remote(s - 1):
            blocking("send", "send", s - 1, (4, "int32", f"vote result s{s}->s{s - 1}"), False)
    if first_step != "metadata":
        return
    for st in stages:
        s = st.stage_index
        if not st.is_first and st._remote(s - 1):
            meta("recv", s - 1, s - 1, True)
        if not st.is_last and st._remote(s + 1):
            meta("send", s + 1, s, True)
    for st in reversed(stages):
        s = st.stage_index
        if not st.is_last and st._remote(s + 1):
            meta("recv", s + 1, s, False)
        if not st.is_first and st._remote(s - 1):
            meta("send", s - 1, s - 1, False)


# ---- the runtime classes, from torch's action lists ------------------------------------------------

def _translate(order: list[Any], stages: dict[int, _Stage], rank: TorchRank) -> None:
    """_PipelineScheduleRuntime._step_microbatches on one rank's lowered actions."""
    from torch.distributed.pipelining import schedules as ts

    recvs: dict[tuple[str, int, int, int], int] = {}  # (way, stage, microbatch, op) -> call

    def post(name: str, ops: list[_Op], kind: str) -> list[int]:
        return [rank.post(name, [(kind, o.peer, *o.tensor)], False) for o in ops]

    def perform(a: Any) -> None:
        t, s, mb = a.computation_type, a.stage_index, a.microbatch_index
        st = stages[s]
        if t == ts.SEND_F:
            post("isend", st.get_fwd_send_ops(mb), "send")
        elif t == ts.SEND_B:
            post("isend", st.get_bwd_send_ops(mb), "send")
        elif t in (ts.RECV_F, ts.RECV_B):
            ops = st.get_fwd_recv_ops(mb) if t == ts.RECV_F else st.get_bwd_recv_ops(mb)
            for k, index in enumerate(post("irecv", ops, "recv")):
                recvs[("f" if t == ts.RECV_F else "b", s, mb, k)] = index
        elif t == ts.FORWARD:
            if not st.is_first and (s - 1) not in stages:
                _wait_all(recvs, "f", s, mb)
        elif t in (ts.FULL_BACKWARD, ts.BACKWARD_INPUT):
            if not st.is_last and (s + 1) not in stages:
                _wait_all(recvs, "b", s, mb)

    def _wait_all(table: dict[tuple[str, int, int, int], int], way: str, s: int, mb: int) -> None:
        k = 0
        while (way, s, mb, k) in table:
            rank.wait(table.pop((way, s, mb, k)), 0)
            k += 1

    for action in order:
        for a in (action.sub_actions if action.computation_type == ts.OVERLAP_F_B else (action,)):
            perform(a)


@functools.lru_cache(maxsize=1)
def _lowered(name: str, pp: int, *, microbatches: int,
             stages_per_rank: int) -> tuple[dict[int, list[Any]], dict[int, int]]:
    """torch's lowered action lists (without defer_pp_recv) and its stage-to-rank mapping."""
    sched, _ = _schedule(name, pp, microbatches=microbatches, stages_per_rank=stages_per_rank, defer_pp_recv=False)
    return sched.pipeline_order_with_comms, dict(sched.stage_index_to_group_rank)


@functools.lru_cache(maxsize=4)
def rank_calls(name: str, pp: int, *, microbatches: int, stages_per_rank: int, defer_pp_recv: bool = False,
               first_step: str = "none", executor: str = "runtime") -> tuple[list[TorchCall], ...]:
    """Every rank's calls: generated from torch's action lists for the runtime classes,
    recorded from torch's own loop for GPipe and 1F1B and for the older executor."""
    check_config(name, pp, microbatches=microbatches, stages_per_rank=stages_per_rank, defer_pp_recv=defer_pp_recv,
                 first_step=first_step, executor=executor)
    if name not in RUNTIME or executor == "multi":
        return tuple(record_calls(name, pp, microbatches=microbatches, stages_per_rank=stages_per_rank,
                                  first_step=first_step, executor=executor))
    orders, where = _lowered(name, pp, microbatches=microbatches, stages_per_rank=stages_per_rank)
    if defer_pp_recv:  # what _prepare_schedule_with_comms does with defer_pp_recv=True
        from torch.distributed.pipelining import schedules as ts

        orders = ts._defer_recv_ops(orders, stage_to_rank=where.__getitem__)
    out: list[list[TorchCall]] = []
    for r, indices in enumerate(_stages_of(name, pp, stages_per_rank)):
        stages = [_Stage(i, pp * stages_per_rank, r, pp) for i in indices]
        for st in stages:
            st.stage_index_to_group_rank = where
        rank = TorchRank()
        _first_step(rank, stages, first_step)
        _translate(orders[r], {st.stage_index: st for st in stages}, rank)
        out.append(rank.finish())
    return tuple(out)


# ---- torch's real loop, recorded -----------------------------------------------------------------

class _Work:
    __slots__ = ("_rank", "_call", "_op")

    def __init__(self, rank: TorchRank, call: int, op: int):
        self._rank, self._call, self._op = rank, call, op

    def wait(self) -> None:
        self._rank.wait(self._call, self._op)


@contextlib.contextmanager
def _recording(rank: TorchRank) -> Iterator[tuple[Any, Any]]:
    """torch.distributed's isend / irecv / batch_isend_irecv record into `rank` meanwhile."""
    import torch.distributed as dist

    def single(kind: str) -> Callable[..., _Work]:
        def op(spec: tuple[int, str, str], dst: int | None = None, group: Any = None, tag: int = 0,
               group_dst: int | None = None, group_src: int | None = None) -> _Work:
            peer = next(p for p in (dst, group_dst, group_src) if p is not None)
            return _Work(rank, rank.post("isend" if kind == "send" else "irecv", [(kind, peer, *spec)], False), 0)
        return op

    isend, irecv = single("send"), single("recv")

    def batch(ops: list[_Op]) -> list[_Work]:
        index = rank.post("batch_isend_irecv", [("send" if o.op is isend else "recv", o.peer, *o.tensor)
                                                for o in ops], True)
        return [_Work(rank, index, k) for k in range(len(ops))]

    with mock.patch.object(dist, "isend", isend), mock.patch.object(dist, "irecv", irecv), \
            mock.patch.object(dist, "batch_isend_irecv", batch):
        yield isend, irecv


def record_calls(name: str, pp: int, *, microbatches: int, stages_per_rank: int = 1, defer_pp_recv: bool = False,
                 first_step: str = "none", executor: str = "runtime") -> list[list[TorchCall]]:
    """Every rank's calls as torch's own `_step_microbatches` of schedule `name` posts and
    waits for them, run once per rank here with stand-in stages (the first step is prepended
    as `rank_calls` makes it). executor "multi" runs the older PipelineScheduleMulti loop on
    the class's compute-only pipeline_order instead of _PipelineScheduleRuntime's."""
    from torch.distributed.pipelining import schedules as ts

    check_config(name, pp, microbatches=microbatches, stages_per_rank=stages_per_rank, defer_pp_recv=defer_pp_recv,
                 first_step=first_step, executor=executor)
    out: list[list[TorchCall]] = []
    for r in range(pp):
        rank = TorchRank()
        with _recording(rank) as (isend, irecv):
            sched, stages = _schedule(name, pp, microbatches=microbatches, stages_per_rank=stages_per_rank,
                                      defer_pp_recv=defer_pp_recv, rank=r, isend=isend, irecv=irecv)
            _first_step(rank, stages, first_step)
            with mock.patch.object(type(sched), "_initialize_stage" if name in ("GPipe", "1F1B")
                                   else "_initialize_stages", lambda *a, **k: None):
                (ts.PipelineScheduleMulti._step_microbatches(sched) if executor == "multi"
                 else sched._step_microbatches())
        out.append(rank.finish())
    return out


# ---- programs -------------------------------------------------------------------------------------

def emit(builder: ProgramBuilder, rank: int, calls: Sequence[TorchCall], lazy_comms: bool) -> None:
    steps = builder.steps
    for name, ops, batched, blocking, awaits in calls:
        lane = GROUP_LANE if batched or not lazy_comms else PAIR_LANE
        steps(rank, [(lane, ops)], wait=blocking, name=name, awaits=awaits)


def build(calls: Sequence[Sequence[TorchCall]], lazy_comms: bool = False, eager_threshold: int = 0) -> Program:
    builder = ProgramBuilder(len(calls), 2 if lazy_comms else 1, eager_threshold)
    for r, rc in enumerate(calls):
        emit(builder, r, rc, lazy_comms)
    return builder.build()


def default_stages_per_rank(name: str) -> int:
    return 1 if name in ("GPipe", "1F1B") else 2


def generate(name: str, pp: int, *, microbatches: int | None = None, stages_per_rank: int | None = None,
             defer_pp_recv: bool = False, first_step: str = "none", lazy_comms: bool = False,
             eager_threshold: int = 0, executor: str = "runtime") -> Program:
    """The program of torch.distributed.pipelining's schedule `name` on `pp` ranks for one
    training step of `microbatches` (default 2 pp); stages_per_rank defaults to 1 for GPipe and
    1F1B, 2 otherwise. ValueError names a bad argument, or carries torch's own refusal."""
    if microbatches is None:
        microbatches = 2 * pp if type(pp) is int else 0
    if stages_per_rank is None:
        stages_per_rank = default_stages_per_rank(name)
    calls = rank_calls(name, pp, microbatches=microbatches, stages_per_rank=stages_per_rank,
                       defer_pp_recv=bool(defer_pp_recv), first_step=first_step, executor=executor)
    return build(calls, lazy_comms, eager_threshold)


def grid_configs(full: bool = True) -> list[dict[str, Any]]:
    """The checker's torch rows: pp 2-32 (full) or 2-4 (reduced), microbatches in {1, 2, pp,
    2 pp, 2 pp + 1, 4 pp}, stages per rank 2-4 where a class takes several (3 reduced), with
    and without defer_pp_recv for the runtime classes (with it, also with every send buffered:
    eager_threshold MAX_EAGER). Configurations torch refuses are found
    when generated."""
    pps = range(2, 33) if full else (2, 3, 4)
    configs: list[dict[str, Any]] = []
    for name in NAMES:
        sprs = (1,) if name in ("GPipe", "1F1B") else (2,) if name in V_SHAPED else (2, 3, 4) if full else (2, 3)
        for pp in pps:
            for spr in sprs:
                for m in sorted({1, 2, pp, 2 * pp, 2 * pp + 1, 4 * pp}):
                    for defer, eager in ((False, 0), (True, 0), (True, MAX_EAGER)) if name in RUNTIME else ((False, 0),):
                        configs.append({"schedule": f"torch:{name}", "pp": pp, "microbatches": m,
                                        "stages_per_rank": spr, "defer_pp_recv": defer, "eager_threshold": eager})
    return configs
