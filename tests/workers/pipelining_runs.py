"""torch.distributed.pipelining's seven schedule classes, run over gloo (torch's own p2p) and over
megatron_p2p (shm, through patch_pipelining) in the same worker, with the same seeds, and
compared bit for bit. One job per world size; every configuration runs in it.

A configuration: a class, stages per rank, microbatches, and whether the stages are given
example tensors (STATIC: no metadata round) or not (DYNAMIC: the metadata round runs through
send_object_list / recv_object_list). Each runs step(), eval(), step() (the first-step rounds
run again after each switch). The model: stages of different widths; stage 0 has two outputs,
the second computed from the data alone, so it needs no gradient and stage 1 sends none back
for it. In the layouts section stage 0's first output is transposed (torch allocates
stage 1's receive buffer with its strides, and the gradient sent back is transposed too): gloo
refuses non-contiguous tensors, so the reference run, over gloo, sends the same values
contiguous.

Sections: runs (per configuration: losses, eval outputs, gradients and whether each is bitwise
equal, messages posted), control (a run with other data compared the same way: must differ),
layouts (transposed activations over megatron_p2p against contiguous ones over gloo), defer
(torch's defer_pp_recv=True: gloo's results against its default order's, and what megatron_p2p
raises, how fast).
params: configs and layout_configs (lists of [class, stages_per_rank, microbatches, given]),
defer (list of [class, stages_per_rank, microbatches, uniform]), timeout."""

from typing import Any

import harness

WIDTH_LIST = [6, 4, 7, 3, 5, 8, 4, 6, 5, 3]
SIDE_WIDTH = 2  # width of stage 0's second output
WIDTH_ALL = 4
ROWS = 2  # rows per microbatch
# torch 2.13's V schedules fail eval() over gloo as well ("can't steal_bwd_input if this stage
# doesn't have backward"): they run the backward half of their local handoff in eval too.
CALLS = {"ZBVZeroBubble": ("step", "step"), "DualPipeV": ("step", "step")}


def build(torch, nn, pipelining, cls_name, spr, n_mb, given, transposed, defer=False, uniform=False, device="cpu",
          group=None):
    """The schedule for this rank over `group` (None: the default group), and its stages on
    `device` (initialised on the CPU, so the same values on any device). uniform: every width
    equal, stage 0's second output too (so a misdelivered message fits its buffer)."""
    import torch.distributed as dist

    widths = [WIDTH_ALL] * len(WIDTH_LIST) if uniform else WIDTH_LIST
    side_w = WIDTH_ALL if uniform else SIDE_WIDTH

    world, me = dist.get_world_size(group), dist.get_rank(group)
    n_stages = world * spr
    v = cls_name in ("ZBVZeroBubble", "DualPipeV")
    local = [me, 2 * world - 1 - me] if v else [me + k * world for k in range(spr)]

    from torch.nn import Module  # nn's

    class Stage(Module):
        def __init__(self, s):
            super().__init__()
            self.s = s
            self.lin = nn.Linear(widths[s], widths[s + 1])
            if s == 1:
                self.side = nn.Linear(side_w, widths[s + 1], bias=False)

        def forward(self, x, side=None):
            h = self.lin(x.t() if transposed and self.s == 1 else x)
            h = torch.tanh(h if side is None else h + self.side(side))
            if self.s == 0 and n_stages > 1:
                out = h.t() if transposed else h
                return out, x[:, :side_w] * 0.5  # from the data only: no gradient flows back for it
            return h

    def examples(s):
        inputs: tuple
        if s == 0:
            inputs = (torch.empty(ROWS, widths[0], device=device),)
        elif s == 1:
            first = torch.empty(ROWS, widths[1], device=device)
            first = first.t() if transposed else first
            inputs = (first.requires_grad_(True), torch.empty(ROWS, side_w, device=device))
        else:
            inputs = (torch.empty(ROWS, widths[s], requires_grad=True, device=device),)
        outputs = Stage(s).to(device)(*inputs)  # with autograd: requires_grad is part of the metadata
        return {"input_args": inputs, "output_args": outputs}

    stages = []
    for s in local:
        torch.manual_seed(1000 + s)
        mod = Stage(s).to(device)
        stages.append(pipelining.PipelineStage(mod, s, n_stages, torch.device(device), group=group,
                                               **(examples(s) if given else {})))
    loss_fn = lambda out, y: ((out - y) ** 2).mean()  # noqa: E731
    cls = getattr(pipelining, "Schedule" + cls_name)
    extra = {"defer_pp_recv": True} if defer else {}
    if cls_name in ("GPipe", "1F1B"):
        sched = cls(stages[0], n_microbatches=n_mb, loss_fn=loss_fn)
    else:
        sched = cls(stages, n_microbatches=n_mb, loss_fn=loss_fn, **extra)
    return sched, stages, n_stages


def run_once(torch, nn, pipelining, cfg, seed, transposed=False, defer=False, uniform=False, device="cpu", group=None):
    """step, eval, step: the losses, eval outputs and gradients this rank holds (on `device`;
    the stages over `group`, None: the default group)."""
    cls_name, spr, n_mb, given = cfg
    sched, stages, n_stages = build(torch, nn, pipelining, cls_name, spr, n_mb, given, transposed, defer, uniform,
                                    device, group)
    widths = [WIDTH_ALL] * len(WIDTH_LIST) if uniform else WIDTH_LIST
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_mb * ROWS, widths[0], generator=g).to(device)
    y = torch.randn(n_mb * ROWS, widths[n_stages], generator=g).to(device)
    has_first = any(st.is_first for st in stages)
    has_last = any(st.is_last for st in stages)
    args = (x,) if has_first else ()
    kw = {"target": y} if has_last else {}
    record: dict[str, list] = {"losses": [], "eval": [], "grads": []}
    for call in CALLS.get(cls_name, ("step", "eval", "step")):
        losses: list | None = [] if has_last else None
        try:
            out = getattr(sched, call)(*args, losses=losses, **kw)
        except Exception as exc:
            exc.add_note(f"in {call}() of {cfg}")
            raise
        if has_last:
            assert losses is not None
            record["losses"] += [t.detach().clone() for t in losses]
            if call == "eval":
                record["eval"].append(out.detach().clone())
    for st in stages:
        record["grads"] += [p.grad.clone() for p in st.submod.parameters()]
    return record


def same_bits(a, b):
    keys = ("losses", "eval", "grads")
    return {k: len(a[k]) == len(b[k]) and all(
        x.dtype == y.dtype and x.shape == y.shape and
        x.cpu().contiguous().numpy().tobytes() == y.cpu().contiguous().numpy().tobytes()
        for x, y in zip(a[k], b[k])) for k in keys} | {f"n_{k}": len(a[k]) for k in keys}


def peers(torch, dist, mp):
    """torch's peer arguments and blocking calls on ranks 0 and 1; the object-list wire bytes of
    torch's own (over gloo) and ours, read raw on rank 1."""
    me, other = dist.get_rank(), 1 - dist.get_rank()
    res: dict[str, Any] = {}
    by_global = mp.P2POp(dist.isend, torch.ones(1), other)
    by_group = mp.P2POp(dist.irecv, torch.ones(1), group_peer=other)
    res["group_peer_filled"] = [by_global.group_peer, by_group.peer]
    named = dist.new_group([0, 1])
    res["group_filled"] = [by_global.group is dist.group.WORLD,
                           mp.P2POp(dist.isend, torch.ones(1), other, group=named).group is named]
    res["not_a_member"] = harness.caught(lambda: mp.P2POp(dist.isend, torch.ones(1), 5))
    t = torch.full((3,), float(me))
    buf = torch.empty(3)
    reqs = [mp.isend(t, group_dst=other), mp.irecv(buf, group_src=other)] if me == 0 else \
        [mp.irecv(buf, group_src=other), mp.isend(t, group_dst=other)]
    for r in reqs:
        r.wait()
    res["group_dst_src"] = buf.tolist()
    if me == 0:
        mp.send(t, 1)
        res["recv_returns"] = mp.recv(buf, group_src=1)
    else:
        res["recv_returns"] = mp.recv(buf, 0)
        mp.send(t, group_dst=0)
    objs = [{"shape": (2, 3), "dtype": "float32"}, "x" * 300, None]
    raw = {}
    for who, send_objs in (("torch", dist.send_object_list), ("ours", mp.send_object_list)):
        recv_raw = dist.recv if who == "torch" else mp.recv
        if me == 0:
            send_objs(objs, dst=1)
        else:
            sizes = torch.empty(len(objs), dtype=torch.int64)
            recv_raw(sizes, 0)
            data = torch.empty(int(sizes.sum()), dtype=torch.uint8)
            recv_raw(data, 0)
            raw[who] = [sizes.tolist(), data.numpy().tobytes().hex()]
    res["wire"] = raw
    got = [None] * len(objs)
    if me == 0:
        mp.send_object_list(objs, group_dst=1, use_batch=True)
    else:
        res["object_list"] = {"sender": mp.recv_object_list(got, src=0), "equal": got == objs}
    return res


def body(params):
    import torch
    import torch.distributed as dist
    import torch.distributed.pipelining as pipelining
    from torch import nn

    import megatron_p2p as mp

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out: dict[str, Any] = {"runs": {}}
    with mp.patch_pipelining():  # no communicator yet: the first-step vote's first call says so
        out["no_comm"] = harness.caught(lambda: run_once(torch, nn, pipelining, params["configs"][0], seed=7))
    mp.register_communicator(mp.init_communicator(timeout=params["timeout"])).close()
    out["closed_comm"] = harness.caught(lambda: mp.isend(torch.ones(1), 1 - dist.get_rank()))
    comm = mp.register_communicator(mp.init_communicator(timeout=params["timeout"]))
    if params.get("peers"):
        out["peers"] = peers(torch, dist, mp)

    def sent():
        stats = comm.stats()
        return stats["sends"] + stats["recvs"]

    for cfg in params["configs"]:
        name = "{} spr{} mb{} {}".format(cfg[0], cfg[1], cfg[2], "given" if cfg[3] else "inferred")
        theirs = run_once(torch, nn, pipelining, cfg, seed=7)
        before = sent()
        with mp.patch_pipelining():
            ours = run_once(torch, nn, pipelining, cfg, seed=7)
        out["runs"][name] = {"equal": same_bits(ours, theirs), "messages": sent() - before}

    cfg = params["configs"][0]
    theirs = run_once(torch, nn, pipelining, cfg, seed=7)
    with mp.patch_pipelining():
        other = run_once(torch, nn, pipelining, cfg, seed=8)
    out["control"] = same_bits(other, theirs)

    # Transposed activations (gloo refuses them): ours carry the values.
    layouts = {}
    for cfg in params["layout_configs"]:
        name = "{} spr{} mb{} {}".format(cfg[0], cfg[1], cfg[2], "given" if cfg[3] else "inferred")
        theirs = run_once(torch, nn, pipelining, cfg, seed=7)
        with mp.patch_pipelining():
            ours = run_once(torch, nn, pipelining, cfg, seed=7, transposed=True)
        layouts[name] = same_bits(ours, theirs)
    out["layouts"] = layouts

    # defer_pp_recv=True: gloo against the default order, then ours (a fresh communicator per
    # case: a deadlock aborts the one it happens on).
    out["defer"] = {}
    for cls_name, spr, n_mb, uniform in params["defer"]:
        cfg = [cls_name, spr, n_mb, True]
        name = f"{cls_name} spr{spr} mb{n_mb}" + (" uniform" if uniform else "")
        reference = run_once(torch, nn, pipelining, cfg, seed=7, uniform=uniform)
        deferred = run_once(torch, nn, pipelining, cfg, seed=7, defer=True, uniform=uniform)
        case = {"gloo": same_bits(deferred, reference)}
        fresh = mp.init_communicator(timeout=params["timeout"])
        with mp.patch_pipelining(fresh):
            case["ours"] = harness.caught(lambda: run_once(torch, nn, pipelining, cfg, seed=7, defer=True,
                                                           uniform=uniform))
        fresh.close()
        out["defer"][name] = case
    return out


if __name__ == "__main__":
    harness.run(body)
