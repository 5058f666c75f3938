"""Seeded random programs for the checker's tests and the replay agreement test.

random_program(seed) draws 2-6 ranks, 1-2 lanes, a few messages and pipeline exchange rounds,
then lays each rank's ops out as calls: steps calls or exchange calls, waited or not, some
awaiting earlier calls or single ops, some with an eager threshold. Half of the programs keep
one global message order on every rank (they complete unless a payload is made to disagree);
the others are shuffled or lose an op, so a fair share deadlock and a fair share mismatch.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from megatron_p2p.program import Program, ProgramBuilder

SIZES = (0, 16, 64, 256, 4096)


@dataclass
class _Item:
    """One entry of a rank's list: a single send or receive, or this rank's part of an exchange round."""
    kind: str  # "send" | "recv" | "exchange"
    peer: int = 0
    lane: int = 0
    bytes: int = 0
    dtype: str = "float32"
    label: str = ""
    slots: dict | None = None  # exchange: slot -> (bytes, dtype, label)
    mode: str = "parity"


def _exchange_round(rng: random.Random, size: int, k: int, sizes: tuple[int, ...], mismatch: bool) -> list[dict]:
    """Every rank's slots for one pipeline exchange round over the ring."""
    fwd = [rng.random() < 0.7 for _ in range(size)]  # fwd[r]: r sends an activation to r + 1
    bwd = [rng.random() < 0.5 for _ in range(size)]  # bwd[r]: r sends a gradient to r - 1
    act = rng.choice(sizes)
    grad = rng.choice(sizes)
    slots: list[dict] = [{} for _ in range(size)]
    for r in range(size):
        nxt, prev = (r + 1) % size, (r - 1) % size
        if fwd[r]:
            slots[r]["send_next"] = (act, "float32", f"act x{k} {r}->{nxt}")
            slots[nxt]["recv_prev"] = (act, "float32", f"act x{k} {r}->{nxt}")
        if bwd[r]:
            slots[r]["send_prev"] = (grad, "float32", f"grad x{k} {r}->{prev}")
            slots[prev]["recv_next"] = (grad, "float32", f"grad x{k} {r}->{prev}")
    if mismatch:
        r = rng.randrange(size)
        for slot in ("recv_prev", "recv_next"):
            if slot in slots[r]:
                nbytes, dtype, label = slots[r][slot]
                slots[r][slot] = (nbytes + 4, dtype, label)
                break
    return slots


def random_program(seed: int) -> Program:
    """A random program; the same seed gives the same program."""
    rng = random.Random(seed)
    size = rng.randint(2, 6)
    lanes = rng.choice((1, 2))
    eager = rng.choice((0, 0, 0, 16, 64))
    ordered = rng.random() < 0.5
    mismatch_share = 0.2
    # One payload size for all messages: a reordering then deadlocks instead of mismatching.
    sizes = SIZES if rng.random() < 0.5 else (rng.choice(SIZES[1:]),)
    items: list[list[_Item]] = [[] for _ in range(size)]
    for k in range(rng.randint(1, 6)):
        if rng.random() < 0.35:
            mode = rng.choice(("parity", "batched"))
            slots = _exchange_round(rng, size, k, sizes, rng.random() < mismatch_share / 2)
            for r in range(size):
                if slots[r]:
                    items[r].append(_Item("exchange", slots=slots[r], mode=mode))
            continue
        src = rng.randrange(size)
        dst = rng.choice([r for r in range(size) if r != src])
        lane = rng.randrange(lanes)
        nbytes = rng.choice(sizes)
        label = f"m{k} {src}->{dst}"
        recv_bytes = nbytes + 4 if rng.random() < mismatch_share / 2 else nbytes
        items[src].append(_Item("send", dst, lane, nbytes, "float32", label))
        items[dst].append(_Item("recv", src, lane, recv_bytes, "float32", label))
    if not ordered:
        for r in range(size):
            if rng.random() < 0.7:
                rng.shuffle(items[r])
        if rng.random() < 0.2:
            r = rng.choice([r for r in range(size) if items[r]])
            items[r].pop(rng.randrange(len(items[r])))
    builder = ProgramBuilder(size, lanes, eager)
    for r in range(size):
        _lay_out(rng, builder, r, items[r], lanes)
    return builder.build()


def _lay_out(rng: random.Random, builder: ProgramBuilder, rank: int, items: list[_Item], lanes: int) -> None:
    """Groups a rank's items into calls, in order."""
    calls: list[int] = []  # call indices made so far
    i = 0
    while i < len(items):
        awaits: list = []
        if calls and rng.random() < 0.2:
            target = rng.choice(calls)
            awaits.append(target)
        wait = rng.random() < 0.7
        item = items[i]
        if item.kind == "exchange":
            assert item.slots is not None  # an exchange's
            calls.append(builder.exchange(rank, mode=item.mode, wait=wait, awaits=awaits, name="exchange",
                                          **item.slots))
            i += 1
            continue
        group = [item]
        while i + len(group) < len(items) and items[i + len(group)].kind != "exchange" and rng.random() < 0.4:
            group.append(items[i + len(group)])
        i += len(group)
        steps: list = []
        for op in group:
            entry = (op.kind, op.peer, op.bytes, op.dtype, op.label)
            if steps and steps[-1][0] == op.lane and rng.random() < 0.5:
                steps[-1][1].append(entry)
            else:
                steps.append((op.lane, [entry]))
        calls.append(builder.steps(rank, steps, wait=wait, awaits=awaits, name="isend_irecv"))
