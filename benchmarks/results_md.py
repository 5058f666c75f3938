"""Writes benchmarks/RESULTS.md from a full run's JSON: how to reproduce, the machine, the
goal lines, the headline figures before and after issue 11, the tables and the plots (copied
beside it, so they can be committed).

The "before" figures are benchmarks/before.json: the tables of the RESULTS.md that `make bench`
generated before issue 11, one run, each figure measured once (its "about" key describes the
schema). The "after" column is this run's median [min-max] over its repetitions."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import goals
import tables
from timing import human_bytes, ranged

BEFORE = Path(__file__).resolve().parent / "before.json"
NOT_MEASURED = "not measured in this run"
# Sections of RESULTS.md written by other benchmarks, by hand from their output: kept as they are
# when this file is rewritten (placed before the plots).
CARRIED = ("## Host cost per exchange on the NCCL path (model)",
           "## torch.distributed.pipelining: Interleaved1F1B step",
           "## On a GPU: one H200, NCCL 2.28.9")


def carried_sections(md_path: Path) -> str:
    """The CARRIED sections of the RESULTS.md at `md_path` (each up to the next "## "), or ""."""
    if not md_path.exists():
        return ""
    kept, keep = [], False
    for line in md_path.read_text().splitlines(keepends=True):
        if line.startswith("## "):
            keep = line.rstrip() in CARRIED
        if keep:
            kept.append(line)
    text = "".join(kept).rstrip()
    return text + "\n\n" if text else ""


def _bandwidth_rows(results: dict, before: dict) -> list[list[str]]:
    bw = results["bandwidth"]
    old = before["bandwidth_gbps"]
    rows = []
    for pattern, what in (("one_way", "one-way"), ("exchange", "exchange")):
        after = {p["bytes"]: p["of_memcpy"] for p in bw[pattern]}
        for size in sorted(int(b) for b in old[pattern]):
            was = f"{old[pattern][str(size)] / old['memcpy'][str(size)]:.2f}"
            now = after.get(size)
            figure = f"bandwidth {what} {human_bytes(size)}, of memcpy"
            rows.append([f"{figure}, plain receive buffers (CMA)", was,
                         tables.spread_text(now["megatron_p2p"]) if now else NOT_MEASURED])
            if bw["arena"]["available"]:
                rows.append([f"{figure}, arena receive buffers (comm.empty)", "no arena",
                             tables.spread_text(now["megatron_p2p_arena"]) if now else NOT_MEASURED])
    return rows


def _step_rows(results: dict, before: dict) -> list[list[str]]:
    after = {p["pp"]: goals.step_ratios(p) for p in results["pipeline"] if p["bytes"] == 8 << 20}
    rows = []
    for pp, ms in sorted(before["step_ms_8mib"].items(), key=lambda kv: int(kv[0])):
        was = min(ms[s] for s in goals.STOCK) / max(ms[o] for o in goals.OURS)
        now = after.get(int(pp))
        rows.append([f"1F1B step at 8 MiB, pp {pp}: faster stock / slower megatron_p2p", f"{was:.2f}x",
                     f"{ranged(now)}x" if now else NOT_MEASURED])
    return rows


def _overhead_rows(results: dict, before: dict) -> list[list[str]]:
    old = before["host_overhead_cpu_us"]
    reps = results["overhead_repeats"]
    ratios = [goals.overhead_ratio(r) for r in reps]
    rows = [["host overhead: megatron_p2p / torch.distributed isend+irecv x4 (CPU time to post)",
             f"{old['megatron_p2p'] / old['torch_isend_irecv']:.3f}", ranged(ratios, ".3f")]]
    null = [goals.binding_layer_us(r) for r in reps]
    rows.append(["binding layer: null transport, CPU us per four-op exchange", "not measured",
                 NOT_MEASURED if None in null else ranged(null)])
    return rows


def _latency_rows(results: dict, before: dict) -> list[list[str]]:
    after = {p["bytes"]: i for i, p in enumerate(results["latency_repeats"][0])}
    rows = []
    for size, old in sorted(before["latency_us"].items(), key=lambda kv: int(kv[0])):
        i = after.get(int(size))
        now = NOT_MEASURED
        if i is not None:
            us = [r[i]["us"]["megatron_p2p"] for r in results["latency_repeats"]]
            now = f"{ranged([u['median_us'] for u in us])} / {ranged([u['p99_us'] for u in us], '.1f')}"
        rows.append([f"latency {human_bytes(int(size))}, median / p99 (us)",
                     f"{old['median']:.2f} / {old['p99']:.1f}", now])
    return rows


def before_after(results: dict, before: dict) -> str:
    """The headline figures of `before` (before.json) beside this run's."""
    rows = (_bandwidth_rows(results, before) + _step_rows(results, before) + _overhead_rows(results, before) +
            _latency_rows(results, before))
    header = ["figure", f"before (commit {before['measured_at'][:7]}, {before['repeats']} run)",
              f"after: median [min-max] of {results['repeats']} repetitions"]
    return tables.markdown_table(header, rows)


def write(results: dict, plots: list[Path], md_path: Path, figures: Path) -> None:
    figures.mkdir(parents=True, exist_ok=True)
    images = []
    for png in plots:
        shutil.copyfile(png, figures / png.name)
        images.append(f"![{png.stem}]({os.path.relpath(figures / png.name, md_path.parent)})")
    m = results["machine"]
    before = json.loads(BEFORE.read_text())
    carried = carried_sections(md_path)
    text = f"""# Benchmark results

Generated by `make bench` (benchmarks/run.py) from `benchmarks/results/results.json`; do not
edit by hand. Every figure was measured in the same run as its baseline, each job launched
with torchrun, and repeated {results['repeats']} times: figures read median [min-max] over the
repetitions, and a goal's ratio is the median of the per-repetition ratios.

## Reproduce

```sh
make bench         # the full suite, under 10 minutes; rewrites this file and benchmarks/figures/
make bench-quick   # a reduced sweep in under a minute, into benchmarks/results/quick/
.venv/bin/python benchmarks/run.py --repeats 9   # more repetitions (the run's time grows with them)
```

Timings on a shared machine are noisy: run on an otherwise idle one. The baselines (memcpy,
gloo, the stock algorithm) are measured beside each figure, in the same processes, so a burst
of load hits both; the spread shows how much the repetitions disagree.

## Machine

| | |
|---|---|
| CPU | {m['cpu_model']} ({m['cores']} cores, {m['usable_cores']} usable) |
| memory | {m['memory_gib']} GiB |
| kernel | {m['kernel']} |
| Python / torch | {m['python']} / {m['torch']} |
| megatron-core | {m['megatron_core'] or 'not installed'} |
| package commit | {m['commit']} |
| load average at start | {' '.join(f'{x:.2f}' for x in m['load_average'])} |
| package environment | {', '.join(f'{k}={v}' for k, v in m.get('package_env', {}).items()) or 'none set'} |
| run took | {results['duration_s']:.0f} s |

## Goals

```
{chr(10).join(goals.summary_line(g) for g in results['goals'])}
```

Why a goal is missed, with the profiles that show where the time goes: [PROFILE.md](PROFILE.md).

## Before / after

The headline figures before issue 11 ({BEFORE.name}: the full run this file held then, each
figure measured once, against a memcpy measured once per size) and in this run.

{before_after(results, before)}

## Tables

{tables.all_tables(results)}

{carried}## Plots

{chr(10).join(images)}
"""
    md_path.write_text(text)
