"""Deadlocks named on NCCL, from the ranks' pending-op tables.

NCCL names nothing: a wait-for cycle of point-to-point ops stalls the streams until the
watchdog's timeout. So, once an op of an NCCL communicator has made no progress on its lane for
MEGATRON_P2P_STALL_SECONDS (default 1), the watchdog thread publishes the rank's flight-recorder
record (its ops, pending and recent, with their message numbers: docs/trace-format.md) through
the store, and reads the records its peers published. The analysis is the one
`python -m megatron_p2p.trace` runs on dumps (trace.analyse): the pending tail of every channel,
simulated under NCCL's semantics, and the wait-for cycle it cannot get past.

A cycle is a deadlock, raised as DeadlockError on every rank of it, only when nothing the hosts
do next can resolve it: each of its ops waits on a partner that is posted (and queued behind
another op of the cycle), or on a rank whose host is blocked in this package's host wait
(Request.synchronize), which posts nothing until it returns. A rank that has not published,
or is computing, or a slow transfer, is never a deadlock before the timeout. A record counts only
once it has stayed the same for STABLE_BEATS of its rank's polls, so that ranks' pictures taken
at different moments agree. Nothing of this runs on the posting path.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import _env, flight_recorder

if TYPE_CHECKING:
    from collections.abc import Sequence

    from torch.distributed.distributed_c10d import Store  # torch.distributed does not re-export it

    from .verify import trace

ENV_SECONDS = "MEGATRON_P2P_STALL_SECONDS"
DEFAULT_SECONDS = float(str(_env.BY_NAME[ENV_SECONDS].default))  # the table's: 1
STABLE_BEATS = 3  # polls a record must stay unchanged for (the watchdog polls every 0.1 s)
ANALYSE_EVERY = 10  # polls between analyses once a stall has lasted that long: the store's load
_UNFINISHED = ("posted", "matched")


def stall_seconds() -> float:
    """MEGATRON_P2P_STALL_SECONDS, or the default; ValueError names a wrong value."""
    return _env.seconds(ENV_SECONDS)


def stalled_for(ops: list[dict[str, Any]], now: float) -> float:
    """How long the longest-stalled lane has made no progress: its oldest unfinished op's age,
    counted from that op's posting or the last completion on its lane, whichever is later."""
    worst = 0.0
    for lane in {op["lane"] for op in ops}:
        on_lane = [op for op in ops if op["lane"] == lane]
        waiting = [op["t_posted"] for op in on_lane if op["state"] in _UNFINISHED]
        if not waiting:
            continue
        done = [op["t_completed"] for op in on_lane if op["t_completed"] is not None]
        worst = max(worst, now - max([min(waiting)] + done))
    return worst


@dataclass
class _Beat:
    signature: str  # what this rank last published: its ops and whether its host waits
    beats: int      # polls it has stayed the same for


class StallWatch:
    """One NCCL communicator's stall analysis, run by the watchdog thread (see the module)."""

    def __init__(self, store: Store, key: str, ranks: Sequence[int], rank: int,
                 seconds: float | None = None) -> None:
        self._store, self._key, self._ranks, self._rank = store, key, ranks, rank
        self._seconds = stall_seconds() if seconds is None else seconds
        self._mine: _Beat | None = None

    def check(self, comm: Any) -> tuple[tuple[int, ...], str] | None:
        """A certain cycle this rank is in, as (its global ranks, its report), or None. Publishes
        this rank's record while it is stalled, and withdraws it once it is not."""
        record = flight_recorder.to_record(comm, "stall")
        if stalled_for(record["ops"], time.time()) < self._seconds:
            self._withdraw()
            comm.group_picture = None
            return None
        self._publish(record, bool(comm.host_waiting))
        beats = self._mine.beats if self._mine is not None else 0
        if beats < STABLE_BEATS or (beats > ANALYSE_EVERY and beats % ANALYSE_EVERY):
            return None  # nothing to conclude yet; a long stall is analysed once a second
        report, verdict = self._analyse()
        comm.group_picture = None if verdict else _picture(report, self._ranks)  # a cycle's report says it all
        return verdict

    def _publish(self, record: dict[str, Any], host_waiting: bool) -> None:
        signature = json.dumps([record["ops"], host_waiting], sort_keys=True)
        if self._mine is not None and self._mine.signature == signature:
            self._mine.beats += 1
        else:
            self._mine = _Beat(signature, 1)
            self._store.set(f"{self._key}/record/{self._rank}", json.dumps({**record, "host_waiting": host_waiting}))
        self._store.set(f"{self._key}/beat/{self._rank}", json.dumps([self._mine.beats, host_waiting]))

    def _withdraw(self) -> None:
        if self._mine is not None:
            self._mine = None
            self._store.delete_key(f"{self._key}/beat/{self._rank}")

    def _analyse(self) -> tuple[trace.Report, tuple[tuple[int, ...], str] | None]:
        """The analysis of the stable records, and the verdict on a certain cycle through this rank."""
        from .verify import trace  # the analyser, imported once a stall is analysed, not with the package

        dumps, waiting = [], {}
        for rank in self._ranks:
            beat_key, record_key = f"{self._key}/beat/{rank}", f"{self._key}/record/{rank}"
            if not self._store.check([beat_key]):
                continue  # not stalled, or not yet: it may still post anything
            beats, host_waiting = json.loads(self._store.get(beat_key))
            if beats < STABLE_BEATS:
                continue
            record = json.loads(self._store.get(record_key))
            if record.get("host_waiting") != host_waiting:
                continue  # the record is being replaced
            waiting[rank] = host_waiting
            dumps.append(trace.dump_from_record(record, Path(f"rank{rank}.stall")))
        if self._rank not in waiting:
            return trace.Report([]), None
        report = trace.analyse(dumps)
        for cycle in report.findings("cycle"):
            if self._rank in cycle.ranks and all(waiting.get(r, False) for r in cycle.unposted):
                return report, (cycle.ranks, cycle.text)  # the one deadlock report grammar
        return report, None


def _picture(report: trace.Report, ranks: Sequence[int]) -> str | None:
    """The group as the stalled ranks published it: what each has not posted, and who published
    nothing (computing, or not stalled)."""
    if not report.communicators:
        return None
    c = report.communicators[0]
    lines = [f"the group as its stalled ranks published it ({c.dumps} of {len(ranks)} ranks):"]
    quiet = [r for f in c.findings if f.kind == "missing" for r in f.ranks]
    for f in c.findings:
        if f.kind == "missing":
            continue
        head, *rest = f.text.split("\n")
        lines.append(f"  {f.kind}: {head}")
        lines.extend(f"    {line}" for line in rest)
    if quiet:
        lines.append(f"  ranks {', '.join(map(str, quiet))} published nothing: not stalled (computing, or waiting "
                     "outside this communicator)")
    return "\n".join(lines)
