"""Program files: what every rank of a group posts, call by call (format `megatron_p2p.program/1`).

    program = load("ring.json")              # validated; a ProgramError names the JSON path and rank
    program.ranks[r][i].steps                # rank r's i-th call, its steps (groups) of Ops in order
    text = dumps(program)                    # one call per line; loads(text) == program

Generators build programs with `ProgramBuilder`, which keeps them packed (one int64 stream per
rank) so that a schedule of millions of ops never becomes Python objects; `Program.ranks` is built
from the packed form only when someone reads it. The packed form is what `megatron_p2p.simulate`
hands to the C simulator; the layout is documented in csrc/core/simulate.h.
"""
from __future__ import annotations

import functools
import json
import os
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, cast

import torch

from .. import _C

if TYPE_CHECKING:
    import builtins  # _Reader's methods int, bool and str shadow the types in its body
    from typing import TypedDict

FORMAT = "megatron_p2p.program/1"
SLOTS = _C.SLOT_NAMES  # the C core's names (csrc/core/plan.c), in mp_slot order
MODES = _C.MODE_NAMES  # in mp_mode order: a call record's mode field is the index
LANES = tuple(range(1, _C.MAX_LANES + 1))  # the lane counts a communicator may have
KINDS = ("send", "recv")
DTYPE_CODES = {name: code for code, name in enumerate(_C.DTYPE_NAMES)}
ITEM_SIZES = {name: getattr(torch, name).itemsize for name in _C.DTYPE_NAMES}
MAX_BYTES = 1 << 62
MAX_SIZE = 1 << 16

# Packed record tags and the flag bits of a call record (csrc/core/simulate.h).
_TAG_STEPS, _TAG_EXCHANGE = 0, 1
_FLAG_WAIT = 1
_MODE_SHIFT = 1
_SLOT_IS_NEXT = tuple(s.endswith("_next") for s in SLOTS)  # its peer: the next rank, else the previous one
_SLOT_IS_SEND = tuple(s.startswith("send_") for s in SLOTS)
_EXCHANGE_FLAGS = {(m, w): i << _MODE_SHIFT | (_FLAG_WAIT if w else 0) for i, m in enumerate(MODES) for w in (False, True)}


Await = int | tuple[int, str | int]  # a whole earlier call, or one op of it

if TYPE_CHECKING:
    OpSpec = tuple[int, str, str]  # an exchange slot's (bytes, dtype, label)

    class _SlotSpecs(TypedDict, total=False):
        """ProgramBuilder.exchange's slots, for callers that pass them as a dict."""

        send_next: OpSpec | None
        recv_prev: OpSpec | None
        send_prev: OpSpec | None
        recv_next: OpSpec | None


class ProgramError(ValueError):
    """A program that is not well-formed; the message starts with the JSON path and names the rank."""


@dataclass(frozen=True)
class Op:
    kind: str  # "send" | "recv"
    peer: int  # group rank
    lane: int
    bytes: int
    dtype: str
    label: str = ""
    slot: str = ""  # ops expanded from an exchange: "send_next" | "recv_prev" | "send_prev" | "recv_next"


@dataclass(frozen=True)
class Exchange:
    ops: Mapping[str, tuple[int, str, str]]  # slot -> (bytes, dtype, label)
    mode: str
    prev: int
    next: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "ops", MappingProxyType(dict(self.ops)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Exchange):
            return NotImplemented
        return (dict(self.ops), self.mode, self.prev, self.next) == (dict(other.ops), other.mode, other.prev, other.next)

    def __hash__(self) -> int:
        return hash((tuple(sorted(self.ops.items())), self.mode, self.prev, self.next))


@dataclass(frozen=True)
class Call:
    steps: tuple[tuple[Op, ...], ...]  # always expanded (an exchange call is expanded at load time)
    wait: bool = True
    name: str = ""  # the "call" field: the API call that posted it, for reports
    exchange: Exchange | None = None  # the exchange form, kept so a replay posts it with comm.exchange
    # Earlier calls of this rank (or single ops of them) that must complete before this call is
    # issued: an index awaits the whole call; (index, "recv_next") one op of an exchange call;
    # (index, k) the k-th op (counted over its steps) of a steps call.
    awaits: tuple[Await, ...] = ()


def _fail(path: str, rank: int | None, call: int | None, problem: str) -> ProgramError:
    if rank is None:
        where = ""
    elif call is None:
        where = f"rank {rank}: "
    else:
        where = f"rank {rank}, call {call}: "
    return ProgramError(f"{path}: {where}{problem}")


class ProgramBuilder:
    """Builds a Program call by call, packed as it goes (no per-op Python objects).

    Every method checks its arguments and raises ProgramError naming the rank and call."""

    def __init__(self, size: int, lanes: int, eager_threshold: int = 0) -> None:
        if type(size) is not int or not 1 <= size <= MAX_SIZE:
            raise ProgramError(f"size: must be an int from 1 to {MAX_SIZE}, got {size!r}")
        if type(lanes) is not int or lanes not in LANES:
            raise ProgramError(f"lanes: must be 1 or {_C.MAX_LANES}, got {lanes!r}")
        if type(eager_threshold) is not int or not 0 <= eager_threshold <= _C.MAX_EAGER_THRESHOLD:
            raise ProgramError(
                f"eager_threshold: must be an int from 0 to {_C.MAX_EAGER_THRESHOLD}, got {eager_threshold!r}")
        self.size, self.lanes, self.eager_threshold = size, lanes, eager_threshold
        self._streams: list[list[int]] = [[] for _ in range(size)]
        self._labels: list[list[str]] = [[] for _ in range(size)]
        self._names: list[list[str]] = [[] for _ in range(size)]
        self._offsets: list[list[int]] = [[] for _ in range(size)]
        self._checked: dict[tuple[int, str], int] = {}  # (bytes, dtype) pairs already checked -> dtype code

    def _rank(self, rank: int) -> int:
        if type(rank) is not int or not 0 <= rank < self.size:
            raise ProgramError(f"rank: {rank!r} is outside a group of {self.size} ranks")
        return rank

    def _encode_awaits(self, rank: int, awaits: Sequence[Any], name: str) -> list[int]:
        """Checks the call name and awaits; returns the awaits as packed (call, op) pairs."""
        index = len(self._names[rank])
        if not isinstance(name, str):
            raise _fail("call", rank, index, f"the call name must be a string, got {name!r}")
        packed: list[int] = []
        for a in awaits:
            call, which = (a, None) if type(a) is int else tuple(a) if isinstance(a, (tuple, list)) and len(a) == 2 \
                else (None, None)
            if type(call) is not int or not 0 <= call < index:
                raise _fail("await", rank, index, f"{a!r} is not an earlier call of this rank (0 to {index - 1}) "
                                                  "or (call, op) of one")
            op = -1 if which is None else _op_position(self._streams[rank], self._offsets[rank][call], which)
            if op is None:
                raise _fail("await", rank, index, f"call {call} has no op {which!r} to await")
            packed.append(call)
            packed.append(op)
        return packed

    def _header(self, rank: int, tag: int, flags: int, awaits: list[int], name: str) -> list[int]:
        stream = self._streams[rank]
        self._offsets[rank].append(len(stream))
        self._names[rank].append(name)
        stream.append(tag)
        stream.append(flags)
        stream.append(len(awaits) // 2)
        stream.extend(awaits)
        return stream

    def _payload(self, rank: int, what: str, bytes_: Any, dtype: Any) -> int:
        code = DTYPE_CODES.get(dtype) if isinstance(dtype, str) else None
        if code is None:
            raise _fail(what + ".dtype", rank, len(self._names[rank]),
                        f"unknown dtype {dtype!r}; one of {', '.join(_C.DTYPE_NAMES)}")
        if type(bytes_) is not int or not 0 <= bytes_ < MAX_BYTES or bytes_ % ITEM_SIZES[dtype]:
            raise _fail(what + ".bytes", rank, len(self._names[rank]),
                        f"{bytes_!r} is not a byte count of whole {dtype} items ({ITEM_SIZES[dtype]} bytes each)")
        return code

    def exchange(self, rank: int, *, send_next: tuple[int, str, str] | None = None,
                 recv_prev: tuple[int, str, str] | None = None, send_prev: tuple[int, str, str] | None = None,
                 recv_next: tuple[int, str, str] | None = None, mode: str = "parity", prev: int | None = None,
                 next: int | None = None, wait: bool = True, name: str = "", awaits: Sequence[Await] = ()) -> int:
        """Adds a pipeline exchange on `rank`; each slot is None or (bytes, dtype, label).
        Returns the call's index on that rank."""
        # The grid builds hundreds of millions of these: checks are cached per (bytes, dtype).
        size = self.size
        if type(rank) is not int or not 0 <= rank < size:
            self._rank(rank)
        if prev is None:
            prev = rank - 1 if rank else size - 1
        elif type(prev) is not int or not 0 <= prev < size:
            raise _fail("exchange.prev", rank, len(self._names[rank]), f"{prev!r} is outside a group of {size} ranks")
        if next is None:
            next = rank + 1 if rank + 1 < size else 0
        elif type(next) is not int or not 0 <= next < size:
            raise _fail("exchange.next", rank, len(self._names[rank]), f"{next!r} is outside a group of {size} ranks")
        flags = _EXCHANGE_FLAGS.get((mode, wait))
        if flags is None:
            if mode not in MODES:
                raise _fail("exchange.mode", rank, len(self._names[rank]),
                            f"must be {' or '.join(map(repr, MODES))}, got {mode!r}")
            flags = _EXCHANGE_FLAGS[mode, bool(wait)]
        packed_awaits = self._encode_awaits(rank, awaits, name) if awaits or type(name) is not str else ()
        labels = self._labels[rank]
        stream = self._streams[rank]
        start, first_label = len(stream), len(labels)
        stream += (_TAG_EXCHANGE, flags, len(packed_awaits) // 2)
        if packed_awaits:
            stream += packed_awaits
        stream += (prev, next, 0)
        mask = 0
        ok = self._checked
        slot = "send_next"
        try:
            for bit, slot, spec in ((1, "send_next", send_next), (2, "recv_prev", recv_prev),
                                    (4, "send_prev", send_prev), (8, "recv_next", recv_next)):
                if spec is None:
                    continue
                nbytes, dtype, label = spec
                code = ok.get((nbytes, dtype))  # checked once per (bytes, dtype): the grid's hot loop
                if code is None or type(nbytes) is not int:
                    code = ok[nbytes, dtype] = self._payload(rank, f"exchange.{slot}", nbytes, dtype)
                stream += (nbytes, code)
                labels.append(label)
                mask |= bit
            if mask and (prev == rank or next == rank):
                self._check_self_exchange(rank, len(self._names[rank]), mask, mode, prev, next)
        except (TypeError, ValueError) as e:
            del stream[start:]
            del labels[first_label:]
            if isinstance(e, ProgramError):
                raise
            raise _fail(f"exchange.{slot}", rank, len(self._names[rank]),
                        f"must be None or (bytes, dtype, label), got {spec!r}") from None
        stream[start + 5 + len(packed_awaits)] = mask
        self._offsets[rank].append(start)
        names = self._names[rank]
        names.append(name)
        return len(names) - 1

    def _check_self_exchange(self, rank: int, index: int, mask: int, mode: str, prev: int, next: int) -> None:
        names = [SLOTS[b] for b in range(len(SLOTS)) if mask >> b & 1]
        for s, (lane, slots) in enumerate(_plan_for(mode, self.lanes, rank, tuple(names), prev == rank, next == rank)):
            peers = [(next if _SLOT_IS_NEXT[SLOTS.index(n)] else prev, _SLOT_IS_SEND[SLOTS.index(n)]) for n in slots]
            sends = sum(1 for p, is_send in peers if p == rank and is_send)
            recvs = sum(1 for p, is_send in peers if p == rank and not is_send)
            if sends != recvs:
                raise _fail("exchange", rank, index,
                            f"step {s} on lane {lane} has {sends} send(s) to itself and {recvs} receive(s) from "
                            "itself; a self send needs its receive in the same step")

    def steps(self, rank: int, steps: Sequence[tuple[int, Sequence[tuple[str, int, int, str, str]]]], *,
              wait: bool = True, name: str = "", awaits: Sequence[Await] = ()) -> int:
        """Adds a call of explicit steps on `rank`: [(lane, [(kind, peer, bytes, dtype, label), ...]), ...].
        Returns the call's index on that rank."""
        self._rank(rank)
        packed_awaits = self._encode_awaits(rank, awaits, name)
        index = len(self._names[rank])
        body: list[int] = [len(steps)]
        labels: list[str] = []
        for s, (lane, ops) in enumerate(steps):
            if type(lane) is not int or not 0 <= lane < self.lanes:
                raise _fail(f"steps[{s}].lane", rank, index, f"lane {lane!r} is not one of the program's {self.lanes}")
            if not ops:
                raise _fail(f"steps[{s}]", rank, index, "a step needs at least one op")
            body.append(lane)
            body.append(len(ops))
            self_balance = 0
            for i, (kind, peer, nbytes, dtype, label) in enumerate(ops):
                if kind not in KINDS:
                    raise _fail(f"steps[{s}][{i}].kind", rank, index, f"must be 'send' or 'recv', got {kind!r}")
                if type(peer) is not int or not 0 <= peer < self.size:
                    raise _fail(f"steps[{s}][{i}].peer", rank, index, f"peer {peer!r} is outside a group of {self.size} ranks")
                code = self._payload(rank, f"steps[{s}][{i}]", nbytes, dtype)
                if peer == rank:
                    self_balance += 1 if kind == "send" else -1
                body.append(0 if kind == "send" else 1)
                body.append(peer)
                body.append(nbytes)
                body.append(code)
                labels.append(label if type(label) is str else str(label))
            if self_balance:
                raise _fail(f"steps[{s}]", rank, index,
                            "a send to itself needs its receive in the same step (and the other way round)")
        self._header(rank, _TAG_STEPS, _FLAG_WAIT if wait else 0, packed_awaits, name).extend(body)
        self._labels[rank].extend(labels)
        return index

    def call(self, rank: int, call: Call) -> int:
        """Adds a Call (as Program.ranks holds them): its exchange form if it has one, else its steps."""
        if call.exchange is not None:
            ex = call.exchange
            return self.exchange(rank, mode=ex.mode, prev=ex.prev, next=ex.next, wait=call.wait, name=call.name,
                                 awaits=call.awaits,
                                 # a slot that is not (bytes, dtype, label) is refused by exchange()
                                 **cast("_SlotSpecs", {slot: tuple(spec) for slot, spec in ex.ops.items()}))
        steps = [(step[0].lane if step else 0, [(o.kind, o.peer, o.bytes, o.dtype, o.label) for o in step])
                 for step in call.steps]
        for s, step in enumerate(call.steps):
            if any(o.lane != step[0].lane for o in step):
                raise _fail(f"steps[{s}]", rank, len(self._names[rank]), "all ops of a step must share one lane")
        return self.steps(rank, steps, wait=call.wait, name=call.name, awaits=call.awaits)

    def build(self) -> Program:
        """The Program; cheap (the packed streams are frozen, Calls are made when read)."""
        for r, labels in enumerate(self._labels):
            for label in labels:
                if type(label) is not str:
                    raise _fail("label", r, None, f"labels must be strings, got {label!r}")
        return Program._packed(self.size, self.lanes, self.eager_threshold,
                               tuple(array("q", s).tobytes() for s in self._streams),
                               tuple(tuple(x) for x in self._labels), tuple(tuple(x) for x in self._names),
                               tuple(tuple(x) for x in self._offsets))


@functools.cache
def _plan(mode: str, lanes: int, rank: int, names: tuple[str, ...], prev_self: bool,
          next_self: bool) -> list[tuple[int, tuple[str, ...]]]:
    # The plan depends on the rank only through its parity; callers pass the rank itself.
    return _C.plan(mode, lanes, rank, names, prev_self, next_self)


def _plan_for(mode: str, lanes: int, rank: int, names: tuple[str, ...], prev_self: bool,
              next_self: bool) -> list[tuple[int, tuple[str, ...]]]:
    return _plan(mode, lanes, rank % 2, names, prev_self, next_self)


class Program:
    """A validated program: `size` ranks, `lanes`, `eager_threshold` and each rank's calls.

    `Program(size, lanes, eager_threshold, ranks)` packs Calls; builders and loaders make the
    packed form directly. Equal programs compare equal whichever way they were made."""

    __slots__ = ("size", "lanes", "eager_threshold", "_streams", "_labels", "_names", "_offsets", "_ranks")
    # The slots' types (set with object.__setattr__: a Program is immutable).
    size: int
    lanes: int
    eager_threshold: int
    _streams: tuple[bytes, ...]  # per rank: the packed int64 records
    _labels: tuple[tuple[str, ...], ...]  # per rank: each op's label, in record order
    _names: tuple[tuple[str, ...], ...]  # per rank: each call's name
    _offsets: tuple[tuple[int, ...], ...]  # per rank: each call's record position in its stream
    _ranks: tuple[tuple[Call, ...], ...] | None  # the decoded Calls, once read

    def __init__(self, size: int, lanes: int, eager_threshold: int = 0, ranks: Iterable[Iterable[Call]] = ()) -> None:
        builder = ProgramBuilder(size, lanes, eager_threshold)
        ranks = tuple(tuple(calls) for calls in ranks)
        if len(ranks) != size:
            raise ProgramError(f"ranks: {len(ranks)} lists of calls for a group of {size} ranks")
        for r, calls in enumerate(ranks):
            for call in calls:
                builder.call(r, call)
        built = builder.build()
        for name in self.__slots__:
            object.__setattr__(self, name, getattr(built, name))

    @classmethod
    def _packed(cls, size: int, lanes: int, eager_threshold: int, streams: tuple[bytes, ...],
                labels: tuple[tuple[str, ...], ...], names: tuple[tuple[str, ...], ...],
                offsets: tuple[tuple[int, ...], ...]) -> Program:
        self = object.__new__(cls)
        for name, value in zip(cls.__slots__, (size, lanes, eager_threshold, streams, labels, names, offsets, None)):
            object.__setattr__(self, name, value)
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Program is immutable")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Program):
            return NotImplemented
        return (self.size, self.lanes, self.eager_threshold, self._streams, self._labels, self._names) == (
            other.size, other.lanes, other.eager_threshold, other._streams, other._labels, other._names)

    def __hash__(self) -> int:
        return hash((self.size, self.lanes, self.eager_threshold, self._streams))

    def __repr__(self) -> str:
        return f"Program(size={self.size}, lanes={self.lanes}, eager_threshold={self.eager_threshold}, calls={self.num_calls()})"

    def num_calls(self, rank: int | None = None) -> int:
        """Calls of one rank, or of all ranks."""
        if rank is not None:
            return len(self._names[rank])
        return sum(len(n) for n in self._names)

    def num_ops(self, rank: int | None = None) -> int:
        """Ops (after expansion) of one rank, or of all ranks."""
        if rank is not None:
            return len(self._labels[rank])
        return sum(len(labels) for labels in self._labels)

    @property
    def ranks(self) -> tuple[tuple[Call, ...], ...]:
        """Each rank's Calls, exchange calls expanded by the runtime's plan (built on first use)."""
        ranks = self._ranks
        if ranks is None:
            ranks = tuple(tuple(self.call(r, i) for i in range(len(self._names[r]))) for r in range(self.size))
            object.__setattr__(self, "_ranks", ranks)
        return ranks

    def call(self, rank: int, index: int) -> Call:
        """Rank `rank`'s call number `index`, decoded from the packed form."""
        stream = memoryview(self._streams[rank]).cast("q")
        pos = self._offsets[rank][index]
        label_at = self._label_base(rank, index)
        tag, flags, nawaits = stream[pos], stream[pos + 1], stream[pos + 2]
        awaits = tuple(self._await_of(rank, stream[pos + 3 + 2 * i], stream[pos + 4 + 2 * i]) for i in range(nawaits))
        pos += 3 + 2 * nawaits
        labels = self._labels[rank]
        wait = bool(flags & _FLAG_WAIT)
        name = self._names[rank][index]
        if tag == _TAG_EXCHANGE:
            prev, nxt, mask = stream[pos], stream[pos + 1], stream[pos + 2]
            pos += 3
            specs = {}
            for bit in range(len(SLOTS)):
                if mask >> bit & 1:
                    specs[SLOTS[bit]] = (stream[pos], _C.DTYPE_NAMES[stream[pos + 1]], labels[label_at])
                    pos += 2
                    label_at += 1
            mode = MODES[flags >> _MODE_SHIFT]
            steps = []
            for lane, slots in _plan_for(mode, self.lanes, rank, tuple(specs), prev == rank, rank == nxt):
                steps.append(tuple(
                    Op("send" if _SLOT_IS_SEND[SLOTS.index(s)] else "recv", nxt if _SLOT_IS_NEXT[SLOTS.index(s)] else prev,
                       lane, specs[s][0], specs[s][1], specs[s][2], s) for s in slots))
            return Call(tuple(steps), wait, name, Exchange(specs, mode, prev, nxt), awaits)
        nsteps = stream[pos]
        pos += 1
        steps = []
        for _ in range(nsteps):
            lane, nops = stream[pos], stream[pos + 1]
            pos += 2
            ops = []
            for _ in range(nops):
                ops.append(Op(KINDS[stream[pos]], stream[pos + 1], lane, stream[pos + 2],
                              _C.DTYPE_NAMES[stream[pos + 3]], labels[label_at]))
                pos += 4
                label_at += 1
            steps.append(tuple(ops))
        return Call(tuple(steps), wait, name, None, awaits)

    def _await_of(self, rank: int, call: int, op: int) -> Await:
        if op < 0:
            return call
        stream = memoryview(self._streams[rank]).cast("q")
        pos = self._offsets[rank][call]
        if stream[pos] == _TAG_EXCHANGE:
            mask = stream[pos + 3 + 2 * stream[pos + 2] + 2]
            return call, [SLOTS[b] for b in range(len(SLOTS)) if mask >> b & 1][op]
        return call, op

    def _label_base(self, rank: int, index: int) -> int:
        """Index into the rank's labels of the call's first op (counted over the earlier records)."""
        bases = _label_bases(self._streams[rank], self._offsets[rank])
        return bases[index]

    def packed(self) -> tuple[int, int, int, tuple[bytes, ...]]:
        """(size, lanes, eager_threshold, streams): what the C simulator takes (csrc/core/simulate.h)."""
        return self.size, self.lanes, self.eager_threshold, self._streams

    def label(self, rank: int, index: int) -> str:
        """The label of rank's `index`-th op in record order (the simulator reports ops by it)."""
        return self._labels[rank][index]

    def call_name(self, rank: int, call: int) -> str:
        return self._names[rank][call]


def _op_position(stream: Sequence[int], pos: int, which: Any) -> int | None:
    """Position in record order of op `which` (a slot name, or an index for a steps call) of
    the call record at `pos`, or None if it has no such op."""
    tag, nawaits = stream[pos], stream[pos + 2]
    pos += 3 + 2 * nawaits
    if tag == _TAG_EXCHANGE:
        mask = stream[pos + 2]
        if which not in SLOTS or not mask >> SLOTS.index(which) & 1:
            return None
        return bin(mask & ((1 << SLOTS.index(which)) - 1)).count("1")
    nops, nsteps = 0, stream[pos]
    pos += 1
    for _ in range(nsteps):
        nops += stream[pos + 1]
        pos += 2 + 4 * stream[pos + 1]
    return which if type(which) is int and 0 <= which < nops else None


@functools.lru_cache(maxsize=64)
def _label_bases(stream_bytes: bytes, offsets: tuple[int, ...]) -> tuple[int, ...]:
    stream = memoryview(stream_bytes).cast("q")
    bases = []
    count = 0
    for pos in offsets:
        bases.append(count)
        tag, nawaits = stream[pos], stream[pos + 2]
        pos += 3 + 2 * nawaits
        if tag == _TAG_EXCHANGE:
            count += bin(stream[pos + 2]).count("1")
        else:
            nsteps = stream[pos]
            pos += 1
            for _ in range(nsteps):
                nops = stream[pos + 1]
                count += nops
                pos += 2 + 4 * nops
    return tuple(bases)


# ---- JSON ---------------------------------------------------------------------------------------

_PROGRAM_KEYS = {"format", "size", "lanes", "eager_threshold", "ranks"}
_STEPS_CALL_KEYS = {"steps", "wait", "call", "await"}
_EXCHANGE_CALL_KEYS = {"exchange", "mode", "prev", "next", "wait", "call", "await"}
_OP_KEYS = {"kind", "peer", "lane", "bytes", "dtype", "label"}
_OPSPEC_KEYS = {"bytes", "dtype", "label"}


class _Reader:
    """Checks one JSON value at a time, each error naming its path, rank and call."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.rank: int | None = None
        self.call: int | None = None

    def fail(self, path: str, problem: str) -> ProgramError:
        err = _fail(path, self.rank, self.call, problem)
        if self.source not in ("<dict>", "<string>"):
            err = ProgramError(f"{self.source}: {err}")
        return err

    def keys(self, obj: Any, path: str, allowed: set[str], required: Iterable[str], what: str) -> dict[str, Any]:
        if not isinstance(obj, dict):
            raise self.fail(path, f"{what} must be a JSON object, got {_json_type(obj)}")
        for key in obj:
            if key not in allowed:
                raise self.fail(f"{path}.{key}" if path else key,
                                f"unknown key {key!r} in {what}; allowed: {', '.join(sorted(allowed))}")
        for key in required:
            if key not in obj:
                raise self.fail(path or "(top level)", f"{what} needs {key!r}")
        return obj

    def int(self, obj: Any, path: str, low: int, high: int, what: str) -> int:
        if type(obj) is not int or not low <= obj <= high:
            raise self.fail(path, f"{what} must be an integer from {low} to {high}, got {json.dumps(obj)}")
        return obj

    def bool(self, obj: Any, path: str) -> bool:
        if type(obj) is not bool:
            raise self.fail(path, f"must be true or false, got {json.dumps(obj)}")
        return obj

    def str(self, obj: Any, path: str) -> str:
        if not isinstance(obj, str):
            raise self.fail(path, f"must be a string, got {json.dumps(obj)}")
        return obj

    def payload(self, obj: dict[builtins.str, Any], path: builtins.str) -> tuple[builtins.int, builtins.str]:
        dtype = obj["dtype"]
        if not isinstance(dtype, str) or dtype not in DTYPE_CODES:
            raise self.fail(f"{path}.dtype", f"unknown dtype {json.dumps(dtype)}; one of {', '.join(_C.DTYPE_NAMES)}")
        nbytes = self.int(obj["bytes"], f"{path}.bytes", 0, MAX_BYTES - 1, "bytes")
        if nbytes % ITEM_SIZES[dtype]:
            raise self.fail(f"{path}.bytes", f"{nbytes} bytes is not a whole number of {dtype} items "
                                             f"({ITEM_SIZES[dtype]} bytes each)")
        return nbytes, dtype


def _json_type(obj: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number"}.get(type(obj), type(obj).__name__)


def from_dict(obj: Any, source: str = "<dict>") -> Program:
    """Validates a decoded JSON program and returns it; ProgramError names the path and rank."""
    rd = _Reader(source)
    rd.keys(obj, "", _PROGRAM_KEYS, ("format", "size", "lanes", "ranks"), "a program")
    if obj["format"] != FORMAT:
        raise rd.fail("format", f"must be {json.dumps(FORMAT)}, got {json.dumps(obj['format'])}")
    size = rd.int(obj["size"], "size", 1, MAX_SIZE, "size")
    lanes = rd.int(obj["lanes"], "lanes", 1, _C.MAX_LANES, "lanes")
    eager = rd.int(obj.get("eager_threshold", 0), "eager_threshold", 0, _C.MAX_EAGER_THRESHOLD, "eager_threshold")
    ranks = obj["ranks"]
    if not isinstance(ranks, list):
        raise rd.fail("ranks", f"must be a list of {size} lists of calls, got {_json_type(ranks)}")
    if len(ranks) != size:
        raise rd.fail("ranks", f"has {len(ranks)} entries for a group of size {size}")
    builder = ProgramBuilder(size, lanes, eager)
    for r, calls in enumerate(ranks):
        rd.rank, rd.call = r, None
        if not isinstance(calls, list):
            raise rd.fail(f"ranks[{r}]", f"must be a list of calls, got {_json_type(calls)}")
        for c, call in enumerate(calls):
            rd.call = c
            path = f"ranks[{r}][{c}]"
            if isinstance(call, dict) and "exchange" in call:
                _read_exchange_call(rd, builder, call, path, r, c, size)
            elif isinstance(call, dict) and ("steps" in call or "await" in call):
                _read_steps_call(rd, builder, call, path, r, c, size, lanes)
            elif isinstance(call, dict):
                raise rd.fail(path, "a call needs 'steps' or 'exchange' (or only 'await')")
            else:
                raise rd.fail(path, f"a call must be a JSON object, got {_json_type(call)}")
    return builder.build()


def _read_common(rd: _Reader, call: dict[str, Any], path: str, index: int) -> tuple[bool, str, tuple[Await, ...]]:
    wait = rd.bool(call.get("wait", True), f"{path}.wait")
    name = rd.str(call.get("call", ""), f"{path}.call")
    awaits = call.get("await", [])
    if not isinstance(awaits, list):
        raise rd.fail(f"{path}.await", f"must be a list of earlier call indices, got {_json_type(awaits)}")
    out: list[Await] = []
    for i, a in enumerate(awaits):
        ap = f"{path}.await[{i}]"
        if index == 0:
            raise rd.fail(ap, "the first call has no earlier call to await")
        if isinstance(a, list):
            if len(a) != 2 or not isinstance(a[1], (str, int)) or type(a[1]) is bool:
                raise rd.fail(ap, f"must be a call index or [call, op] (op: a slot name or an op index), got {json.dumps(a)}")
            out.append((rd.int(a[0], f"{ap}[0]", 0, index - 1, "an awaited call"), a[1]))
        else:
            out.append(rd.int(a, ap, 0, index - 1, "an awaited call"))
    return wait, name, tuple(out)


def _read_exchange_call(rd: _Reader, builder: ProgramBuilder, call: dict[str, Any], path: str, r: int, c: int,
                        size: int) -> None:
    rd.keys(call, path, _EXCHANGE_CALL_KEYS, ("exchange",), "an exchange call")
    wait, name, awaits = _read_common(rd, call, path, c)
    mode = call.get("mode", "parity")
    if mode not in MODES:
        raise rd.fail(f"{path}.mode", f"must be {' or '.join(map(json.dumps, MODES))}, got {json.dumps(mode)}")
    prev = rd.int(call.get("prev", (r - 1) % size), f"{path}.prev", 0, size - 1, "prev")
    nxt = rd.int(call.get("next", (r + 1) % size), f"{path}.next", 0, size - 1, "next")
    ops = rd.keys(call["exchange"], f"{path}.exchange", set(SLOTS), (), "an exchange")
    specs: dict[str, OpSpec] = {}
    for slot, spec in ops.items():
        p = f"{path}.exchange.{slot}"
        rd.keys(spec, p, _OPSPEC_KEYS, ("bytes", "dtype"), f"the {slot} op")
        nbytes, dtype = rd.payload(spec, p)
        specs[slot] = (nbytes, dtype, rd.str(spec.get("label", ""), f"{p}.label"))
    try:
        # specs' keys are slots: rd.keys allowed no other
        builder.exchange(r, mode=mode, prev=prev, next=nxt, wait=wait, name=name, awaits=awaits,
                         **cast("_SlotSpecs", specs))
    except ProgramError as e:  # what needs the rank's earlier calls: awaits, a self exchange
        raise _at_path(rd, path, e) from None


def _read_steps_call(rd: _Reader, builder: ProgramBuilder, call: dict[str, Any], path: str, r: int, c: int, size: int,
                     lanes: int) -> None:
    rd.keys(call, path, _STEPS_CALL_KEYS, (), "a steps call")
    wait, name, awaits = _read_common(rd, call, path, c)
    steps = call.get("steps", [])
    if not isinstance(steps, list):
        raise rd.fail(f"{path}.steps", f"must be a list of steps (lists of ops), got {_json_type(steps)}")
    packed: list[tuple[int, list[tuple[str, int, int, str, str]]]] = []
    for s, step in enumerate(steps):
        sp = f"{path}.steps[{s}]"
        if not isinstance(step, list) or not step:
            raise rd.fail(sp, "a step must be a non-empty list of ops")
        ops: list[tuple[str, int, int, str, str]] = []
        lane0: int | None = None
        balance = 0
        for i, op in enumerate(step):
            op_path = f"{sp}[{i}]"
            rd.keys(op, op_path, _OP_KEYS, ("kind", "peer", "bytes", "dtype"), "an op")
            kind = op["kind"]
            if kind not in KINDS:
                raise rd.fail(f"{op_path}.kind", f"must be \"send\" or \"recv\", got {json.dumps(kind)}")
            peer = op["peer"]
            if type(peer) is not int or not 0 <= peer < size:
                raise rd.fail(f"{op_path}.peer", f"peer {json.dumps(peer)} is outside a group of {size} ranks")
            lane = op.get("lane", 0)
            if type(lane) is not int or not 0 <= lane < lanes:
                raise rd.fail(f"{op_path}.lane", f"lane {json.dumps(lane)} is not one of the program's {lanes} lane(s)")
            if lane0 is None:
                lane0 = lane
            elif lane != lane0:
                raise rd.fail(f"{op_path}.lane", f"lane {lane} differs from lane {lane0} of the step's first op; "
                                                 "all ops of a step share one lane")
            nbytes, dtype = rd.payload(op, op_path)
            label = rd.str(op.get("label", ""), f"{op_path}.label")
            if peer == r:
                balance += 1 if kind == "send" else -1
            ops.append((kind, peer, nbytes, dtype, label))
        if balance:
            raise rd.fail(sp, "a send to this rank itself needs its receive in the same step (and the other way round)")
        assert lane0 is not None  # the step has an op
        packed.append((lane0, ops))
    try:
        builder.steps(r, packed, wait=wait, name=name, awaits=awaits)
    except ProgramError as e:
        raise _at_path(rd, path, e) from None


def _at_path(rd: _Reader, path: str, err: ProgramError) -> ProgramError:
    """A builder's error ("field: rank r, call c: problem") at the call's JSON path."""
    field_, _, rest = str(err).partition(": ")
    return rd.fail(f"{path}.{field_}", rest.split(": ", 1)[-1])


def loads(text: str, source: str = "<string>") -> Program:
    """Parses and validates a program from JSON text."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProgramError(f"{source}: not valid JSON: {e}") from None
    return from_dict(obj, source)


def load(path: str | os.PathLike[str]) -> Program:
    """Reads and validates a program file. OSError if it cannot be read, ProgramError if it is wrong."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return loads(text, os.fspath(path))


def _call_dict(program: Program, rank: int, index: int) -> dict[str, Any]:
    call = program.call(rank, index)
    out: dict[str, Any] = {}
    if call.exchange is not None:
        ex = call.exchange
        out["exchange"] = {slot: {"bytes": b, "dtype": d, **({"label": label} if label else {})}
                           for slot, (b, d, label) in ex.ops.items()}
        if ex.mode != "parity":
            out["mode"] = ex.mode
        if ex.prev != (rank - 1) % program.size:
            out["prev"] = ex.prev
        if ex.next != (rank + 1) % program.size:
            out["next"] = ex.next
    elif call.steps or not call.awaits:
        out["steps"] = [[_op_dict(op) for op in step] for step in call.steps]
    if not call.wait:
        out["wait"] = False
    if call.awaits:
        out["await"] = [a if isinstance(a, int) else list(a) for a in call.awaits]  # (decoded awaits hold no bools)
    if call.name:
        out["call"] = call.name
    return out


def _op_dict(op: Op) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": op.kind, "peer": op.peer}
    if op.lane:
        out["lane"] = op.lane
    out["bytes"] = op.bytes
    out["dtype"] = op.dtype
    if op.label:
        out["label"] = op.label
    return out


def to_dict(program: Program) -> dict[str, Any]:
    """The JSON object of a program; from_dict(to_dict(p)) == p."""
    return {"format": FORMAT, "size": program.size, "lanes": program.lanes,
            "eager_threshold": program.eager_threshold,
            "ranks": [[_call_dict(program, r, i) for i in range(program.num_calls(r))] for r in range(program.size)]}


def dumps(program: Program) -> str:
    """JSON text, one call per line; loads(dumps(p)) == p."""
    head = json.dumps({"format": FORMAT, "size": program.size, "lanes": program.lanes,
                       "eager_threshold": program.eager_threshold})
    lines = [head[:-1] + ', "ranks": [']
    for r in range(program.size):
        calls = [json.dumps(_call_dict(program, r, i)) for i in range(program.num_calls(r))]
        end = "]" if r == program.size - 1 else "],"
        if calls:
            lines.append("  [")
            lines.extend(f"    {c}," for c in calls[:-1])
            lines.append(f"    {calls[-1]}")
            lines.append("  " + end)
        else:
            lines.append("  [" + end)
    lines.append("]}")
    return "\n".join(lines) + "\n"

