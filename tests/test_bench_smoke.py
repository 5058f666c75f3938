"""`make bench-quick` as a smoke test: the reduced sweep completes and writes a complete, valid
JSON, the plots and one line per goal. It never checks a timing: this suite runs on shared
machines where timings mean nothing."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from conftest import ROOT

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.torchrun  # benchmarks/run.py starts torchrun jobs of its own
def test_quick_benchmark_writes_complete_results(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run.py"), "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    r = json.loads((tmp_path / "results.json").read_text())
    assert r["complete"] and r["kind"] == "quick" and r["repeats"] == 5
    for key in ("cpu_model", "cores", "kernel", "torch", "commit"):
        assert r["machine"][key], key

    pinnable = len(os.sched_getaffinity(0)) >= 2
    assert len(r["latency_repeats"]) == len(r["overhead_repeats"]) == 5
    contenders = {"megatron_p2p", "c_floor", "gloo_isend_irecv", "gloo_batch_isend_irecv", "python_floor"}
    if pinnable:
        contenders |= {"megatron_p2p_pinned", "c_floor_pinned"}
    for points in [r["latency"], *r["latency_repeats"]]:
        assert [p["bytes"] for p in points] == [0, 8, 1024, 65536]
        for p in points:
            assert set(p["us"]) == contenders
            assert all(_positive(f["median_us"]) and f["p99_us"] >= f["median_us"] for f in p["us"].values())

    bw = r["bandwidth"]
    sizes = [p["bytes"] for p in bw["memcpy"]]
    assert sizes and [p["bytes"] for p in bw["one_way"]] == sizes == [p["bytes"] for p in bw["exchange"]]
    assert [p["bytes"] for p in bw["memcpy_concurrent"]] == sizes
    assert all(_positive(p["gbps"]) for p in bw["memcpy"] + bw["memcpy_concurrent"])
    contenders = {"megatron_p2p", "gloo_isend_irecv", "gloo_batch_isend_irecv"}
    if bw["arena"]["available"]:
        contenders.add("megatron_p2p_arena")
    for p in bw["one_way"] + bw["exchange"]:
        assert set(p["gbps"]) == set(p["of_memcpy"]) == set(p["repeats"]) == contenders
        assert all(_positive(v) for v in p["gbps"].values())
        for c in contenders:  # each repetition's figure beside the memcpy measured with it
            assert len(p["repeats"][c]["gbps"]) == len(p["repeats"][c]["memcpy_gbps"]) == 5
            s = p["of_memcpy"][c]
            assert _positive(s["min"]) and s["min"] <= s["median"] <= s["max"]

    assert {p["pp"] for p in r["pipeline"]} == {2, 4}
    for p in r["pipeline"]:
        assert set(p["step_ms"]) == {"megatron_p2p_parity", "megatron_p2p_batched", "stock_gloo_batched",
                                     "stock_gloo_p2p_ops"}
        assert all(_positive(v) for v in p["step_ms"].values())
        assert all(len(v) == 5 for v in p["rounds_ms"].values())
    assert r["stock"]["kind"] in ("megatron-core", "replica")
    assert [p["ranks"] for p in r["oversubscription"]] == [2, 4]

    ov = r["overhead"]["us"]
    assert set(ov) == {"megatron_p2p", "torch_isend_irecv", "torch_batch_isend_irecv"}
    assert all(_positive(f["cpu_median_us"]) for f in ov.values())
    assert all(_positive(o["binding_layer"]["cpu_us"]) for o in r["overhead_repeats"])

    assert len(r["goals"]) == 9
    assert all(isinstance(g["met"], bool) and math.isfinite(g["ratio"]) for g in r["goals"])
    assert proc.stdout.count("GOAL ") == 9
    assert "| size |" in proc.stdout  # the printed table
    for name in ("latency.png", "bandwidth.png", "step_time.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG_SIGNATURE, name


@pytest.mark.torchrun  # one torchrun job per pp
def test_pipelining_benchmark_writes_its_figures(tmp_path):
    """benchmarks/pipelining.py at its smallest (pp 2, one round of one step): both contenders
    timed, and their ratio."""
    out = tmp_path / "pipelining.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "pipelining.py"), "--pp", "2", "--rounds", "1",
                           "--steps", "1", "--out", str(out)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    [r] = json.loads(out.read_text())
    assert r["pp"] == 2 and r["microbatches"] == 4 and r["activation_bytes"] == 8 << 20
    assert set(r["step_ms"]) == {"gloo", "megatron_p2p"} and all(_positive(v) for v in r["step_ms"].values())
    assert _positive(r["ratio"]) and r["ratio"] == r["step_ms"]["gloo"] / r["step_ms"]["megatron_p2p"]
