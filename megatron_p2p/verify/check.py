"""Offline verdicts on programs: does every rank's sequence of calls complete, deadlock, or pair
messages whose bytes or dtype disagree?

    python -m megatron_p2p.check [--json] [--serialize-lanes] [--timeline FILE.json|FILE.png] FILE...
    python -m megatron_p2p.check --schedule {1f1b,interleaved} --pp N [--vpp V] [--microbatches M]
           [--mode {parity,batched}] [--lanes {1,2}] [--overlap] [--variable-seq-lengths]
           [--eager BYTES] [--dump FILE] [--serialize-lanes] [--timeline FILE.json|FILE.png]
    python -m megatron_p2p.check --schedule torch:NAME --pp N [--microbatches M] [--stages-per-rank S]
           [--defer-pp-recv] [--first-step {none,vote,metadata}] [--lazy-comms] [--eager BYTES] [--dump FILE]
           [--timeline FILE.json|FILE.png]
    python -m megatron_p2p.check --grid [--reduced] [--family {all,megatron,torch}] [--jobs N] [--serialize-lanes]

Prints a verdict per file or schedule: OK with the rounds on the critical path, DEADLOCK with
the wait-for cycle (ranks, ops, labels), MISMATCH with the first disagreeing pair. --json prints
one object per line instead. --serialize-lanes runs each rank's steps of all lanes in one queue
in issue order (the worst case NCCL allows for communicators sharing a device); messages still
pair per lane. --timeline draws the simulated rounds of one program (a FILE or --schedule) as a
Chrome trace (.json) or a picture (.png), the cycle's ops marked. Exit status: 0 all OK, 1 otherwise,
2 for a usage error or a file that cannot be
read or is not a valid program.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TextIO

from ._cli import tool_parser, wrote
from .program import LANES, MODES, ProgramError, dumps, load
from .simulate import Verdict, simulate

if TYPE_CHECKING:
    from typing import TypeAlias

    from .program import Program

    # A grid or --schedule config: generate()'s keyword arguments plus "schedule" and "pp" (JSON-like).
    Config: TypeAlias = dict[str, Any]
    Result: TypeAlias = tuple[Config, str, str, int]  # (config, verdict, summary, ops)

TORCH_PREFIX = "torch:"
PP_BANDS = ((1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 32), (33, 64))
_SHAPE_KEYS = ("mode", "lanes", "eager_threshold")


def _record(verdict: Verdict, **where: Any) -> dict[str, Any]:
    return {**where, "verdict": verdict.verdict, "ranks": verdict.ranks, "rounds": verdict.rounds,
            "serialize_lanes": verdict.serialize_lanes, "detail": verdict.detail()}


def _simulate(program: Any, serialize_lanes: bool, timeline_path: str | None, title: str) -> Verdict:
    """The verdict on `program`; with timeline_path, its simulated rounds drawn there too."""
    verdict = simulate(program, serialize_lanes=serialize_lanes, timeline=timeline_path is not None)
    if timeline_path is not None:
        from . import timeline

        timeline.write(timeline.of_simulation(program, verdict, title), timeline_path)
        wrote("check", timeline_path)
    return verdict


def check_files(paths: Sequence[str], as_json: bool, serialize_lanes: bool = False,
                timeline_path: str | None = None) -> int:
    """Prints one verdict per file; returns the exit status."""
    status = 0
    for path in paths:
        try:
            program = load(path)
        except OSError as e:
            print(f"{path}: cannot read: {e.strerror or e}", file=sys.stderr)
            status = 2
            continue
        except ProgramError as e:
            print(f"error: {e}", file=sys.stderr)
            status = 2
            continue
        verdict = _simulate(program, serialize_lanes, timeline_path, path)
        if as_json:
            print(json.dumps(_record(verdict, file=path)))
        else:
            text = verdict.summary() if verdict.ok else verdict.detail()
            print(f"{path}: {text}")
        if not verdict.ok and status == 0:
            status = 1
    return status


def _describe(config: Config) -> str:
    parts = [config["schedule"], f"pp={config['pp']}"]
    for key in ("vpp", "microbatches", "stages_per_rank", "mode", "lanes"):
        if config.get(key) is not None:
            parts.append(f"{key}={config[key]}")
    if config.get("first_step", "none") != "none":
        parts.append(f"first_step={config['first_step']}")
    if config.get("executor", "runtime") != "runtime":
        parts.append(f"executor={config['executor']}")
    for key in ("overlap", "variable_seq_lengths", "defer_pp_recv", "lazy_comms"):
        if config.get(key):
            parts.append(key)
    if config.get("eager_threshold"):
        parts.append(f"eager={config['eager_threshold']}")
    return " ".join(parts)


def _generate(config: Config) -> Program:
    """The program of one grid or --schedule config: megatron-core's, or torch's (torch:NAME)."""
    kwargs = {k: v for k, v in config.items() if k not in ("schedule", "pp", "skip")}
    if config["schedule"].startswith(TORCH_PREFIX):
        from .torch_schedules import generate as torch_generate

        return torch_generate(config["schedule"][len(TORCH_PREFIX):], config["pp"], **kwargs)
    from .schedules import generate

    return generate(config["schedule"], config["pp"], **kwargs)


def check_schedule(config: Config, as_json: bool, dump: str | None, serialize_lanes: bool = False,
                   timeline_path: str | None = None) -> int:
    """Generates one schedule (megatron-core's or torch's), checks it, optionally writes its
    program file (and its timeline)."""
    try:
        program = _generate(config)
    except (ValueError, ProgramError) as e:
        print(f"error: {_describe(config)}: {e}", file=sys.stderr)
        return 2
    if dump:
        try:
            with open(dump, "w", encoding="utf-8") as f:
                f.write(dumps(program))
        except OSError as e:
            print(f"error: cannot write {dump}: {e.strerror or e}", file=sys.stderr)
            return 2
        wrote("check", dump)
    verdict = _simulate(program, serialize_lanes, timeline_path, _describe(config))
    if as_json:
        print(json.dumps(_record(verdict, schedule=config, file=dump)))
    else:
        print(f"{_describe(config)}: {verdict.summary() if verdict.ok else verdict.detail()}")
    return 0 if verdict.ok else 1


# ---- the grid -------------------------------------------------------------------------------------

def _run_group(work: tuple[list[Config], bool]) -> list[Result]:
    """Worker: (config, verdict, summary, ops) for configs sharing one schedule shape, with
    lanes serialized or not."""
    configs, serialize_lanes = work
    out: list[Result] = []
    for config in configs:
        try:
            program = _generate(config)
        except ValueError as e:  # torch refuses it: found only by building the schedule
            out.append(({**config, "skip": str(e)}, "skip", str(e), 0))
            continue
        verdict = simulate(program, details=False, serialize_lanes=serialize_lanes)
        out.append((config, verdict.verdict, verdict.summary(), program.num_ops()))
    return out


_LEGEND = ("columns: 1f1b / intl = interleaved, +ov = overlap_p2p_comm, +var = variable_seq_lengths; "
           "par / bat = parity / batched mode; 1L / 2L = lanes")


def _column(config: Config) -> str:
    schedule: str = config["schedule"]
    name = {"interleaved": "intl"}.get(schedule, schedule)
    name += ("+ov" if config.get("overlap") else "") + ("+var" if config.get("variable_seq_lengths") else "")
    return f"{name} {config.get('mode', 'parity')[:3]} {config.get('lanes', 2)}L"


def _band(pp: int) -> str:
    for low, high in PP_BANDS:
        if low <= pp <= high:
            return f"pp {low}" if low == high else f"pp {low}-{high}"
    return f"pp {pp}"


FAMILIES = ("all", "megatron", "torch")


def _grid_configs(full: bool, family: str) -> list[Config]:
    from . import schedules, torch_schedules

    return ((schedules.grid_configs(full) if family != "torch" else [])
            + (torch_schedules.grid_configs(full) if family != "megatron" else []))


def grid_results(full: bool = True, jobs: int = 1, serialize_lanes: bool = False,
                 family: str = "megatron", progress_to: TextIO | None = None) -> list[Result]:
    """(config, verdict, summary, ops) for every config of the grid megatron-core accepts
    (family "megatron"), of torch's rows ("torch": verdict "skip" where torch refuses the
    configuration), or both ("all"); serialize_lanes: each rank's lanes run in one queue in
    issue order; progress_to: a terminal to show the progress on."""
    groups: dict[tuple[tuple[str, Any], ...], list[Config]] = defaultdict(list)
    for c in _grid_configs(full, family):
        if "skip" not in c:  # torch's rows share their action lists across defer and eager
            shape = (_SHAPE_KEYS + ("defer_pp_recv",)) if c["schedule"].startswith(TORCH_PREFIX) else _SHAPE_KEYS
            groups[tuple(sorted((k, v) for k, v in c.items() if k not in shape))].append(c)
    # Largest first, so the last job to finish is a small one.
    ordered = sorted(groups.values(), key=lambda g: -g[0]["pp"] * g[0].get("vpp", 1) * (g[0].get("microbatches") or 0))
    work = [(group, serialize_lanes) for group in ordered]
    results: list[Result] = []
    total = sum(len(group) for group in ordered)
    if jobs > 1:
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            for part in pool.imap_unordered(_run_group, work):
                results.extend(part)
                progress(len(results), total, progress_to)
    else:
        for group in work:
            results.extend(_run_group(group))
            progress(len(results), total, progress_to)
    progress(None, total, progress_to)
    return results


def progress(done: int | None, total: int, stream: TextIO | None) -> None:
    """The grid's progress, rewritten in place on `stream` when it is a terminal; nothing when it
    is not (a log or a pipe gets the result lines only). done None: the line is cleared."""
    if stream is None or not stream.isatty():
        return
    stream.write("\r\033[K" if done is None else f"\rgrid: {done} of {total} configs checked")
    stream.flush()


def run_grid(full: bool, jobs: int, as_json: bool, serialize_lanes: bool = False, family: str = "all") -> int:
    """Checks every config of the grid over `jobs` processes and prints a table (megatron-core's)
    and torch's rows. Exit status 1 when a megatron-core config or a torch config without
    defer_pp_recv fails (defer_pp_recv's failures are what the torch table shows)."""
    start = time.perf_counter()
    skipped = [c for c in _grid_configs(full, family) if "skip" in c]
    everything = grid_results(full, jobs, serialize_lanes, family, progress_to=sys.stderr)
    elapsed = time.perf_counter() - start
    refused = [r for r in everything if r[1] == "skip"]
    results = [r for r in everything if r[1] != "skip"]
    mcore = [r for r in results if not r[0]["schedule"].startswith(TORCH_PREFIX)]
    torch_rows = [r for r in results if r[0]["schedule"].startswith(TORCH_PREFIX)]
    failures = [r for r in results if r[1] != "ok" and not r[0].get("defer_pp_recv")]
    if as_json:
        for config, verdict, summary, _ in sorted(results, key=lambda r: _describe(r[0])):
            print(json.dumps({"schedule": config, "verdict": verdict, "serialize_lanes": serialize_lanes,
                              "detail": summary}))
    else:
        if mcore:
            print(_table(mcore, skipped))
        if torch_rows:
            print(_torch_table(torch_rows, refused))
        for config, _verdict, summary, _ in sorted(failures, key=lambda r: _describe(r[0]))[:40]:
            print(f"  {_describe(config)}: {summary}")
    counts: defaultdict[str, int] = defaultdict(int)
    for r in results:
        counts[r[1]] += 1
    total = (f"grid: {len(results)} configs checked ({sum(r[3] for r in results):,} ops), "
             f"{counts['ok']} OK, {counts['deadlock']} DEADLOCK, {counts['mismatch']} MISMATCH, "
             f"{len(skipped)} refused by megatron-core, {len(refused)} by torch; {elapsed:.0f} s on {jobs} process(es)"
             + ("; lanes serialized in issue order" if serialize_lanes else ""))
    print(total, file=sys.stderr if as_json else sys.stdout)
    return 0 if not failures else 1


def _table(results: list[Result], skipped: list[Config]) -> str:
    columns = sorted({_column(r[0]) for r in results})
    bands = [_band(low) for low, _ in PP_BANDS]
    cells: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for config, verdict, _, _ in results:
        cell = cells[_band(config["pp"]), _column(config)]
        cell[0] += 1
        cell[1] += verdict != "ok"
    width = max(len(c) for c in columns) if columns else 8
    head = f"{'':9}" + "".join(f" {c:>{width}}" for c in columns)
    lines = [head]
    for band in bands:
        row = []
        for column in columns:
            n, bad = cells.get((band, column), (0, 0))
            row.append("-" if n == 0 else f"all {n} OK" if bad == 0 else f"{bad}/{n} FAIL")
        if any(x != "-" for x in row):
            lines.append(f"{band:9}" + "".join(f" {x:>{width}}" for x in row))
    if skipped:
        lines.append(f"{len(skipped)} configs megatron-core refuses are left out (e.g. {skipped[0]['skip']})")
    lines.append(_LEGEND)
    return "\n".join(lines)


def _torch_variant(config: Config) -> str:
    name: str = config["schedule"][len(TORCH_PREFIX):]
    if not config.get("defer_pp_recv"):
        return name
    return name + (" +defer buffered" if config.get("eager_threshold") else " +defer")


def _torch_table(results: list[Result], refused: list[Result]) -> str:
    """Rows: torch class (with defer_pp_recv, under strict rendezvous and with every send
    buffered); columns: pp ranges; a cell counts the verdicts of its configs."""
    from .torch_schedules import NAMES

    order = {n: i for i, n in enumerate(NAMES)}
    rows = sorted({_torch_variant(r[0]) for r in results},
                  key=lambda v: (order[v.split()[0]], v))
    bands = [_band(low) for low, _ in PP_BANDS if low >= 2 and any(low <= r[0]["pp"] for r in results)]
    bands = [b for b in bands if any(_band(r[0]["pp"]) == b for r in results)]
    cells: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for config, verdict, _, _ in results:
        cells[_torch_variant(config), _band(config["pp"])][verdict] += 1
    def text(c: dict[str, int]) -> str:
        n = sum(c.values())
        if not n:
            return "-"
        if c["ok"] == n:
            return f"all {n} OK"
        return " ".join(f"{c[v]}{v[0].upper()}" for v in ("ok", "deadlock", "mismatch") if c[v]) + f" /{n}"
    width = max([len(text(c)) for c in cells.values()] + [len(b) for b in bands])
    name_width = max(len(r) for r in rows)
    lines = [f"{'torch.distributed.pipelining':{name_width}}" + "".join(f" {b:>{width}}" for b in bands)]
    for row in rows:
        lines.append(f"{row:{name_width}}" + "".join(f" {text(cells[row, b]):>{width}}" for b in bands))
    if refused:
        lines.append(f"{len(refused)} configs torch refuses are left out (e.g. {refused[0][2]})")
    lines.append("cells: O = OK, D = DEADLOCK, M = MISMATCH; +defer = defer_pp_recv under strict rendezvous, "
                 "+defer buffered = the same with every send buffered (eager)")
    return "\n".join(lines)


# ---- command line ---------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    p = tool_parser("check", __doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="*", metavar="FILE", help="program files (megatron_p2p.program/1 JSON)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--schedule", metavar="{1f1b,interleaved,torch:NAME}",
                   help="check a megatron-core schedule, or torch.distributed.pipelining's NAME (GPipe, 1F1B, "
                        "LoopedBFS, Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV)")
    p.add_argument("--pp", type=int, help="pipeline ranks (with --schedule)")
    p.add_argument("--vpp", type=int, default=1, help="virtual stages per rank (interleaved)")
    p.add_argument("--microbatches", type=int, help="microbatches (default 2 * pp)")
    p.add_argument("--mode", choices=MODES, default=MODES[0])
    p.add_argument("--lanes", type=int, choices=LANES, default=max(LANES))
    p.add_argument("--overlap", action="store_true", help="overlap_p2p_comm (interleaved)")
    p.add_argument("--variable-seq-lengths", action="store_true", help="with the shape round before each exchange")
    p.add_argument("--eager", type=int, default=0, metavar="BYTES",
                   help="eager threshold: sends up to BYTES complete before their receive is posted (default 0: "
                        "strict rendezvous, as P2PCommunicator's communicators)")
    p.add_argument("--stages-per-rank", type=int, default=None, metavar="S",
                   help="torch: stages per rank (default 1 for GPipe and 1F1B, else 2)")
    p.add_argument("--defer-pp-recv", action="store_true", help="torch: the runtime schedules' defer_pp_recv=True")
    p.add_argument("--first-step", choices=("none", "vote", "metadata"), default="none",
                   help="torch: prepend the first step's vote, or the vote and the metadata round")
    p.add_argument("--lazy-comms", action="store_true",
                   help="torch: NCCL's lazy communicators: single ops on lane 1 (pair), batched ops on lane 0 (group)")
    p.add_argument("--executor", choices=("runtime", "multi"), default="runtime",
                   help="torch: the runtime schedules' executor, or the older PipelineScheduleMulti loop")
    p.add_argument("--dump", metavar="FILE", help="write the generated program to FILE")
    p.add_argument("--grid", action="store_true", help="check the whole grid of schedules and print a table")
    p.add_argument("--reduced", action="store_true", help="with --grid: the small grid the test suite runs")
    p.add_argument("--family", choices=FAMILIES, default="all",
                   help="with --grid: megatron-core's schedules, torch's, or both (default)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes for --grid (default: all CPUs)")
    p.add_argument("--serialize-lanes", action="store_true",
                   help="run each rank's steps of all lanes in one queue in issue order (the worst case NCCL allows "
                        "for communicators sharing a device); messages still pair per lane")
    p.add_argument("--timeline", metavar="FILE", help="draw one program's simulated rounds: a Chrome trace (FILE.json, "
                   "for Perfetto) or a picture (FILE.png)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    modes = sum(bool(x) for x in (args.files, args.schedule, args.grid))
    if modes != 1:
        parser.error("give program FILEs, or --schedule, or --grid (exactly one of them)")
    if (args.reduced or args.family != "all") and not args.grid:
        parser.error("--reduced and --family go with --grid")
    if args.schedule is None and (args.pp is not None or args.dump or args.overlap or args.variable_seq_lengths):
        parser.error("--pp, --dump, --overlap and --variable-seq-lengths go with --schedule")
    if args.timeline:
        from .timeline import check_path

        problem = check_path(args.timeline)
        if problem:
            parser.error(problem)
        if args.grid or len(args.files) > 1:
            parser.error("--timeline draws one program: give one FILE or --schedule")
    if args.grid:
        if args.jobs < 1:
            parser.error("--jobs must be at least 1")
        return run_grid(not args.reduced, args.jobs, args.json, args.serialize_lanes, args.family)
    torch_only = (args.stages_per_rank is not None or args.defer_pp_recv or args.first_step != "none"
                  or args.lazy_comms or args.executor != "runtime")
    if args.schedule:
        if args.pp is None:
            parser.error("--schedule needs --pp")
        if args.schedule.startswith(TORCH_PREFIX):
            from .torch_schedules import NAMES

            name = args.schedule[len(TORCH_PREFIX):]
            if name not in NAMES:
                parser.error(f"--schedule torch:NAME: NAME must be one of {', '.join(NAMES)}, got {name!r}")
            if args.vpp != 1 or args.overlap or args.variable_seq_lengths:
                parser.error("--vpp, --overlap and --variable-seq-lengths are megatron-core's; torch's schedules "
                             "take --stages-per-rank")
            config = {"schedule": args.schedule, "pp": args.pp, "microbatches": args.microbatches,
                      "stages_per_rank": args.stages_per_rank, "defer_pp_recv": args.defer_pp_recv,
                      "first_step": args.first_step, "lazy_comms": args.lazy_comms,
                      "eager_threshold": args.eager, "executor": args.executor}
            return check_schedule(config, args.json, args.dump, args.serialize_lanes, args.timeline)
        if args.schedule not in ("1f1b", "interleaved"):
            parser.error(f"--schedule must be 1f1b, interleaved or torch:NAME, got {args.schedule!r}")
        if torch_only:
            parser.error("--stages-per-rank, --defer-pp-recv, --first-step, --lazy-comms and --executor go with "
                         "torch:NAME")
        config = {"schedule": args.schedule, "pp": args.pp, "vpp": args.vpp, "microbatches": args.microbatches,
                  "mode": args.mode, "lanes": args.lanes, "overlap": args.overlap,
                  "variable_seq_lengths": args.variable_seq_lengths, "eager_threshold": args.eager}
        return check_schedule(config, args.json, args.dump, args.serialize_lanes, args.timeline)
    return check_files(args.files, args.json, args.serialize_lanes, args.timeline)


if __name__ == "__main__":
    sys.exit(main())
