"""megatron-core's P2PCommunicator (over torch.distributed gloo) against megatron_p2p's (over
shm), in one 4-rank job: importing megatron-core costs seconds per rank, so every section runs
here and records "ok" with its value or the error it raised; the tests read their part.

megatron-core is written for CUDA: its calls run inside the package's CPU shim (the replacements
of megatron_p2p.megatron_on_cpu(), applied also where the NCCL model says CUDA is there), with
torch.cuda.synchronize and NVTX's push and pop counted (counting_on_cpu). Nothing else of megatron-core is changed.

Sections: methods (the nine methods, compared), pp2 (2-rank groups: batched pairing, shape
exchange pairing, dtype disagreement), modes (what the shape exchange issues), cuda_only
(batch_p2p_sync and NVTX only when CUDA is in use), overlap_1f1b, logging, registry, ops,
legacy, schedules (megatron-core's real schedules, stock against swapped).
params: timeout, microbatches, hidden, only (sections), schedule_names, backend.

backend "nccl" runs ours on the NCCL backend over the fake libraries (nccl_model_backend.py),
in the sections that compare ours with megatron-core or with the one-process run: methods,
pp2, overlap_1f1b, and schedules without "stock" (megatron-core over gloo, which no backend
of ours changes), patch_megatron (it builds its own communicator, fed CPU tensors) and the
naive order (NCCL has no deadlock detector: it would wait out its timeout)."""
import contextlib
import datetime
import logging
import time
import traceback
from typing import Any

import harness
from nccl_model_backend import Backend

COUNTS = {"synchronize": 0, "nvtx_push": 0, "nvtx_pop": 0}
NCCL_SECTIONS = ("methods", "pp2", "overlap_1f1b", "schedules")


def counting_on_cpu(torch):
    """megatron_p2p.megatron_on_cpu()'s replacements (the package's CPU shim), with
    torch.cuda.synchronize and NVTX's range_push / range_pop counted in COUNTS."""
    from unittest import mock

    from megatron_p2p import _megatron_cpu

    def counter(name):
        return lambda *args, **kwargs: COUNTS.__setitem__(name, COUNTS[name] + 1)

    @contextlib.contextmanager
    def on_cpu():
        with _megatron_cpu.on_cpu(), \
                mock.patch.object(torch.cuda, "synchronize", counter("synchronize")), \
                mock.patch.object(torch.cuda.nvtx, "range_push", counter("nvtx_push")), \
                mock.patch.object(torch.cuda.nvtx, "range_pop", counter("nvtx_pop")):
            yield

    return on_cpu


class Timers:
    """megatron-core's timers interface, recording every call."""

    def __init__(self):
        self.log = []

    def __call__(self, name, log_level=None):
        self.log.append(["get", name, log_level])
        timers = self

        class _T:
            def start(self, barrier=False):
                timers.log.append(["start", name])

            def stop(self, barrier=False):
                timers.log.append(["stop", name])

        return _T()


def describe(torch, x):
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return {"shape": list(x.shape), "dtype": str(x.dtype), "requires_grad": x.requires_grad,
                "device": x.device.type, "values": x.detach().float().flatten().tolist()}
    if isinstance(x, dict):
        return {"handles": sorted(x)}
    if isinstance(x, tuple):
        return {"tuple": [describe(torch, v) for v in x]}
    if isinstance(x, list):
        return [describe(torch, v) for v in x]
    return {"other": repr(x)}


def wait_handles(h):
    if isinstance(h, dict):
        for r in h.values():
            r.wait()
    elif isinstance(h, list):
        for r in h:
            wait_handles(r)


def guarded(fn, *args):
    try:
        return {"ok": True, "value": fn(*args)}
    except Exception as exc:
        return {"ok": False, "error_type": type(exc).__name__, "error": str(exc), "traceback": traceback.format_exc()}


def our_comm(ctx, group):
    """A megatron_p2p communicator over `group`, on the job's backend, strict rendezvous on shm."""
    return ctx["mp"].init_communicator(group, ctx["backend"].name, timeout=ctx["timeout"])


def ours(ctx, group, cfg, comm):
    """Our P2PCommunicator over `comm`. Run its calls inside ctx["on_our_device"](): on NCCL it
    allocates its receive buffers on the CUDA device, which the CPU shim turns into the CPU."""
    return ctx["mp"].P2PCommunicator(group, cfg, comm=ctx["backend"].comm(comm))


def payload(torch, shape, rank, call, kind, dtype=None):
    numel = 1
    for d in shape:
        numel *= d
    base = rank * 1000 + call * 10 + kind
    return (torch.arange(numel, dtype=torch.float32) / 64 + base).reshape(shape).to(dtype or torch.float32)


def method_script(torch, p2p, rank, size, variable, overlap_ok):
    """Every one of the nine methods, in patterns that pair up on a 4-rank chain or ring.
    Returns {method: [records]} where a record describes what one call returned."""
    first, last = rank == 0, rank == size - 1
    timers = p2p.config.timers
    out: dict[str, list] = {}
    call = [0]

    def shape(i):  # varies per call when sequence lengths vary
        return (2 + i % 3, 2, 4) if variable else (3, 2, 4)

    def t(kind):
        call[0] += 1
        return payload(torch, shape(call[0]), rank, call[0], kind)

    def rec(method, args, fn, overlap=False):
        start = len(timers.log)
        result = fn()
        handles = None
        if overlap:
            handles = describe(torch, result[1])
            wait_handles(result[1])
            result = result[0]
        out.setdefault(method, []).append({"args": args, "result": describe(torch, result), "handles": handles,
                                           "timers": timers.log[start:]})

    S = (3, 2, 4)
    # Forward chain, single and list forms. Calls are numbered the same on every rank, so a
    # receiver knows what its sender sent from the call number alone.
    for form in ("single", "list"):
        call[0] = 100 if form == "single" else 200
        sends = t(1) if form == "single" else [t(1), t(2)]
        shapes = S if form == "single" else [S, S]
        rec("recv_forward", form, lambda: p2p.recv_forward(shapes, first))
        rec("send_forward", form, lambda: p2p.send_forward(sends, last))
    for form in ("single", "list"):
        call[0] = 300 if form == "single" else 400
        sends = t(3) if form == "single" else [t(3), t(4)]
        shapes = S if form == "single" else [S, S]
        rec("recv_backward", form, lambda: p2p.recv_backward(shapes, last))
        rec("send_backward", form, lambda: p2p.send_backward(sends, first))
    # 1F1B steady state: pairs (0,1), (2,3), then (1,2); ends skip.
    for rnd in range(2):
        call[0] = 500 + rnd * 10
        fwd = t(5)
        bwd = t(6)
        if (rank + rnd) % 2 == 0:
            rec("send_forward_recv_backward", f"round{rnd}",
                lambda: p2p.send_forward_recv_backward(fwd, S, last))
        else:
            rec("send_backward_recv_forward", f"round{rnd}",
                lambda: p2p.send_backward_recv_forward(bwd, S, first))
    # Interleaved-style calls around the ring (every rank at once), then on the chain.
    overlaps = (False, True) if overlap_ok else (False,)
    for ov in overlaps:
        call[0] = 600 + 50 * ov
        a = t(7)
        rec("send_forward_recv_forward", f"ring overlap={ov}",
            lambda: p2p.send_forward_recv_forward(a, True, S, overlap_p2p_comm=ov), overlap=ov)
        b = t(8)
        rec("send_forward_recv_forward", f"chain overlap={ov}",
            lambda: p2p.send_forward_recv_forward(None if last else b, not first, S, overlap_p2p_comm=ov),
            overlap=ov)
        c = t(9)
        rec("send_backward_recv_backward", f"ring overlap={ov}",
            lambda: p2p.send_backward_recv_backward(c, True, S, overlap_p2p_comm=ov), overlap=ov)
        d = t(1)
        rec("send_backward_recv_backward", f"chain overlap={ov}",
            lambda: p2p.send_backward_recv_backward(None if first else d, not last, S, overlap_p2p_comm=ov),
            overlap=ov)
    call[0] = 700
    e, f = t(2), t(3)
    rec("send_forward_backward_recv_forward_backward", "ring",
        lambda: p2p.send_forward_backward_recv_forward_backward(e, f, True, True, S))
    g, h = t(4), t(5)
    rec("send_forward_backward_recv_forward_backward", "chain",
        lambda: p2p.send_forward_backward_recv_forward_backward(None if last else g, None if first else h,
                                                                not first, not last, S))
    # _communicate itself (the 3-tuple) and _communicate_shapes.
    call[0] = 800
    k = t(6)
    rec("_communicate", "ring send_next/recv_prev",
        lambda: p2p._communicate(tensor_send_next=k, tensor_send_prev=None, recv_prev=True, recv_next=False,
                                 tensor_shape=S))
    if variable:
        call[0] = 900
        m, n = t(7), t(8)
        rec("_communicate_shapes", "ring both ways",
            lambda: {"shapes": p2p._communicate_shapes(m, n, True, True)}["shapes"])
    return out


def config_for(torch, ModelParallelConfig, batch, variable, pipeline_dtype=None, sync=True):
    cfg = ModelParallelConfig(pipeline_dtype=pipeline_dtype or torch.float32, batch_p2p_comm=batch,
                              batch_p2p_sync=sync, variable_seq_lengths=variable)
    cfg.timers = Timers()
    return cfg


def section_methods(ctx):
    torch, dist = ctx["torch"], ctx["dist"]
    out = {}
    world = ctx["world_group"]
    for batch in (False, True):
        for variable in (False, True):
            name = f"{'batched' if batch else 'parity'}{' variable' if variable else ''}"
            stock = ctx["McoreP2P"](world, config_for(torch, ctx["MPC"], batch, variable))
            with ctx["cuda_to_cpu"]():
                mc = method_script(torch, stock, ctx["rank"], 4, variable, overlap_ok=not batch)
            dist.barrier()
            with our_comm(ctx, world) as comm, ctx["on_our_device"]():
                # batch_p2p_sync off here: not needed for the same results.
                ours_p2p = ours(ctx, world, config_for(torch, ctx["MPC"], batch, variable, sync=False), comm)
                mine = method_script(torch, ours_p2p, ctx["rank"], 4, variable, overlap_ok=not batch)
            out[name] = {"megatron": mc, "ours": mine}
    # Attributes and properties, read from both.
    attrs = ("next_rank", "prev_rank", "virtual_pipeline_model_parallel_size", "is_pp_first_stage",
             "is_pp_last_stage", "total_stages", "current_stage")
    cfg = config_for(torch, ctx["MPC"], True, False)
    cfg.virtual_pipeline_model_parallel_size = 2
    with our_comm(ctx, world) as comm:
        both = {"megatron": ctx["McoreP2P"](world, cfg), "ours": ours(ctx, world, cfg, comm)}
        out["attributes"] = {k: {a: getattr(v, a) for a in attrs} for k, v in both.items()}
        for k, v in both.items():
            out["attributes"][k]["same pp_group and config"] = v.pp_group is world and v.config is cfg
    return out


def pair_group(ctx):
    return ctx["pairs"][ctx["rank"] // 2]


def section_pp2(ctx):
    """Two pipelines of 2 ranks each ({0,1} and {2,3})."""
    torch = ctx["torch"]
    rank = ctx["rank"]
    me, peer = rank % 2, rank ^ 1
    group = pair_group(ctx)
    S = (3, 2, 4)
    out = {}

    def both_ways(p2p, act_shape, grad_shape):
        act = payload(torch, act_shape, rank, 1, 1)
        grad = payload(torch, grad_shape, rank, 1, 2)
        got_prev, got_next = p2p.send_forward_backward_recv_forward_backward(act, grad, True, True, S)
        want_prev = payload(torch, act_shape, peer, 1, 1)   # the peer's activation
        want_next = payload(torch, grad_shape, peer, 1, 2)  # the peer's gradient
        return {"recv_prev_is_activation": got_prev.shape == want_prev.shape and torch.equal(got_prev.detach(), want_prev),
                "recv_next_is_gradient": got_next.shape == want_next.shape and torch.equal(got_next.detach(), want_next),
                "recv_prev_shape": list(got_prev.shape), "recv_next_shape": list(got_next.shape)}

    # Batched data path, fixed shapes.
    cfg = config_for(torch, ctx["MPC"], batch=True, variable=False)
    with ctx["cuda_to_cpu"]():
        out["batched megatron"] = guarded(both_ways, ctx["McoreP2P"](group, cfg), S, S)
    with our_comm(ctx, group) as comm, ctx["on_our_device"]():
        out["batched ours"] = guarded(both_ways, ours(ctx, group, cfg, comm), S, S)
    # Shape exchange, parity data path: shapes with equal byte counts, so nothing can hang.
    act_shape, grad_shape = (3, 2, 4), (4, 2, 3)
    cfg = config_for(torch, ctx["MPC"], batch=False, variable=True)
    with ctx["cuda_to_cpu"]():
        out["shapes megatron"] = guarded(both_ways, ctx["McoreP2P"](group, cfg), act_shape, grad_shape)
    with our_comm(ctx, group) as comm, ctx["on_our_device"]():
        out["shapes ours"] = guarded(both_ways, ours(ctx, group, cfg, comm), act_shape, grad_shape)
        # ... and in batched mode.
        cfg_b = config_for(torch, ctx["MPC"], batch=True, variable=True)
        out["shapes ours batched"] = guarded(both_ways, ours(ctx, group, cfg_b, comm), act_shape, grad_shape)

    # dtype disagreement: stage 0 sends float16, stage 1 expects bfloat16 (same byte count).
    def dtypes(p2p, send_dtype):
        if me == 0:
            p2p.send_forward(payload(torch, S, rank, 2, 1, send_dtype), False)
            return {"sent": True}
        got = p2p.recv_forward(S, False)
        want = payload(torch, S, peer, 2, 1, send_dtype)
        return {"dtype": str(got.dtype), "values_equal": torch.equal(got.detach().float(), want.float())}

    for case, recv_dtype in (("mismatch", torch.bfloat16), ("match", torch.float16)):
        cfg = config_for(torch, ctx["MPC"], batch=False, variable=True,
                         pipeline_dtype=torch.float16 if me == 0 else recv_dtype)
        with ctx["cuda_to_cpu"]():
            out[f"dtype {case} megatron"] = guarded(dtypes, ctx["McoreP2P"](group, cfg), torch.float16)
        with our_comm(ctx, group) as comm, ctx["on_our_device"]():
            p2p = ours(ctx, group, cfg, comm)
            out[f"dtype {case} ours"] = guarded(dtypes, p2p, torch.float16)
            # The communicator stays usable after the report.
            out[f"dtype {case} ours after"] = guarded(
                lambda: dtypes(ours(ctx, group, config_for(torch, ctx["MPC"], False, True,
                                                           pipeline_dtype=torch.float16), comm),
                               torch.float16))
    # One rank with variable_seq_lengths, the other without.
    cfg = config_for(torch, ctx["MPC"], batch=False, variable=(me == 0))
    with our_comm(ctx, group) as comm, ctx["on_our_device"]():
        out["setting mismatch ours"] = guarded(dtypes, ours(ctx, group, cfg, comm), torch.float32)
    return out


class RecordingComm:
    """A communicator stand-in that records the mode of every exchange and the op kinds of every
    batch (and can claim a CUDA backend while moving CPU tensors through shm)."""

    def __init__(self, comm, backend=None):
        self._comm = comm
        self.modes = []
        self.batches = []
        self.backend = backend or comm.backend

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def exchange(self, **kw):
        self.modes.append(kw.get("mode"))
        return self._comm.exchange(**kw)

    def batch(self, ops, **kw):
        self.batches.append(["send" if is_send else "recv" for is_send, _, _ in ops])
        return self._comm.batch(ops, **kw)


def section_modes(ctx):
    """What the variable-length shape exchange issues, per mode, and how often it syncs."""
    torch, mp, dist = ctx["torch"], ctx["mp"], ctx["dist"]
    world = ctx["world_group"]
    rank = ctx["rank"]
    out = {}
    for batch in (False, True):
        cfg = config_for(torch, ctx["MPC"], batch=batch, variable=True)
        calls = {"batch_isend_irecv": 0}
        originals = {k: getattr(dist, k) for k in calls}

        def spy(name):
            def f(*a, **k):
                calls[name] += 1
                return originals[name](*a, **k)
            return f

        before = COUNTS["synchronize"]
        for k in calls:
            setattr(dist, k, spy(k))
        try:
            with ctx["cuda_to_cpu"]():
                ctx["McoreP2P"](world, cfg).send_forward_recv_forward(payload(torch, (3, 2, 4), rank, 3, 1), True,
                                                                       (3, 2, 4))
        finally:
            for k, f in originals.items():
                setattr(dist, k, f)
        mc = {"calls": calls, "synchronize": COUNTS["synchronize"] - before}
        before = COUNTS["synchronize"]
        with mp.init_communicator(world, timeout=ctx["timeout"]) as comm:
            rc = RecordingComm(comm)
            mp.P2PCommunicator(world, cfg, comm=rc).send_forward_recv_forward(
                payload(torch, (3, 2, 4), rank, 3, 1), True, (3, 2, 4))
        ours = {"modes": rc.modes, "batches": rc.batches, "synchronize": COUNTS["synchronize"] - before}
        out["batched" if batch else "parity"] = {"megatron": mc, "ours": ours}
    return out


def section_cuda_only(ctx):
    """batch_p2p_sync and NVTX: on when the communicator's backend is a CUDA one (simulated by a
    stand-in that claims 'nccl'), off for shm."""
    torch, mp = ctx["torch"], ctx["mp"]
    world = ctx["world_group"]
    rank = ctx["rank"]
    out = {}
    with mp.init_communicator(world, timeout=ctx["timeout"]) as comm:
        for backend in ("shm", "nccl"):
            for sync in (True, False):
                cfg = config_for(torch, ctx["MPC"], batch=True, variable=False, sync=sync)
                before = dict(COUNTS)
                p2p = mp.P2PCommunicator(world, cfg, comm=RecordingComm(comm, backend=backend))
                with ctx["cuda_to_cpu"]():
                    got = p2p.send_forward_recv_forward(payload(torch, (3, 2, 4), rank, 4, 1), True, (3, 2, 4))
                out[f"{backend} sync={sync}"] = {k: COUNTS[k] - before[k] for k in COUNTS}
                out[f"{backend} sync={sync}"]["ok"] = torch.equal(
                    got.detach(), payload(torch, (3, 2, 4), (rank - 1) % 4, 4, 1))
    return out


def section_overlap_1f1b(ctx):
    """send_forward_recv_backward / send_backward_recv_forward with overlap_p2p_comm=True, in
    both modes: (tensor, handles) with the posted ops' names, right values once waited."""
    torch = ctx["torch"]
    world = ctx["world_group"]
    rank = ctx["rank"]
    first, last = rank == 0, rank == 3
    S = (3, 2, 4)
    out = {}
    for batch in (False, True):
        cfg = config_for(torch, ctx["MPC"], batch=batch, variable=False)
        with our_comm(ctx, world) as comm, ctx["on_our_device"]():
            p2p = ours(ctx, world, cfg, comm)
            records = []
            for rnd in range(2):
                fwd, bwd = payload(torch, S, rank, rnd, 5), payload(torch, S, rank, rnd, 6)
                if (rank + rnd) % 2 == 0:
                    got, handles = p2p.send_forward_recv_backward(fwd, S, last, overlap_p2p_comm=True)
                    want = None if last else payload(torch, S, rank + 1, rnd, 6)
                    name = "send_forward_recv_backward"
                else:
                    got, handles = p2p.send_backward_recv_forward(bwd, S, first, overlap_p2p_comm=True)
                    want = None if first else payload(torch, S, rank - 1, rnd, 5)
                    name = "send_backward_recv_forward"
                keys = sorted(handles)
                wait_handles(handles)
                records.append({"method": name, "keys": keys,
                                "right": (got is None) if want is None else torch.equal(got.detach(), want)})
            out["batched" if batch else "parity"] = records
    return out


def section_logging(ctx):
    torch, mp = ctx["torch"], ctx["mp"]
    world = ctx["world_group"]
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append([record.name, record.levelname, record.getMessage()])

    log = logging.getLogger("megatron_p2p")
    handler = Keep()
    log.addHandler(handler)
    old = log.level
    out = {}
    try:
        with mp.init_communicator(world, timeout=ctx["timeout"]) as comm:
            for level in ("INFO", "DEBUG"):
                log.setLevel(level)
                del records[:]
                p2p = mp.P2PCommunicator(world, config_for(torch, ctx["MPC"], True, False), comm=comm)
                p2p.send_forward_recv_forward(payload(torch, (3, 2, 4), ctx["rank"], 5, 1), True, (3, 2, 4))
                out[level] = list(records)
    finally:
        log.removeHandler(handler)
        log.setLevel(old)
    return out


def section_registry(ctx):
    """Group arguments find communicators that were created explicitly, and only those."""
    torch, mp = ctx["torch"], ctx["mp"]
    from megatron_p2p import p2p_communication as p2p_mod

    group = pair_group(ctx)
    rank = ctx["rank"]
    peer = rank ^ 1
    S = (2, 2)

    def ops_exchange(fn):
        send = payload(torch, S, rank, 6, 1)
        recv = torch.zeros(S)
        reqs = fn(tensor_send_prev=None, tensor_recv_prev=recv if rank % 2 else None,
                  tensor_send_next=None if rank % 2 else send, tensor_recv_next=None, group=group,
                  prev_pipeline_rank=peer, next_pipeline_rank=peer)
        kind = type(reqs).__name__
        for r in (reqs.values() if isinstance(reqs, dict) else reqs):
            r.wait()
        return {"type": kind, "keys": sorted(reqs) if isinstance(reqs, dict) else [r.label for r in reqs],
                "right": rank % 2 == 0 or torch.equal(recv, payload(torch, S, peer, 6, 1))}

    out = {"before": guarded(ops_exchange, p2p_mod._p2p_ops)}
    with mp.init_communicator(group, timeout=ctx["timeout"]) as comm:
        out["_p2p_ops"] = guarded(ops_exchange, p2p_mod._p2p_ops)
        out["_batched_p2p_ops"] = guarded(ops_exchange, p2p_mod._batched_p2p_ops)
        out["found"] = mp.get_communicator(group) is comm
    out["after close"] = guarded(ops_exchange, p2p_mod._p2p_ops)
    return out


def section_ops(ctx):
    """torch.distributed-style isend / irecv / batch_isend_irecv / P2POp with group=."""
    torch, mp, dist = ctx["torch"], ctx["mp"], ctx["dist"]
    group = pair_group(ctx)
    rank = ctx["rank"]
    peer = rank ^ 1
    out = {}
    with mp.init_communicator(group, timeout=ctx["timeout"]) as comm:
        send = payload(torch, (4,), rank, 7, 1)
        recv = torch.zeros(4)
        if rank % 2 == 0:
            reqs = [mp.isend(send, peer, group), mp.irecv(recv, peer, group)]
        else:
            reqs = [mp.irecv(recv, src=None, group=group, group_src=0), mp.isend(send, dst=peer, group=group)]
        for r in reqs:
            r.wait()
        out["isend_irecv"] = torch.equal(recv, payload(torch, (4,), peer, 7, 1))
        recv2 = torch.zeros(4)
        ops = [mp.P2POp(dist.isend, send, peer, group), mp.P2POp(mp.irecv, recv2, group=group, group_peer=peer % 2)]
        for r in mp.batch_isend_irecv(ops):
            r.wait()
        out["batch"] = torch.equal(recv2, payload(torch, (4,), peer, 7, 1))
        out["tag"] = guarded(lambda: mp.isend(send, peer, group, tag=3))
        out["comm_keyword"] = guarded(lambda: [r.wait() for r in mp.batch_isend_irecv(
            [mp.P2POp(mp.isend, send, peer, comm=comm), mp.P2POp(mp.irecv, recv2, peer, comm=comm)])] and True)
    return out


def section_legacy(ctx):
    """The <= 0.12 (config) and 0.13 (stage flag) module-level functions over parallel_state's
    pipeline group."""
    torch, mp = ctx["torch"], ctx["mp"]
    from megatron.core import parallel_state

    from megatron_p2p import p2p_communication as p2p_mod

    rank = ctx["rank"]
    S = (3, 2, 4)
    group = ctx["world_group"]
    saved = (parallel_state.get_pipeline_model_parallel_group, parallel_state.is_pipeline_first_stage,
             parallel_state.is_pipeline_last_stage)
    # Stand-ins for an initialised parallel_state: one pipeline of the 4 ranks.
    parallel_state.get_pipeline_model_parallel_group = lambda *a, **k: group
    parallel_state.is_pipeline_first_stage = lambda *a, **k: rank == 0
    parallel_state.is_pipeline_last_stage = lambda *a, **k: rank == 3
    out = {}
    try:
        cfg = config_for(torch, ctx["MPC"], batch=True, variable=False)
        out["missing communicator"] = guarded(
            lambda: p2p_mod.send_forward_recv_forward(payload(torch, S, rank, 8, 0), True, S, cfg))
        with mp.init_communicator(group, timeout=ctx["timeout"]):
            got = p2p_mod.recv_forward(S, cfg)  # 0.12 form
            p2p_mod.send_forward(payload(torch, S, rank, 8, 1), cfg)
            out["0.12 recv_forward"] = None if got is None else torch.equal(got.detach(), payload(torch, S, rank - 1, 8, 1))
            got = p2p_mod.recv_backward(S, cfg, rank == 3)  # 0.13 form
            p2p_mod.send_backward(payload(torch, S, rank, 8, 2), cfg, rank == 0)
            out["0.13 recv_backward"] = None if got is None else torch.equal(got.detach(), payload(torch, S, rank + 1, 8, 2))
            overlapped = p2p_mod.send_forward_recv_forward(payload(torch, S, rank, 8, 3), True, S, cfg,
                                                           overlap_p2p_comm=True)
            assert isinstance(overlapped, tuple)  # overlap_p2p_comm=True: (tensor, handles)
            got, handles = overlapped
            assert isinstance(handles, dict)  # the exchange's requests, by op name
            out["overlap keys"] = sorted(handles)
            wait_handles(handles)
            assert got is not None  # recv_prev=True
            out["overlap right"] = torch.equal(got.detach(), payload(torch, S, (rank - 1) % 4, 8, 3))
            out["timers"] = cfg.timers.log
    finally:
        (parallel_state.get_pipeline_model_parallel_group, parallel_state.is_pipeline_first_stage,
         parallel_state.is_pipeline_last_stage) = saved
    return out


# ---- real schedules -------------------------------------------------------------------------


def make_stage(torch, cfg, hidden, seed, first, last, device="cpu"):
    """One pipeline chunk, initialised on the CPU (the same values on any device), then moved to `device`."""
    from torch import nn  # the `torch` passed in: already imported

    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            gen = torch.Generator().manual_seed(seed)
            self.linear = torch.nn.Linear(hidden, hidden)
            with torch.no_grad():
                self.linear.weight.copy_(torch.randn(hidden, hidden, generator=gen) / hidden ** 0.5)
                self.linear.bias.copy_(torch.randn(hidden, generator=gen) / 10)
            self.config = cfg
            self.first, self.last = first, last
            self.input_tensor = None

        def set_input_tensor(self, tensors):
            self.input_tensor = tensors[0] if isinstance(tensors, list) else tensors

        def forward(self, x):
            return self.linear(torch.tanh(x))

    return Stage().to(device)


def batches(torch, hidden, micro, variable, seed=7, device="cpu"):
    """Drawn on the CPU (the same values on any device), then moved to `device`."""
    gen = torch.Generator().manual_seed(seed)
    for m in range(micro * 2):
        seq = 2 + (m % 3 if variable else 1)
        yield torch.randn(seq, 2, hidden, generator=gen).to(device)


def loss_func(out):
    loss = (out.float() ** 2).mean()
    return loss, {"loss": loss.detach().clone()}


def reference_run(ctx, pp_ranks, vpp, variable):
    """The same model and microbatches in one process, no pipeline: every chunk in order,
    the loss scaled by 1 / microbatches as megatron-core's schedules do, backward per
    microbatch. Returns the losses and this rank's chunks' gradients. On ctx["device"] (default
    the CPU), as the pipeline runs, so that equal results are meaningful."""
    torch = ctx["torch"]
    rank, device = ctx["rank"], ctx.get("device", "cpu")
    stage, stages = pp_ranks.index(rank), len(pp_ranks)
    chunks, micro = vpp or 1, ctx["microbatches"]
    total = chunks * stages
    cfg = object()
    models = [make_stage(torch, cfg, ctx["hidden"], 1000 + v, v == 0, v == total - 1, device) for v in range(total)]
    losses = []
    for x in list(batches(torch, ctx["hidden"], micro, variable, device=device))[:micro]:
        for m in models:
            x = m(x)
        loss, reduced = loss_func(x)
        losses.append(float(reduced["loss"]))
        (loss / micro).backward()
    mine = [models[c * stages + stage] for c in range(chunks)]
    return {"losses": losses if rank == pp_ranks[-1] else [],
            "grads": [[p.grad.flatten().tolist() for p in m.parameters()] for m in mine]}


def run_schedule(ctx, kind, pp_ranks, vpp, batch, variable, overlap, how):
    """One forward-backward pass of megatron-core's schedule; returns losses and gradients.
    how: "stock" (megatron-core's P2PCommunicator passed in), "swapped" (ours passed in as
    p2p_communicator= with pg_collection=), "patched" (neither passed: megatron-core builds
    the communicator from parallel_state, under patch_megatron()). Models and data on
    ctx["device"] (default the CPU)."""
    torch = ctx["torch"]
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.process_groups_config import ProcessGroupCollection

    rank, device = ctx["rank"], ctx.get("device", "cpu")
    pp_group = ctx["groups"][tuple(pp_ranks)]
    stage, stages = pp_ranks.index(rank), len(pp_ranks)
    hidden, micro = ctx["hidden"], ctx["microbatches"]
    cfg = ctx["MPC"](pipeline_model_parallel_size=stages, virtual_pipeline_model_parallel_size=vpp,
                     pipeline_dtype=torch.float32, batch_p2p_comm=batch, variable_seq_lengths=variable,
                     overlap_p2p_comm=overlap)
    cfg.hidden_size = hidden
    chunks = vpp or 1
    models = []
    for c in range(chunks):
        virtual = c * stages + stage  # position in the whole pipeline
        total = chunks * stages
        model = make_stage(torch, cfg, hidden, 1000 + virtual, virtual == 0, virtual == total - 1, device)
        model.model_type = ModelType.encoder_or_decoder
        models.append(model)

    def forward_step(data_iterator, model):
        x = next(data_iterator) if model.first else model.input_tensor
        y = model(x)

        return y, loss_func

    iters = [batches(torch, hidden, micro, variable, device=device) for _ in range(chunks)]
    kwargs = {}
    if how != "patched":
        kwargs["pg_collection"] = ProcessGroupCollection(tp=ctx["self_group"], cp=ctx["self_group"])
        if how == "swapped":
            kwargs["p2p_communicator"] = ours(ctx, pp_group, cfg, ctx["comms"][tuple(pp_ranks)])
        else:
            kwargs["p2p_communicator"] = ctx["McoreP2P"](pp_group, cfg)
    fn = (schedules.forward_backward_pipelining_with_interleaving if kind == "interleaved"
          else schedules.forward_backward_pipelining_without_interleaving)
    with ctx["cuda_to_cpu"]():
        losses = fn(forward_step_func=forward_step, data_iterator=iters if chunks > 1 else iters[0],
                    model=models if chunks > 1 else models[0], num_microbatches=micro, seq_length=3,
                    micro_batch_size=2, **kwargs)
    return {"losses": [float(d["loss"]) for d in losses],
            "grads": [[p.grad.flatten().tolist() if p.grad is not None else None for p in m.parameters()]
                      for m in models]}


SCHEDULES = [
    # name, kind, pipelines (each a list of global ranks), vpp, batch_p2p_comm, variable, overlap, stock
    ("1f1b pp4", "1f1b", [[0, 1, 2, 3]], None, True, False, False, True),
    ("1f1b pp4 parity", "1f1b", [[0, 1, 2, 3]], None, False, False, False, True),
    ("1f1b pp4 variable", "1f1b", [[0, 1, 2, 3]], None, True, True, False, True),
    ("1f1b pp2", "1f1b", [[0, 1], [2, 3]], None, True, False, False, True),
    ("1f1b pp2 variable", "1f1b", [[0, 1], [2, 3]], None, True, True, False, True),
    ("interleaved pp4 vpp2", "interleaved", [[0, 1, 2, 3]], 2, True, False, False, True),
    ("interleaved pp4 vpp2 overlap", "interleaved", [[0, 1, 2, 3]], 2, False, False, True, True),
    # Stock megatron-core deadlocks here over gloo: its blocking shape round inside the
    # interleaved schedule waits on sends that a rendezvous transport completes only later.
    ("interleaved pp4 vpp2 variable", "interleaved", [[0, 1, 2, 3]], 2, True, True, False, False),
    # In parity mode with as many microbatches as stages, a shape round in parity order deadlocked
    # (the checker's grid found it); the shape round now runs as one group per lane.
    ("interleaved pp4 vpp2 variable parity", "interleaved", [[0, 1, 2, 3]], 2, False, True, False, False),
]


def open_schedule_comms(ctx):
    """Our communicators for the schedules: over the 4 ranks, and over this rank's pair."""
    pair = (0, 1) if ctx["rank"] < 2 else (2, 3)
    ctx["comms"] = {(0, 1, 2, 3): our_comm(ctx, ctx["world_group"]),
                    pair: our_comm(ctx, ctx["pairs"][ctx["rank"] // 2])}


def close_schedule_comms(ctx):
    for comm in ctx.pop("comms").values():
        comm.close()


def failed_anywhere(ctx, res):
    """Whether a run of `res` failed on any rank (collective)."""
    torch, dist = ctx["torch"], ctx["dist"]
    flag = torch.tensor([0 if all(r["ok"] for r in res.values()) else 1])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag)


def section_schedules(ctx):
    out = {}
    rank = ctx["rank"]
    open_schedule_comms(ctx)
    try:
        for name, kind, pipelines, vpp, batch, variable, overlap, stock in SCHEDULES:
            if ctx["schedule_names"] and name not in ctx["schedule_names"]:
                continue
            pp_ranks = next(p for p in pipelines if rank in p)
            res = {"reference": guarded(reference_run, ctx, pp_ranks, vpp, variable)}
            for how in ("stock", "swapped") if stock and not ctx["backend"].nccl else ("swapped",):
                res[how] = guarded(run_schedule, ctx, kind, pp_ranks, vpp, batch, variable, overlap, how)
                if not res[how]["ok"]:  # the others may wait in the schedule: say why in the job's output
                    print(f"rank {rank}: {name} {how} failed:\n{res[how]['traceback']}", flush=True)
                ctx["dist"].barrier()
            out[name] = res
            if failed_anywhere(ctx, res):  # its communicators may be aborted: the next run gets new ones
                close_schedule_comms(ctx)
                open_schedule_comms(ctx)
        if not ctx["backend"].nccl:
            out["patch_megatron"] = guarded(patched_run, ctx)
            out["naive_order"] = naive_order_run(ctx)
    finally:
        close_schedule_comms(ctx)
    return out


NAIVE_TIMEOUT = 60.0


def naive_order_run(ctx):
    """megatron-core's real 1F1B over 4 stages with our communicator made wrong on purpose: every
    op of an exchange posted by itself, sends first, on one lane (the order parity exists to
    avoid). It must raise DeadlockError well under the 60 s timeout, not hang. Runs on a
    communicator of its own, since a deadlock leaves it unusable for the ranks involved."""
    mp, torch = ctx["mp"], ctx["torch"]

    from megatron_p2p import Communicator, P2PCommunicator  # ctx["mp"]'s

    class NaiveOrder(P2PCommunicator):
        comm: Communicator  # the one it is given below (init_communicator's), not a stand-in

        def _exchange(self, **ops):
            ops.pop("call", None)
            reqs = {}
            for name in ("send_next", "send_prev", "recv_prev", "recv_next"):
                if ops.get(name) is None:
                    continue
                peer = self.next_rank if name.endswith("next") else self.prev_rank
                post = self.comm.isend if name.startswith("send") else self.comm.irecv
                reqs[name] = post(ops[name], peer, call=f"naive {name}")
            return reqs

    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.process_groups_config import ProcessGroupCollection

    rank, pp_ranks = ctx["rank"], [0, 1, 2, 3]
    cfg = ctx["MPC"](pipeline_model_parallel_size=4, pipeline_dtype=torch.float32, batch_p2p_comm=False)
    cfg.hidden_size = ctx["hidden"]
    model = make_stage(torch, cfg, ctx["hidden"], 1000 + rank, rank == 0, rank == 3)
    model.model_type = ModelType.encoder_or_decoder

    def forward_step(data_iterator, model):
        x = next(data_iterator) if model.first else model.input_tensor
        return model(x), loss_func

    start = time.monotonic()
    out: dict[str, Any] = {"type": None}
    with mp.init_communicator(ctx["world_group"], timeout=NAIVE_TIMEOUT) as comm:
        try:
            with ctx["cuda_to_cpu"]():
                schedules.forward_backward_pipelining_without_interleaving(
                    forward_step_func=forward_step, data_iterator=batches(torch, ctx["hidden"], 8, False),
                    model=model, num_microbatches=8, seq_length=3, micro_batch_size=2,
                    p2p_communicator=NaiveOrder(ctx["groups"][tuple(pp_ranks)], cfg, comm=comm),
                    pg_collection=ProcessGroupCollection(tp=ctx["self_group"], cp=ctx["self_group"]))
        except Exception as exc:  # the test asserts on what was raised, and when
            out = {"type": type(exc).__name__, "msg": str(exc)}
    out["elapsed"] = time.monotonic() - start
    ctx["dist"].barrier()
    return out


def patched_run(ctx):
    """megatron-core's default path (no p2p_communicator, no pg_collection) under
    patch_megatron(): its schedules module constructs our class from parallel_state's
    pipeline group. Stock for comparison is "1f1b pp4" above."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import schedules

    mp = ctx["mp"]
    comm = ctx["comms"][(0, 1, 2, 3)]
    out = {"binding before": schedules.P2PCommunicator.__module__}
    with ctx["cuda_to_cpu"]():
        parallel_state.initialize_model_parallel(pipeline_model_parallel_size=4)
    try:
        with mp.patch_megatron() as patch:
            out["binding during"] = schedules.P2PCommunicator.__module__
            out["swapped"] = sorted(f"{m}.{a}" for m, a in patch.swapped)
            sends = comm.stats()["sends"]
            out["run"] = run_schedule(ctx, "1f1b", [0, 1, 2, 3], None, True, False, False, "patched")
            out["sends through ours"] = comm.stats()["sends"] - sends
        out["binding after"] = schedules.P2PCommunicator.__module__
    finally:
        parallel_state.destroy_model_parallel()
    return out


_PREPARED: dict[str, Any] = {}


def prepare():
    """The CPU shim and the imports: before the process group, so slow imports on a loaded
    machine do not eat into the first collective's timeout. Returns the shim (counting_on_cpu)."""
    if "mode" not in _PREPARED:
        import torch

        _PREPARED["mode"] = counting_on_cpu(torch)
        from megatron.core.pipeline_parallel import schedules  # noqa: F401

        import megatron_p2p  # noqa: F401
    return _PREPARED["mode"]


def run_all(params, backend, seconds=None):
    """Every section of params["only"] (all by default), once the process group exists."""
    t0 = time.monotonic()
    import torch
    import torch.distributed as dist
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator as McoreP2P

    import megatron_p2p as mp

    on_cpu = prepare()
    rank = dist.get_rank()
    world_group = dist.new_group([0, 1, 2, 3])
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    selves = [dist.new_group([r]) for r in range(4)]
    ctx = {"torch": torch, "dist": dist, "mp": mp, "rank": rank, "timeout": params["timeout"],
           "McoreP2P": McoreP2P, "MPC": ModelParallelConfig, "cuda_to_cpu": on_cpu,
           "world_group": world_group, "pairs": pairs, "self_group": selves[rank],
           "groups": {(0, 1, 2, 3): world_group, (0, 1): pairs[0], (2, 3): pairs[1]},
           "hidden": params["hidden"], "microbatches": params["microbatches"],
           "schedule_names": params.get("schedule_names"), "backend": backend,
           "on_our_device": on_cpu if backend.nccl else contextlib.nullcontext}
    sections = [("methods", section_methods), ("pp2", section_pp2), ("modes", section_modes),
                ("cuda_only", section_cuda_only), ("overlap_1f1b", section_overlap_1f1b),
                ("logging", section_logging), ("registry", section_registry), ("ops", section_ops),
                ("legacy", section_legacy)]
    only = params.get("only") or [name for name, _ in sections] + ["schedules"]
    if backend.nccl:
        only = [name for name in only if name in NCCL_SECTIONS]
    results = {}
    seconds = {**(seconds or {}), "groups": time.monotonic() - t0}
    for name, fn in sections:
        if name not in only:
            continue
        t = time.monotonic()
        results[name] = guarded(fn, ctx)
        dist.barrier()
        seconds[name] = time.monotonic() - t
    if "schedules" in only:
        t = time.monotonic()
        results["schedules"] = guarded(section_schedules, ctx)
        seconds["schedules"] = time.monotonic() - t
    results["seconds"] = seconds
    return results


def body(params):
    backend = Backend(params.get("backend", "shm"))  # first: the shim then replaces its torch.cuda stand-ins
    t0 = time.monotonic()
    prepare()
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=params["timeout"] * 2))
    return run_all(params, backend, {"setup": time.monotonic() - t0})


if __name__ == "__main__":
    harness.run(body)
