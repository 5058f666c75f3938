"""torch.distributed.pipelining's ScheduleInterleaved1F1B step, torch's own p2p over gloo against
the same schedule under megatron_p2p.patch_pipelining() (shm): two stages per rank, activations
of 8 MiB per microbatch (float32 [2048, 1024]), 2·pp microbatches, stages that scale by one
learned scalar (so that the step is nearly all communication). The two contenders take turns,
one round each, so a burst of load hits them alike; each round gives a ratio (gloo's step time
over megatron_p2p's), and the median ratio is reported.

    .venv/bin/python benchmarks/pipelining.py                  # pp 2 and 4, 5 rounds
    .venv/bin/python benchmarks/pipelining.py --pp 2 --rounds 1 --steps 1   # smoke

Each pp is one torchrun job of benchmarks/worker.py (section "pipelining", run() below)."""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
ROWS, WIDTH = 2048, 1024  # float32: 8 MiB per microbatch


def _schedule(pipelining: Any, group: Any, pp: int, rank: int, n_mb: int) -> Any:
    from torch import nn

    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.w

    stages = [pipelining.PipelineStage(Scale(), s, 2 * pp, torch.device("cpu"), group=group,
                                       input_args=(torch.empty(ROWS, WIDTH, requires_grad=s > 0),),
                                       output_args=(torch.empty(ROWS, WIDTH, requires_grad=True),))
              for s in (rank, rank + pp)]
    return pipelining.ScheduleInterleaved1F1B(stages, n_microbatches=n_mb, loss_fn=lambda out, y: out.mean())


def run(comm: Any, group: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """The worker's section: per round, seconds per step of each contender, on this group."""
    import torch.distributed.pipelining as pipelining
    from timing import median, say, timed_loop

    import megatron_p2p as mp

    pp, rank = dist.get_world_size(group), dist.get_rank(group)
    n_mb = 2 * pp
    gloo = _schedule(pipelining, group, pp, rank, n_mb)
    ours = _schedule(pipelining, group, pp, rank, n_mb)  # the patch decides, at each step, what it calls
    x = torch.randn(n_mb * ROWS, WIDTH)  # the input on the first rank, the (unused) target on the last
    is_last = rank == pp - 1

    def step(sched: Any) -> None:
        sched.step(*([x] if rank == 0 else []), **({"target": x} if is_last else {}))

    rounds: dict[str, list[float]] = {"gloo": [], "megatron_p2p": []}
    for _ in range(cfg["rounds"]):
        rounds["gloo"].append(timed_loop(lambda: step(gloo), cfg["steps"], cfg["warmup"], group) * 1e3)
        with mp.patch_pipelining(comm):  # the timing's barrier and all_reduce stay torch's own
            rounds["megatron_p2p"].append(timed_loop(lambda: step(ours), cfg["steps"], cfg["warmup"], group) * 1e3)
    ratios = [g / o for g, o in zip(rounds["gloo"], rounds["megatron_p2p"])]
    out = {"pp": pp, "microbatches": n_mb, "activation_bytes": ROWS * WIDTH * 4, "rounds_ms": rounds,
           "step_ms": {k: median(v) for k, v in rounds.items()}, "ratio": median(ratios),
           "ratio_range": [min(ratios), max(ratios)]}
    say(f"pipelining Interleaved1F1B pp={pp}: gloo {out['step_ms']['gloo']:.1f} ms, megatron_p2p "
        f"{out['step_ms']['megatron_p2p']:.1f} ms per step; gloo / megatron_p2p {out['ratio']:.2f} "
        f"[{min(ratios):.2f}-{max(ratios):.2f}]")
    return out


def main() -> int:
    sys.path.insert(0, str(HERE))
    import launch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="mp2p-pipelining-") as tmp:
        for pp in args.pp:
            section = {"ranks": pp, "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup}
            res = launch.run_job(f"pipelining_pp{pp}", pp, {"sections": {"pipelining": section}, "timeout": 120},
                                 Path(tmp), limit_s=300)
            if res.returncode != 0 or res.result is None:
                print(f"FAILED: pp {pp} (status {res.returncode}{', timed out' if res.timed_out else ''})")
                return 1
            results.append(res.result["pipelining"])
    for r in results:
        print(f"pp {r['pp']}: gloo {r['step_ms']['gloo']:.1f} ms, megatron_p2p {r['step_ms']['megatron_p2p']:.1f} ms "
              f"per step; ratio {r['ratio']:.2f} [{r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f}]")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
