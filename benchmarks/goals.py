"""The issue's goals, each as a figure measured in one run, marked met or missed. Every figure
is measured once per repetition beside its baseline; a point's ratio is the median of its
per-repetition ratios, and the detail gives their spread (min-max). Every goal compares against
the harder baseline where there are two (the faster gloo call, the faster stock algorithm) and
takes the worst point of its range (by median); the goal's `spread` is that point's.

Goals about what the machine itself allows are ratios to floors measured in the same run, so
they travel between machines: latency to the Python call floor (latency.py, the null transport)
plus the C ping-pong between the same two ranks, each placement to its own; the exchange to two memcpys at once."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from timing import median, ranged, spread

MiB = 1 << 20
GLOO = ("gloo_isend_irecv", "gloo_batch_isend_irecv")
STOCK = ("stock_gloo_batched", "stock_gloo_p2p_ops")
OURS = ("megatron_p2p_parity", "megatron_p2p_batched")
SMALL = 1024  # the latency goals cover 0 B to 1 KiB


def _goal(name: str, ratio: float | None, op: str, target: float, detail: str, also: bool = True,
          repeats: list[float] | None = None) -> dict[str, Any]:
    """`op` is ">=" or "<=": how `ratio` must compare with `target`; `also` any further condition;
    `repeats` the per-repetition figures `ratio` is the median of. A ratio of None: not measured."""
    met = ratio is not None and (ratio >= target if op == ">=" else ratio <= target) and also
    goal = {"name": name, "ratio": ratio, "op": op, "target": target, "met": bool(met), "detail": detail}
    if repeats:
        goal["spread"] = spread(repeats)
    return goal


def gloo_over_ours(us: dict[str, dict[str, float]]) -> float:
    """One latency point's faster gloo median over this package's."""
    return min(us[g]["median_us"] for g in GLOO) / us["megatron_p2p"]["median_us"]


def _per_small_size(repeats: list[list[dict]], figure: Callable[[dict, int], float]) -> dict[int, list[float]]:
    """Each 0-1 KiB size's `figure(us, i)` (of its point's "us" in repetition i) in every repetition."""
    sizes = [p["bytes"] for p in repeats[0] if p["bytes"] <= SMALL]
    return {b: [figure(next(p for p in points if p["bytes"] == b)["us"], i) for i, points in enumerate(repeats)]
            for b in sizes}


def latency_vs_gloo(repeats: list[list[dict]]) -> dict:
    per_size = _per_small_size(repeats, lambda us, _: gloo_over_ours(us))
    worst = per_size[min(per_size, key=lambda b: median(per_size[b]))]
    detail = "median [min-max] over repetitions: " + ", ".join(
        f"{b} B {ranged(v, '.1f')}x" for b, v in per_size.items())
    return _goal("small-message latency (<= 1 KiB, median): gloo / this package", median(worst), ">=", 20.0,
                 detail, repeats=worst)


PLACED = {"unpinned": "megatron_p2p", "pinned": "megatron_p2p_pinned"}  # latency.py's contender per placement
C_FLOOR = {"unpinned": "c_floor", "pinned": "c_floor_pinned"}  # and its C floor, measured between its turns


def _per_placement_size(results: dict, figure: Callable[[dict, str], float]) -> dict[tuple[str, int], list[float]]:
    """Each (placement, 0-1 KiB size)'s `figure(us, placement)` in every repetition, for the
    placements latency.py measured."""
    repeats = results["latency_repeats"]
    placements = [pl for pl, c in PLACED.items() if c in repeats[0][0]["us"]]
    return {(pl, b): v for pl in placements
            for b, v in _per_small_size(repeats, lambda us, _, pl=pl: figure(us, pl)).items()}


def floor_us(us: dict, placement: str) -> float:
    """What a round trip's half costs at best here: the Python calls (the null-transport floor)
    plus the crossing between the two processes (the C floor), both of the same repetition."""
    return us["python_floor"]["median_us"] + us[C_FLOOR[placement]]["median_us"]


def _worst(per_key: dict[tuple[str, int], list[float]]) -> tuple[str, int]:
    return max(per_key, key=lambda k: median(per_key[k]))


def latency_median(results: dict) -> dict:
    name = "small-message latency (0-1 KiB, one-way median): this package / (Python call floor + C floor)"
    per = _per_placement_size(results, lambda us, pl: us[PLACED[pl]]["median_us"] / floor_us(us, pl))
    worst = _worst(per)
    detail = "median [min-max] over repetitions: " + ", ".join(
        f"{pl} {b} B {ranged(v)}x" for (pl, b), v in per.items())
    return _goal(name, median(per[worst]), "<=", 2.0, detail, repeats=per[worst])


def latency_p99(results: dict) -> dict:
    name = "small-message latency (0-1 KiB, one-way): p99 / median of this package"
    per = _per_placement_size(results, lambda us, pl: us[PLACED[pl]]["p99_us"] / us[PLACED[pl]]["median_us"])
    worst = _worst(per)
    detail = "median [min-max] over repetitions: " + ", ".join(
        f"{pl} {b} B {ranged(v, '.1f')}x" for (pl, b), v in per.items())
    return _goal(name, median(per[worst]), "<=", 10.0, detail, repeats=per[worst])


def _big(bw: dict, pattern: str) -> tuple[str, dict[int, list[float]], dict[int, list[float]], int | None]:
    """The contender the bandwidth goals judge (the arena's where the communicator has one: where
    megatron-core's receive buffers come from, else the plain buffers'), each >= 16 MiB size's
    per-repetition ratios of `pattern` to its baseline and to the faster gloo call, and the size
    whose ratio to its baseline is the worst (None without such a size)."""
    ours = "megatron_p2p_arena" if bw["arena"]["available"] else "megatron_p2p"
    of_floor, of_gloo = {}, {}
    for p in bw[pattern]:
        if p["bytes"] >= 16 * MiB:
            reps = p["repeats"]
            of_floor[p["bytes"]] = [g / m for g, m in zip(reps[ours]["gbps"], reps[ours]["memcpy_gbps"])]
            of_gloo[p["bytes"]] = [g / max(reps[c]["gbps"][i] for c in GLOO) for i, g in enumerate(reps[ours]["gbps"])]
    worst = min(of_floor, key=lambda b: median(of_floor[b])) if of_floor else None
    return ours, of_floor, of_gloo, worst


def _buffers(ours: str) -> str:
    return ("arena receive buffers (comm.empty)" if ours != "megatron_p2p"
            else "plain receive buffers (no arena in this build)")


def bandwidth(bw: dict) -> dict:
    name = "one-way bandwidth >= 16 MiB: this package / memcpy, and >= 3x gloo"
    ours, of_memcpy, of_gloo, worst = _big(bw, "one_way")
    if worst is None:
        return _goal(name, None, ">=", 0.8, "no point at 16 MiB or above")
    m, g = median(of_memcpy[worst]), min(median(v) for v in of_gloo.values())
    plain = {p["bytes"]: p["of_memcpy"]["megatron_p2p"]["median"] for p in bw["one_way"]}
    parts = [f"{b // MiB} MiB {ranged(v)} of memcpy" + ("" if ours == "megatron_p2p" else f" (plain buffers "
             f"{plain[b]:.2f})") + f", {ranged(of_gloo[b], '.1f')}x gloo" for b, v in of_memcpy.items()]
    return _goal(name, m, ">=", 0.8, f"{_buffers(ours)}; median [min-max] over repetitions; worst {m:.2f} of "
                 f"memcpy (target 0.8), worst {g:.1f}x gloo (target 3); " + "; ".join(parts),
                 also=g >= 3.0, repeats=of_memcpy[worst])


def exchange(bw: dict) -> dict:
    name = "exchange bandwidth >= 16 MiB, per direction: this package / two memcpys at once"
    ours, of_two, of_gloo, worst = _big(bw, "exchange")
    if worst is None:
        return _goal(name, None, ">=", 0.9, "no point at 16 MiB or above")
    parts = [f"{b // MiB} MiB {ranged(v)} ({ranged(of_gloo[b], '.1f')}x gloo)" for b, v in of_two.items()]
    return _goal(name, median(of_two[worst]), ">=", 0.9,
                 f"{_buffers(ours)}; median [min-max] over repetitions: " + "; ".join(parts), repeats=of_two[worst])


def overhead_ratio(ov: dict) -> float:
    """One repetition's CPU time to post through this package over torch.distributed isend/irecv x4."""
    return ov["us"]["megatron_p2p"]["cpu_median_us"] / ov["us"]["torch_isend_irecv"]["cpu_median_us"]


def overhead(repeats: list[dict]) -> dict:
    ratios = [overhead_ratio(r) for r in repeats]
    ours = [r["us"]["megatron_p2p"]["cpu_median_us"] for r in repeats]
    theirs = [r["us"]["torch_isend_irecv"]["cpu_median_us"] for r in repeats]
    return _goal("host overhead to post a four-op exchange: this package / torch.distributed isend+irecv",
                 median(ratios), "<=", 0.2,
                 f"ratio {ranged(ratios, '.3f')}, {ranged(ours, '.1f')} us against {ranged(theirs, '.1f')} us "
                 "of CPU time to post (median [min-max] over repetitions)", repeats=ratios)


def binding_layer_us(ov: dict) -> float | None:
    """One repetition's CPU microseconds per four-op exchange on the benchmark-only null
    transport, which completes every op at once (the binding layer alone); None when this
    build's overhead section does not report it."""
    return ov["binding_layer"]["cpu_us"] if "binding_layer" in ov else None


def binding_layer(repeats: list[dict]) -> dict:
    name = "binding layer: CPU time to post a four-op exchange on the null transport, us"
    if binding_layer_us(repeats[0]) is None:
        return _goal(name, None, "<=", 3.0, "not measured: this build's overhead section reports no null transport")
    ours = [binding_layer_us(r) for r in repeats]
    batch = [r["us"]["torch_batch_isend_irecv"]["cpu_median_us"] for r in repeats]
    return _goal(name, median(ours), "<=", 3.0,
                 f"{ranged(ours)} us beside torch batch_isend_irecv's {ranged(batch, '.1f')} us to post "
                 "(median [min-max] over repetitions)", repeats=ours)


def step_ratios(p: dict) -> list[float]:
    """Each round's faster stock algorithm over this package's slower mode."""
    rounds = p["rounds_ms"]
    return [min(rounds[s][i] for s in STOCK) / max(rounds[o][i] for o in OURS) for i in range(len(rounds[OURS[0]]))]


def pipeline(points: list[dict]) -> dict:
    name = "pipeline step at 8 MiB: stock on gloo / this package"
    at8 = {p["pp"]: step_ratios(p) for p in points if p["bytes"] == 8 * MiB}
    goal = {pp: r for pp, r in at8.items() if pp in (2, 4)}
    if not goal:
        return _goal(name, None, ">=", 3.0, "no 8 MiB point at pp 2 or 4")
    worst_pp = min(goal, key=lambda pp: median(goal[pp]))
    detail = "slower mode of this package against the faster stock algorithm, median [min-max] over rounds: " + \
        ", ".join(f"pp {pp} {ranged(r)}x" + ("" if pp in goal else " (not in the goal)")
                  for pp, r in sorted(at8.items()))
    return _goal(name, median(goal[worst_pp]), ">=", 3.0, detail, repeats=goal[worst_pp])


def oversubscription(points: list[dict], cores: int) -> dict:
    """A 1F1B step over n stages moves 2(n-1) messages; with more ranks than cores they share
    the cores, so a smooth transport's cost per message per core, step * min(n, cores) / (2(n-1)),
    stays flat as ranks grow, while spinning ranks starve each other and make it collapse.
    Allowed: at most 2x the 2-rank cost, for every mode of this package. Round i of each size
    is compared with round i of 2 ranks."""
    def cost(p: dict, mode: str, i: int) -> float:
        return p["rounds_ms"][mode][i] * min(p["ranks"], cores) / (2 * (p["ranks"] - 1))

    name = "oversubscription: step cost per message per core, n ranks / 2 ranks"
    base = next((p for p in points if p["ranks"] == 2), None)
    others = [p for p in points if p["ranks"] > 2]
    if base is None or not others:
        return _goal(name, None, "<=", 2.0, "needs 2 ranks and more", also=False)
    growth = {p["ranks"]: [max(cost(p, o, i) / cost(base, o, i) for o in OURS)
                           for i in range(min(len(base["rounds_ms"][OURS[0]]), len(p["rounds_ms"][OURS[0]])))]
              for p in others}
    worst_n = max(growth, key=lambda n: median(growth[n]))
    detail = f"cost per message per core against 2 ranks, on {cores} cores, median [min-max] over rounds: " + \
        ", ".join(f"{n} ranks {ranged(g)}x" for n, g in sorted(growth.items()))
    return _goal(name, median(growth[worst_n]), "<=", 2.0, detail, repeats=growth[worst_n])


def evaluate(results: dict) -> list[dict]:
    return [latency_vs_gloo(results["latency_repeats"]), latency_median(results), latency_p99(results),
            bandwidth(results["bandwidth"]), exchange(results["bandwidth"]),
            overhead(results["overhead_repeats"]), binding_layer(results["overhead_repeats"]),
            pipeline(results["pipeline"]),
            oversubscription(results["oversubscription"], results["machine"]["usable_cores"])]


def summary_line(goal: dict) -> str:
    if goal["ratio"] is None:
        return f"GOAL MISSED: {goal['name']}: not measured (goal {goal['op']} {goal['target']:g}) -- {goal['detail']}"
    mark = "met" if goal["met"] else "MISSED"
    return (f"GOAL {mark}: {goal['name']}: {goal['ratio']:.3g} (goal {goal['op']} {goal['target']:g}) "
            f"-- {goal['detail']}")
