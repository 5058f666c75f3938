"""What the two-process device checks' parts share (two_process_worker.py runs them): the device
(target.py: a GPU, or the model of libcuda and libnccl, MP_GPU_TARGET=model), payloads that a
receiver can rebuild, the package's calls with bounded waits, and Megatron's 1F1B steps."""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.append(str(Path(__file__).resolve().parents[2]))  # the source tree, when not installed
import target  # noqa: E402

import megatron_p2p as mp  # noqa: E402

T = target.make()  # a GPU, or the model (the dry run)
WATCHDOG_TIMEOUT_S = 3.0
STALL_S = 2 * WATCHDOG_TIMEOUT_S  # a stream sleep longer than the watchdog's timeout
MICROBATCHES = 4
# bytes; the model copies on the CPU, where 64 MiB in each of the 24 configurations costs 35 s
SIZES = [0, 1, 8, 4097, 1 << 20] + ([] if target.on_model() else [64 << 20])
DTYPES = ["float32", "bfloat16", "uint8", "int64", "bool", "float8_e5m2"]


# ---- helpers ---------------------------------------------------------------------------------------

def pattern(nbytes: int, dtype: torch.dtype, *key: Any) -> torch.Tensor:
    """Bytes that depend only on `key`, so a receiver can rebuild what its peer sent."""
    gen = torch.Generator(device=T.torch_device)
    gen.manual_seed(zlib.crc32(repr(key).encode()))
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes // size * size,), dtype=torch.uint8, device=T.torch_device, generator=gen)
    return T.own((raw & 1).bool() if dtype == torch.bool else raw.view(dtype))


def zeros(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return T.own(torch.zeros(*shape, dtype=dtype, device=T.torch_device))


def full(numel: int, value: float) -> torch.Tensor:
    return T.own(torch.full((numel,), value, device=T.torch_device))


def empty_like(t: torch.Tensor) -> torch.Tensor:
    return T.own(torch.empty_like(t))


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    T.wait_stream()  # what the device wrote, before the host reads it
    return a.numel() == b.numel() and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def communicator(**kwargs: Any) -> mp.Communicator:
    return mp.init_communicator(backend="nccl", timeout=kwargs.pop("timeout", 30.0), **kwargs)


def checked_communicator(**kwargs: Any) -> mp.Communicator:
    """A communicator with debug matching: MEGATRON_P2P_CHECK=1, read when it is created."""
    os.environ["MEGATRON_P2P_CHECK"] = "1"
    try:
        return communicator(**kwargs)
    finally:
        del os.environ["MEGATRON_P2P_CHECK"]


def disagreement(comm: mp.Communicator, ops: mp._C._ExchangeTensors, call: str,
                 sender: bool) -> tuple[BaseException | None, float, str]:
    """Posts an exchange its peer disagrees with and waits: (what this rank raised, seconds from
    the post, where it heard). NCCL may complete a small send before its receive is posted; the
    receiver's verdict then reaches the sender's next call."""
    posted = time.monotonic()
    exc, _ = raised(lambda: settle(comm.exchange(**ops, call=call), timeout=10.0))
    heard = "at its synchronize"
    if exc is None and sender:
        time.sleep(1.0)
        exc, _ = raised(lambda: comm.exchange(send_next=full(4, 1.0), call="after_mismatch"))
        heard = "at its next call"
    return exc, time.monotonic() - posted, heard


def settle(reqs: Any, timeout: float = 30.0) -> None:
    """The GPU way (the current stream waits), then a bounded host wait."""
    reqs = list(reqs.values()) if isinstance(reqs, dict) else list(reqs)
    for r in reqs:
        r.wait()
    for r in reqs:
        r.synchronize(timeout=timeout)


def raised(fn: Callable[[], Any]) -> tuple[BaseException | None, float]:
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the parts assert on what was raised
        return exc, time.monotonic() - start
    return None, time.monotonic() - start


def silent(comm: mp.Communicator) -> bool:
    """The rank that never posts in the watchdog parts: rank 1 of two."""
    return comm.size > 1 and comm.rank == 1


def stall_or_skip(comm: mp.Communicator, x: torch.Tensor, y: torch.Tensor) -> Any:
    """An exchange that cannot complete within the timeout: the peer stays silent, or a lone
    rank's stream sleeps ahead of it. Returns its requests (None on the silent rank)."""
    if silent(comm):
        return None
    if comm.size == 1:
        T.sleep(STALL_S)
    return comm.exchange(send_next=x, recv_prev=y, call="stalled")


class WatchdogLog(logging.Handler):
    """Prints the watchdog's reports and notes when the first one came."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.first_at: float | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.first_at is None:
            self.first_at = time.monotonic()
        print(f"[rank {os.environ.get('RANK')}] log {record.name}: {record.getMessage()[:1500]}", flush=True)


WATCHDOG_LOG = WatchdogLog()


class OneFOneB:
    """Two pipeline stages running 1F1B over MICROBATCHES microbatches on static buffers: the
    first stage sends activations and receives gradients, the last stage the reverse. Each
    call carries one step of each stage this rank plays, as Megatron's schedule issues them."""

    def __init__(self, comm: mp.Communicator, numel: int):
        self.comm = comm
        self.first = comm.size == 1 or comm.rank == 0
        self.last = comm.size == 1 or comm.rank == comm.size - 1
        self.numel = numel

        def buffers(needed: bool) -> list[torch.Tensor]:
            return [zeros(numel) for _ in range(MICROBATCHES)] if needed else []

        self.act_out, self.grad_in = buffers(self.first), buffers(self.first)
        self.act_in, self.grad_out = buffers(self.last), buffers(self.last)

    def _input(self, kind: str, run: int, m: int, sender: int) -> torch.Tensor:
        return pattern(self.numel * 4, torch.float32, kind, run, m, sender)

    def load(self, run: int) -> None:
        """Writes run `run`'s values into the send buffers, as a training step's compute would."""
        T.wait_stream()  # after the device's last reads of them
        for m in range(MICROBATCHES):
            for kind, bufs in (("act", self.act_out), ("grad", self.grad_out)):
                if bufs:
                    bufs[m].copy_(self._input(kind, run, m, self.comm.rank))

    def received(self) -> torch.Tensor:
        T.wait_stream()
        return torch.cat([t.view(torch.uint8) for t in self.act_in + self.grad_in])

    def expected(self, run: int) -> torch.Tensor:
        acts = [self._input("act", run, m, self.comm.prev_rank) for m in range(MICROBATCHES)] if self.last else []
        grads = [self._input("grad", run, m, self.comm.next_rank) for m in range(MICROBATCHES)] if self.first else []
        return torch.cat([t.view(torch.uint8) for t in acts + grads])

    def step(self, mode: str) -> list:
        reqs: list[mp.Request] = []
        for k in range(MICROBATCHES + 1):
            ops: mp._C._ExchangeTensors = {}
            if self.first:
                if k < MICROBATCHES:
                    ops["send_next"] = self.act_out[k]
                if k > 0:
                    ops["recv_next"] = self.grad_in[k - 1]
            if self.last:
                if k < MICROBATCHES:
                    ops["recv_prev"] = self.act_in[k]
                if k > 0:
                    ops["send_prev"] = self.grad_out[k - 1]
            call = "warmup_forward" if k == 0 else "cooldown_backward" if k == MICROBATCHES else "steady_1f1b"
            reqs += self.comm.exchange(**ops, mode=mode, call=call).values()
        return reqs


def bounded(fn: Callable[[], Any], limit: float) -> tuple[bool, float, BaseException | None]:
    """Runs fn in a daemon thread joined with `limit`: (returned, seconds, what it raised)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - reported
            box["exc"] = exc

    start = time.monotonic()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(limit)
    return not t.is_alive(), time.monotonic() - start, box.get("exc")
