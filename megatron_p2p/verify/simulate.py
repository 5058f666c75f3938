"""The one simulator of the transport semantics: what a program does under strict rendezvous.

    verdict = simulate(load("ring.json"))
    verdict.verdict      # "ok" | "deadlock" | "mismatch"
    print(verdict.summary())   # "OK in 12 rounds", "DEADLOCK: ranks 0 -> 1 -> 2 -> 3 -> 0", ...
    print(verdict.detail())    # the cycle, one line per rank, or the disagreeing pair

The run itself is C (`_C.simulate`, csrc/core/simulate.c): exchange calls are expanded by the
runtime's own plan, sends wait for their receive unless at or under the eager threshold, and
each channel has the shm transport's 8 descriptor slots. Semantics: docs/program-format.md.

Each lane runs its steps in issue order, lanes side by side. `serialize_lanes=True` runs each
rank's steps of all lanes in one queue in issue order instead, the worst case NCCL allows for
communicators sharing a device (one execution order per device); messages still pair per lane.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from .. import _C
from .program import KINDS, SLOTS, Op, Program

_PARTNER_QUEUED = 1  # csrc/core/simulate.h: MP_SIM_PARTNER_QUEUED


@dataclass(frozen=True)
class OpRef:
    """One op of the program, located: program.ranks[rank][call].steps[step][index] is `op`."""
    rank: int
    call: int
    step: int
    index: int
    op: Op
    call_name: str
    seq: int  # k-th op of its kind on its channel (src, dst, lane)

    def describe(self) -> str:
        """"send to rank 1 (send_next), 4096 bytes of float32, lane 0, message #0, call 2 'send_forward' (label 'act 0')"."""
        op = self.op
        where = f"to rank {op.peer}" if op.kind == "send" else f"from rank {op.peer}"
        kind = "send" if op.kind == "send" else "receive"
        slot = f" ({op.slot})" if op.slot else ""
        name = f" {self.call_name!r}" if self.call_name else ""
        label = f" (label {op.label!r})" if op.label else ""
        return (f"{kind} {where}{slot}, {op.bytes} bytes of {op.dtype}, lane {op.lane}, message #{self.seq}, "
                f"call {self.call}{name}{label}")


class CycleRank(NamedTuple):
    """One rank of a wait-for cycle as every deadlock report words it (_C.cycle_report,
    csrc/core/cycle_report.h): the op it is blocked on, which needs `peer`, the cycle's next rank."""
    rank: int
    peer: int
    pid: int  # 0: not known
    kind: str  # "send" | "recv"
    what: str  # who posted it: a slot ("send_next"), or "isend" / "irecv"
    nbytes: int
    dtype: str
    lane: int
    message: int  # its number among its kind's ops on its channel
    call: str  # the API call that posted it, or ""
    label: str  # the program's label for it, or ""
    partner_posted: bool  # the peer posted the partner, queued behind the peer's own blocked op
    lanes_serialized: bool  # the peer runs its lanes in one queue
    partner_count: int  # ops of the partner's kind the peer has posted on the channel


def cycle_report(ranks: list[CycleRank]) -> str:
    """The report of the cycle ranks[0] -> ranks[1] -> ... -> ranks[0]: the words shm's run-time
    detection, the checker, `trace` and NCCL's stall analysis all use."""
    return _C.cycle_report(ranks)


@dataclass(frozen=True)
class CycleEdge:
    rank: int
    blocked_on: OpRef  # the op of `rank` that needs the next rank
    waits_for: int  # the next rank in the cycle
    peer_posted: str  # what that peer has posted on that channel, in words
    reported: CycleRank  # the edge as the report words it


@dataclass(frozen=True)
class TimedOp:
    """An op of the run with the rounds it was posted and completed in (None: never)."""
    ref: OpRef
    posted: int | None
    done: int | None


@dataclass
class Verdict:
    verdict: str  # "ok" | "deadlock" | "mismatch"
    rounds: int  # rounds on the critical path (ok), or rounds until the last op completed
    cycle: list[CycleEdge] = field(default_factory=list)  # deadlock: the wait-for cycle, in order
    pending: list[OpRef] = field(default_factory=list)  # deadlock: every op left pending
    mismatch: tuple[OpRef, OpRef] | None = None  # mismatch: (send, recv) of the first disagreeing pair
    ranks: list[int] = field(default_factory=list)  # ranks involved: the cycle's, or the mismatched pair's
    cycle_closed: bool = True  # False: no cycle exists; `cycle` is a chain ending at a rank that finished
    num_pending: int = 0  # ops left pending (also when `pending` was not collected)
    serialize_lanes: bool = False  # each rank's lanes ran in one queue in issue order
    timeline: list[TimedOp] = field(default_factory=list)  # every op, when simulate(timeline=True)

    @property
    def report(self) -> str:
        """A deadlock's wait-for cycle in the words of every deadlock report (cycle_report); "" when
        there is no cycle."""
        return cycle_report([e.reported for e in self.cycle]) if self.cycle_closed and self.cycle else ""

    @property
    def ok(self) -> bool:
        return self.verdict == "ok"

    def summary(self) -> str:
        """One line: "OK in 17 rounds", "DEADLOCK: ranks 0 -> 1 -> 0 (4 ops pending)", "MISMATCH: ..."."""
        if self.verdict == "ok":
            return f"OK in {self.rounds} rounds"
        if self.verdict == "mismatch":
            assert self.mismatch is not None  # a mismatch verdict holds its pair
            send, recv = self.mismatch
            return (f"MISMATCH: rank {send.rank} sends {_payload(send)} to rank {recv.rank}, which expects "
                    f"{_payload(recv)} (message #{send.seq} on lane {send.op.lane})")
        pending = f"{self.num_pending} op{'s' if self.num_pending != 1 else ''} pending"
        if self.cycle_closed:
            chain = " -> ".join(str(e.rank) for e in self.cycle)
            return f"DEADLOCK: ranks {chain} -> {self.cycle[0].rank} ({pending})"
        if not self.cycle:
            return f"DEADLOCK: {pending}, no rank left to post their partners"
        chain = " -> ".join(str(r) for r in self.ranks)
        return f"DEADLOCK: ranks {chain}, which finished without posting the partner ({pending})"

    def detail(self) -> str:
        """Several lines: the summary, then the cycle's report (cycle_report), the chain of waits, or the
        mismatched pair."""
        lines = [self.summary()]
        if self.verdict == "mismatch":
            assert self.mismatch is not None  # a mismatch verdict holds its pair
            send, recv = self.mismatch
            lines.append(f"  rank {send.rank}: {send.describe()}")
            lines.append(f"  rank {recv.rank}: {recv.describe()}")
        elif self.verdict == "deadlock":
            if self.report:
                lines.append(self.report)
            else:  # a chain of waits that ends at a rank that finished
                lines.extend(f"  rank {e.rank}: {e.blocked_on.describe()}; {e.peer_posted}" for e in self.cycle)
            lanes = ", lanes serialized in issue order" if self.serialize_lanes else ""
            lines.append(f"  stuck after {self.rounds} rounds with {self.num_pending} op(s) pending{lanes}")
        return "\n".join(lines)


def _payload(ref: OpRef) -> str:
    label = f", {ref.op.label!r}" if ref.op.label else ""
    slot = f"{ref.op.slot} " if ref.op.slot else ""
    return f"{slot}{ref.op.bytes} bytes of {ref.op.dtype}{label}"


def _op_ref(program: Program, t: tuple[int, ...]) -> OpRef:
    rank, call, step, index, seq, kind, peer, lane, nbytes, dtype, slot, label = t[:12]
    op = Op(KINDS[kind], peer, lane, nbytes, _C.DTYPE_NAMES[dtype], program.label(rank, label),
            SLOTS[slot] if slot >= 0 else "")
    return OpRef(rank, call, step, index, op, program.call_name(rank, call), seq)


def _peer_posted(ref: OpRef, partner_state: int, posted: int, serialize_lanes: bool) -> str:
    op = ref.op
    want = "receive" if op.kind == "send" else "send"
    direction = f"from rank {ref.rank}" if op.kind == "send" else f"to rank {ref.rank}"
    if partner_state == _PARTNER_QUEUED:
        head = "its first unfinished step (lanes serialized)" if serialize_lanes else f"its lane {op.lane} head"
        return f"rank {op.peer} has posted the matching {want} (#{ref.seq}) but it is queued behind {head}"
    plural = "" if posted == 1 else "s"
    return f"rank {op.peer} has posted {posted} {want}{plural} {direction} on lane {op.lane} (this needs #{ref.seq})"


def simulate(program: Program, *, details: bool = True, serialize_lanes: bool = False,
             timeline: bool = False, buffered_at_most: int | None = None) -> Verdict:
    """Runs `program` to quiescence and says whether it completes, deadlocks or mismatches.
    details=False skips listing every pending op (the grid only needs verdicts).
    serialize_lanes=True runs each rank's steps of all lanes in one queue in issue order (one
    execution order per device, as NCCL may run its communicators); matching stays per lane.
    timeline=True lists every op with the rounds it was posted and completed in.
    buffered_at_most: sends of at most this many bytes complete without their receive, in place of
    the program's eager_threshold: the most a transport may buffer (Communicator.buffered_at_most),
    under which a deadlock found is one that no buffering resolves."""
    size, lanes, eager, streams = program.packed()
    verdict, rounds, mismatch, cycle, closed, pending, num_pending, ops = _C.simulate(
        size, lanes, eager if buffered_at_most is None else buffered_at_most, streams, details=details,
        serialize_lanes=serialize_lanes, timeline=timeline)
    result = Verdict(verdict, rounds, num_pending=num_pending, cycle_closed=closed if verdict == "deadlock" else True,
                     serialize_lanes=serialize_lanes)
    if mismatch is not None:
        send, recv = _op_ref(program, mismatch[0]), _op_ref(program, mismatch[1])
        result.mismatch = (send, recv)
        result.ranks = [send.rank, recv.rank]
    if verdict == "deadlock":
        edges = []
        for t, waits_for in cycle:
            ref = _op_ref(program, t)
            op = ref.op
            reported = CycleRank(ref.rank, waits_for, 0, op.kind, op.slot or ("isend" if op.kind == "send" else "irecv"),
                                 op.bytes, op.dtype, op.lane, ref.seq, ref.call_name, op.label,
                                 t[12] == _PARTNER_QUEUED, serialize_lanes, t[13])
            edges.append(CycleEdge(ref.rank, ref, waits_for, _peer_posted(ref, t[12], t[13], serialize_lanes), reported))
        if closed and edges:  # start the cycle at its lowest rank
            first = min(range(len(edges)), key=lambda i: edges[i].rank)
            edges = edges[first:] + edges[:first]
        result.cycle = edges
        result.ranks = [e.rank for e in edges] + ([] if closed or not edges else [edges[-1].waits_for])
    result.pending = [_op_ref(program, t) for t in pending] if verdict == "deadlock" else []
    result.timeline = [TimedOp(_op_ref(program, t), t[14] if t[14] >= 0 else None, t[15] if t[15] >= 0 else None)
                       for t in ops]
    return result
