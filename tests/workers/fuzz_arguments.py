"""Property test of the argument layer on 2 ranks: every call either moves exact data or raises
TypeError / ValueError before anything is posted, and the communicator works afterwards.

Rank 0 draws cases with hypothesis (no database, derandomized, so a run repeats) and ships
each one to rank 1 as plain data; both ranks build their half of the call from it, report what
happened before waiting on anything, then wait and compare bytes. A case is symmetric: what
rank 0 sends, rank 1 builds from the same recipe as a receive buffer, so an argument is valid on
both ranks or on neither. Rank 1 never draws, so hypothesis may shrink a failure freely.

params: examples (hypothesis max_examples), seed.
Returns (rank 0) {"cases": n, "outcomes": {"<api>: <accepted|rejected>": count}}."""
from __future__ import annotations

import dataclasses
import functools
import math
import sys
import types
from collections import Counter
from collections.abc import Callable
from typing import Any

import harness
import numpy as np
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

import megatron_p2p as mp
from megatron_p2p import _C

PEER, SELF, PEER_IN_GROUP = "<peer>", "<self>", "<peer in group>"
WORLD, MY_GROUP = "<world group>", "<my one-rank group>"
CARRIED = [getattr(torch, n) for n in _C.DTYPE_NAMES if hasattr(torch, n)]
OTHER_DTYPES = [torch.complex32, torch.bits8, *(getattr(torch, n) for n in ("uint4", "int2")),  # not in torch's stubs
                torch.float4_e2m1fn_x2]
QUANTIZED = [torch.qint8, torch.quint8, torch.qint32]
REJECTED = (TypeError, ValueError)
# megatron-core's own errors for a receive without a dtype or a shape, kept by P2PCommunicator.
DOCUMENTED_RUNTIME = ("needs a dtype", "needs tensor_shape")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How to build one tensor; a sender fills it with its rank's bytes, a receiver with 0xEE."""

    form: str
    dtype: str
    shape: tuple[int, ...]


def dtype_of(name: str) -> torch.dtype:
    return getattr(torch, name)


def dense(dtype: torch.dtype, shape: tuple[int, ...], fill: int | None) -> torch.Tensor:
    """Contiguous, with random bytes from `fill` (a seed), or 0xEE when fill is None."""
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if fill is None:
        raw = torch.full((nbytes,), 0xEE, dtype=torch.uint8)
    else:
        raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(fill))
    if dtype == torch.bool:
        raw &= 1
    return raw.view(dtype).reshape(shape)


def build(r: Recipe, fill: int | None) -> Any:
    dtype, shape = dtype_of(r.dtype), r.shape
    if r.form == "dense":
        return dense(dtype, shape, fill)
    if r.form == "offset":  # a contiguous slice that starts past its storage's first element
        return dense(dtype, (1 + math.prod(shape),), fill)[1:].reshape(shape)
    if r.form == "transposed":
        return dense(dtype, shape[::-1], fill).t() if len(shape) == 2 else dense(dtype, shape, fill).T
    if r.form == "every_other":
        return dense(dtype, (*shape[:-1], 2 * shape[-1]) if shape else (2,), fill)[..., ::2]
    if r.form == "expanded":  # huge, never allocated
        return dense(dtype, (1,), fill).expand(*shape)
    if r.form == "as_strided":
        return dense(dtype, (1,), fill).as_strided(shape, (0,) * len(shape))
    if r.form == "requires_grad":
        return dense(dtype, shape, fill).requires_grad_(True)
    if r.form == "meta":
        return torch.empty(shape, dtype=dtype, device="meta")
    if r.form == "other_dtype":
        return torch.zeros(shape, dtype=dtype)
    if r.form == "quantized":
        return torch.quantize_per_tensor(torch.zeros(shape), 0.5, 0, dtype)
    if r.form == "conj":
        return dense(dtype, shape, fill).conj()
    if r.form == "neg":
        return dense(dtype, shape, fill)._neg_view()
    if r.form in ("sparse_coo", "sparse_csr", "sparse_csc"):
        return getattr(dense(dtype, shape, fill), "to_" + r.form)()
    if r.form == "mkldnn":
        return dense(torch.float32, shape, fill).to_mkldnn()
    if r.form in ("nested", "jagged"):
        parts = [dense(dtype, (n,), None if fill is None else fill + n) for n in shape]
        return torch.nested.nested_tensor(parts, layout=torch.jagged if r.form == "jagged" else torch.strided)
    if r.form == "numpy_scalar":
        return np.zeros(shape, dtype=np.float32)
    raise AssertionError(r.form)


small_shape = st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple)
huge_shape = st.lists(st.sampled_from([1, 2, 7, 2 ** 31, 2 ** 40]), min_size=1, max_size=3).map(tuple).filter(
    lambda s: math.prod(s) < 2 ** 59)  # numel * itemsize fits in int64, as torch needs
carried = st.sampled_from([str(d).split(".")[1] for d in CARRIED])


def recipes() -> st.SearchStrategy[Recipe]:
    def of(form: str, dtypes: st.SearchStrategy[str], shapes: st.SearchStrategy[tuple]) -> st.SearchStrategy[Recipe]:
        return st.builds(Recipe, st.just(form), dtypes, shapes)

    name = lambda ds: st.sampled_from([str(d).split(".")[1] for d in ds])  # noqa: E731
    two_d = st.tuples(st.integers(0, 4), st.integers(0, 4))
    nonempty = st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple)
    floats = name([torch.float32, torch.float64])
    return st.one_of(
        of("dense", carried, small_shape),
        of("offset", carried, small_shape),
        of("transposed", carried, two_d),
        of("every_other", carried, nonempty),
        of("expanded", carried, huge_shape),
        of("as_strided", carried, huge_shape),
        of("dense", carried, st.tuples(st.just(0), st.sampled_from([2 ** 40, 2 ** 62]))),  # huge, 0 bytes
        of("requires_grad", floats, small_shape),
        of("meta", carried, huge_shape),
        of("other_dtype", name(OTHER_DTYPES), st.just((4,))),
        of("quantized", name(QUANTIZED), small_shape),
        of("conj", name([torch.complex64, torch.complex128]), nonempty),
        of("neg", floats, nonempty),
        of("sparse_coo", floats, two_d),
        of("sparse_csr", floats, two_d),
        of("sparse_csc", floats, two_d),
        of("mkldnn", name([torch.float32]), nonempty),
        of("nested", floats, st.lists(st.integers(1, 3), min_size=1, max_size=3).map(tuple)),
        of("jagged", floats, st.lists(st.integers(1, 3), min_size=2, max_size=3).map(tuple)),
        of("numpy_scalar", floats, nonempty),
    )


# Objects that are not what a parameter wants. Plain data, so that they travel to rank 1.
# Objects that are not what a parameter wants. Plain data, so that they travel to rank 1; never 0,
# 1 or a bool, which would name a rank on one side and not on the other.
junk = st.one_of(
    st.none(), st.integers(-2 ** 70, 2 ** 70).filter(lambda i: i not in (0, 1)),
    st.sampled_from([-1, 2, 7, 2 ** 31, 2 ** 63, 2 ** 64]), st.floats(allow_nan=True).filter(lambda f: f not in (0, 1)),
    st.text(max_size=8), st.binary(max_size=8), st.lists(st.integers(0, 3), max_size=3),
    st.sampled_from([WORLD, "<object>", "<np.int64 7>"]),
)
valid_recipes = st.one_of(st.builds(Recipe, st.sampled_from(["dense", "offset"]), carried, small_shape),
                          st.builds(Recipe, st.just("requires_grad"), st.just("float32"), small_shape))


def mostly(valid: st.SearchStrategy, invalid: st.SearchStrategy = junk) -> st.SearchStrategy:
    """Valid four times in five (a call is accepted only when every argument is); shrinks to valid.
    (one_of cannot weigh: it drops repeated branches.)"""
    return st.integers(0, 4).flatmap(lambda i: invalid if i == 4 else valid)


tensor_arg = mostly(valid_recipes, st.one_of(recipes(), junk))
peer_arg = mostly(st.sampled_from([PEER, "<np.int64 peer>"]), st.one_of(st.just(SELF), junk))
batch_peer_arg = mostly(st.sampled_from([PEER, "<np.int64 peer>"]))


def resolve(x: Any, rank: int) -> Any:
    """A drawn value as this rank passes it: tokens become ranks, groups and objects."""
    if x == PEER:
        return 1 - rank
    if x == SELF:
        return rank
    if x == PEER_IN_GROUP:
        return 1 - rank
    if x == WORLD:
        return dist.group.WORLD
    if x == MY_GROUP:
        return GROUPS[rank]
    if x == "<object>":
        return object()
    if x == "<np.int64 peer>":
        return np.int64(1 - rank)
    if x == "<np.int64 7>":
        return np.int64(7)
    return x


# ---- cases: (what to call, with what) -----------------------------------------------------------

exchange_case = st.fixed_dictionaries(
    {"api": st.just("exchange"), "fwd": st.one_of(st.none(), tensor_arg), "bwd": st.one_of(st.none(), tensor_arg),
     "mode": mostly(st.sampled_from(["parity", "batched"])), "neighbours": mostly(st.sampled_from([None, PEER, SELF])),
     "call": mostly(st.one_of(st.none(), st.text(max_size=4)))})

p2p_case = st.fixed_dictionaries(
    {"api": st.sampled_from(["isend_irecv", "comm_isend_irecv"]), "sender": st.integers(0, 1), "tensor": tensor_arg,
     "peer": peer_arg, "group": mostly(st.sampled_from([None, WORLD]), st.sampled_from([MY_GROUP, "<object>"])),
     "tag": mostly(st.just(0)), "group_peer": mostly(st.just(None))})

batch_case = st.fixed_dictionaries(
    {"api": st.sampled_from(["batch_isend_irecv", "comm_batch"]),
     "ops": st.lists(mostly(st.tuples(st.sampled_from(["0to1", "1to0", "self"]), tensor_arg, batch_peer_arg),
                            st.tuples(st.just("junk"), junk, junk)), max_size=3),
     "lane": mostly(st.sampled_from([0, 1]))})

init_case = st.fixed_dictionaries(
    {"api": st.just("init_communicator"),
     "kwargs": st.fixed_dictionaries({}, optional={
         "group": st.sampled_from([None, WORLD, "<object>"]), "backend": st.one_of(st.just("shm"), junk),
         "timeout": st.one_of(st.just(30.0), st.sampled_from([0.0, -1.0, math.nan, math.inf, -math.inf, 1e300]), junk),
         "lanes": st.one_of(st.sampled_from([1, 2]), junk),
         "eager_threshold": st.one_of(st.sampled_from([0, 64]), junk), "device": st.one_of(st.just("cpu"), junk),
         "high_priority": st.one_of(st.booleans(), junk)})})

pipeline_case = st.fixed_dictionaries(
    {"api": st.just("P2PCommunicator"),
     "method": st.sampled_from(["send_forward_recv_forward", "send_backward_recv_backward",
                                "send_forward_backward_recv_forward_backward", "send_forward", "recv_forward",
                                "send_backward", "recv_backward", "send_forward_recv_backward"]),
     "tensor": tensor_arg, "flag": mostly(st.booleans()),
     # Invalid shapes only: a valid huge one would ask for memory (and torch would fail to find it).
     "shape": mostly(st.just("<same>"), st.one_of(junk, st.just([2 ** 40, 2 ** 40]),
                                                  st.lists(st.integers(-3, -1), min_size=1, max_size=3))),
     "pipeline_dtype": mostly(st.just("<same>"), st.one_of(st.sampled_from(["int64", "float32"]), junk)),
     "mode": mostly(st.sampled_from([None, "parity", "batched"])),
     "variable_seq_lengths": st.booleans(), "lanes": mostly(st.none())})

cases = st.one_of(exchange_case, p2p_case, batch_case, init_case, pipeline_case)


# ---- running a case on this rank ----------------------------------------------------------------


class Posted:
    """What a rank posted: its requests, and per receive buffer the tensor it must equal."""

    def __init__(self) -> None:
        self.requests: list[Any] = []
        self.checks: list[tuple[str, torch.Tensor, Callable[[], torch.Tensor]]] = []

    def add_recv(self, what: str, got: torch.Tensor, expected: Callable[[], torch.Tensor]) -> None:
        self.checks.append((what, got, expected))


def fill_seed(case_id: int, sender: int, slot: str) -> int:
    return (case_id * 7919 + sender * 104729 + sum(map(ord, slot))) % (2 ** 31)


class RecipeError(Exception):
    """The test could not build a tensor it drew: a bug of this test, not a finding."""


def as_arg(x: Any, rank: int, fill: int | None) -> Any:
    if not isinstance(x, Recipe):
        return resolve(x, rank)
    try:
        return build(x, fill)
    except Exception as exc:
        raise RecipeError(f"{x}: {type(exc).__name__}: {exc}") from None


def expected_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes a tensor reads as, in logical order (NaN payloads included)."""
    flat = t.detach().reshape(-1)
    # A copy: torch calls a tensor contiguous whatever the strides of its size-1 dims.
    return torch.empty(flat.shape, dtype=flat.dtype).copy_(flat).view(torch.uint8)


def run_exchange(case: dict, rank: int, comm: Any, case_id: int, out: Posted) -> None:
    # Forward: my send_next meets the peer's recv_prev (both from recipe fwd); backward likewise.
    neighbours = case["neighbours"]
    source = rank if neighbours == SELF else 1 - rank
    args: dict[str, Any] = {}
    for direction, send, recv in (("fwd", "send_next", "recv_prev"), ("bwd", "send_prev", "recv_next")):
        spec = case[direction]
        if spec is None:
            continue
        args[send] = as_arg(spec, rank, fill_seed(case_id, rank, direction))
        args[recv] = as_arg(spec, rank, None)
        if isinstance(spec, Recipe):
            out.add_recv(recv, args[recv], functools.partial(build, spec, fill_seed(case_id, source, direction)))
    kw: dict[str, Any] = {"mode": resolve(case["mode"], rank), "call": resolve(case["call"], rank)}
    if neighbours is not None:
        kw["prev_rank"] = kw["next_rank"] = resolve(neighbours, rank)
    out.requests = list(comm.exchange(**args, **kw).values())


def run_p2p(case: dict, rank: int, comm: Any, case_id: int, out: Posted) -> None:
    sending = rank == case["sender"]
    spec = case["tensor"]
    tensor = as_arg(spec, rank, fill_seed(case_id, rank, "p2p") if sending else None)
    peer = resolve(case["peer"], rank)
    if case["api"] == "comm_isend_irecv":
        out.requests = [(comm.isend if sending else comm.irecv)(tensor, peer)]
    else:
        op = mp.isend if sending else mp.irecv
        group_peer = resolve(case["group_peer"], rank)
        out.requests = [op(tensor, peer, resolve(case["group"], rank), resolve(case["tag"], rank), group_peer)]
    if not sending and isinstance(spec, Recipe):
        out.add_recv("irecv", tensor, lambda: build(spec, fill_seed(case_id, 1 - rank, "p2p")))


def run_batch(case: dict, rank: int, comm: Any, case_id: int, out: Posted) -> None:
    entries: list[tuple[Any, Any, Any]] = []  # (is_send or "junk", tensor, peer)
    for i, (direction, spec, peer) in enumerate(case["ops"]):
        if direction == "junk":
            entries.append(("junk", resolve(spec, rank), resolve(peer, rank)))
            continue
        ends = {"0to1": (0, 1), "1to0": (1, 0), "self": (rank, rank)}[direction]
        for is_send in ([True, False] if direction == "self" else [rank == ends[0]]):
            where = "self" if direction == "self" else "peer"
            # A self op addresses this rank with the token's type (an int, or a numpy int).
            target = resolve(peer, 1 - rank) if direction == "self" else resolve(peer, rank)
            tensor = as_arg(spec, rank, fill_seed(case_id, rank, f"b{i}") if is_send else None)
            entries.append((is_send, tensor, target))
            if not is_send and isinstance(spec, Recipe):
                sender = ends[0]
                out.add_recv(f"ops[{i}] ({where})", tensor, functools.partial(
                    build, spec, fill_seed(case_id, sender, f"b{i}")))
    if case["api"] == "comm_batch":
        ops = [e if e[0] != "junk" else e[1] for e in entries]
        out.requests = comm.batch(ops, lane=resolve(case["lane"], rank))
    else:
        p2p_ops = [e[1] if e[0] == "junk" else mp.P2POp(mp.isend if e[0] else mp.irecv, e[1], e[2]) for e in entries]
        out.requests = mp.batch_isend_irecv(p2p_ops)


def run_init(case: dict, rank: int, comm: Any, case_id: int, out: Posted) -> None:
    kwargs = {k: resolve(v, rank) for k, v in case["kwargs"].items()}
    made = mp.init_communicator(**kwargs)
    try:
        check_canary(made, rank, case_id)
    finally:
        made.close()


def run_pipeline(case: dict, rank: int, comm: Any, case_id: int, out: Posted) -> None:
    """P2PCommunicator over this rank's one-rank group: its sends come back to itself."""
    spec = case["tensor"]
    tensor = as_arg(spec, rank, fill_seed(case_id, rank, "pp"))
    same = isinstance(spec, Recipe)
    dtype = case["pipeline_dtype"]
    config = types.SimpleNamespace(
        pipeline_dtype=(dtype_of(spec.dtype) if same else None) if dtype == "<same>"
        else dtype_of(dtype) if dtype in ("int64", "float32") else resolve(dtype, rank),
        variable_seq_lengths=case["variable_seq_lengths"], batch_p2p_comm=True, timers=None)
    shape = case["shape"]
    shape = (list(spec.shape) if same else [1]) if shape == "<same>" else resolve(shape, rank)
    p2p = mp.P2PCommunicator(GROUPS[rank], config, mode=resolve(case["mode"], rank),
                             lanes=resolve(case["lanes"], rank))
    method, flag = case["method"], resolve(case["flag"], rank)
    call = getattr(p2p, method)
    if method in ("send_forward_recv_forward", "send_backward_recv_backward"):
        got = call(tensor, flag, shape)
        gots = [got] if flag else []
    elif method == "send_forward_backward_recv_forward_backward":
        got_prev, got_next = call(tensor, tensor, flag, flag, shape)
        gots = [got_prev, got_next] if flag else []
    elif method.startswith("send") and "recv" in method:
        call(tensor, shape, flag)
        gots = []
    elif method.startswith("send"):
        call(tensor, flag)
        gots = []
    else:
        call(shape, flag)
        gots = []
    for i, got in enumerate(gots):
        out.add_recv(f"{method}[{i}]", got, lambda: tensor)


RUNNERS = {"exchange": run_exchange, "isend_irecv": run_p2p, "comm_isend_irecv": run_p2p,
           "batch_isend_irecv": run_batch, "comm_batch": run_batch, "init_communicator": run_init,
           "P2PCommunicator": run_pipeline}


def posted_count(comm: Any) -> int:
    s = comm.stats()
    return s["sends"] + s["recvs"]


def check_canary(comm: Any, rank: int, case_id: int) -> None:
    """A plain exchange with the peer (or itself, on one rank), checked byte for byte."""
    source = comm.ranks[(comm.rank - 1) % comm.size]
    send = dense(torch.float32, (3,), fill_seed(case_id, rank, "canary"))
    recv = dense(torch.float32, (3,), None)
    for r in comm.exchange(send_next=send, recv_prev=recv).values():
        r.wait()
    if not torch.equal(expected_bytes(recv), expected_bytes(dense(torch.float32, (3,), fill_seed(case_id, source,
                                                                                              "canary")))):
        raise AssertionError(f"canary exchange after case {case_id} received wrong bytes")


def attempt(case: dict, rank: int, comm: Any, case_id: int) -> tuple[dict, Posted]:
    """Runs this rank's half up to posting; the outcome is what both ranks compare."""
    out = Posted()
    local_comm = PIPELINE_COMMS[rank] if case["api"] == "P2PCommunicator" else comm
    before = posted_count(local_comm)
    try:
        RUNNERS[case["api"]](case, rank, comm, case_id, out)
    except RecipeError as exc:
        return {"kind": "recipe error", "type": "RecipeError", "msg": str(exc)}, out
    except REJECTED as exc:
        extra = posted_count(local_comm) - before
        return {"kind": "rejected", "type": type(exc).__name__, "msg": str(exc)[:300], "posted_first": extra}, out
    except mp.MismatchError as exc:
        if case["api"] == "P2PCommunicator" and (case["pipeline_dtype"], case["shape"]) != ("<same>", "<same>"):
            # The tensor sent is not what the receive expects (config.pipeline_dtype, tensor_shape):
            # a disagreement between sender and receiver, reported as such.
            return {"kind": "rejected", "type": "MismatchError", "msg": str(exc)[:300], "posted_first": 0}, out
        return {"kind": "wrong error", "type": type(exc).__name__, "msg": str(exc)[:300]}, out
    except RuntimeError as exc:
        if case["api"] == "P2PCommunicator" and any(s in str(exc) for s in DOCUMENTED_RUNTIME):
            return {"kind": "rejected", "type": "RuntimeError (megatron-core's)", "msg": str(exc)[:300],
                    "posted_first": posted_count(local_comm) - before}, out
        return {"kind": "wrong error", "type": type(exc).__name__, "msg": str(exc)[:300]}, out
    except Exception as exc:
        return {"kind": "wrong error", "type": type(exc).__name__, "msg": str(exc)[:300]}, out
    return {"kind": "accepted"}, out


def finish(posted: Posted) -> list[str]:
    """Waits for what was posted and compares each receive buffer with what its sender sent."""
    problems = []
    for r in posted.requests:
        try:
            r.wait()
        except Exception as exc:
            problems.append(f"wait raised {type(exc).__name__}: {exc}")
    for what, got, expected in posted.checks:
        try:
            if not torch.equal(expected_bytes(got), expected_bytes(expected())):
                problems.append(f"{what}: received bytes differ from the bytes sent")
        except Exception as exc:  # reported like a finding, so that both ranks go on
            problems.append(f"{what}: comparing raised {type(exc).__name__}: {exc}")
    return problems


def gather(obj: Any) -> list[Any]:
    out: list[Any] = [None, None]
    dist.all_gather_object(out, obj)
    return out


def play(case: dict, rank: int, comm: Any, case_id: int) -> tuple[list[str], list[str]]:
    """One case on both ranks: the problems found (the same list on both) and the outcomes."""
    outcome, posted = attempt(case, rank, comm, case_id)
    outcomes = gather(outcome)
    problems = [f"rank {r}: {o['type']} is neither TypeError nor ValueError: {o['msg']}"
                for r, o in enumerate(outcomes) if o["kind"] == "wrong error"]
    problems += [f"rank {r}: this test could not build its tensor: {o['msg']}"
                 for r, o in enumerate(outcomes) if o["kind"] == "recipe error"]
    problems += [f"rank {r}: {o['type']} raised after {o['posted_first']} op(s) were posted: {o['msg']}"
                 for r, o in enumerate(outcomes) if o["kind"] == "rejected" and o["posted_first"]]
    kinds = {o["kind"] for o in outcomes}
    if kinds == {"accepted"}:
        problems += [f"rank {rank}: {p}" for p in finish(posted)]
    elif "accepted" in kinds:
        problems.append(f"only one rank accepted the call: {outcomes}")
        comm.abort(reason="fuzz: the ranks disagreed")  # its posted ops can never be matched
    problems = sorted(set(sum(gather(problems), [])))
    if not problems and not comm.closed:
        check_canary(comm, rank, case_id)
        check_canary(PIPELINE_COMMS[rank], rank, case_id)
    return problems, sorted(kinds)


# ---- the job ------------------------------------------------------------------------------------

GROUPS: list[Any] = []
PIPELINE_COMMS: list[Any] = [None, None]


class Session:
    """This rank's communicators, replaced when a case leaves one aborted."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.comm = mp.register_communicator(mp.init_communicator(timeout=60.0))
        self.cases = 0
        self.tally: Counter[str] = Counter()

    def step(self) -> list[str] | None:
        """Plays the case rank 0 broadcasts (None when the run is over)."""
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        return None if box[0] is None else self.play(box[0])

    def play(self, case: dict) -> list[str]:
        self.cases += 1
        problems, kinds = play(case, self.rank, self.comm, self.cases)
        self.tally.update(f"{case['api']}: {k}" for k in kinds)
        if problems or self.comm.closed:
            print(f"rank {self.rank}, case {self.cases}: {case}: {problems}", file=sys.stderr, flush=True)
            self.comm.close()
            self.comm = mp.register_communicator(mp.init_communicator(timeout=60.0))
        return problems


def body(params: dict) -> Any:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    GROUPS.extend(dist.new_group([r]) for r in range(2))
    PIPELINE_COMMS[rank] = mp.register_communicator(mp.init_communicator(GROUPS[rank], timeout=60.0))
    session = Session(rank)
    if rank == 1:
        while session.step() is not None:
            pass
        return None

    @seed(params["seed"])
    @settings(max_examples=params["examples"], database=None, deadline=None, suppress_health_check=list(HealthCheck),
              phases=[Phase.generate, Phase.shrink], report_multiple_bugs=False)
    @given(case=cases)
    def each_case(case: dict) -> None:
        dist.broadcast_object_list([case], src=0)
        problems = session.play(case)
        assert not problems, f"{case}:\n" + "\n".join(problems)

    try:
        each_case()
    finally:
        dist.broadcast_object_list([None], src=0)
    return {"cases": session.cases, "outcomes": dict(session.tally)}


if __name__ == "__main__":
    harness.run(body)
