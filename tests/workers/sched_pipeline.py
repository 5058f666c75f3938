"""Deadlock freedom under strict rendezvous (eager_threshold=0).

For every group size from 2 to the world size, the last `size` ranks form a communicator (so
group ranks differ from global ranks) and run, in each mode and lane count:
- "ring": the four-op exchange (send_next, recv_prev, send_prev, recv_next) around the ring,
  small tensors and a couple of 1 MiB ones;
- "1f1b": megatron's non-interleaved 1F1B schedule on a chain of `size` stages: warmup
  (recv_forward / send_forward), steady state (send_forward_recv_backward,
  send_backward_recv_forward) and cooldown (recv_backward / send_backward).

Every payload is checked element by element. Each run is recorded as "ok" or as the error it
raised, so one failing configuration does not hide the others.
params: iterations, small_numel, big_numel, big_iterations, microbatches, timeout, and backend
("shm", the default, or "nccl": the NCCL backend over the fake libraries)."""
import datetime
import traceback

import harness
from nccl_model_backend import Backend

CONFIGS = [(mode, lanes) for mode in ("parity", "batched") for lanes in (1, 2)]


def payload(torch, numel, tag):
    """A tensor whose every element says who sent it, when, and which element it is."""
    return torch.arange(numel, dtype=torch.int64) + (tag << 32)


def check(torch, got, numel, tag, what):
    want = payload(torch, numel, tag)
    if not torch.equal(got, want):
        bad = (got != want).nonzero()
        first = int(bad[0]) if len(bad) else -1
        raise AssertionError(
            f"{what}: {len(bad)} of {numel} elements wrong; first at {first}: "
            f"got {int(got[first]) if first >= 0 else None}, want {int(want[first]) if first >= 0 else None}"
        )


def ring(torch, comm, mode, params, backend):
    """The four-op exchange with both neighbours, many times; returns the iterations run."""
    me, n = comm.rank, comm.size
    prev, nxt = (me - 1) % n, (me + 1) % n
    iters = params["iterations"]
    for it in range(iters):
        numel = params["big_numel"] if it in params["big_iterations"] else params["small_numel"][it % 2]
        fwd_tag, bwd_tag = (me * 1000 + it) * 2, (me * 1000 + it) * 2 + 1
        send_next = payload(torch, numel, fwd_tag)
        send_prev = payload(torch, numel, bwd_tag)
        recv_prev = torch.full((numel,), -1, dtype=torch.int64)
        recv_next = torch.full((numel,), -1, dtype=torch.int64)
        on = backend.tensor
        reqs = comm.exchange(send_next=on(send_next), recv_prev=on(recv_prev), send_prev=on(send_prev),
                             recv_next=on(recv_next), mode=mode)
        assert sorted(reqs) == ["recv_next", "recv_prev", "send_next", "send_prev"], sorted(reqs)
        for r in reqs.values():
            backend.settle(r)
        check(torch, recv_prev, numel, (prev * 1000 + it) * 2, f"iteration {it} recv_prev")
        check(torch, recv_next, numel, (nxt * 1000 + it) * 2 + 1, f"iteration {it} recv_next")
    return iters


def one_f_one_b(torch, comm, mode, params, backend):
    """Megatron's forward_backward_pipelining_without_interleaving, communication only, on a
    chain (stage 0 never talks to its ring predecessor). Returns how often each call ran."""
    stage, stages = comm.rank, comm.size
    first, last = stage == 0, stage == stages - 1
    microbatches = params["microbatches"]
    calls: dict[str, int] = {}

    def numel(m):
        return params["small_numel"][0] if m % 2 == 0 else params["big_numel"]

    def act(s, m):  # activation stage s sends forward for microbatch m
        return (s * 100 + m) * 2

    def grad(s, m):  # gradient stage s sends backward for microbatch m
        return (s * 100 + m) * 2 + 1

    def p2p(name, **ops):
        calls[name] = calls.get(name, 0) + 1
        reqs = comm.exchange(mode=mode, **{k: backend.tensor(t) for k, t in ops.items()})
        assert sorted(reqs) == sorted(ops), (name, sorted(reqs))
        for r in reqs.values():
            backend.settle(r)

    def recv_forward(m):
        if not first:
            buf = torch.full((numel(m),), -1, dtype=torch.int64)
            p2p("recv_forward", recv_prev=buf)
            check(torch, buf, numel(m), act(stage - 1, m), f"recv_forward of microbatch {m}")

    def send_forward(m):
        if not last:
            p2p("send_forward", send_next=payload(torch, numel(m), act(stage, m)))

    def send_forward_recv_backward(m_fwd, m_bwd):
        if not last:
            buf = torch.full((numel(m_bwd),), -1, dtype=torch.int64)
            p2p("send_forward_recv_backward", send_next=payload(torch, numel(m_fwd), act(stage, m_fwd)),
                recv_next=buf)
            check(torch, buf, numel(m_bwd), grad(stage + 1, m_bwd), f"send_forward_recv_backward of {m_bwd}")

    def send_backward_recv_forward(m_bwd, m_fwd):
        if not first:
            buf = torch.full((numel(m_fwd),), -1, dtype=torch.int64)
            p2p("send_backward_recv_forward", send_prev=payload(torch, numel(m_bwd), grad(stage, m_bwd)),
                recv_prev=buf)
            check(torch, buf, numel(m_fwd), act(stage - 1, m_fwd), f"send_backward_recv_forward of {m_fwd}")

    def recv_backward(m):
        if not last:
            buf = torch.full((numel(m),), -1, dtype=torch.int64)
            p2p("recv_backward", recv_next=buf)
            check(torch, buf, numel(m), grad(stage + 1, m), f"recv_backward of microbatch {m}")

    def send_backward(m):
        if not first:
            p2p("send_backward", send_prev=payload(torch, numel(m), grad(stage, m)))

    warmup = min(stages - stage - 1, microbatches)
    remaining = microbatches - warmup
    fwd = bwd = 0
    for _ in range(warmup):
        recv_forward(fwd)
        send_forward(fwd)
        fwd += 1
    if remaining > 0:
        recv_forward(fwd)
    for i in range(remaining):
        send_forward_recv_backward(fwd, bwd)
        fwd += 1
        if i == remaining - 1:
            send_backward(bwd)
        else:
            send_backward_recv_forward(bwd, fwd)
        bwd += 1
    for _ in range(warmup):
        recv_backward(bwd)
        send_backward(bwd)
        bwd += 1
    assert fwd == bwd == microbatches, (fwd, bwd)
    return calls


def run_all(params, backend):
    """Every size, mode, lane count and schedule, once the process group exists."""
    import torch
    import torch.distributed as dist

    import megatron_p2p as mp

    params = {**params, "big_iterations": set(params["big_iterations"])}
    world, me = dist.get_world_size(), dist.get_rank()
    results = {}
    for size in range(2, world + 1):
        members = list(range(world - size, world))
        group = dist.new_group(members)  # collective over the world, so every rank calls it
        if me not in members:
            continue
        for mode, lanes in CONFIGS:
            for schedule, run in (("ring", ring), ("1f1b", one_f_one_b)):
                key = f"{schedule} size={size} mode={mode} lanes={lanes}"
                try:
                    with mp.init_communicator(group, backend.name, timeout=params["timeout"], lanes=lanes) as comm:
                        assert comm.eager_threshold == 0 and comm.size == size
                        assert comm.ranks == tuple(members), comm.ranks
                        results[key] = {"ok": True, "value": run(torch, comm, mode, params, backend)}
                except Exception as exc:  # recorded; the test reports every failing configuration
                    results[key] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                                    "traceback": traceback.format_exc()}
    return results


def body(params):
    backend = Backend(params.get("backend", "shm"))
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    results = run_all(params, backend)
    dist.destroy_process_group()
    return results


if __name__ == "__main__":
    harness.run(body)
