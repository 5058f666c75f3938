"""megatron-core's pipeline schedules as programs: every exchange each rank posts, and every
wait, exactly as megatron-core's schedule functions drive this package's P2PCommunicator.

    program = generate("interleaved", 8, vpp=2, microbatches=16, mode="batched", overlap=True)
    configs = grid_configs()        # the checker's grid, with the configs megatron-core refuses

- "1f1b": forward_backward_pipelining_without_interleaving (warmup, steady 1F1B, cooldown);
- "interleaved": forward_backward_pipelining_with_interleaving, with or without
  overlap_p2p_comm (its handles become `awaits` of the later call that waits for them);
- variable_seq_lengths adds P2PCommunicator's shape round (_shape_headers.py): each step of an
  exchange carries its tensors' headers, and a step with receives follows, on its lane, one of
  their headers' receives, waited before it is posted. Those calls are explicit steps, so a
  variable program's calls depend on the mode and lane count.

Each megatron-core call becomes the exchange call(s) P2PCommunicator makes for it, named
after the method ("send_forward_recv_backward", "_communicate_shapes" for the shape round);
labels name the tensor: "act mb3 chunk1" is microbatch 3's activation leaving model chunk 1,
"grad mb3 chunk1" the gradient leaving chunk 1 backwards. megatron_recording.record() makes
the same programs by running megatron-core itself; the tests hold the two together.

The configuration megatron-core 0.19.2 uses: microbatch_group_size_per_vp_stage = pp,
overlap_p2p_comm_warmup_flush off, deallocate_pipeline_outputs off, training (not
forward_only). The full grid is about 300 million ops, so a rank's calls are made once per
schedule shape and replayed into the builder for each mode and lane count.

A wait on some ops of a call only (overlap_p2p_comm's handles, the shape round's receives)
is an await of those ops, (call, slot): modelling it as a wait on the whole call would invent
deadlocks, leaving it out would hide them.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, overload

from .. import _shape_headers
from ..p2p_communication import HEADER_BYTES, HEADER_CALL
from .program import LANES, MODES, SLOTS, Program, ProgramBuilder, _plan_for

if TYPE_CHECKING:
    from typing import TypeAlias

    from .program import OpSpec

    _Handle: TypeAlias = tuple[int, str | int]  # (call, slot) of an exchange, (call, op index) of a step

SCHEDULES = ("1f1b", "interleaved")
SENDS, RECVS = _shape_headers.SENDS, _shape_headers.RECVS  # from the C core's slot names, as SLOTS
DEFAULT_TENSOR_BYTES = 4096
SHAPE_ROUND = HEADER_CALL
HEADER = (HEADER_BYTES, "int64")  # the shape round's message: int64 words

# One call of a rank, ready for ProgramBuilder.exchange:
# [name, send_next, recv_prev, send_prev, recv_next, wait, awaits]
# where each slot is None or (bytes, dtype, label) and awaits are (call, slot) pairs; or one step
# for ProgramBuilder.steps: [name, STEP, (lane, ops), None, None, wait, awaits] with ops
# [(kind, peer, bytes, dtype, label)] and awaits (call, slot or op index).
RankCall = list[Any]
STEP = "step"
_SLOT_FIELD = {s: 1 + i for i, s in enumerate(SLOTS)}  # slot -> its field in a RankCall


def _await_order(wait: tuple[int, Any]) -> tuple[int, int]:
    return wait[0], wait[1] if type(wait[1]) is int else _SLOT_FIELD[wait[1]]


class Rank:
    """One rank's exchange calls and waits, lowered into program calls as they are posted.

    `post` and `wait` are what P2PCommunicator does to its communicator. Waits made between
    two posts precede the later post: they become the earlier call's `wait` when they cover
    all of its ops, and the later call's awaits otherwise. megatron_recording feeds the same
    methods, so the generator and megatron-core itself are lowered by one piece of code."""

    def __init__(self) -> None:
        self.calls: list[RankCall] = []
        self._left: list[int] = []                # per call: its ops not waited yet
        self._waited: set[_Handle] = set()
        self._window: list[_Handle] = []  # waited since the last post

    def post(self, name: str, send_next: OpSpec | None = None, recv_prev: OpSpec | None = None,
             send_prev: OpSpec | None = None, recv_next: OpSpec | None = None, waited: bool = False) -> int:
        """Records one exchange call (each slot None or (bytes, dtype, label)); returns its
        index, or -1 when it posts nothing (P2PCommunicator's empty exchange). waited: the
        rank waits for all of its ops straight away (what a blocking call does)."""
        count = (send_next is not None) + (recv_prev is not None) + (send_prev is not None) + (recv_next is not None)
        if not count:
            return -1
        awaits = self._close_window() if self._window else ()
        self.calls.append([name, send_next, recv_prev, send_prev, recv_next, waited, awaits])
        self._left.append(0 if waited else count)
        return len(self.calls) - 1

    def post_step(self, name: str, lane: int, ops: Sequence[tuple[str, int, int, str, str]]) -> int:
        """Records one step (a batch on `lane` of (kind, peer, bytes, dtype, label) ops) as a call
        of its own; returns its index."""
        awaits = self._close_window() if self._window else ()
        self.calls.append([name, STEP, (lane, tuple(ops)), None, None, False, awaits])
        self._left.append(len(ops))
        return len(self.calls) - 1

    def wait(self, call: int, slot: str | int) -> None:
        """The rank blocks on one op of an earlier call, by slot (an exchange) or index (a step);
        waiting again changes nothing."""
        posted = 0 <= call < len(self.calls)
        if posted and self.calls[call][1] == STEP:
            posted = type(slot) is int and 0 <= slot < len(self.calls[call][2][1])
        elif posted:
            if not isinstance(slot, str):
                raise KeyError(slot)  # an exchange's ops go by slot name: what _SLOT_FIELD[slot] raises
            posted = self.calls[call][_SLOT_FIELD[slot]] is not None
        if not posted:
            raise ValueError(f"wait on {slot} of call {call}, which did not post it")
        key = (call, slot)
        if self._left[call] == 0 or key in self._waited:
            return
        self._waited.add(key)
        self._window.append(key)

    def finish(self) -> list[RankCall]:
        """The rank's calls. Waits after its last call are the program's final wait."""
        if self._window:
            self._close_window()
        return self.calls

    def _close_window(self) -> tuple[_Handle, ...]:
        window, self._window = self._window, []
        left = self._left
        for call, _ in window:
            left[call] -= 1
        last = len(self.calls) - 1
        if left[last] == 0 and any(c == last for c, _ in window):
            self.calls[last][5] = True
            window = [w for w in window if w[0] != last]
        if len(window) > 1:
            window.sort(key=_await_order)
        return tuple(window)


class _P2P:
    """What P2PCommunicator's methods post and wait for, on one rank. Tensors are specs
    (bytes, dtype, label); a received tensor is the spec its sender sends (None: none). With
    variable_seq_lengths each exchange is posted step by step with its shape headers, in parity
    order over `lanes` (_shape_headers.round_steps), whatever the mode."""

    def __init__(self, rank: Rank, stage: int, pp: int, variable: bool, lanes: int | None):
        self.rank, self.stage, self.pp, self.variable, self.lanes = rank, stage, pp, variable, lanes
        self.first, self.last = stage == 0, stage == pp - 1

    def communicate(self, name: str, send_next: OpSpec | None, recv_prev: OpSpec | None, send_prev: OpSpec | None,
                    recv_next: OpSpec | None, wait: bool = True) -> dict[str, _Handle] | None:
        """P2PCommunicator._communicate. Returns the handles {slot: (call, slot or op)} when
        wait is False."""
        rank = self.rank
        specs = (send_next, recv_prev, send_prev, recv_next)
        if self.variable:
            handles, header_sends = self._with_headers(name, dict(zip(SLOTS, specs)))
        elif wait:
            rank.post(name, *specs, waited=True)
            return None
        else:
            d = rank.post(name, *specs)
            return {s: (d, s) for s, t in zip(SLOTS, specs) if t is not None}
        if not wait:
            return handles
        for h in header_sends:
            rank.wait(*h)
        for h in handles.values():
            rank.wait(*h)
        return None

    def _with_headers(self, name: str, specs: dict[str, OpSpec | None]) -> tuple[dict[str, _Handle], list[_Handle]]:
        """Posts one exchange step by step with its shape headers; returns its data ops
        {slot: (call, op)} and its header sends [(call, op)]."""
        rank, stage, pp, lanes = self.rank, self.stage, self.pp, self.lanes
        assert lanes is not None  # rank_calls plans variable programs for a lane count
        peer = {"send_next": (stage + 1) % pp, "recv_next": (stage + 1) % pp,
                "send_prev": (stage - 1) % pp, "recv_prev": (stage - 1) % pp}
        given = {s: t for s, t in specs.items() if t is not None}  # the plan's ops are these slots
        present = tuple(s for s in SLOTS if specs[s] is not None)
        plan = _plan_for("parity", lanes, stage, present, peer["recv_prev"] == stage, peer["send_next"] == stage)
        handles: dict[str, _Handle] = {}
        header_sends: list[_Handle] = []
        for headers, lane, ops in _shape_headers.round_steps(plan):
            h = rank.post_step(SHAPE_ROUND if headers else name, lane,
                               [("send" if s in SENDS else "recv", peer[s], *(_header(given[s][2]) if is_header
                                                                            else given[s])) for s, is_header in ops])
            for i, (s, is_header) in enumerate(ops):
                if headers:
                    rank.wait(h, i)
                elif is_header:
                    header_sends.append((h, i))
                else:
                    handles[s] = (h, i)
        return handles, header_sends

    # megatron-core's methods, as P2PCommunicator implements them (one tensor shape).
    def recv_forward(self, tensor: OpSpec | None, is_first_stage: bool) -> None:
        if not is_first_stage:
            self.communicate("recv_forward", None, tensor, None, None)

    def recv_backward(self, tensor: OpSpec | None, is_last_stage: bool) -> None:
        if not is_last_stage:
            self.communicate("recv_backward", None, None, None, tensor)

    def send_forward(self, tensor: OpSpec | None, is_last_stage: bool) -> None:
        if not is_last_stage:
            self.communicate("send_forward", tensor, None, None, None)

    def send_backward(self, tensor: OpSpec | None, is_first_stage: bool) -> None:
        if not is_first_stage:
            self.communicate("send_backward", None, None, tensor, None)

    def send_forward_recv_backward(self, tensor: OpSpec | None, received: OpSpec | None, is_last_stage: bool) -> None:
        if not is_last_stage:
            self.communicate("send_forward_recv_backward", tensor, None, None, received)

    def send_backward_recv_forward(self, tensor: OpSpec | None, received: OpSpec | None, is_first_stage: bool) -> None:
        if not is_first_stage:
            self.communicate("send_backward_recv_forward", None, received, tensor, None)

    # overlap=True returns the handles, as megatron-core's overlap_p2p_comm does.
    @overload
    def send_forward_recv_forward(self, tensor: OpSpec | None, received: OpSpec | None,
                                  overlap: Literal[False] = ...) -> None: ...
    @overload
    def send_forward_recv_forward(self, tensor: OpSpec | None, received: OpSpec | None,
                                  overlap: Literal[True]) -> dict[str, _Handle]: ...
    def send_forward_recv_forward(self, tensor: OpSpec | None, received: OpSpec | None,
                                  overlap: bool = False) -> dict[str, _Handle] | None:
        return self.communicate("send_forward_recv_forward", tensor, received, None, None, wait=not overlap)

    @overload
    def send_backward_recv_backward(self, tensor: OpSpec | None, received: OpSpec | None,
                                    overlap: Literal[False] = ...) -> None: ...
    @overload
    def send_backward_recv_backward(self, tensor: OpSpec | None, received: OpSpec | None,
                                    overlap: Literal[True]) -> dict[str, _Handle]: ...
    def send_backward_recv_backward(self, tensor: OpSpec | None, received: OpSpec | None,
                                    overlap: bool = False) -> dict[str, _Handle] | None:
        return self.communicate("send_backward_recv_backward", None, None, tensor, received, wait=not overlap)

    def send_forward_backward_recv_forward_backward(self, act: OpSpec | None, grad: OpSpec | None,
                                                    recv_prev: OpSpec | None, recv_next: OpSpec | None) -> None:
        self.communicate("send_forward_backward_recv_forward_backward", act, recv_prev, grad, recv_next)


@functools.lru_cache(maxsize=1 << 16)
def _header(label: str) -> tuple[int, str, str]:
    return (*HEADER, "shape " + label)


class _Specs:
    """The (bytes, dtype, label) of every activation and gradient, made once per schedule."""

    def __init__(self, nbytes: int, dtype: str, microbatches: int, chunks: int):
        self.act = [[(nbytes, dtype, f"act mb{m} chunk{c}") for m in range(microbatches)] for c in range(chunks)]
        self.grad = [[(nbytes, dtype, f"grad mb{m} chunk{c}") for m in range(microbatches)] for c in range(chunks)]


def _one_f_one_b(p2p: _P2P, stage: int, *, pp: int, microbatches: int, specs: _Specs) -> None:
    """forward_backward_pipelining_without_interleaving's communication on one stage."""
    first, last = p2p.first, p2p.last
    act, grad = specs.act[0], specs.grad[0]
    warmup = min(pp - stage - 1, microbatches)
    remaining = microbatches - warmup
    for i in range(warmup):
        p2p.recv_forward(act[i], first)
        p2p.send_forward(act[i], last)
    if remaining > 0:
        p2p.recv_forward(act[warmup], first)
    for i in range(remaining):
        p2p.send_forward_recv_backward(act[i + warmup], grad[i], last)
        if i == remaining - 1:
            p2p.send_backward(grad[i], first)
        else:
            p2p.send_backward_recv_forward(grad[i], act[i + warmup + 1], first)
    for i in range(remaining, microbatches):
        p2p.recv_backward(grad[i], last)
        p2p.send_backward(grad[i], first)


@functools.lru_cache(maxsize=64)
def schedule_table(microbatches: int, chunks: int, group: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """megatron-core's get_schedule_table: (microbatch ids, chunk ids) per virtual microbatch."""
    table = []
    for start in range(0, microbatches, group):
        end = microbatches if start + group >= microbatches else start + group
        table += [(m, c) for c in range(chunks) for m in range(start, end)]
    mbs, cks = zip(*table)
    return mbs, cks


def _interleaved(p2p: _P2P, stage: int, *, pp: int, vpp: int, microbatches: int, overlap: bool,
                 specs: _Specs) -> None:
    """forward_backward_pipelining_with_interleaving's communication on one stage (training,
    microbatch_group_size_per_vp_stage = pp, no warmup flush)."""
    first, last = p2p.first, p2p.last
    mbs, chunk_ids = schedule_table(microbatches, vpp, pp)
    total = microbatches * vpp
    warmup = (pp - stage - 1) * 2 + (vpp - 1) * pp
    all_warmup = warmup >= total
    warmup = min(warmup, total)
    remaining = total - warmup
    acts, grads = specs.act, specs.grad
    fwd_chunk = [chunk_ids[k] for k in range(total)]
    bwd_chunk = [vpp - 1 - c for c in fwd_chunk]
    # The tensor a stage makes at virtual microbatch k, and what this stage sends of it
    # (nothing past either end of the whole pipeline).
    act_at = [acts[c][m] for m, c in zip(mbs, fwd_chunk)]
    grad_at = [grads[c][m] for m, c in zip(mbs, bwd_chunk)]
    sent_fwd = [None if (c == vpp - 1 and last) else t for c, t in zip(fwd_chunk, act_at)]
    sent_bwd = [None if (c == 0 and first) else t for c, t in zip(bwd_chunk, grad_at)]

    def received(k: int, forward: bool) -> OpSpec | None:
        """megatron-core's recv_tensor_from_previous_stage(k): what arrives after virtual
        microbatch k, as its sender sent it (None: nothing)."""
        if not (first if forward else last):
            return (act_at if forward else grad_at)[k + 1]
        # The leading stage gets what the far end made pp - 1 microbatches earlier.
        source = k - (pp - 1)
        if source < 0:
            return None
        c = (fwd_chunk if forward else bwd_chunk)[source]
        if c == (vpp - 1 if forward else 0):
            return None
        return (act_at if forward else grad_at)[source]

    recv_prev_handles: list[_Handle] = []
    recv_next_handles: list[_Handle] = []
    send_next_handle: _Handle | None = None
    send_prev_handle: _Handle | None = None
    wait = p2p.rank.wait

    p2p.recv_forward(acts[0][mbs[0]], first)
    for k in range(warmup):
        recv = received(k, True) if k != total - 1 else None
        if k == warmup - 1 and not overlap and not all_warmup:
            p2p.send_forward_backward_recv_forward_backward(sent_fwd[k], None, recv,
                                                            None if last else received(-1, False))
        else:
            p2p.send_forward_recv_forward(sent_fwd[k], recv)
        if overlap and k == warmup - 1 and not all_warmup:
            handles = p2p.send_backward_recv_backward(None, None if last else received(-1, False), overlap=True)
            if send_prev_handle is not None:
                wait(*send_prev_handle)
            send_prev_handle = handles.pop("send_prev", None)
            if "recv_next" in handles:
                recv_next_handles.append(handles.pop("recv_next"))

    for k in range(remaining):
        forward_k = k + warmup
        recv = received(forward_k, True) if k != remaining - 1 else None
        if not overlap:
            p2p.send_forward_backward_recv_forward_backward(sent_fwd[forward_k], sent_bwd[k], recv,
                                                            received(k, False))
            continue
        if not (fwd_chunk[forward_k] == 0 and first) and recv_prev_handles:
            wait(*recv_prev_handles.pop(0))
        handles = p2p.send_forward_recv_forward(sent_fwd[forward_k], recv, overlap=True)
        if send_next_handle is not None:
            wait(*send_next_handle)
        send_next_handle = handles.pop("send_next", None)
        if "recv_prev" in handles:
            recv_prev_handles.append(handles.pop("recv_prev"))
        if not (bwd_chunk[k] == vpp - 1 and last) and recv_next_handles:
            wait(*recv_next_handles.pop(0))
        handles = p2p.send_backward_recv_backward(sent_bwd[k], received(k, False), overlap=True)
        if send_prev_handle is not None:
            wait(*send_prev_handle)
        send_prev_handle = handles.pop("send_prev", None)
        if "recv_next" in handles:
            recv_next_handles.append(handles.pop("recv_next"))

    if all_warmup:
        p2p.recv_backward(received(-1, False), last)
    for k in range(remaining, total):
        if not (bwd_chunk[k] == vpp - 1 and last) and k != 0 and recv_next_handles:
            wait(*recv_next_handles.pop(0))
        p2p.send_backward_recv_backward(sent_bwd[k], received(k, False) if k != total - 1 else None)
    if send_prev_handle is not None:
        wait(*send_prev_handle)
    if recv_prev_handles or recv_next_handles:
        raise AssertionError(f"stage {stage}: receive handles left at the end, which megatron-core asserts against")


# ---- programs ---------------------------------------------------------------------------------


def megatron_refusal(schedule: str, pp: int, *, vpp: int, microbatches: int, overlap: bool) -> str | None:
    """Why megatron-core 0.19.2 refuses this schedule (its own check, in words), or None."""
    if schedule == "1f1b" and overlap:
        return "megatron-core's non-interleaved schedule raises ValueError with overlap_p2p_comm"
    if schedule == "interleaved":
        if microbatches < pp:
            return (f"megatron-core raises ValueError: {microbatches} microbatches is fewer than "
                    f"microbatch_group_size_per_vp_stage = pp = {pp}")
        rest = microbatches % pp
        if 0 < rest < pp:
            return (f"megatron-core raises RuntimeError: {microbatches} microbatches leave a last group of {rest}, "
                    f"neither 0 nor >= pp = {pp}")
    return None


def _check(schedule: str, pp: int, *, vpp: int, microbatches: int, mode: str, lanes: int, overlap: bool,
           eager_threshold: int, tensor_bytes: int, dtype: str) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if not isinstance(pp, int) or pp < 1:
        raise ValueError(f"pp must be an int >= 1, got {pp!r}")
    if schedule == "1f1b" and vpp != 1:
        raise ValueError(f"vpp must be 1 for the 1f1b schedule (use 'interleaved'), got {vpp!r}")
    if schedule == "interleaved" and (not isinstance(vpp, int) or vpp < 2 or pp < 2):
        raise ValueError(f"the interleaved schedule needs vpp >= 2 and pp >= 2, got vpp={vpp!r}, pp={pp!r}")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches must be an int >= 1, got {microbatches!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if lanes not in LANES:
        raise ValueError(f"lanes must be 1 or {max(LANES)}, got {lanes!r}")
    if not isinstance(eager_threshold, int) or eager_threshold < 0:
        raise ValueError(f"eager_threshold must be an int >= 0, got {eager_threshold!r}")
    if not isinstance(tensor_bytes, int) or tensor_bytes < 1:
        raise ValueError(f"tensor_bytes must be an int >= 1, got {tensor_bytes!r}")
    refusal = megatron_refusal(schedule, pp, vpp=vpp, microbatches=microbatches, overlap=overlap)
    if refusal:
        raise ValueError(f"{schedule} pp={pp} vpp={vpp} microbatches={microbatches}: {refusal}")


@functools.lru_cache(maxsize=1)
def rank_calls(schedule: str, pp: int, *, vpp: int, microbatches: int, overlap: bool, variable: bool,
               tensor_bytes: int, dtype: str, lanes: int | None = None) -> tuple[list[RankCall], ...]:
    """Every rank's calls for one schedule shape; the same for every mode and lane count, except
    with variable_seq_lengths, whose steps are planned over `lanes`."""
    specs = _Specs(tensor_bytes, dtype, microbatches, vpp)
    out: list[list[RankCall]] = []
    for stage in range(pp):
        rank = Rank()
        p2p = _P2P(rank, stage, pp, variable, lanes)
        if schedule == "1f1b":
            _one_f_one_b(p2p, stage, pp=pp, microbatches=microbatches, specs=specs)
        else:
            _interleaved(p2p, stage, pp=pp, vpp=vpp, microbatches=microbatches, overlap=overlap, specs=specs)
        out.append(rank.finish())
    return tuple(out)


def emit(builder: ProgramBuilder, rank: int, calls: Sequence[RankCall], mode: str) -> None:
    """Adds one rank's lowered calls to `builder`: exchanges in `mode`, steps as they are."""
    exchange = builder.exchange
    for name, sn, rp, sp, rn, wait, awaits in calls:
        if sn == STEP:
            builder.steps(rank, [(rp[0], list(rp[1]))], wait=wait, name=name, awaits=awaits)
        else:
            exchange(rank, send_next=sn, recv_prev=rp, send_prev=sp, recv_next=rn, mode=mode, wait=wait, name=name,
                     awaits=awaits)


def generate(schedule: str, pp: int, *, vpp: int = 1, microbatches: int | None = None, mode: str = "parity",
             lanes: int = 2, overlap: bool = False, variable_seq_lengths: bool = False,
             eager_threshold: int = 0, tensor_bytes: int = DEFAULT_TENSOR_BYTES,
             dtype: str = "float32") -> Program:
    """The program of megatron-core's `schedule` ("1f1b" or "interleaved") on `pp` ranks,
    driving P2PCommunicator in `mode` over `lanes` lanes; microbatches defaults to 2 * pp, and
    eager_threshold to 0 (strict rendezvous, what P2PCommunicator's communicators have).
    Activations and gradients are tensor_bytes of dtype. ValueError names a bad argument, or says
    why megatron-core itself refuses the configuration."""
    if microbatches is None:
        microbatches = 2 * pp
    _check(schedule, pp, vpp=vpp, microbatches=microbatches, mode=mode, lanes=lanes, overlap=overlap,
           eager_threshold=eager_threshold, tensor_bytes=tensor_bytes, dtype=dtype)
    if variable_seq_lengths or pp == 1:  # steps planned for the lane count, or self exchanges checked against it
        return _build(schedule, pp, vpp=vpp, microbatches=microbatches, mode=mode, lanes=lanes, overlap=bool(overlap),
                      variable=bool(variable_seq_lengths), eager_threshold=eager_threshold,
                      tensor_bytes=tensor_bytes, dtype=dtype)
    program = _built(schedule, pp, vpp=vpp, microbatches=microbatches, mode=mode, overlap=bool(overlap),
                     eager_threshold=eager_threshold, tensor_bytes=tensor_bytes, dtype=dtype)
    if program.lanes == lanes:
        return program
    # The calls do not depend on the lane count: only the expansion into steps does.
    return Program._packed(pp, lanes, program.eager_threshold, program._streams, program._labels, program._names,
                           program._offsets)


@functools.lru_cache(maxsize=1)
def _built(schedule: str, pp: int, *, vpp: int, microbatches: int, mode: str, overlap: bool, eager_threshold: int,
           tensor_bytes: int, dtype: str) -> Program:
    return _build(schedule, pp, vpp=vpp, microbatches=microbatches, mode=mode, lanes=2, overlap=overlap, variable=False,
                  eager_threshold=eager_threshold, tensor_bytes=tensor_bytes, dtype=dtype)


def _build(schedule: str, pp: int, *, vpp: int, microbatches: int, mode: str, lanes: int, overlap: bool,
           variable: bool, eager_threshold: int, tensor_bytes: int, dtype: str) -> Program:
    builder = ProgramBuilder(pp, lanes, eager_threshold)
    # Only the shape round's steps depend on the lane count; other calls fit every plan.
    calls = rank_calls(schedule, pp, vpp=vpp, microbatches=microbatches, overlap=overlap, variable=variable,
                       tensor_bytes=tensor_bytes, dtype=dtype, lanes=lanes if variable else None)
    for rank in range(pp):
        emit(builder, rank, calls[rank], mode)
    return builder.build()


def grid_configs(full: bool = True) -> list[dict[str, Any]]:
    """The checker's grid, each config generate()'s keyword arguments plus "schedule" and
    "pp"; configs megatron-core refuses carry "skip" with its reason.

    full: pp 1-64, vpp 1 (1f1b) and 2-8 (interleaved, overlap_p2p_comm off and on),
    microbatches pp, 2 pp and 4 pp + 1, both modes, both lane counts.
    reduced (full=False): pp 1-5 and 8, vpp 1-3, the same microbatch counts, modes and
    lanes, each also with variable_seq_lengths; it simulates in seconds."""
    pps = range(1, 65) if full else (1, 2, 3, 4, 5, 8)
    vpps = range(1, 9) if full else (1, 2, 3)
    variables = (False,) if full else (False, True)
    configs: list[dict[str, Any]] = []
    for pp in pps:
        for vpp in vpps:
            if vpp > 1 and pp < 2:
                continue
            schedule = "1f1b" if vpp == 1 else "interleaved"
            for overlap in ((False,) if vpp == 1 else (False, True)):
                for microbatches in sorted({pp, 2 * pp, 4 * pp + 1}):
                    refusal = megatron_refusal(schedule, pp, vpp=vpp, microbatches=microbatches, overlap=overlap)
                    for variable in variables:
                        # mode and lanes innermost: they reuse one cached call sequence
                        for mode in MODES:
                            for lanes in LANES:
                                config = {"schedule": schedule, "pp": pp, "vpp": vpp, "microbatches": microbatches,
                                          "mode": mode, "lanes": lanes, "overlap": overlap,
                                          "variable_seq_lengths": variable}
                                if refusal:
                                    config["skip"] = refusal
                                configs.append(config)
    return configs
