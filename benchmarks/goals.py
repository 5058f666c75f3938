"""The issue's goals, each as a ratio measured in one run, marked met or missed. Every goal
compares against the harder baseline where there are two (the faster gloo call, the faster
stock algorithm) and takes the worst point of its range."""
from __future__ import annotations

from typing import Any

MiB = 1 << 20
GLOO = ("gloo_isend_irecv", "gloo_batch_isend_irecv")
STOCK = ("stock_gloo_batched", "stock_gloo_p2p_ops")
OURS = ("megatron_p2p_parity", "megatron_p2p_batched")


def _goal(name: str, ratio: float, op: str, target: float, detail: str, also: bool = True) -> dict[str, Any]:
    """`op` is ">=" or "<=": how `ratio` must compare with `target`; `also` any further condition."""
    met = (ratio >= target if op == ">=" else ratio <= target) and also
    return {"name": name, "ratio": ratio, "op": op, "target": target, "met": bool(met), "detail": detail}


def latency(points: list[dict]) -> dict:
    small = [p for p in points if p["bytes"] <= 1024]
    ratios = {p["bytes"]: min(p["us"][g]["median_us"] for g in GLOO) / p["us"]["megatron_p2p"]["median_us"]
              for p in small}
    worst = min(ratios.values())
    detail = ", ".join(f"{b} B {r:.1f}x" for b, r in ratios.items())
    return _goal("small-message latency (<= 1 KiB, median): gloo / this package", worst, ">=", 20.0, detail)


def bandwidth(bw: dict) -> dict:
    copy = {p["bytes"]: p["gbps"] for p in bw["memcpy"]}
    of_memcpy, of_gloo, parts = [], [], []
    for pattern in ("one_way", "exchange"):
        for p in bw[pattern]:
            if p["bytes"] < 16 * MiB:
                continue
            ours = p["gbps"]["megatron_p2p"]
            of_memcpy.append(ours / copy[p["bytes"]])
            of_gloo.append(ours / max(p["gbps"][g] for g in GLOO))
            parts.append(f"{pattern} {p['bytes'] // MiB} MiB {of_memcpy[-1]:.2f} of memcpy, {of_gloo[-1]:.1f}x gloo")
    if not parts:
        return _goal("bandwidth >= 16 MiB: this package / memcpy", 0.0, ">=", 0.7, "no point at 16 MiB or above")
    m, g = min(of_memcpy), min(of_gloo)
    return _goal("bandwidth >= 16 MiB: this package / memcpy, and >= 3x gloo", m, ">=", 0.7,
                 f"worst {m:.2f} of memcpy (target 0.7), worst {g:.1f}x gloo (target 3); " + "; ".join(parts), also=g >= 3.0)


def overhead(ov: dict) -> dict:
    ours = ov["us"]["megatron_p2p"]["cpu_median_us"]
    torch_ = ov["us"]["torch_isend_irecv"]["cpu_median_us"]
    ratio = ours / torch_
    return _goal("host overhead to post a four-op exchange: this package / torch.distributed isend+irecv", ratio,
                 "<=", 0.2, f"{ours:.1f} us against {torch_:.1f} us of CPU time to post")


def pipeline(points: list[dict]) -> dict:
    at8 = [p for p in points if p["bytes"] == 8 * MiB and p["pp"] in (2, 4)]
    ratios = {p["pp"]: min(p["step_ms"][s] for s in STOCK) / max(p["step_ms"][o] for o in OURS) for p in at8}
    if not ratios:
        return _goal("pipeline step at 8 MiB: stock on gloo / this package", 0.0, ">=", 3.0, "no 8 MiB point at pp 2 or 4")
    worst = min(ratios.values())
    detail = "slower mode of this package against the faster stock algorithm: " + ", ".join(
        f"pp {pp} {r:.2f}x" for pp, r in ratios.items())
    return _goal("pipeline step at 8 MiB: stock on gloo / this package", worst, ">=", 3.0, detail)


def oversubscription(points: list[dict], cores: int) -> dict:
    """A 1F1B step over n stages moves 2(n-1) messages; with more ranks than cores they share
    the cores, so a smooth transport's cost per message per core, step * min(n, cores) / (2(n-1)),
    stays flat as ranks grow, while spinning ranks starve each other and make it collapse.
    Allowed: at most 2x the 2-rank cost, for every mode of this package."""
    def cost(p: dict, mode: str) -> float:
        return p["step_ms"][mode] * min(p["ranks"], cores) / (2 * (p["ranks"] - 1))

    base = next((p for p in points if p["ranks"] == 2), None)
    others = [p for p in points if p["ranks"] > 2]
    if base is None or not others:
        return _goal("oversubscription", 0.0, "<=", 2.0, "needs 2 ranks and more", also=False)
    growth = {p["ranks"]: max(cost(p, o) / cost(base, o) for o in OURS) for p in others}
    worst = max(growth.values())
    detail = f"cost per message per core against 2 ranks, on {cores} cores: " + ", ".join(
        f"{n} ranks {g:.2f}x" for n, g in sorted(growth.items()))
    return _goal("oversubscription: step cost per message per core, n ranks / 2 ranks", worst, "<=", 2.0, detail)


def evaluate(results: dict) -> list[dict]:
    return [latency(results["latency"]), bandwidth(results["bandwidth"]), overhead(results["overhead"]),
            pipeline(results["pipeline"]),
            oversubscription(results["oversubscription"], results["machine"]["usable_cores"])]


def summary_line(goal: dict) -> str:
    mark = "met" if goal["met"] else "MISSED"
    return (f"GOAL {mark}: {goal['name']}: {goal['ratio']:.3g} (goal {goal['op']} {goal['target']:g}) "
            f"-- {goal['detail']}")
