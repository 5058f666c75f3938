"""Pipeline step: 1F1B's steady state with no compute. Every stage but the last calls
send_forward_recv_backward and every stage but the first then calls
send_backward_recv_forward, so each call meets its neighbour's opposite one. Time per step
for each mode of this package's P2PCommunicator (which allocates its receive buffers as it
does for megatron-core: from the communicator's arena where there is one) and for the stock
algorithm over gloo (see stock.py), which allocates a fresh torch.empty per call.

The contenders take turns, one round each, `repeats` rounds in all, so a burst of load hits
them alike; each round gives one step time per contender, and the goals take each round's
ratio."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import stock
import torch
import torch.distributed as dist
from timing import human_bytes, median, say, timed_loop

import megatron_p2p as mp

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CONTENDERS = ("megatron_p2p_parity", "megatron_p2p_batched", "stock_gloo_batched", "stock_gloo_p2p_ops")


def _contender(name: str, comm, group, dtype: torch.dtype):
    """An object with megatron-core's send_forward_recv_backward / send_backward_recv_forward."""
    if name.startswith("megatron_p2p_"):
        mode = name.rsplit("_", 1)[1]
        config = SimpleNamespace(pipeline_dtype=dtype, batch_p2p_comm=mode == "batched", variable_seq_lengths=False)
        return mp.P2PCommunicator(group, config, comm=comm, mode=mode)
    return stock.communicator(group, dtype, batched=name == "stock_gloo_batched")


def run(comm, group, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    pp = dist.get_world_size(group)
    stage = dist.get_rank(group)
    first, last = stage == 0, stage == pp - 1
    points = []
    for act in cfg["activations"]:
        shape, dtype = tuple(act["shape"]), DTYPES[act["dtype"]]
        output = torch.ones(shape, dtype=dtype)
        grad = torch.ones(shape, dtype=dtype)
        p2p = {name: _contender(name, comm, group, dtype) for name in CONTENDERS}

        def step(c) -> None:
            c.send_forward_recv_backward(output, shape, is_last_stage=last)
            c.send_backward_recv_forward(grad, shape, is_first_stage=first)

        rounds: dict[str, list[float]] = {name: [] for name in CONTENDERS}
        for _ in range(cfg["repeats"]):
            for name, c in p2p.items():
                seconds = timed_loop(lambda: step(c), cfg["steps"], cfg["warmup"], group)
                rounds[name].append(seconds * 1e3)
        step_ms = {name: median(v) for name, v in rounds.items()}
        nbytes = output.numel() * output.element_size()
        points.append({"pp": pp, "shape": list(shape), "dtype": act["dtype"], "bytes": nbytes,
                       "steps": cfg["steps"] * cfg["repeats"], "step_ms": step_ms, "rounds_ms": rounds})
        say(f"pipeline pp={pp} {human_bytes(nbytes):>7} {act['dtype']:>8}  " +
            "  ".join(f"{n} {v:8.3f} ms" for n, v in step_ms.items()))
    return points
