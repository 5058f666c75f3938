"""The printed tables (Markdown, so RESULTS.md can hold them as they are)."""
from __future__ import annotations

from timing import human_bytes

NAMES = {
    "megatron_p2p": "megatron_p2p shm",
    "gloo_isend_irecv": "gloo isend/irecv",
    "gloo_batch_isend_irecv": "gloo batch_isend_irecv",
    "torch_isend_irecv": "torch.distributed isend/irecv x4",
    "torch_batch_isend_irecv": "torch.distributed batch_isend_irecv",
    "megatron_p2p_parity": "megatron_p2p parity",
    "megatron_p2p_batched": "megatron_p2p batched",
    "stock_gloo_batched": "stock batched (gloo)",
    "stock_gloo_p2p_ops": "stock _p2p_ops (gloo)",
}


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def latency(points: list[dict]) -> str:
    contenders = list(points[0]["us"])
    rows = [[human_bytes(p["bytes"])] +
            [f"{p['us'][c]['median_us']:.2f} / {p['us'][c]['p99_us']:.1f}" for c in contenders] +
            [f"{min(p['us'][c]['median_us'] for c in contenders[1:]) / p['us'][contenders[0]]['median_us']:.1f}x"]
            for p in points]
    return _table(["size"] + [f"{NAMES[c]} median / p99 (us)" for c in contenders] + ["gloo / this"], rows)


def bandwidth(bw: dict) -> str:
    copy = {p["bytes"]: p["gbps"] for p in bw["memcpy"]}
    contenders = list(bw["one_way"][0]["gbps"])
    rows = []
    for one, both in zip(bw["one_way"], bw["exchange"]):
        rows.append([human_bytes(one["bytes"]), f"{copy[one['bytes']]:.2f}"] +
                    [f"{one['gbps'][c]:.2f}" for c in contenders] + [f"{both['gbps'][c]:.2f}" for c in contenders])
    header = (["size", "memcpy"] + [f"one-way {NAMES[c]}" for c in contenders] +
              [f"exchange {NAMES[c]}" for c in contenders])
    return "GB/s (10^9 bytes per second; the exchange per direction)\n\n" + _table(header, rows)


def overhead(ov: dict) -> str:
    rows = [[NAMES[c], f"{f['cpu_median_us']:.2f}", f"{f['wall_median_us']:.2f}"] for c, f in ov["us"].items()]
    return (f"Posting one four-op exchange of {human_bytes(ov['bytes'])} tensors (median)\n\n" +
            _table(["contender", "CPU time (us)", "wall time (us)"], rows))


def pipeline(points: list[dict]) -> str:
    contenders = list(points[0]["step_ms"])
    rows = [[str(p["pp"]), f"{human_bytes(p['bytes'])} {p['dtype']} {'x'.join(map(str, p['shape']))}"] +
            [f"{p['step_ms'][c]:.3f}" for c in contenders] for p in points]
    return "Time per 1F1B steady-state step (ms)\n\n" + _table(
        ["pp", "activation"] + [NAMES[c] for c in contenders], rows)


def all_tables(results: dict) -> str:
    stock = results["stock"]
    parts = [
        "### Latency (2 ranks, half round trip)\n\n" + latency(results["latency"]),
        "### Bandwidth (2 ranks)\n\n" + bandwidth(results["bandwidth"]),
        "### Pipeline step\n\n" + pipeline(results["pipeline"]) +
        f"\n\nStock algorithm: {stock['what']}" + (f" {stock['version']}" if stock["version"] else "") +
        (f"; CPU shim: {stock['shim']}" if stock["shim"] else ""),
        "### Host overhead (2 ranks)\n\n" + overhead(results["overhead"]),
    ]
    return "\n\n".join(parts)
