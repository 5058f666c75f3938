"""The printed tables (Markdown, so RESULTS.md can hold them as they are). A repeated figure
reads "median [min-max]" over the repetitions."""
from __future__ import annotations

from typing import Any

import goals
from timing import human_bytes, ranged

NAMES = {
    "megatron_p2p": "megatron_p2p shm",
    "megatron_p2p_arena": "megatron_p2p shm, arena buffers",
    "megatron_p2p_pinned": "megatron_p2p shm, pinned",
    "python_floor": "Python call floor (null transport)",
    "c_floor": "C floor",
    "c_floor_pinned": "C floor, pinned",
    "gloo_isend_irecv": "gloo isend/irecv",
    "gloo_batch_isend_irecv": "gloo batch_isend_irecv",
    "torch_isend_irecv": "torch.distributed isend/irecv x4",
    "torch_batch_isend_irecv": "torch.distributed batch_isend_irecv",
    "megatron_p2p_parity": "megatron_p2p parity",
    "megatron_p2p_batched": "megatron_p2p batched",
    "stock_gloo_batched": "stock batched (gloo)",
    "stock_gloo_p2p_ops": "stock _p2p_ops (gloo)",
}


def name(contender: str) -> str:
    """A contender's name in tables and plots (one a section adds later reads as its key)."""
    return NAMES.get(contender, contender)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def latency(repeats: list[list[dict]]) -> str:
    contenders = list(repeats[0][0]["us"])
    rows = []
    for i, p in enumerate(repeats[0]):
        reps: list[dict[str, Any]] = [r[i]["us"] for r in repeats]

        def of(c: str, figure: str, reps=reps) -> list[float]:
            return [u[c][figure] for u in reps]

        gloo_ratio = [goals.gloo_over_ours(u) for u in reps]
        rows.append([human_bytes(p["bytes"])] +
                    [f"{ranged(of(c, 'median_us'))} / {ranged(of(c, 'p99_us'), '.1f')}" for c in contenders] +
                    [f"{ranged(gloo_ratio, '.1f')}x"])
    return markdown_table(["size"] + [f"{name(c)} median / p99 (us)" for c in contenders] + ["gloo / this"], rows)


def spread_text(s: dict[str, float]) -> str:
    return f"{s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}]"


BASELINE = {"one_way": "memcpy", "exchange": "memcpy_concurrent"}  # each pattern's floor (bandwidth.py)
BASELINE_NAME = {"one_way": "memcpy", "exchange": "two memcpys at once, each"}


def _bandwidth_pattern(bw: dict, pattern: str) -> str:
    copy = {p["bytes"]: p for p in bw[BASELINE[pattern]]}
    contenders = list(bw[pattern][0]["gbps"])
    rows = []
    for p in bw[pattern]:
        rows.append([human_bytes(p["bytes"]), spread_text(copy[p["bytes"]]["spread"])] +
                    [f"{p['gbps'][c]:.2f} ({spread_text(p['of_memcpy'][c])})" for c in contenders])
    return markdown_table(["size", BASELINE_NAME[pattern]] + [name(c) for c in contenders], rows)


def bandwidth(bw: dict) -> str:
    arena = bw["arena"]
    size = f" (arena_bytes {human_bytes(arena['arena_bytes'])})" if arena["arena_bytes"] else ""
    return ("Median GB/s (10^9 bytes per second; the exchange per direction), then in parentheses the ratio "
            "to the baseline measured beside it (one way: a memcpy; the exchange: two memcpys at once, in "
            "two processes), median [min-max]; baseline: median [min-max] GB/s. "
            f"megatron_p2p shm receives into plain tensors (the CMA path). Arena: {arena['note']}{size}."
            "\n\nOne-way stream\n\n" + _bandwidth_pattern(bw, "one_way") +
            "\n\nBidirectional exchange\n\n" + _bandwidth_pattern(bw, "exchange"))


def overhead(ov: dict, repeats: list[dict]) -> str:
    def of(c: str, figure: str) -> list[float]:
        return [r["us"][c][figure] for r in repeats]

    rows = [[name(c), ranged(of(c, "cpu_median_us")), ranged(of(c, "wall_median_us"))] for c in ov["us"]]
    if "binding_layer" in ov:  # the binding layer alone: what this package adds on any transport
        rows.append(["megatron_p2p binding layer (null transport)",
                     ranged([r["binding_layer"]["cpu_us"] for r in repeats]),
                     ranged([r["binding_layer"]["wall_us"] for r in repeats])])
    return (f"Posting one four-op exchange of {human_bytes(ov['bytes'])} tensors (each repetition's median)\n\n" +
            markdown_table(["contender", "CPU time (us)", "wall time (us)"], rows))


def pipeline(points: list[dict]) -> str:
    contenders = list(points[0]["step_ms"])
    rows = [[str(p["pp"]), f"{human_bytes(p['bytes'])} {p['dtype']} {'x'.join(map(str, p['shape']))}"] +
            [ranged(p["rounds_ms"][c], ".3f") for c in contenders] + [f"{ranged(goals.step_ratios(p))}x"]
            for p in points]
    return "Time per 1F1B steady-state step (ms)\n\n" + markdown_table(
        ["pp", "activation"] + [name(c) for c in contenders] + ["faster stock / slower megatron_p2p"], rows)


def all_tables(results: dict) -> str:
    stock = results["stock"]
    parts = [
        f"Every figure: median [min-max] over {results['repeats']} repetitions.",
        "### Latency (2 ranks, half round trip)\n\n" + latency(results["latency_repeats"]) +
        "\n\nPinned: each rank and all its threads on a core of its own. Python call floor: the same round trip "
        "on the null transport, on one rank. C floor: the same two ranks bounce a counter through one shared page "
        "in C, between their round trips (megatron_p2p._testing.pingpong), unpinned and pinned.",
        "### Bandwidth (2 ranks)\n\n" + bandwidth(results["bandwidth"]),
        "### Pipeline step\n\n" + pipeline(results["pipeline"]) +
        f"\n\nStock algorithm: {stock['what']}" + (f" {stock['version']}" if stock["version"] else "") +
        (f"; CPU shim: {stock['shim']}" if stock["shim"] else ""),
        "### Host overhead (2 ranks)\n\n" + overhead(results["overhead"], results["overhead_repeats"]),
    ]
    return "\n\n".join(parts)
