"""Merges the trace dumps of a job and says what went wrong, naming ranks and ops.

    python -m megatron_p2p.trace DIR [--json] [--program OUT.json] [--communicator ID] [--stale S]
                                     [--timeline FILE.json|FILE.png]

It matches sends and receives per channel (src, dst, lane) in message order and reports
unmatched ops, bytes/dtype mismatches, the wait-for cycle of the ops still pending (found by
megatron_p2p.simulate on a program of the pending tail), missing ranks (no dump) and dead
ranks (definition in docs/trace-format.md). `--program` turns the dumps into a program file for
`python -m megatron_p2p.check` and `megatron_p2p.replay`. `--timeline` draws the ops as a Chrome
trace (.json) or a picture (.png), the cycle's marked (megatron_p2p.timeline). Exit status: 0
clean, 1 problems found, 2 bad input.

Python API: `load_dumps(directory) -> list[Dump]`, `analyse(dumps, ...) -> Report`,
`to_program(dumps) -> Program`.
"""
from __future__ import annotations

import json
import math
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..flight_recorder import FORMAT, REASONS
from . import program as prog
from . import timeline
from ._cli import tool_parser, wrote
from .simulate import CycleRank, cycle_report, simulate

if TYPE_CHECKING:
    from typing import TypeVar

    _T = TypeVar("_T")

RING_CAPACITY = 1024  # ops a flight recorder keeps (MP_TRACE_CAPACITY)
STALE_SECONDS = 60.0
STATES = ("posted", "matched", "completed", "failed")
KINDS = ("send", "recv")

Channel = tuple[int, int, int]  # (src, dst, lane), global ranks


class TraceError(ValueError):
    """Dumps that cannot be analysed; the message names the file, the field and the rank."""


@dataclass(frozen=True)
class TraceOp:
    """One entry of a rank's flight recorder (`comm.recent_ops()`); ranks are global."""

    rank: int
    kind: str
    label: str
    peer: int
    nbytes: int
    dtype: str
    lane: int
    step: int
    seq: int
    group_size: int
    call: int
    call_name: str
    state: str
    error: str
    t_posted: float
    t_completed: float | None
    waited: bool

    @property
    def channel(self) -> Channel:
        return (self.rank, self.peer, self.lane) if self.kind == "send" else (self.peer, self.rank, self.lane)

    @property
    def unfinished(self) -> bool:
        """Not complete when the dump was taken (ops failed by an abort count: they never met)."""
        return self.state in ("posted", "matched") or (self.state == "failed" and self.error != "mismatch")

    def describe(self) -> str:
        """e.g. 'send to rank 1, 4096 bytes of float32, lane 0, message #3, call 7 send_forward (posted, waited)'"""
        direction = "to" if self.kind == "send" else "from"
        name = f" {self.call_name}" if self.call_name else ""
        state = self.state + (f": {self.error}" if self.error else "") + (", waited" if self.waited else "")
        return (f"{self.kind} {direction} rank {self.peer}, {self.nbytes} bytes of {self.dtype}, lane {self.lane}, "
                f"message #{self.seq}, call {self.call}{name} ({state})")


@dataclass(frozen=True)
class Dump:
    """One rank's dump of one communicator (a `rank<R>.<ID>.json` file)."""

    path: Path
    communicator: str
    rank: int
    group_rank: int
    size: int
    ranks: tuple[int, ...]
    backend: str
    lanes: int
    eager_threshold: int
    buffered_at_most: int  # the most its transport may buffer of a send (absent in a dump: eager_threshold)
    pid: int
    hostname: str
    reason: str
    error: str | None
    time: float
    ops: tuple[TraceOp, ...]

    @property
    def truncated(self) -> bool:
        """The ring was full: ops older than the first one kept may have been dropped."""
        return len(self.ops) >= RING_CAPACITY


@dataclass(frozen=True)
class Finding:
    """One problem: kind is "missing", "dead", "stopped", "idle", "error", "cycle", "mismatch" or
    "unmatched"."""

    kind: str
    ranks: tuple[int, ...]  # global ranks involved
    text: str  # first line a summary, then details
    ops: tuple[TraceOp, ...] = ()  # cycle: the op each rank of the cycle is blocked on
    # A cycle's ranks that have not posted an op one of its edges waits for (they could still post
    # it, unless their host is blocked); none when every edge waits on a posted, queued partner.
    unposted: tuple[int, ...] = ()


@dataclass
class CommunicatorReport:
    communicator: str
    size: int
    ranks: tuple[int, ...]
    dumps: int
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.findings

    def to_dict(self) -> dict[str, Any]:
        return {"communicator": self.communicator, "verdict": "clean" if self.ok else "problem", "size": self.size,
                "ranks": list(self.ranks), "dumps": self.dumps,
                "findings": [{"kind": f.kind, "ranks": list(f.ranks), "text": f.text} for f in self.findings],
                "notes": self.notes}


@dataclass
class Report:
    communicators: list[CommunicatorReport]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.communicators)

    def findings(self, kind: str | None = None) -> list[Finding]:
        return [f for c in self.communicators for f in c.findings if kind is None or f.kind == kind]

    def text(self) -> str:
        lines = []
        for c in self.communicators:
            lines.append(f"communicator {c.communicator}: {c.size} ranks {_ranks_text(c.ranks)}, {c.dumps} dumps")
            for f in c.findings:
                head, *rest = f.text.split("\n")
                lines.append(f"  {f.kind.upper()}: {head}")
                lines.extend(f"    {line}" for line in rest)
            lines.extend(f"  note: {n}" for n in c.notes)
        problems = len(self.findings())
        lines.append("trace: clean" if self.ok else f"trace: {problems} problem{'s' if problems > 1 else ''} found")
        return "\n".join(lines)


def _ranks_text(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 3, 7] -> "[0-3, 7]": a job has hundreds of ranks."""
    parts: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if j - i < 2 else f"{ranks[i]}-{ranks[j]}")
        if j - i == 1:
            parts.append(str(ranks[j]))
        i = j + 1
    return f"[{', '.join(parts)}]"


# ---- loading --------------------------------------------------------------------------------

def _field(obj: dict[str, Any], key: str, types: Any, where: str, check: Any = None, why: Any = "") -> Any:
    """obj[key], checked; `why` (a string, or a callable making it only on failure) says what is wrong."""
    if key not in obj:
        raise TraceError(f"{where}: missing field {key!r}")
    value = obj[key]
    ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in _as_tuple(types))
    if not ok or (check is not None and not check(value)):
        raise TraceError(f"{where}.{key}: {(why() if callable(why) else why) or 'bad value'}, got {value!r}")
    return value


def _as_tuple(types: Any) -> tuple[Any, ...]:
    return types if isinstance(types, tuple) else (types,)


def _read_op(obj: Any, where: str, rank: int, dump: dict[str, Any], members: frozenset[int]) -> TraceOp:
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: an op must be an object, got {type(obj).__name__}")
    nonneg = lambda v: v >= 0  # noqa: E731
    finite = lambda v: math.isfinite(v)  # noqa: E731
    peer = _field(obj, "peer", int, where, lambda v: v in members,
                  lambda: f"not a rank of the group {_ranks_text(dump['ranks'])}")
    completed = obj.get("t_completed")
    if completed is not None and (isinstance(completed, bool) or not isinstance(completed, (int, float))):
        raise TraceError(f"{where}.t_completed: must be a number or null, got {completed!r}")
    dtype = _field(obj, "dtype", str, where, lambda v: v in prog.ITEM_SIZES, "unknown dtype")
    _field(obj, "nbytes", int, where, lambda v: v >= 0 and v % prog.ITEM_SIZES[dtype] == 0,
           f"must be a multiple of {dtype}'s {prog.ITEM_SIZES[dtype]} bytes")
    return TraceOp(
        rank=rank,
        kind=_field(obj, "kind", str, where, lambda v: v in KINDS, "must be 'send' or 'recv'"),
        label=_field(obj, "label", str, where),
        peer=peer,
        nbytes=_field(obj, "nbytes", int, where, nonneg, "must be >= 0"),
        dtype=_field(obj, "dtype", str, where, lambda v: v in prog.ITEM_SIZES, "unknown dtype"),
        lane=_field(obj, "lane", int, where, lambda v: 0 <= v < dump["lanes"], f"must be below lanes={dump['lanes']}"),
        step=_field(obj, "step", int, where, nonneg, "must be >= 0"),
        seq=_field(obj, "seq", int, where, nonneg, "must be >= 0"),
        group_size=_field(obj, "group_size", int, where, lambda v: v >= 1, "must be >= 1"),
        call=_field(obj, "call", int, where, nonneg, "must be >= 0"),
        call_name=_field(obj, "call_name", str, where),
        state=_field(obj, "state", str, where, lambda v: v in STATES, f"must be one of {STATES}"),
        error=_field(obj, "error", str, where),
        t_posted=float(_field(obj, "t_posted", (int, float), where, finite, "must be a number")),
        t_completed=None if completed is None else float(completed),
        waited=_field(obj, "waited", bool, where),
    )


def load_dump(path: Path) -> Dump:
    """Reads and validates one dump file; raises TraceError naming the file and field."""
    try:
        obj = json.loads(path.read_text())
    except OSError as exc:
        raise TraceError(f"{path}: cannot read ({exc.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: not JSON ({exc})") from None
    return dump_from_record(obj, path)


def dump_from_record(obj: Any, path: Path) -> Dump:
    """Validates one dump's record (what flight_recorder writes, from a file or through the
    store); `path` names it in errors. Raises TraceError naming the field."""
    name = path.name
    if not isinstance(obj, dict):
        raise TraceError(f"{name}: a dump must be a JSON object")
    if obj.get("format") != FORMAT:
        raise TraceError(f"{name}.format: expected {FORMAT!r}, got {obj.get('format')!r}")
    size = _field(obj, "size", int, name, lambda v: v >= 1, "must be >= 1")
    ranks = _field(obj, "ranks", list, name, lambda v: len(v) == size and all(type(r) is int and r >= 0 for r in v)
                   and len(set(v)) == len(v), f"must list {size} distinct global ranks")
    rank = _field(obj, "rank", int, name, lambda v: v in ranks, f"not one of ranks {ranks}")
    where = f"{name} (rank {rank})"
    _field(obj, "group_rank", int, where, lambda v: v == ranks.index(rank), f"rank {rank} is group rank {ranks.index(rank)}")
    _field(obj, "lanes", int, where, lambda v: v in prog.LANES, f"must be 1 or {max(prog.LANES)}")
    _field(obj, "reason", str, where, lambda v: v in REASONS, f"must be one of {REASONS}")
    error = obj.get("error")
    if error is not None and not isinstance(error, str):
        raise TraceError(f"{where}.error: must be a string or null, got {error!r}")
    members = frozenset(ranks)
    eager = _field(obj, "eager_threshold", int, where, lambda v: v >= 0, "must be >= 0")
    ops = tuple(_read_op(op, f"{where}.ops[{i}]", rank, obj, members)
                for i, op in enumerate(_field(obj, "ops", list, where)))
    seen: set[tuple[str, Channel, int]] = set()
    for i, op in enumerate(ops):
        key = (op.kind, op.channel, op.seq)
        if key in seen:
            raise TraceError(f"{where}.ops[{i}].seq: {op.kind} #{op.seq} on channel {op.channel} is recorded twice")
        seen.add(key)
    return Dump(
        path=path, communicator=_field(obj, "communicator", str, where, bool, "must be a non-empty string"),
        rank=rank, group_rank=obj["group_rank"], size=size, ranks=tuple(ranks),
        backend=_field(obj, "backend", str, where), lanes=obj["lanes"],
        eager_threshold=eager,
        buffered_at_most=_field({"buffered_at_most": eager, **obj}, "buffered_at_most", int, where,
                                lambda v: v >= eager, "must be >= eager_threshold"),
        pid=_field(obj, "pid", int, where), hostname=_field(obj, "hostname", str, where),
        reason=obj["reason"], error=error,
        time=float(_field(obj, "time", (int, float), where, lambda v: math.isfinite(v), "must be epoch seconds")),
        ops=ops,
    )


def load_dumps(directory: str | Path) -> list[Dump]:
    """Every dump in `directory`, validated and checked for agreement between the ranks of each
    communicator, sorted by (communicator, group rank). Raises TraceError on bad input."""
    root = Path(directory)
    if not root.is_dir():
        raise TraceError(f"{directory}: not a directory of trace dumps")
    paths = sorted(p for p in root.glob("rank*.json") if p.is_file())
    if not paths:
        raise TraceError(f"{directory}: no trace dumps (rank<R>.<communicator>.json) in it")
    dumps = [load_dump(p) for p in paths]
    first: dict[str, Dump] = {}
    seen: dict[tuple[str, int], Dump] = {}
    for d in dumps:
        ref = first.setdefault(d.communicator, d)
        for attr in ("size", "ranks", "lanes", "backend", "eager_threshold", "buffered_at_most"):
            if getattr(d, attr) != getattr(ref, attr):
                raise TraceError(f"{d.path.name} (rank {d.rank}).{attr}: {getattr(d, attr)!r} disagrees with "
                                 f"{getattr(ref, attr)!r} in {ref.path.name} for communicator {d.communicator}")
        if (d.communicator, d.rank) in seen:
            raise TraceError(f"{d.path.name}: rank {d.rank} of communicator {d.communicator} is dumped twice "
                             f"(also {seen[d.communicator, d.rank].path.name})")
        seen[d.communicator, d.rank] = d
    return sorted(dumps, key=lambda d: (d.communicator, d.group_rank))


# ---- matching -------------------------------------------------------------------------------

class _Group:
    """One communicator's dumps, indexed by channel and message number."""

    def __init__(self, dumps: Sequence[Dump]) -> None:
        self.dumps = {d.rank: d for d in dumps}
        ref = dumps[0]
        self.id, self.size, self.ranks, self.lanes = ref.communicator, ref.size, ref.ranks, ref.lanes
        self.eager_threshold, self.buffered_at_most = ref.eager_threshold, ref.buffered_at_most
        self.group_rank = {r: i for i, r in enumerate(self.ranks)}
        self.missing = [r for r in self.ranks if r not in self.dumps]
        # channel -> side ("send"/"recv") -> seq -> op
        self.sides: dict[Channel, dict[str, dict[int, TraceOp]]] = defaultdict(lambda: {"send": {}, "recv": {}})
        for d in dumps:
            for op in d.ops:
                self.sides[op.channel][op.kind][op.seq] = op
        self.channels = sorted(self.sides)
        # rank -> the (channel, kind) sides it owns
        self.owned: dict[int, list[tuple[Channel, str]]] = defaultdict(list)
        for ch in self.channels:
            for kind in KINDS:
                self.owned[self.owner(ch, kind)].append((ch, kind))

    def owner(self, channel: Channel, kind: str) -> int:
        return channel[0] if kind == "send" else channel[1]

    def side_start(self, channel: Channel, kind: str) -> int | None:
        """First message number this side's record covers on the channel: 0 for a complete
        record, None when a truncated record says nothing of the channel (or there is none)."""
        dump = self.dumps.get(self.owner(channel, kind))
        if dump is None:
            return None
        if not dump.truncated:
            return 0
        seqs = self.sides[channel][kind]
        return min(seqs) if seqs else None

    def window(self, channel: Channel) -> int | None:
        """First message number both sides cover, or None when one side is unknown."""
        starts = [self.side_start(channel, k) for k in KINDS]
        known = [s for s in starts if s is not None]
        return max(known) if len(known) == len(starts) else None

    def posted(self, channel: Channel, kind: str) -> str:
        """What the owner of `kind` has posted on the channel, in words."""
        seqs = self.sides[channel][kind]
        src, dst, lane = channel
        what = f"{'send' if kind == 'send' else 'receive'}s {'to' if kind == 'send' else 'from'} rank " \
               f"{dst if kind == 'send' else src} on lane {lane}"
        if not seqs:
            return f"no {what}"
        return f"{what} up to message #{max(seqs)}"


def _match(g: _Group, report: CommunicatorReport, explained: set[TraceOp]) -> None:
    """Mismatched pairs and ops without a partner, per channel; ops that a cycle or a dead rank
    already explains are not repeated."""
    cut = 0
    for ch in g.channels:
        if any(g.owner(ch, k) not in g.dumps for k in KINDS):
            continue  # the missing rank is reported instead
        start = g.window(ch)
        sends, recvs = g.sides[ch]["send"], g.sides[ch]["recv"]
        if start is None:
            cut += len(sends) + len(recvs)
            continue
        src, dst, lane = ch
        alone: list[TraceOp] = []
        bad: list[tuple[TraceOp, TraceOp]] = []
        for seq in sorted(set(sends) | set(recvs)):
            if seq < start:
                cut += 1
                continue
            s, r = sends.get(seq), recvs.get(seq)
            if s is None or r is None:
                lone = sends[seq] if r is None else r  # the side that has it: seq is one of their keys
                if lone not in explained:
                    alone.append(lone)
            elif (s.nbytes, s.dtype) != (r.nbytes, r.dtype):
                bad.append((s, r))
        if bad:
            s, r = bad[0]
            report.findings.append(Finding("mismatch", (src, dst), (
                f"rank {src} -> rank {dst}, lane {lane}: {len(bad)} matched pair{'s' if len(bad) > 1 else ''} "
                f"disagree, first message #{s.seq}: {s.nbytes} bytes of {s.dtype} sent, {r.nbytes} bytes of "
                f"{r.dtype} received\n"
                f"rank {src}: {s.describe()}\nrank {dst}: {r.describe()}")))
        if alone:
            lines = [f"rank {op.rank}: {op.describe()}; rank {op.peer} has posted "
                     f"{g.posted(ch, 'recv' if op.kind == 'send' else 'send')}" for op in alone[:3]]
            more = [f"... and {len(alone) - 3} more"] if len(alone) > 3 else []
            report.findings.append(Finding("unmatched", (src, dst), "\n".join(
                [f"rank {src} -> rank {dst}, lane {lane}: {len(alone)} op{'s' if len(alone) > 1 else ''} "
                 f"without a partner"] + lines + more)))
    if cut:
        report.notes.append(f"{cut} ops lie before the window both sides of their channel recorded (a flight "
                            f"recorder keeps the last {RING_CAPACITY} ops) and were not compared")


# ---- the pending tail and its wait-for cycle -----------------------------------------------

def _tail_start(g: _Group, ch: Channel) -> int | None:
    """First message number of the channel still unfinished on either side (None: nothing is)."""
    firsts = [min((s for s, op in g.sides[ch][k].items() if op.unfinished), default=None) for k in KINDS]
    found = [f for f in firsts if f is not None]
    if not found:
        return None
    window = [g.side_start(ch, k) for k in KINDS if g.owner(ch, k) in g.dumps]
    return max([min(found)] + [w for w in window if w is not None])


def _pending_program(g: _Group) -> tuple[prog.Program, dict[tuple[int, int, int, int], TraceOp]]:
    """A program of what was still pending: every op from its channel's first unfinished message
    on, all posted (calls that do not wait), each rank waiting for everything at the end, which
    is what a hang is. Receives take their send's size: mismatches are reported apart."""
    starts = {ch: _tail_start(g, ch) for ch in g.channels}
    builder = prog.ProgramBuilder(g.size, g.lanes, g.eager_threshold)
    where: dict[tuple[int, int, int, int], TraceOp] = {}
    for grank, rank in enumerate(g.ranks):
        dump = g.dumps.get(rank)
        ops = [op for op in (dump.ops if dump else ()) if (first := starts[op.channel]) is not None
               and op.seq >= first]
        for call_ops in _by_call(ops):
            steps = _steps(call_ops)
            spec = []
            for lane, step in steps:
                spec.append((lane, [_program_op(g, op, sizes_from_send=True) for op in step]))
            index = builder.steps(grank, spec, wait=False, name=call_ops[0].call_name)
            for s, (_, step) in enumerate(steps):
                for i, op in enumerate(step):
                    where[grank, index, s, i] = op
    return builder.build(), where


def _by_call(ops: Iterable[TraceOp]) -> list[list[TraceOp]]:
    calls: dict[int, list[TraceOp]] = {}
    for op in ops:
        calls.setdefault(op.call, []).append(op)
    return list(calls.values())


def _steps(ops: Sequence[TraceOp]) -> list[tuple[int, list[TraceOp]]]:
    steps: dict[tuple[int, int], list[TraceOp]] = {}
    for op in ops:
        steps.setdefault((op.lane, op.step), []).append(op)
    return [(lane, step) for (lane, _), step in steps.items()]


def _program_op(g: _Group, op: TraceOp, sizes_from_send: bool) -> tuple[str, int, int, str, str]:
    src, dst, lane = op.channel
    size = g.sides[op.channel]["send"].get(op.seq, op) if sizes_from_send else op
    label = f"{g.group_rank[src]}>{g.group_rank[dst]} lane {lane} #{op.seq}"  # both sides: replay derives bytes from it
    return (op.kind, g.group_rank[op.peer], size.nbytes, size.dtype, label)


def _cycle(g: _Group, report: CommunicatorReport, explained: set[TraceOp]) -> None:
    if not any(op.unfinished for d in g.dumps.values() for op in d.ops):
        return
    program, where = _as_trace_error(g, _pending_program)
    # Every send its transport may buffer is taken as buffered: a cycle found is then one that no
    # buffering resolves (on NCCL, where buffering depends on the topology, that is the certain one).
    verdict = simulate(program, buffered_at_most=g.buffered_at_most)
    pending = sum(op.unfinished for d in g.dumps.values() for op in d.ops)
    if verdict.verdict == "ok":
        report.notes.append(f"{pending} ops were in flight; all of them can still complete")
        return
    if verdict.verdict != "deadlock" or not verdict.cycle or not verdict.cycle_closed:
        return  # stuck on ranks that post nothing more: reported as missing or dead
    ranks = tuple(g.ranks[e.rank] for e in verdict.cycle)
    blocked, unposted, reported = [], [], []
    for e in verdict.cycle:
        ref = e.blocked_on
        op = where[ref.rank, ref.call, ref.step, ref.index]
        explained.add(op)
        blocked.append(op)
        peer = g.ranks[e.waits_for]
        partners = g.sides[op.channel]["recv" if op.kind == "send" else "send"]
        if op.seq not in partners and peer not in unposted:
            unposted.append(peer)
        reported.append(CycleRank(op.rank, peer, g.dumps[op.rank].pid, op.kind, op.label, op.nbytes, op.dtype, op.lane,
                                  op.seq, op.call_name, "", e.reported.partner_posted, False,
                                  max(partners, default=-1) + 1))
    report.findings.append(Finding("cycle", ranks, cycle_report(reported), tuple(blocked), tuple(unposted)))


# ---- missing and dead ranks ----------------------------------------------------------------

def _dead(g: _Group, report: CommunicatorReport, stale_after: float, explained: set[TraceOp]) -> None:
    """Ranks the others wait on, each under one kind: "dead" only when its process is gone (it left
    no dump, or its last dump is its exit's), "stopped" when its record ends while its peers'
    go on, "idle" when it is alive with nothing pending (computing, or outside communication)."""
    for rank in g.missing:
        report.findings.append(Finding("missing", (rank,), f"rank {rank} left no dump (killed, or stuck where "
                                                          "no Python code runs)"))
    newest = max(d.time for d in g.dumps.values())
    for rank, dump in g.dumps.items():
        reasons, kind = [], "idle"
        if dump.reason != "exit" and newest - dump.time > stale_after:
            kind = "stopped"
            reasons.append(f"its record stops {newest - dump.time:.0f} s before the newest dump of the "
                           f"communicator (dumped on {dump.reason}); it stopped while its peers went on")
        waiting = _waiting_on(g, rank)
        if waiting and not any(op.unfinished for op in dump.ops):
            op = waiting[0]
            if dump.reason == "exit":
                kind, did = "dead", "exited"
            else:
                did = "is idle (computing, or outside communication): it has nothing pending"
            more = f" and {len(waiting) - 1} more ops of its peers" if len(waiting) > 1 else ""
            reasons.append(f"rank {op.rank} waits on it ({op.describe()}){more}, but it {did}")
        if reasons:
            explained.update(waiting)
            report.findings.append(Finding(kind, (rank,), f"rank {rank}: " + "\n".join(reasons)))


def _waiting_on(g: _Group, rank: int) -> list[TraceOp]:
    """Unfinished ops of other ranks whose partner `rank` never posted, within its window."""
    out = []
    for ch, partner_kind in g.owned[rank]:
        kind = "send" if partner_kind == "recv" else "recv"
        start = g.side_start(ch, partner_kind)
        if g.owner(ch, kind) == rank or start is None:
            continue  # a self channel, or one this rank's full record says nothing of
        partners = g.sides[ch][partner_kind]
        out += [op for seq, op in sorted(g.sides[ch][kind].items())
                if op.unfinished and seq >= start and seq not in partners]
    return out


def _errors(g: _Group, report: CommunicatorReport) -> None:
    seen: dict[tuple[str, ...], int] = {}  # a report the ranks of one cycle share -> the first rank that gave it
    for rank, dump in g.dumps.items():
        if dump.error is not None:
            head, *rest = (dump.error.strip() or "(no message)").split("\n")
            split = next((i for i, line in enumerate(rest) if line.startswith("pending ops of")), len(rest))
            shared, own = tuple(rest[:split]), rest[split:]
            if shared and shared in seen:
                shared = (f"(the same report as rank {seen[shared]})",)
            elif shared:
                seen[shared] = rank
            lines = [f"rank {rank} raised {head}", *shared, *own][:21]
            report.findings.append(Finding("error", (rank,), "\n".join(lines)))


# ---- entry points ---------------------------------------------------------------------------

def _groups(dumps: Sequence[Dump], communicator: str | None) -> list[list[Dump]]:
    by_id: dict[str, list[Dump]] = {}
    for d in dumps:
        by_id.setdefault(d.communicator, []).append(d)
    if communicator is not None:
        if communicator not in by_id:
            raise TraceError(f"--communicator {communicator}: no dump of it; there are {sorted(by_id)}")
        return [by_id[communicator]]
    return list(by_id.values())


def analyse(dumps: Sequence[Dump], communicator: str | None = None,
            stale_after: float = STALE_SECONDS) -> Report:
    """What went wrong in each communicator (or the one named): missing and dead ranks, errors,
    the wait-for cycle, mismatches and unmatched ops. An empty findings list means clean."""
    if not dumps:
        raise TraceError("no dumps to analyse")
    reports = []
    for group in _groups(dumps, communicator):
        g = _Group(group)
        report = CommunicatorReport(g.id, g.size, g.ranks, len(group))
        explained: set[TraceOp] = set()
        _dead(g, report, stale_after, explained)
        _errors(g, report)
        _cycle(g, report, explained)
        _match(g, report, explained)
        truncated = [d.rank for d in group if d.truncated]
        if truncated:
            report.notes.append(f"ranks {_ranks_text(truncated)} filled their flight recorder ({RING_CAPACITY} ops): earlier ops "
                                "were cut off, so only messages both sides still recorded are compared")
        reports.append(report)
    return Report(reports)


def _as_trace_error(g: _Group, build: Callable[[_Group], _T]) -> _T:
    try:
        return build(g)
    except prog.ProgramError as exc:
        raise TraceError(f"communicator {g.id}: its dumps do not make a valid program: {exc}") from None


def to_program(dumps: Sequence[Dump], communicator: str | None = None) -> prog.Program:
    """The dumps of one communicator as a program (peers as group ranks): each rank's calls in
    order, steps from the lanes' step numbers, `wait` when every op of the call was waited.
    Truncated records start each channel at the first message both sides kept."""
    groups = _groups(dumps, communicator)
    if len(groups) > 1:
        raise TraceError(f"the dumps hold {len(groups)} communicators {sorted(gr[0].communicator for gr in groups)}; "
                         "name one with --communicator")
    return _as_trace_error(_Group(groups[0]), _whole_program)


def _whole_program(g: _Group) -> prog.Program:
    starts = {ch: g.window(ch) for ch in g.channels}
    builder = prog.ProgramBuilder(g.size, g.lanes, g.eager_threshold)
    for grank, rank in enumerate(g.ranks):
        dump = g.dumps.get(rank)
        ops = [op for op in (dump.ops if dump else ()) if (s := starts[op.channel]) is not None and op.seq >= s]
        for call_ops in _by_call(ops):
            spec = [(lane, [_program_op(g, op, sizes_from_send=False) for op in step]) for lane, step in _steps(call_ops)]
            builder.steps(grank, spec, wait=all(op.waited for op in call_ops), name=call_ops[0].call_name)
    return builder.build()


def main(argv: Sequence[str] | None = None) -> int:
    parser = tool_parser("trace", __doc__)
    parser.add_argument("dir", help="the directory MEGATRON_P2P_TRACE_DIR named")
    parser.add_argument("--json", action="store_true", help="one JSON object per communicator")
    parser.add_argument("--program", metavar="OUT.json", help="write the dumps as a program file")
    parser.add_argument("--communicator", metavar="ID", help="only this communicator")
    parser.add_argument("--stale", type=float, default=STALE_SECONDS, metavar="S",
                        help=f"a dump this much older than its peers' marks a dead rank (default {STALE_SECONDS:.0f})")
    parser.add_argument("--timeline", metavar="FILE",
                        help="draw the ops: a Chrome trace (FILE.json, for Perfetto) or a picture (FILE.png)")
    args = parser.parse_args(argv)
    problem = timeline.check_path(args.timeline) if args.timeline else None
    if problem:
        parser.error(problem)
    try:
        dumps = load_dumps(args.dir)
        report = analyse(dumps, args.communicator, args.stale)
        if args.program:
            program = to_program(dumps, args.communicator)
            Path(args.program).write_text(prog.dumps(program))
            wrote("trace", args.program)
        if args.timeline:
            groups = _groups(dumps, args.communicator)
            if len(groups) > 1:
                raise TraceError(f"the dumps hold {len(groups)} communicators "
                                 f"{sorted(gr[0].communicator for gr in groups)}; name one with --communicator "
                                 "for --timeline")
            timeline.write(timeline.of_trace(groups[0], report, args.dir), args.timeline)
            wrote("trace", args.timeline)
    except TraceError as exc:
        print(f"trace: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"trace: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        for c in report.communicators:
            print(json.dumps(c.to_dict()))
    else:
        print(report.text())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
