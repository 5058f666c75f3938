"""Pictures of a run: every op a span on its rank's lane, from posted to completed (or to the end
of the record), with the ops of a wait-for cycle marked.

    write(of_simulation(program, verdict), "hang.json")   # python -m megatron_p2p.check --timeline
    write(of_trace(dumps, report), "hang.png")            # python -m megatron_p2p.trace --timeline

A `.json` file is a Chrome trace (the trace-event format; Perfetto and chrome://tracing open it):
pid is the rank and tid the lane, named by metadata events; each op is a complete ("X") event, in
category "cycle" (coloured "terrible") when it is one of the cycle's blocked ops, "unfinished"
when it never completed, "op" otherwise. A `.png` file is the same timeline drawn with
matplotlib: one row per rank and lane; sends dark and receives light, forward ops (send_next,
recv_prev) blue and backward ones (send_prev, recv_next) green, unfinished ops hatched, the
cycle's ops red, each op named where its bar has room; a legend says so.

The checker's timeline is its simulated rounds (one round drawn as 1 ms in the Chrome trace);
the flight recorder's is wall time from the earliest op posted.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from .program import Program
    from .simulate import Verdict
    from .trace import Dump, Report

FORMATS = (".json", ".png")
ROUND_US = 1000.0  # one simulated round in the Chrome trace, in microseconds
PNG_SIZE = (12.0, 0.5, 2.4, 100)  # width in, height in per row, height in besides the rows, dpi


@dataclass(frozen=True)
class Span:
    """One op on the timeline: `start` and `end` in the timeline's unit; done is False when the
    op never completed (`end` is then the end of the record)."""

    rank: int
    lane: int
    name: str
    start: float
    end: float
    done: bool
    in_cycle: bool
    args: dict[str, Any] = field(default_factory=dict, compare=False)


@dataclass
class Timeline:
    title: str
    unit: str  # "round" or "s"
    end: float
    spans: list[Span]


def _op_name(kind: str, peer: int, label: str) -> str:
    arrow = f"send -> {peer}" if kind == "send" else f"recv <- {peer}"
    return f"{arrow} {label}" if label else arrow


def of_simulation(program: Program, verdict: Verdict, title: str = "") -> Timeline:
    """The simulated rounds of `verdict` (from simulate(program, timeline=True)). An op never
    posted is left out; one posted and never completed runs to the round after the last."""
    if not verdict.timeline and program.num_ops():
        raise ValueError("the verdict holds no timeline: simulate the program with timeline=True")
    end = verdict.rounds + 1
    blocked = {(e.blocked_on.rank, e.blocked_on.call, e.blocked_on.step, e.blocked_on.index): e.waits_for
               for e in verdict.cycle} if verdict.cycle_closed else {}
    spans = []
    for t in verdict.timeline:
        if t.posted is None:
            continue
        ref, op = t.ref, t.ref.op
        key = (ref.rank, ref.call, ref.step, ref.index)
        args = {"kind": op.kind, "slot": op.slot, "bytes": op.bytes, "dtype": op.dtype, "peer": op.peer,
                "message": ref.seq, "call": ref.call, "call_name": ref.call_name, "label": op.label,
                "posted_round": t.posted, "done_round": t.done}
        if key in blocked:
            args["cycle"] = True
            args["waits_for"] = blocked[key]
        done = t.done is not None
        spans.append(Span(ref.rank, op.lane, _op_name(op.kind, op.peer, op.label), float(t.posted),
                          float(t.done if t.done is not None else end), done, key in blocked, args))
    summary = verdict.summary()
    return Timeline(f"{title}: {summary}" if title else summary, "round", float(end), spans)


def of_trace(dumps: Sequence[Dump], report: Report, title: str = "") -> Timeline:
    """The flight recorder's ops of `dumps` (one communicator's), in seconds from the earliest op
    posted; an op not completed runs to its rank's dump. The ops of the report's cycles are marked."""
    ops = [op for d in dumps for op in d.ops]
    if not ops:
        raise ValueError("the dumps hold no ops to draw")
    cycle = {op for f in report.findings("cycle") for op in f.ops}
    t0 = min(op.t_posted for op in ops)
    end = max([d.time for d in dumps] + [op.t_completed or op.t_posted for op in ops]) - t0
    spans = []
    for d in dumps:
        for op in d.ops:
            done = op.t_completed is not None
            stop = (op.t_completed if op.t_completed is not None else max(d.time, op.t_posted)) - t0
            args = {"kind": op.kind, "slot": op.label, "bytes": op.nbytes, "dtype": op.dtype, "peer": op.peer,
                    "message": op.seq, "call": op.call,
                    "call_name": op.call_name, "label": op.label, "state": op.state, "waited": op.waited,
                    "communicator": d.communicator}
            if op in cycle:
                args["cycle"] = True
            spans.append(Span(op.rank, op.lane, _op_name(op.kind, op.peer, op.label), op.t_posted - t0, stop, done,
                              op in cycle, args))
    text = "clean" if report.ok else "; ".join(f.text.split("\n")[0] for f in report.findings())
    return Timeline(f"{title}: {text}" if title else text, "s", end, spans)


# ---- Chrome trace ---------------------------------------------------------------------------------


def chrome_trace(timeline: Timeline) -> dict[str, Any]:
    """The timeline in the trace-event format (JSON object form)."""
    scale = ROUND_US if timeline.unit == "round" else 1e6
    events: list[dict[str, Any]] = []
    rows = sorted({(s.rank, s.lane) for s in timeline.spans})
    for rank in sorted({r for r, _ in rows}):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
    for rank, lane in rows:
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": lane, "args": {"name": f"lane {lane}"}})
    for s in timeline.spans:
        event = {"name": s.name, "cat": "cycle" if s.in_cycle else "op" if s.done else "unfinished", "ph": "X",
                 "ts": s.start * scale, "dur": max(s.end - s.start, 0.0) * scale, "pid": s.rank, "tid": s.lane,
                 "args": s.args}
        if s.in_cycle:
            event["cname"] = "terrible"
        elif not s.done:
            event["cname"] = "bad"
        events.append(event)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"title": timeline.title, "unit": timeline.unit,
                          "note": "one simulated round is drawn as 1 ms" if timeline.unit == "round" else ""}}


# ---- PNG ------------------------------------------------------------------------------------------


def png_size(timeline: Timeline) -> tuple[int, int]:
    """The picture's (width, height) in pixels: a fixed width, a fixed height per row."""
    width, per_row, extra, dpi = PNG_SIZE
    rows = len({(s.rank, s.lane) for s in timeline.spans}) or 1
    return round(width * dpi), round((extra + per_row * rows) * dpi)


def _packed_rows(spans: Sequence[Span], least: float) -> dict[tuple[int, int], list[list[Span]]]:
    """Per (rank, lane), its spans on shelves: overlapping ops (a group's, or ops queued behind
    one another) side by side instead of on top of each other."""
    rows: dict[tuple[int, int], list[list[Span]]] = {}
    for s in sorted(spans, key=lambda s: (s.rank, s.lane, s.start, s.end)):
        shelves = rows.setdefault((s.rank, s.lane), [])
        for shelf in shelves:
            last = shelf[-1]
            if max(last.end, last.start + least) <= s.start:
                shelf.append(s)
                break
        else:
            shelves.append([s])
    return rows


# An op's colour: its direction's hue (forward, backward, or neither: a plain isend/irecv), dark
# for a send and light for a receive; the cycle's ops red whatever they are.
DIRECTIONS = {"send_next": "forward", "recv_prev": "forward", "send_prev": "backward", "recv_next": "backward"}
COLOURS = {("forward", "send"): "#1f77b4", ("forward", "recv"): "#aec7e8",
           ("backward", "send"): "#2ca02c", ("backward", "recv"): "#98df8a",
           ("", "send"): "#7f7f7f", ("", "recv"): "#c7c7c7"}
CYCLE_COLOUR = "#d62728"
LABEL_FONT_PT = 7
ROWS_NOTE = "bars stacked in one row overlap in time: one group's ops, or ops queued behind one another"


def style(s: Span) -> tuple[str, str | None]:
    """The bar's colour and hatch (None: plain; "//": the op never completed)."""
    colour = CYCLE_COLOUR if s.in_cycle else COLOURS[DIRECTIONS.get(s.args["slot"], ""), s.args["kind"]]
    return colour, None if s.done else "//"


def bar_text(s: Span, width_px: float) -> str:
    """What a bar `width_px` pixels wide says: the op's name, or its kind and peer ("S1", "R0"),
    whichever fits; nothing when neither does."""
    per_char = LABEL_FONT_PT * 0.6 * 100 / 72  # about a character's width at 100 dpi
    short = ("S" if s.args["kind"] == "send" else "R") + str(s.args["peer"])
    for text in (s.name, short):
        if len(text) * per_char + 4 <= width_px:
            return text
    return ""


def legend_entries() -> list[tuple[str, str, str | None]]:
    """(label, colour, hatch) of each legend entry."""
    entries: list[tuple[str, str, str | None]] = [
        (f"{'send' if kind == 'send' else 'receive'}, {direction or 'no direction (isend/irecv)'}", colour, None)
        for (direction, kind), colour in COLOURS.items()]
    return entries + [("never completed", "#ffffff", "//"), ("blocked in the wait-for cycle", CYCLE_COLOUR, None)]


def draw_png(timeline: Timeline, path: str | Path) -> None:
    """Draws the timeline with matplotlib's Agg backend."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    width, per_row, extra, dpi = PNG_SIZE
    rows = sorted({(s.rank, s.lane) for s in timeline.spans})
    row_of = {r: i for i, r in enumerate(rows)}
    fig, ax = plt.subplots(figsize=(width, extra + per_row * (len(rows) or 1)), dpi=dpi)
    span_end = timeline.end or 1.0
    px_per_unit = width * dpi * 0.88 / span_end  # the axes' share of the width (subplots_adjust below)
    for (rank, lane), packed in _packed_rows(timeline.spans, span_end * 0.004).items():
        height = 0.8 / len(packed)
        for k, shelf in enumerate(packed):
            y = row_of[rank, lane] - 0.4 + k * height
            for s in shelf:
                length = max(s.end - s.start, span_end * 0.004)
                colour, hatch = style(s)
                ax.broken_barh([(s.start, length)], (y, height), facecolors=colour, edgecolor="black",
                               linewidth=0.5, hatch=hatch, zorder=3 if s.in_cycle else 2)
                text = bar_text(s, length * px_per_unit)
                if text:
                    ax.text(s.start + length / 2, y + height / 2, text, ha="center", va="center",
                            fontsize=LABEL_FONT_PT, clip_on=True, zorder=4,
                            bbox={"facecolor": "white", "alpha": 0.7, "pad": 1, "linewidth": 0})
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {r} lane {lane}" for r, lane in rows])
    ax.invert_yaxis()
    ax.set_xlim(0, span_end)
    ax.set_xlabel("simulated round" if timeline.unit == "round" else "seconds since the first op was posted")
    ax.set_title(timeline.title[:150], fontsize=9)
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(facecolor=colour, hatch=hatch, edgecolor="black", label=label)
                       for label, colour, hatch in legend_entries()],
              loc="upper center", bbox_to_anchor=(0.5, -0.35 / (len(rows) or 1) - 0.12), ncol=4, fontsize=8,
              title=ROWS_NOTE, title_fontsize=8)
    fig.subplots_adjust(left=0.1, right=0.98, top=1 - 0.5 / fig.get_figheight(), bottom=1.6 / fig.get_figheight())
    fig.savefig(str(path), dpi=dpi, format="png")
    plt.close(fig)


def write(timeline: Timeline, path: str | Path) -> None:
    """Writes `path`: a Chrome trace for .json, a picture for .png."""
    problem = check_path(path)
    if problem:
        raise ValueError(problem)
    if Path(path).suffix.lower() == ".json":
        Path(path).write_text(json.dumps(chrome_trace(timeline)), encoding="utf-8")
    else:
        draw_png(timeline, path)


def check_path(path: str | Path) -> str | None:
    """Why `path` cannot take a timeline, or None (checked before any work is done)."""
    if Path(path).suffix.lower() not in FORMATS:
        return f"--timeline {path}: the file must end in .json (Chrome trace) or .png (picture)"
    if Path(path).suffix.lower() == ".png":
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return f"--timeline {path}: drawing a .png needs matplotlib (pip install matplotlib); a .json needs nothing"
    return None
