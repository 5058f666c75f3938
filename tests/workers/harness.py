"""Runs a worker body on one rank and writes what it returned (or raised) for the parent test.

The body gets the job's params (a dict). Stacks of every thread are dumped on SIGUSR1, which
the parent sends before it kills a job that passed its limit."""
from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# Workers import the package from the source tree when it is not installed.
sys.path.append(str(Path(__file__).resolve().parents[2]))


def caught(fn: Callable[[], Any]) -> dict[str, Any]:
    """What calling fn raised (type, its classes, message; type None when nothing), and how long
    it took: the record tests assert on."""
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:
        return {"type": type(exc).__name__, "mro": [c.__name__ for c in type(exc).__mro__], "msg": str(exc),
                "elapsed": time.monotonic() - start}
    return {"type": None, "elapsed": time.monotonic() - start}


def store_of_rank0(agent_store: Any, me: int, world: int) -> Any:
    """A TCPStore hosted by rank 0's process (not torchrun's agent store, which outlives it), made
    the default store through a gloo group, so that a communicator bootstraps and relays through
    it and it dies with rank 0."""
    import datetime

    import torch.distributed as dist

    if me == 0:
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
        agent_store.set("port", str(store.port))
    else:
        store = dist.TCPStore("127.0.0.1", int(agent_store.get("port")), world, is_master=False,
                              timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=me, world_size=world)
    return store


def barrier(name: str) -> None:
    """Every rank of the job has reached `name` (a key of torchrun's store) when this returns. A
    worker whose communicator has a short timeout meets here just before creating it: creation
    waits for the peers under that timeout, and ranks of a loaded machine (sanitizers, pytest's
    workers) start seconds apart."""
    from megatron_p2p.communicator import _env_rendezvous

    store, me, world = _env_rendezvous()
    store.set(f"harness/barrier/{name}/{me}", "1")
    store.wait([f"harness/barrier/{name}/{r}" for r in range(world)])


def run(body: Callable[[dict[str, Any]], Any]) -> None:
    rank = int(os.environ["RANK"])
    out = Path(os.environ["MP_RESULT_DIR"])
    stack_file = open(out / f"stack{rank}.txt", "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    params = json.loads(os.environ.get("MP_PARAMS", "{}"))
    result: dict[str, Any] = {"rank": rank}
    try:
        returned = body(params)
        if returned is not None:
            result["value"] = returned
        result["ok"] = True
    except BaseException as exc:  # the parent asserts on what was raised
        result.update(ok=False, error_type=type(exc).__name__, error=str(exc), traceback=traceback.format_exc())
    tmp = out / f"rank{rank}.json.tmp"
    tmp.write_text(json.dumps(result))
    os.replace(tmp, out / f"rank{rank}.json")


@contextlib.contextmanager
def environ(env: dict[str, str] | None) -> Iterator[None]:
    """`env` set in os.environ for the block (the model and the package read options at
    creation), and what was there before put back."""
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
