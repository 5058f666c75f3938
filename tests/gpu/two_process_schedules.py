"""The schedule parts of the two-process device checks (two_process_worker.py runs them): real
pipeline schedules over megatron_p2p's NCCL backend, bit for bit against runs without it.

- megatron_schedules: megatron-core's 1F1B (pp 2) and interleaved (pp 2, vpp 2, variable
  sequence lengths) schedules with megatron_p2p's P2PCommunicator passed in, against the same
  model and microbatches in one process on the same device: losses and every gradient equal
  (tests/workers/megatron_dropin.py's reference_run and run_schedule);
- torch_pipelining: torch.distributed.pipelining's Schedule1F1B and ScheduleInterleaved1F1B (two
  stages a rank), stage shapes given and inferred (the metadata round), under
  patch_pipelining(comm), against torch's own p2p: ProcessGroupNCCL on a GPU, gloo on the model,
  where torch has no NCCL (tests/workers/pipelining_runs.py's run_once and same_bits).

On a GPU nothing is shimmed: CUDA tensors, megatron-core and torch as they are. On the model
(MP_GPU_TARGET=model) tensors are CPU memory and the host is the compute: megatron-core runs
under megatron_dropin's CPU shim, and megatron_p2p gets those CPU tensors as fake CUDA ones
whose wait() also synchronizes (nccl_model_backend.ModelComm).

Both need two ranks: a lone rank (the self-loop) reports them as not run. Each initialises
torch.distributed's default group (gloo) when it is not yet, and leaves it initialised for the
parts after it. megatron-core (pure Python) must be importable where they run.

    from two_process_schedules import PARTS   # {"megatron_schedules": ..., "torch_pipelining": ...}
"""
from __future__ import annotations

import contextlib
import datetime
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import target  # first: puts tests/workers on sys.path  # isort: skip
from two_process_common import T  # isort: skip  # T: the target the worker installs; only torch_device is used

import megatron_p2p as mp  # isort: skip

import megatron_dropin  # isort: skip
import pipelining_runs  # isort: skip
from nccl_model_backend import Backend, ModelComm, SettlingRequest  # isort: skip

TIMEOUT_S = 30.0
HIDDEN = 8
MICROBATCHES = 4
# name, megatron_dropin.run_schedule's kind, vpp, variable_seq_lengths (batch_p2p_comm on, no overlap)
MEGATRON_RUNS = [("1F1B pp2", "1f1b", None, False), ("interleaved pp2 vpp2 variable", "interleaved", 2, True)]
# pipelining_runs' configurations: class, stages per rank, microbatches, example tensors given
PIPELINING_CONFIGS = [("1F1B", 1, MICROBATCHES, True), ("1F1B", 1, MICROBATCHES, False),
                      ("Interleaved1F1B", 2, MICROBATCHES, True), ("Interleaved1F1B", 2, MICROBATCHES, False)]


def _lone_rank() -> dict | None:
    """The result of a part on a lone rank (pp 2 needs two), else None."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return {"detail": "not run: one rank (the self-loop)", "skipped": True}
    if world != 2:
        raise ValueError(f"the schedule parts run on two ranks, not {world}")
    return None


def _default_group() -> None:
    """gloo on both targets: the schedules' own traffic never crosses it (only group creation,
    and the shapes of tp/cp groups of one rank, do)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=2 * TIMEOUT_S))


class _CudaBackend:
    """nccl_model_backend.Backend("nccl") for a GPU: the tensors are CUDA ones already."""

    name, nccl = "nccl", True

    @staticmethod
    def comm(comm: mp.Communicator) -> mp.Communicator:
        return comm


def _same(a: list | None, b: list | None) -> bool:
    """torch.equal on float32 tensors: the lists hold float32 values as Python floats, exactly."""
    if a is None or b is None or len(a) != len(b) or any(v is None for v in a + b):
        return False
    return torch.equal(torch.tensor(a, dtype=torch.float32), torch.tensor(b, dtype=torch.float32))


def _megatron_differences(name: str, got: dict, ref: dict, last: bool) -> list[str]:
    bad = [] if _same(got["losses"], ref["losses"]) else [f"{name}: losses {got['losses']} != {ref['losses']}"]
    if last and len(ref["losses"]) != MICROBATCHES:
        bad.append(f"{name}: {len(ref['losses'])} losses on the last stage, expected {MICROBATCHES}")
    if [len(c) for c in got["grads"]] != [len(c) for c in ref["grads"]]:
        shapes = [[len(c) for c in run["grads"]] for run in (got, ref)]
        return bad + [f"{name}: parameters per chunk {shapes[0]} != {shapes[1]}"]
    bad += [f"{name}: chunk {c} parameter {p}'s gradient" for c, (gs, rs) in enumerate(zip(got["grads"], ref["grads"]))
            for p, (g, r) in enumerate(zip(gs, rs)) if not _same(g, r)]
    return bad


def part_megatron_schedules() -> dict:
    """megatron-core's 1F1B (pp 2) and interleaved (pp 2, vpp 2, variable lengths) schedules with
    our P2PCommunicator on NCCL: losses and every gradient equal to one process's run."""
    if (skipped := _lone_rank()) is not None:
        return skipped
    model = target.on_model()
    try:  # before any collective: a rank without megatron-core fails here, its peer too
        # On the model: Backend first, then the shim replaces its torch.cuda stand-ins (as megatron_dropin.body).
        backend: Any = Backend("nccl") if model else _CudaBackend()
        shim = megatron_dropin.prepare() if model else contextlib.nullcontext
        from megatron.core.model_parallel_config import ModelParallelConfig
        from megatron.core.pipeline_parallel import schedules  # noqa: F401 - the slow import, here
    except ImportError as exc:
        raise ImportError(f"megatron-core is not importable ({exc}); it is pure Python: carry its megatron/ "
                          "directory with the tree and put its parent on PYTHONPATH") from exc

    _default_group()
    rank = dist.get_rank()
    pp_group = dist.new_group([0, 1])
    selves = [dist.new_group([r]) for r in range(2)]  # tp and cp of one rank; collective, so every rank makes both
    ctx = {"torch": torch, "dist": dist, "mp": mp, "rank": rank, "timeout": TIMEOUT_S, "MPC": ModelParallelConfig,
           "cuda_to_cpu": shim, "backend": backend, "device": T.torch_device, "groups": {(0, 1): pp_group},
           "self_group": selves[rank], "hidden": HIDDEN, "microbatches": MICROBATCHES}
    bad: list[str] = []
    seconds = {}
    with megatron_dropin.our_comm(ctx, pp_group) as comm:
        ctx["comms"] = {(0, 1): comm}
        for name, kind, vpp, variable in MEGATRON_RUNS:
            start = time.monotonic()
            ref = megatron_dropin.reference_run(ctx, [0, 1], vpp, variable)
            got = megatron_dropin.run_schedule(ctx, kind, [0, 1], vpp, True, variable, False, "swapped")
            seconds[name] = round(time.monotonic() - start, 2)
            bad += _megatron_differences(name, got, ref, last=rank == 1)
        sends = comm.stats()["sends"]
    assert sends > 0, "megatron-core's schedules sent nothing through megatron_p2p"
    assert not bad, f"{len(bad)} differences from the one-process run: " + "; ".join(bad[:6])
    what = "losses and" if rank == 1 else "(losses on rank 1) and"
    return {"detail": f"{' and '.join(n for n, *_ in MEGATRON_RUNS)} ({MICROBATCHES} microbatches, hidden {HIDDEN}, "
                      f"{sends} sends): {what} every gradient bit-equal to one process on {T.torch_device} "
                      f"({target.name()})",
            "seconds_per_schedule": seconds, "sends": sends}


class _PipeliningModelComm(ModelComm):
    """ModelComm with the one-op posts that patch_pipelining's ops make (isend, irecv)."""

    def isend(self, tensor: torch.Tensor, peer: int, **kw: Any) -> SettlingRequest:
        return SettlingRequest(self._comm.isend(self._backend.tensor(tensor), peer, **kw), self._backend)

    def irecv(self, tensor: torch.Tensor, peer: int, **kw: Any) -> SettlingRequest:
        return SettlingRequest(self._comm.irecv(self._backend.tensor(tensor), peer, **kw), self._backend)


@contextlib.contextmanager
def _patched(comm: mp.Communicator) -> Iterator[None]:
    """patch_pipelining(comm). On the model its proxy's p2p functions are swapped for the
    package's own, bound to `comm` through _PipeliningModelComm (patch_pipelining takes only a
    real communicator, which refuses the CPU tensors)."""
    with mp.patch_pipelining(comm) as patch:
        if target.on_model():
            from megatron_p2p import pipelining_patch

            # a stand-in for the real communicator _proxy is typed for (see above)
            own = pipelining_patch._proxy(_PipeliningModelComm(comm, Backend("nccl")))  # type: ignore[arg-type]
            for name in pipelining_patch.P2P_NAMES:
                setattr(patch.dist, name, getattr(own, name))
        yield


@contextlib.contextmanager
def _destroyed(group: dist.ProcessGroup | None) -> Iterator[None]:
    """Destroys torch's NCCL group on leaving: its communicators would outlive the part (and
    torch warns at exit about a group never destroyed); the default group stays."""
    try:
        yield
    finally:
        if group is not None:
            dist.destroy_process_group(group)


def part_torch_pipelining() -> dict:
    """torch.distributed.pipelining's 1F1B and Interleaved1F1B over megatron_p2p (patch_pipelining)
    against torch's own p2p: losses, eval outputs and gradients bitwise equal."""
    if (skipped := _lone_rank()) is not None:
        return skipped
    from torch.distributed import pipelining

    _default_group()
    device = T.torch_device
    # torch's own run: its NCCL on a GPU; the model has no torch NCCL, so gloo (the default group).
    theirs_group = None if target.on_model() else dist.new_group(backend="nccl")
    theirs_backend = dist.get_backend(theirs_group)
    bad, messages = [], {}
    with mp.init_communicator(backend="nccl", timeout=TIMEOUT_S) as comm, _destroyed(theirs_group):
        def posted() -> int:
            stats = comm.stats()
            return stats["sends"] + stats["recvs"]

        for cfg in PIPELINING_CONFIGS:
            name = f"{cfg[0]} spr{cfg[1]} {'given' if cfg[3] else 'inferred'}"
            theirs = pipelining_runs.run_once(torch, nn, pipelining, cfg, seed=7, device=device, group=theirs_group)
            before = posted()
            with _patched(comm):  # the stages over the default group: every p2p call goes to `comm`
                ours = pipelining_runs.run_once(torch, nn, pipelining, cfg, seed=7, device=device)
            messages[name] = posted() - before
            equal = pipelining_runs.same_bits(ours, theirs)
            bad += [f"{name}: {k} ({equal['n_' + k]})" for k in ("losses", "eval", "grads") if not equal[k]]
            if not messages[name]:
                bad.append(f"{name}: nothing went through megatron_p2p")
            if dist.get_rank() == 1 and not equal["n_losses"]:
                bad.append(f"{name}: no losses on the last stage")
    assert not bad, f"differences from torch's own run over {theirs_backend}: " + "; ".join(bad)
    return {"detail": f"{', '.join(messages)} ({MICROBATCHES} microbatches; step, eval, step): losses, eval outputs "
                      f"and gradients bitwise equal to torch's own p2p over {theirs_backend}, on {device} "
                      f"({target.name()})",
            "messages": messages, "theirs": theirs_backend}


PARTS: dict[str, Callable[[], dict]] = {"megatron_schedules": part_megatron_schedules,
                                        "torch_pipelining": part_torch_pipelining}
