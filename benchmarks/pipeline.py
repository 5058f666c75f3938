"""Pipeline step: 1F1B's steady state with no compute. Every stage but the last calls
send_forward_recv_backward and every stage but the first then calls
send_backward_recv_forward, so each call meets its neighbour's opposite one. Time per step
for each mode of this package and for the stock algorithm over gloo (see stock.py). Both
allocate a fresh receive buffer per call, as megatron-core does."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import stock
from timing import human_bytes, median, say, timed_loop

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CONTENDERS = ("megatron_p2p_parity", "megatron_p2p_batched", "stock_gloo_batched", "stock_gloo_p2p_ops")


class _Ours:
    """The two 1F1B calls as one exchange each, the way a schedule would swap this package in."""

    def __init__(self, comm, dtype: torch.dtype, mode: str):
        self.comm, self.dtype, self.mode = comm, dtype, mode

    def _exchange(self, shape, **ops) -> torch.Tensor:
        buf = torch.empty(shape, dtype=self.dtype, requires_grad=True)
        name = "recv_next" if "send_next" in ops else "recv_prev"
        for req in self.comm.exchange(mode=self.mode, **{name: buf}, **ops).values():
            req.wait()
        return buf

    def send_forward_recv_backward(self, output, shape, is_last_stage: bool):
        return None if is_last_stage else self._exchange(shape, send_next=output)

    def send_backward_recv_forward(self, grad, shape, is_first_stage: bool):
        return None if is_first_stage else self._exchange(shape, send_prev=grad)


def _contender(name: str, comm, group, dtype: torch.dtype):
    if name.startswith("megatron_p2p_"):
        return _Ours(comm, dtype, name.rsplit("_", 1)[1])
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
        for _ in range(cfg["rounds"]):  # contenders take turns, so load bursts hit them alike
            for name, c in p2p.items():
                seconds = timed_loop(lambda: step(c), cfg["steps"], cfg["warmup"], group)
                rounds[name].append(seconds * 1e3)
        step_ms = {name: median(v) for name, v in rounds.items()}
        nbytes = output.numel() * output.element_size()
        points.append({"pp": pp, "shape": list(shape), "dtype": act["dtype"], "bytes": nbytes,
                       "steps": cfg["steps"] * cfg["rounds"], "step_ms": step_ms, "rounds_ms": rounds})
        say(f"pipeline pp={pp} {human_bytes(nbytes):>7} {act['dtype']:>8}  " +
            "  ".join(f"{n} {v:8.3f} ms" for n, v in step_ms.items()))
    return points
