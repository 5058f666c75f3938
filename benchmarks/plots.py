"""PNG plots of one run: latency against size, bandwidth against size beside the memcpy line,
and pipeline step time against ranks. Repeated figures are drawn at their median, with bars
from the smallest to the largest repetition where the JSON keeps them."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
from tables import name  # noqa: E402
from timing import human_bytes  # noqa: E402


def _size_axis(ax, sizes: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes)
    ax.set_xticklabels([human_bytes(s) for s in sizes], rotation=30)
    ax.grid(True, which="both", alpha=0.3)


def _bars(values: list[list[float]], medians: list[float]) -> list[list[float]]:
    """matplotlib's yerr: each point's distance down to its smallest and up to its largest value."""
    return [[max(0.0, m - min(v)) for v, m in zip(values, medians)],
            [max(0.0, max(v) - m) for v, m in zip(values, medians)]]


def latency(points: list[dict], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    sizes = [max(p["bytes"], 1) for p in points]  # 0 B sits at 1 on the log axis
    for c in points[0]["us"]:
        med = [p["us"][c]["median_us"] for p in points]
        p99 = [p["us"][c]["p99_us"] for p in points]
        line, = ax.plot(sizes, med, "o-", label=f"{name(c)} median")
        ax.plot(sizes, p99, "x:", color=line.get_color(), alpha=0.6, label=f"{name(c)} p99")
    _size_axis(ax, sizes)
    ax.set_xticklabels([human_bytes(p["bytes"]) for p in points], rotation=30)
    ax.set_yscale("log")
    ax.set_xlabel("message size")
    ax.set_ylabel("one-way latency (us, half round trip)")
    ax.set_title("Ping-pong latency, 2 ranks")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def bandwidth(bw: dict, path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    sizes = [p["bytes"] for p in bw["memcpy"]]
    for ax, pattern, title in ((axes[0], "one_way", "One-way stream"),
                               (axes[1], "exchange", "Bidirectional exchange (per direction)")):
        if pattern == "one_way":
            ax.plot(sizes, [p["gbps"] for p in bw["memcpy"]], "k--", label="single-thread memcpy (one-copy limit)")
        else:
            ax.plot(sizes, [p["gbps"] for p in bw["memcpy_concurrent"]], "k--",
                    label="two memcpys at once, each (the exchange's limit)")
        for c in bw[pattern][0]["gbps"]:
            medians = [p["gbps"][c] for p in bw[pattern]]
            ax.errorbar(sizes, medians, yerr=_bars([p["repeats"][c]["gbps"] for p in bw[pattern]], medians),
                        fmt="o-", capsize=3, label=name(c))
        _size_axis(ax, sizes)
        ax.set_xlabel("message size")
        ax.set_title(title)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("GB/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def step_time(points: list[dict], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    sizes = sorted({p["bytes"] for p in points})
    for nbytes in sizes:
        style = "o-" if nbytes == sizes[0] else "s--"
        rows = sorted((p for p in points if p["bytes"] == nbytes), key=lambda p: p["pp"])
        for i, c in enumerate(rows[0]["step_ms"]):
            medians = [p["step_ms"][c] for p in rows]
            ax.errorbar([p["pp"] for p in rows], medians, yerr=_bars([p["rounds_ms"][c] for p in rows], medians),
                        fmt=style, capsize=3, color=f"C{i}", label=f"{name(c)}, {human_bytes(nbytes)}")
    ranks = sorted({p["pp"] for p in points})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ranks)
    ax.set_xticklabels([str(r) for r in ranks])
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.set_xlabel("ranks (pipeline stages) on this machine")
    ax.set_ylabel("time per 1F1B step (ms)")
    ax.set_title("Pipeline step time against ranks")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_all(results: dict, out: Path) -> list[Path]:
    paths = [out / "latency.png", out / "bandwidth.png", out / "step_time.png"]
    latency(results["latency"], paths[0])
    bandwidth(results["bandwidth"], paths[1])
    step_time(results["pipeline"], paths[2])
    return paths
