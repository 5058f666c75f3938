"""Runs program files on a real backend: `python -m megatron_p2p.replay FILE...` starts as many
ranks as the largest program has, under torchrun, and ends with the verdict; or, in a job you
launch yourself, `torchrun --nproc-per-node N -m megatron_p2p.replay FILE...`.

Each rank posts what the program says it posts (exchange calls through `comm.exchange`, steps
through `comm.batch` on their lane), waits where it says, and checks every received byte: a send
carries bytes derived from (sender, label), and the receiver compares them with those of the send
the program pairs it with. A program of `size` ranks runs on global ranks 0..size-1, on a fresh
communicator; several files run one after another.

Prints `replay: ok` and exits 0 when every file completed with exact data on every rank;
otherwise prints, per file, the verdict (mismatch, deadlock, timeout, data or error) with the
error each rank raised, and exits 1. `--json` prints one object per file instead, as
`megatron_p2p.check --json` does, so that the two verdicts can be compared.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..communicator import init_communicator
from . import program as prog
from ._cli import tool_parser

_KEY = "megatron_p2p/replay"
# Verdicts by precedence: one rank's MismatchError explains its peers' later failures, not the
# other way round.
_VERDICTS = ("mismatch", "data", "deadlock", "timeout", "error")
_STUCK = ("wait-for cycle", "closed the communicator without posting")


def payload(sender: int, label: str, nbytes: int) -> torch.Tensor:
    """The bytes a send from group rank `sender` with `label` carries (uint8, `nbytes` long)."""
    seed = zlib.crc32(f"{sender}\0{label}".encode())
    return ((torch.arange(nbytes, dtype=torch.int64) * 131 + seed) % 251).to(torch.uint8)


def _tensor(nbytes: int, dtype: str, device: torch.device, fill: torch.Tensor | None = None) -> torch.Tensor:
    raw = torch.zeros(nbytes, dtype=torch.uint8) if fill is None else fill
    return raw.to(device).view(getattr(torch, dtype))


def _send_labels(program: prog.Program) -> dict[tuple[int, int, int], list[str]]:
    """(src, dst, lane) -> labels of src's sends to dst on the lane, in issue order: the k-th
    receive on that channel must get the k-th of these."""
    out: dict[tuple[int, int, int], list[str]] = {}
    for r in range(program.size):
        for i in range(program.num_calls(r)):
            for step in program.call(r, i).steps:
                for op in step:
                    if op.kind == "send":
                        out.setdefault((r, op.peer, op.lane), []).append(op.label)
    return out


class _Rank:
    """One rank's run of one program."""

    def __init__(self, program: prog.Program, comm: Any, me: int, device: torch.device):
        self.program, self.comm, self.me, self.device = program, comm, me, device
        self.labels = _send_labels(program)
        self.seen: dict[tuple[int, int], int] = {}  # (src, lane) -> receives posted so far
        self.reqs: list[dict[Any, Any]] = []  # per call: its requests, by slot (exchange) or op index (steps)
        self.checks: list[tuple[Any, torch.Tensor, torch.Tensor, str]] = []  # (request, buffer, expected, what)

    def _recv_buffer(self, peer: int, lane: int, nbytes: int, dtype: str) -> tuple[torch.Tensor, torch.Tensor | None, str]:
        k = self.seen.get((peer, lane), 0)
        self.seen[(peer, lane)] = k + 1
        sends = self.labels.get((peer, self.me, lane), [])
        label = sends[k] if k < len(sends) else None
        expected = payload(peer, label, nbytes) if label is not None else None
        what = f"receive #{k} from rank {peer} on lane {lane} (label {label!r})"
        return _tensor(nbytes, dtype, self.device), expected, what

    def _post(self, call: prog.Call) -> dict[Any, Any]:
        ranks = self.comm.ranks
        posted: list[tuple[Any, torch.Tensor, torch.Tensor | None, str]] = []
        if call.exchange is not None:
            ex = call.exchange
            tensors: dict[str, torch.Tensor] = {}
            lanes = {op.slot: op.lane for step in call.steps for op in step}  # as the runtime's plan puts them
            for slot, (nbytes, dtype, label) in ex.ops.items():
                peer = ex.next if slot.endswith("next") else ex.prev
                if slot.startswith("send"):
                    tensors[slot] = _tensor(nbytes, dtype, self.device, payload(self.me, label, nbytes))
                else:
                    buf, expected, what = self._recv_buffer(peer, lanes[slot], nbytes, dtype)
                    tensors[slot] = buf
                    posted.append((slot, buf, expected, what))
            reqs = self.comm.exchange(**tensors, mode=ex.mode, prev_rank=ranks[ex.prev], next_rank=ranks[ex.next],
                                      call=call.name or None)
            self.checks += [(reqs[slot], buf, exp, what) for slot, buf, exp, what in posted if exp is not None]
            return dict(reqs)
        out: list[Any] = []
        for step in call.steps:
            ops, recvs = [], []
            for op in step:
                if op.kind == "send":
                    ops.append((True, _tensor(op.bytes, op.dtype, self.device, payload(self.me, op.label, op.bytes)),
                                ranks[op.peer]))
                else:
                    buf, expected, what = self._recv_buffer(op.peer, op.lane, op.bytes, op.dtype)
                    recvs.append((len(ops), buf, expected, what))
                    ops.append((False, buf, ranks[op.peer]))
            reqs = self.comm.batch(ops, lane=step[0].lane, call=call.name or None)
            self.checks += [(reqs[i], buf, exp, what) for i, buf, exp, what in recvs if exp is not None]
            out += reqs
        return dict(enumerate(out))

    def finished_failures(self) -> list[BaseException]:
        """What the finished ops raise: a rank that stops at one failure may hold others that
        explain it (a receive that mismatched before the rank blocked elsewhere)."""
        out: list[BaseException] = []
        for reqs in self.reqs:
            for r in reqs.values():
                if r.is_completed():
                    try:
                        r.wait()
                    except Exception as exc:  # collected, not raised
                        out.append(exc)
        return out

    def _wait(self, request: Any) -> None:
        """The program's wait: the rank posts nothing until the op is done. On NCCL, wait() only
        orders the current stream, so the host waits too (synchronize(), where the stall
        analysis names a deadlock instead of the device hanging)."""
        request.wait()
        if self.device.type == "cuda":
            request.synchronize()

    def run(self) -> None:
        for i in range(self.program.num_calls(self.me)):
            call = self.program.call(self.me, i)
            for a in call.awaits:  # a whole earlier call, or (call, slot or op index)
                for r in (self.reqs[a].values() if isinstance(a, int) else [self.reqs[a[0]][a[1]]]):
                    self._wait(r)
            self.reqs.append(self._post(call))
            if call.wait:
                for r in self.reqs[-1].values():
                    self._wait(r)
        for reqs in self.reqs:
            for r in reqs.values():
                self._wait(r)
        for _, buf, expected, what in self.checks:
            got = buf.view(torch.uint8).cpu()
            if not torch.equal(got, expected):
                bad = int((got != expected).nonzero()[0])
                raise _DataError(f"rank {self.me}: {what} holds wrong bytes from byte {bad} on")


class _DataError(RuntimeError):
    """A receive completed with bytes other than its matched send's."""


def _classify(exc: BaseException) -> str:
    import megatron_p2p as mp
    if isinstance(exc, mp.MismatchError):
        return "mismatch"
    if isinstance(exc, _DataError):
        return "data"
    # Stuck for good: a wait-for cycle, or a wait on a rank that finished without posting the
    # partner (the checker's "deadlock" covers both).
    if isinstance(exc, mp.DeadlockError) or any(why in str(exc) for why in _STUCK):
        return "deadlock"
    if isinstance(exc, mp.P2PTimeoutError):
        return "timeout"
    return "error"


def _run_one(program: prog.Program, backend: str, timeout: float, me: int) -> dict[str, Any]:
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", me)) % max(1, torch.cuda.device_count()))
        torch.cuda.set_device(device)
    group = dist.new_group(list(range(program.size)))
    if me >= program.size:
        return {"rank": me, "outcome": "idle"}
    try:
        with init_communicator(group, backend, timeout, lanes=program.lanes, eager_threshold=program.eager_threshold,
                               device=device if backend == "nccl" else None) as comm:
            rank = _Rank(program, comm, me, device)
            try:
                rank.run()
            except Exception as exc:
                raise min([exc, *rank.finished_failures()], key=lambda e: _VERDICTS.index(_classify(e))) from None
    except Exception as exc:  # the verdict is what was raised
        return {"rank": me, "outcome": _classify(exc), "error": f"{type(exc).__name__}: {exc}"}
    return {"rank": me, "outcome": "ok"}


def _verdict(results: Sequence[dict[str, Any]]) -> tuple[str, list[int]]:
    outcomes = [r["outcome"] for r in results if r["outcome"] != "idle"]
    for verdict in _VERDICTS:
        if verdict in outcomes:
            return verdict, [r["rank"] for r in results if r["outcome"] == verdict]
    return "ok", []


def main(argv: Sequence[str] | None = None) -> int:
    parser = tool_parser("replay", __doc__)
    parser.add_argument("files", nargs="+", metavar="FILE", help="program files (megatron_p2p.program/1)")
    parser.add_argument("--backend", choices=("shm", "nccl"), default="shm")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds any wait may block (default 60)")
    parser.add_argument("--json", action="store_true", help="one JSON object per file, as check --json prints")
    parser.add_argument("--verdict-file", help=argparse.SUPPRESS)  # from _launch: rank 0 leaves its exit status there
    args = parser.parse_args(argv)
    if not args.timeout > 0:
        parser.error(f"--timeout must be positive, got {args.timeout}")
    try:
        programs = [prog.load(path) for path in args.files]
    except (OSError, prog.ProgramError) as exc:
        print(f"replay: {exc}", file=sys.stderr)
        return 2
    if "WORLD_SIZE" not in os.environ:
        return _launch(list(sys.argv[1:] if argv is None else argv), max(p.size for p in programs))
    world = int(os.environ["WORLD_SIZE"])
    for path, program in zip(args.files, programs):
        problem = None
        if program.size > world:
            problem = f"it has {program.size} ranks; run it with --nproc-per-node {program.size} or more"
        elif args.backend == "nccl" and program.eager_threshold:
            problem = "eager_threshold is an shm setting; NCCL decides its own buffering"
        if problem:
            print(f"replay: {path}: {problem}", file=sys.stderr)
            return 2

    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout * 4 + 60))
    me = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    failed = False
    for index, (path, program) in enumerate(zip(args.files, programs)):
        result = _run_one(program, args.backend, args.timeout, me)
        store.set(f"{_KEY}/{index}/{me}", json.dumps(result))
        dist.barrier()
        if me != 0:
            continue
        results = [json.loads(store.get(f"{_KEY}/{index}/{r}")) for r in range(world)]
        verdict, ranks = _verdict(results)
        failed |= verdict != "ok"
        errors = {r["rank"]: r["error"] for r in results if "error" in r}
        if args.json:
            print(json.dumps({"file": path, "verdict": verdict, "ranks": ranks, "errors": errors}), flush=True)
        else:
            print(f"{path}: {verdict.upper()}" + (f" (ranks {', '.join(map(str, ranks))})" if ranks else ""))
            for r, err in sorted(errors.items()):
                print(f"  rank {r}: {err.splitlines()[0]}")
            if ranks:  # the whole report once: the ranks of one verdict tell the same story
                print("  " + "\n  ".join(errors[ranks[0]].splitlines()[1:]))
    if me == 0 and not args.json and not failed:
        print("replay: ok")
    dist.barrier()
    dist.destroy_process_group()
    status = 1 if failed and me == 0 else 0
    if args.verdict_file is not None:  # launched by _launch, which exits with it: torchrun sees success
        if me == 0:
            Path(args.verdict_file).write_text(str(status))
        return 0
    return status


def _launch(argv: list[str], nproc: int) -> int:
    """Runs this command under torchrun on `nproc` ranks and exits with rank 0's verdict, so that
    the verdict is the last thing printed: a failed rank's status would bring torchrun's own
    report of the failure after it."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="mp2p-replay-") as tmp:
        verdict = Path(tmp) / "status"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "megatron_p2p.replay", "--verdict-file", str(verdict), *argv]
        done = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
        if verdict.exists():
            return int(verdict.read_text())
        print(f"replay: the ranks ended without a verdict (torchrun exited with status {done.returncode})",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
