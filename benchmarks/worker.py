"""One torchrun job of the benchmark suite (started by launch.py): sets up gloo and this
package's communicators, runs the sections named in MP_BENCH_PARAMS (each on the first n ranks),
and rank 0 writes their figures to MP_BENCH_RESULT. SIGUSR1 dumps every thread's stack.

Every section is repeated `repeats` times: bandwidth and pipeline interleave their repetitions
with their baselines inside one call; latency and overhead measure one repetition per call
(their baselines interleaved inside it), so they are called once per repetition here and
report a list of repetitions."""
from __future__ import annotations

import datetime
import faulthandler
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

# Run as a script: the sections sit beside this file, the package in the source tree above.
sys.path.append(str(Path(__file__).resolve().parents[1]))

import bandwidth  # noqa: E402
import latency  # noqa: E402
import overhead  # noqa: E402
import pipeline  # noqa: E402
import pipelining  # noqa: E402
import stock  # noqa: E402

import megatron_p2p as mp  # noqa: E402


def main() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    params = json.loads(os.environ["MP_BENCH_PARAMS"])
    torch.set_num_threads(1)  # ranks share the cores; the memcpy baseline is single-thread
    timeout = float(params.get("timeout", 120))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
    me = dist.get_rank()
    sections = params["sections"]
    # A section runs on the first n ranks (its pipeline group); the others wait for it in a
    # barrier, asleep. Groups are made collectively, in one order, by every rank.
    sizes = sorted({cfg["ranks"] for name, cfg in sections.items() if name != "pipeline"} |
                   set(sections.get("pipeline", {}).get("pp", [])))
    groups = {n: dist.new_group(list(range(n)), backend="gloo") for n in sizes}
    comms = {n: mp.init_communicator(group=groups[n], timeout=timeout) for n in sizes if me < n}
    results: dict = {"ranks": dist.get_world_size()}
    start = time.perf_counter()
    for name, cfg in sections.items():
        for n in cfg["pp"] if name == "pipeline" else [cfg["ranks"]]:
            if me < n:
                if name in REPEATED_HERE:
                    out = [SECTIONS[name](comms[n], groups[n], cfg) for _ in range(cfg["repeats"])]
                else:
                    out = SECTIONS[name](comms[n], groups[n], cfg)
                results[name] = results.get(name, []) + out if name == "pipeline" else out
            dist.barrier()
    if "pipeline" in sections:
        results["stock"] = stock.describe()
    results["seconds"] = time.perf_counter() - start
    for comm in comms.values():
        comm.close()
    if me == 0:
        path = Path(os.environ["MP_BENCH_RESULT"])
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(results, indent=1))
        os.replace(tmp, path)
    dist.destroy_process_group()


SECTIONS = {"latency": latency.run, "overhead": overhead.run, "bandwidth": bandwidth.run, "pipeline": pipeline.run,
            "pipelining": pipelining.run}
REPEATED_HERE = ("latency", "overhead")

if __name__ == "__main__":
    main()
