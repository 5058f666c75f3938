"""Pipeline-parallel training over megatron_p2p, checked bit for bit against one process.

    torchrun --standalone --nproc-per-node 4 -m megatron_p2p.demo [--mode parity|batched]

What it shows:
- A small MLP (8 Linear layers with tanh between them, float32) is cut into one pipeline stage
  per rank. The ranks train it with Megatron's non-interleaved 1F1B schedule: warmup forwards,
  a steady state in which every forward is paired with a backward through the combined
  exchanges send_forward_recv_backward / send_backward_recv_forward, then cooldown backwards.
  Every transfer is a single `comm.exchange(...)` call on the CPU shared-memory transport.
- Each rank also trains the whole model alone, from the same seed, on the same microbatches,
  accumulating gradients in the same order. Pipelining only moves work between processes; it
  does not change a single floating-point operation. So the per-step losses, and every stage's
  final parameters, must equal the single-process run bitwise, and the demo exits non-zero if
  they do not. (A schedule that ran backwards out of microbatch order, or lost or crossed a
  message, would change the gradient sums and show up here.)
- At the end, rank 0 prints every rank's p2p statistics: messages, bytes, and the time spent
  blocked in wait().

Runs on any number of ranks that divides the layer count (one rank: no communication at all).
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

import megatron_p2p as mp

if TYPE_CHECKING:
    from megatron_p2p import _C


@dataclass(frozen=True)
class Config:
    steps: int
    microbatches: int
    microbatch_size: int
    hidden: int
    layers: int
    out_features: int
    lr: float
    seed: int
    mode: str
    timeout: float


def parse_args(argv: list[str] | None = None) -> Config:
    p = argparse.ArgumentParser(
        prog="python -m megatron_p2p.demo",
        description="1F1B pipeline-parallel training over megatron_p2p, checked against a single-process run.",
    )
    p.add_argument("--steps", type=int, default=5, help="optimizer steps (default 5)")
    p.add_argument("--microbatches", type=int, default=8, help="microbatches per step (default 8)")
    p.add_argument("--microbatch-size", type=int, default=16, help="samples per microbatch (default 16)")
    p.add_argument("--hidden", type=int, default=128, help="width of the hidden layers (default 128)")
    p.add_argument("--layers", type=int, default=8, help="Linear layers; a multiple of the rank count (default 8)")
    p.add_argument("--lr", type=float, default=0.2, help="SGD learning rate (default 0.2)")
    p.add_argument("--seed", type=int, default=1234, help="seed of the weights and the data (default 1234)")
    p.add_argument("--mode", choices=mp._C.MODE_NAMES, default="parity",
                   help="how each exchange issues its ops: Megatron's parity order, or grouped (default parity)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds any p2p wait may block (default 60)")
    a = p.parse_args(argv)
    for name in ("steps", "microbatches", "microbatch_size", "hidden", "layers"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return Config(a.steps, a.microbatches, a.microbatch_size, a.hidden, a.layers, out_features=8, lr=a.lr,
                  seed=a.seed, mode=a.mode, timeout=a.timeout)


# ---- model and data: identical on every rank, derived from the seed alone ---------------------

def build_blocks(cfg: Config) -> list[nn.Module]:
    """The full model as a list of blocks (Linear + tanh, the last one a plain Linear), so that
    a stage is just a slice of it and every rank builds the same weights from the seed."""
    torch.manual_seed(cfg.seed)
    blocks: list[nn.Module] = []
    for i in range(cfg.layers):
        last = i == cfg.layers - 1
        linear = nn.Linear(cfg.hidden, cfg.out_features if last else cfg.hidden)
        blocks.append(linear if last else nn.Sequential(linear, nn.Tanh()))
    return blocks


def make_data(cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs [steps, microbatches, B, hidden] and regression targets [steps, microbatches, B, out]
    from a fixed random 'teacher'. Fresh samples every step; the offset gives the deep tanh net
    (whose output starts near zero) something it can learn within a few steps, so the printed
    loss visibly goes down."""
    g = torch.Generator().manual_seed(cfg.seed + 1)
    x = torch.randn(cfg.steps, cfg.microbatches, cfg.microbatch_size, cfg.hidden, generator=g)
    teacher = torch.randn(cfg.hidden, cfg.out_features, generator=g) / cfg.hidden ** 0.5
    y = 1.0 + torch.tanh(x @ teacher)
    return x, y


def microbatch_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def step_loss(losses: list[torch.Tensor]) -> torch.Tensor:
    # One function for both runs, so the reported number is computed identically.
    return torch.stack(losses).mean()


def make_optimizer(model: nn.Module, cfg: Config) -> torch.optim.Optimizer:
    # foreach=False: the same per-parameter kernels in both runs, whatever torch's default is.
    return torch.optim.SGD(model.parameters(), lr=cfg.lr, foreach=False)


# ---- the single-process reference ------------------------------------------------------------

def train_reference(model: nn.Module, cfg: Config, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """Plain gradient accumulation: forward and backward of each microbatch in order."""
    opt = make_optimizer(model, cfg)
    per_step: list[torch.Tensor] = []
    for step in range(cfg.steps):
        opt.zero_grad(set_to_none=True)
        losses = []
        for m in range(cfg.microbatches):
            loss = microbatch_loss(model(x[step, m]), y[step, m])
            (loss / cfg.microbatches).backward()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
            losses.append(loss.detach())
        opt.step()
        per_step.append(step_loss(losses))
    return per_step


# ---- one pipeline stage ------------------------------------------------------------------------

class Stage:
    """This rank's slice of the model and its side of the four pipeline transfers."""

    def __init__(self, comm: mp.Communicator, module: nn.Module, cfg: Config,
                 x: torch.Tensor, y: torch.Tensor) -> None:
        self.comm = comm
        self.module = module
        self.cfg = cfg
        self.x = x
        self.y = y
        self.first = comm.rank == 0
        self.last = comm.rank == comm.size - 1
        self.shape = (cfg.microbatch_size, cfg.hidden)  # every boundary activation has this shape

    # Each transfer is one exchange. The first stage has no previous stage and the last none
    # after it, so those slots are simply left out (not sent around the ring).
    def _exchange(self, send_next: torch.Tensor | None = None, recv_prev: torch.Tensor | None = None,
                  send_prev: torch.Tensor | None = None, recv_next: torch.Tensor | None = None) -> None:
        ops: _C._ExchangeTensors = {}
        if not self.last:
            if send_next is not None:
                ops["send_next"] = send_next
            if recv_next is not None:
                ops["recv_next"] = recv_next
        if not self.first:
            if recv_prev is not None:
                ops["recv_prev"] = recv_prev
            if send_prev is not None:
                ops["send_prev"] = send_prev
        if not ops:
            return
        for req in self.comm.exchange(**ops, mode=self.cfg.mode).values():
            req.wait()

    def _act_buffer(self) -> torch.Tensor | None:
        return None if self.first else torch.empty(self.shape)

    def _grad_buffer(self) -> torch.Tensor | None:
        return None if self.last else torch.empty(self.shape)

    @staticmethod
    def _as_input(buf: torch.Tensor | None) -> torch.Tensor | None:
        # Marked only after the receive has completed: the transport writes the raw bytes, and
        # the received activation must be an autograd leaf whose .grad goes back upstream.
        return None if buf is None else buf.requires_grad_()

    def recv_forward(self) -> torch.Tensor | None:
        buf = self._act_buffer()
        self._exchange(recv_prev=buf)
        return self._as_input(buf)

    def send_forward(self, output: torch.Tensor) -> None:
        self._exchange(send_next=output.detach())

    def recv_backward(self) -> torch.Tensor | None:
        buf = self._grad_buffer()
        self._exchange(recv_next=buf)
        return buf

    def send_backward(self, input_grad: torch.Tensor | None) -> None:
        self._exchange(send_prev=input_grad)

    def send_forward_recv_backward(self, output: torch.Tensor) -> torch.Tensor | None:
        buf = self._grad_buffer()
        self._exchange(send_next=output.detach(), recv_next=buf)
        return buf

    def send_backward_recv_forward(self, input_grad: torch.Tensor | None) -> torch.Tensor | None:
        buf = self._act_buffer()
        self._exchange(send_prev=input_grad, recv_prev=buf)
        return self._as_input(buf)

    def forward(self, step: int, m: int, inp: torch.Tensor | None,
                losses: list[torch.Tensor]) -> torch.Tensor:
        """The stage's output, or on the last stage the microbatch's scaled loss."""
        out: torch.Tensor = self.module(self.x[step, m] if self.first else inp)
        if not self.last:
            return out
        loss = microbatch_loss(out, self.y[step, m])
        losses.append(loss.detach())
        return loss / self.cfg.microbatches

    def backward(self, inp: torch.Tensor | None, out: torch.Tensor,
                 out_grad: torch.Tensor | None) -> torch.Tensor | None:
        # out_grad is None on the last stage: out is the loss. (torch leaves backward unannotated.)
        out.backward(out_grad)  # type: ignore[no-untyped-call]
        return None if inp is None else inp.grad

    def train_step(self, step: int) -> list[torch.Tensor]:
        """One optimizer step's forwards and backwards in 1F1B order (Megatron's
        forward_backward_pipelining_without_interleaving). Returns the microbatch losses on the
        last stage. Backwards run in microbatch order on every stage, so parameter gradients are
        summed in the same order as in the single-process run."""
        n = self.cfg.microbatches
        warmup = min(self.comm.size - self.comm.rank - 1, n)
        remaining = n - warmup
        inputs: list[torch.Tensor | None] = []
        outputs: list[torch.Tensor] = []
        losses: list[torch.Tensor] = []
        fwd = 0  # next microbatch to run forward

        for _ in range(warmup):
            inp = self.recv_forward()
            out = self.forward(step, fwd, inp, losses)
            fwd += 1
            self.send_forward(out)
            inputs.append(inp)
            outputs.append(out)

        inp = self.recv_forward() if remaining > 0 else None
        for i in range(remaining):
            out = self.forward(step, fwd, inp, losses)
            fwd += 1
            out_grad = self.send_forward_recv_backward(out)
            inputs.append(inp)
            outputs.append(out)
            input_grad = self.backward(inputs.pop(0), outputs.pop(0), out_grad)
            if i == remaining - 1:
                self.send_backward(input_grad)
            else:
                inp = self.send_backward_recv_forward(input_grad)

        for _ in range(warmup):
            out_grad = self.recv_backward()
            input_grad = self.backward(inputs.pop(0), outputs.pop(0), out_grad)
            self.send_backward(input_grad)

        assert fwd == n and not inputs and not outputs
        return losses

    def train(self, on_step: Callable[[int, torch.Tensor], None] | None = None) -> list[torch.Tensor]:
        """Every step; returns the per-step losses on the last stage (elsewhere: empty)."""
        opt = make_optimizer(self.module, self.cfg)
        per_step: list[torch.Tensor] = []
        for step in range(self.cfg.steps):
            opt.zero_grad(set_to_none=True)
            losses = self.train_step(step)
            opt.step()
            if self.last:
                per_step.append(step_loss(losses))
                if on_step is not None:
                    on_step(step, per_step[-1])
        return per_step


# ---- reporting -----------------------------------------------------------------------------------

STAT_FIELDS: tuple[Literal["sends", "recvs", "bytes_sent", "bytes_received", "wait_seconds"], ...] = (
    "sends", "recvs", "bytes_sent", "bytes_received", "wait_seconds")


def gather_to_rank0(comm: mp.Communicator, tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's copy of a same-shaped tensor, on rank 0 (elsewhere: an empty list). Rides on
    the communicator itself, so the demo needs nothing from torch.distributed."""
    if comm.rank != 0:
        comm.isend(tensor, comm.ranks[0]).wait()
        return []
    got = [tensor]
    for r in range(1, comm.size):
        buf = torch.empty_like(tensor)
        comm.irecv(buf, comm.ranks[r]).wait()
        got.append(buf)
    return got


def print0(comm: mp.Communicator, *args: object) -> None:
    if comm.rank == 0:
        print(*args, flush=True)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    # One thread and deterministic kernels: the same matmul must give the same bits in the
    # pipeline stage and in the reference, whatever else the machine is doing.
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    comm = mp.init_communicator(backend="shm", timeout=cfg.timeout)
    with comm:
        if cfg.layers % comm.size:
            # Every rank sees the same numbers and stops here, so none is left waiting.
            print0(comm, f"error: {cfg.layers} layers do not split evenly over {comm.size} ranks; "
                         f"pass --layers a multiple of {comm.size}")
            return 2
        per_stage = cfg.layers // comm.size
        print0(comm, f"megatron_p2p demo: {cfg.layers}-layer MLP (hidden {cfg.hidden}) in {comm.size} stages "
                     f"of {per_stage} layers; 1F1B, {cfg.microbatches} microbatches of {cfg.microbatch_size} "
                     f"per step, {cfg.steps} SGD steps, exchange mode {cfg.mode!r}")

        x, y = make_data(cfg)
        blocks = build_blocks(cfg)
        reference = nn.Sequential(*copy.deepcopy(blocks))
        t0 = time.perf_counter()
        ref_losses = train_reference(reference, cfg, x, y)
        ref_seconds = time.perf_counter() - t0

        lo = comm.rank * per_stage
        stage = Stage(comm, nn.Sequential(*blocks[lo:lo + per_stage]), cfg, x, y)

        def report(step: int, loss: torch.Tensor) -> None:
            ref = ref_losses[step]
            verdict = "bitwise equal" if torch.equal(loss, ref) else f"DIFFERS by {(loss - ref).item():+.3e}"
            print(f"[rank {comm.rank}, last stage] step {step + 1}/{cfg.steps}: loss {loss.item():.9g}  "
                  f"(single-process {ref.item():.9g}, {verdict})", flush=True)

        t0 = time.perf_counter()
        pipe_losses = stage.train(on_step=report)
        pipe_seconds = time.perf_counter() - t0
        stats = comm.stats()  # before the gathers below, so they count training traffic only

        # This stage's weights against the same layers of the reference model.
        ref_stage = nn.Sequential(*list(reference)[lo:lo + per_stage])
        params_equal = all(torch.equal(p, q) for p, q in zip(stage.module.parameters(), ref_stage.parameters()))

        row = torch.tensor([float(stats[f]) for f in STAT_FIELDS] + [pipe_seconds, float(params_equal)],
                           dtype=torch.float64)
        rows = gather_to_rank0(comm, row)
        # The losses live on the last stage; they travel to rank 0 as float32, bits intact.
        if comm.size > 1 and stage.last:
            comm.isend(torch.stack(pipe_losses), comm.ranks[0]).wait()
        if comm.size > 1 and stage.first:
            buf = torch.empty(cfg.steps, dtype=torch.float32)
            comm.irecv(buf, comm.ranks[-1]).wait()
            pipe_losses = list(buf)
        if comm.rank != 0:
            return 0

    # Rank 0 only, communicator closed: the verdict and the statistics.
    size = len(rows)
    print(f"\np2p statistics per rank ({cfg.steps} steps, mode {cfg.mode!r}; training traffic only):")
    print(f"{'rank':>6} {'sends':>7} {'recvs':>7} {'bytes sent':>12} {'bytes recv':>12} "
          f"{'wait s':>8} {'train s':>8}")
    for r, t in enumerate(rows):
        sends, recvs, sent, received, wait, seconds, _ = t.tolist()
        print(f"{r:>6} {int(sends):>7} {int(recvs):>7} {int(sent):>12} {int(received):>12} "
              f"{wait:>8.3f} {seconds:>8.3f}")
    print(f"(the single-process reference run took {ref_seconds:.3f} s on rank 0)")

    losses_equal = [torch.equal(p, q) for p, q in zip(pipe_losses, ref_losses)]
    bad_params = [r for r, t in enumerate(rows) if t[-1].item() != 1.0]
    if all(losses_equal) and not bad_params:
        print(f"\nlosses match the single-process reference (bitwise) over {cfg.steps} steps; "
              f"so do the final weights of {'all ' + str(size) + ' stages' if size > 1 else 'the model'}", flush=True)
        return 0
    print("\nFAILED: the pipeline run does not reproduce the single-process reference", file=sys.stderr)
    for s, (p, q, ok) in enumerate(zip(pipe_losses, ref_losses, losses_equal)):
        if not ok:
            print(f"  step {s + 1}: pipeline loss {p.item():.9g} != reference {q.item():.9g}", file=sys.stderr)
    if bad_params:
        print(f"  final weights differ on stage(s) {bad_params}", file=sys.stderr)
    sys.stderr.flush()
    return 1


if __name__ == "__main__":
    sys.exit(main())
