"""The benchmark suite's driver: runs the torchrun jobs (each with a wall-clock limit), then
assembles one JSON with every figure and the machine, the PNG plots, the printed tables and
one summary line per goal.

    .venv/bin/python benchmarks/run.py                 # full suite into benchmarks/results/
    .venv/bin/python benchmarks/run.py --quick         # reduced sweep into benchmarks/results/quick/
    .venv/bin/python benchmarks/run.py --results-md benchmarks/RESULTS.md   # and rewrite RESULTS.md
    .venv/bin/python benchmarks/run.py --repeats 3     # each figure 3 times instead of 5

Every figure is measured `--repeats` times, each time beside its baseline; the JSON keeps every
repetition, and the tables and goal lines give the median with its spread (min-max).
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import goals  # noqa: E402
import launch  # noqa: E402
import machine  # noqa: E402
import plots  # noqa: E402
import results_md  # noqa: E402
import tables  # noqa: E402
from timing import combine_repeats  # noqa: E402

MiB = 1 << 20
ACT_8MIB = {"shape": [2048, 1, 1024], "dtype": "float32"}
ACT_32MIB = {"shape": [4096, 1, 4096], "dtype": "bfloat16"}


def plan(quick: bool, repeats: int) -> tuple[list[dict], float]:
    """The jobs of a run (name, ranks, sections, limit) and the whole run's limit in seconds. A
    section runs on its first `ranks` ranks (pipeline: on each of `pp`), the others waiting.
    The counts below are per repetition: a run's time grows with `repeats`."""
    if quick:  # one job: every torchrun start costs each rank its imports
        sections = {
            "latency": {"ranks": 2, "sizes": [0, 8, 1024, 64 * 1024], "iterations": 40, "warmup": 8},
            "overhead": {"ranks": 2, "bytes": 64 * 1024, "iterations": 20, "rounds": 1},
            "bandwidth": {"ranks": 2, "sizes": [64 * 1024, MiB, 16 * MiB], "target_bytes": 16 * MiB,
                          "min_reps": 1, "max_reps": 32},
            "pipeline": {"pp": [2, 4], "activations": [ACT_8MIB], "steps": 2, "warmup": 1},
        }
        jobs = [{"name": "all", "ranks": 4, "sections": sections, "limit": 55}]
        run_limit = 58.0
    else:
        pipeline = {"activations": [ACT_8MIB, ACT_32MIB], "steps": 8, "warmup": 1}
        pair = {
            "latency": {"ranks": 2, "sizes": [0, 8, 1024, 64 * 1024], "iterations": 800, "warmup": 40},
            "overhead": {"ranks": 2, "bytes": 64 * 1024, "iterations": 200, "rounds": 1},
            "bandwidth": {"ranks": 2, "sizes": [64 * 1024 << (2 * i) for i in range(7)], "target_bytes": 256 * MiB,
                          "min_reps": 1, "max_reps": 1000},
            "pipeline": dict(pipeline, pp=[2]),
        }
        jobs = [{"name": "pair", "ranks": 2, "sections": pair, "limit": 300},
                {"name": "pp4", "ranks": 4, "sections": {"pipeline": dict(pipeline, pp=[4])}, "limit": 200},
                {"name": "pp8", "ranks": 8,
                 "sections": {"pipeline": dict(pipeline, pp=[8], activations=[ACT_8MIB])}, "limit": 120}]
        run_limit = 590.0
    for job in jobs:
        for cfg in job["sections"].values():
            cfg["repeats"] = repeats
    return jobs, run_limit


def assemble(job_results: dict[str, dict]) -> dict:
    """One result from the jobs' own: latency and overhead as the median of each figure over
    their repetitions, beside the repetitions themselves (`latency_repeats`, `overhead_repeats`)."""
    pair = next(r for r in job_results.values() if "latency" in r)
    points = [p for r in job_results.values() for p in r.get("pipeline", [])]
    points.sort(key=lambda p: (p["bytes"], p["pp"]))
    oversub = [{"ranks": p["pp"], "bytes": p["bytes"], "step_ms": p["step_ms"], "rounds_ms": p["rounds_ms"]}
               for p in points if p["bytes"] == 8 * MiB]
    return {"latency": combine_repeats(pair["latency"]), "latency_repeats": pair["latency"],
            "overhead": combine_repeats(pair["overhead"]), "overhead_repeats": pair["overhead"],
            "bandwidth": pair["bandwidth"], "pipeline": points, "oversubscription": oversub, "stock": pair["stock"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="reduced sweep, under a minute")
    parser.add_argument("--repeats", type=int, default=5,
                        help="repetitions of every figure; goals take the median ratio (default 5)")
    parser.add_argument("--out", type=Path, help="output directory (default benchmarks/results[/quick])")
    parser.add_argument("--results-md", type=Path, help="also rewrite this RESULTS.md, plots beside it in figures/")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    out = args.out or HERE / "results" / ("quick" if args.quick else "")
    out.mkdir(parents=True, exist_ok=True)

    started = time.monotonic()
    report = {"schema": 2, "kind": "quick" if args.quick else "full", "repeats": args.repeats,
              "spread": "min-max over the repetitions",
              "started_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "machine": machine.describe(), "jobs": [], "complete": False}
    jobs, run_limit = plan(args.quick, args.repeats)
    job_results = {}
    for job in jobs:
        left = run_limit - (time.monotonic() - started)
        print(f"== job {job['name']}: {job['ranks']} ranks, sections {', '.join(job['sections'])}", flush=True)
        res = launch.run_job(job["name"], job["ranks"], {"sections": job["sections"], "timeout": 120},
                             out, min(job["limit"], max(left, 1.0)))
        report["jobs"].append({"name": res.name, "ranks": res.ranks, "returncode": res.returncode,
                               "seconds": round(res.seconds, 2), "timed_out": res.timed_out})
        if res.returncode != 0 or res.result is None:
            why = "passed its wall-clock limit" if res.timed_out else f"exited with status {res.returncode}"
            print(f"FAILED: job {res.name} {why}; no results assembled", flush=True)
            report["duration_s"] = time.monotonic() - started
            (out / "results.json").write_text(json.dumps(report, indent=1))
            return 1
        job_results[res.name] = res.result

    report.update(assemble(job_results))
    report["goals"] = goals.evaluate(report)
    report["duration_s"] = time.monotonic() - started
    report["complete"] = True
    png = plots.write_all(report, out)
    (out / "results.json").write_text(json.dumps(report, indent=1))

    print("\n" + tables.all_tables(report) + "\n")
    print(f"stock algorithm: {report['stock']['kind']} ({report['stock']['what']})")
    for goal in report["goals"]:
        print(goals.summary_line(goal))
    print(f"results: {out / 'results.json'}; plots: {', '.join(p.name for p in png)}; "
          f"{report['duration_s']:.0f} s in all", flush=True)
    if args.results_md:
        results_md.write(report, png, args.results_md, args.results_md.parent / "figures")
        print(f"rewrote {args.results_md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
