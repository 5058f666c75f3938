"""Matching: every message arrives, byte for byte, in the receive it was meant for.

One torchrun job per world size (1, 2, 3, 4 and 8 ranks) runs workers/matching_exchange.py:
every rank sends patterns derived from (its global rank, the direction, the exchange number)
and checks each byte it receives, on chains and rings, in both modes, with one lane and two,
for every dtype and for sizes from 0 B to 64 MiB. The 4-rank job also runs Megatron-style
strided pipeline groups {0, 2} and {1, 3} side by side, and one more job forces the two-copy
path. Each job runs once per module; the tests below assert on its results.

Directions: "fwd" is what a rank sends with send_next (an activation), "bwd" what it sends with
send_prev (a gradient). recv_prev must get the previous stage's fwd, recv_next the next
stage's bwd; an origin reads "<sender's global rank>:<direction>".
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from conftest import run_job

KiB, MiB = 1 << 10, 1 << 20
ALL_DTYPES = [
    "float64", "float32", "float16", "bfloat16",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "bool", "complex64", "complex128",
]
KINDS = ("both", "fwd", "bwd")  # the worker cycles steps through these halves of an exchange
STEPS = 3
INFLIGHT_DEPTH = 10  # exchanges posted before any wait: more than the 8 descriptor slots per channel
MODES = ("parity", "batched")
LANES = (1, 2)


def configs(world: int) -> list[list]:
    topos = ("ring",) if world == 1 else ("chain", "ring")  # a one-rank chain has nothing to post
    return [[t, m, lanes] for t in topos for m in MODES for lanes in LANES]


def suite(world: int, *, huge: bool, dtypes=ALL_DTYPES, dtype_numels=("one", "4KiB", "4KiB+1")) -> dict:
    return {
        "configs": configs(world),
        "steps": STEPS,
        "timeout": 10.0,
        "dtypes": list(dtypes),
        "dtype_numels": list(dtype_numels),  # one element, 4 KiB (inline), one element past it
        "sizes": [["uint8", 0], ["uint8", 1], ["uint8", 4 * KiB], ["uint8", MiB], ["float32", MiB]],
        "huge": [["uint8", 64 * MiB]] if huge else [],
        "huge_steps": 1,
        "inflight": [["uint8", 64], ["uint8", 8 * KiB]],
        "inflight_depth": INFLIGHT_DEPTH,
        "isend": [["float32", 4], ["float32", 4 * KiB], ["float32", MiB]],
        "batch": [["float32", 4], ["float32", 4 * KiB], ["float32", MiB]],
    }


@dataclass
class JobSpec:
    nproc: int
    params: dict[str, Any]
    timeout: float
    env: dict[str, str] | None = field(default=None)


SUBGROUPS = [[0, 2], [1, 3]]
JOBS = {
    "world1": JobSpec(1, {"suite": suite(1, huge=True), "expect_single_copy": None}, 180),
    "world2": JobSpec(2, {"suite": suite(2, huge=True), "expect_single_copy": True}, 180),
    "world3": JobSpec(3, {"suite": suite(3, huge=False), "expect_single_copy": True}, 180),
    "world4": JobSpec(4, {
        "suite": suite(4, huge=True),
        "expect_single_copy": True,
        "process_group": True,
        "subgroups": SUBGROUPS,
        "subgroup_suite": {
            **suite(2, huge=False, dtypes=["bfloat16", "float8_e4m3fn", "int64", "bool"], dtype_numels=["one", "4KiB+1"]),
            "inflight": [["uint8", 64]],
        },
    }, 240),
    "world8": JobSpec(8, {"suite": suite(8, huge=False), "expect_single_copy": True}, 300),
    # process_vm_readv off: messages past 4 KiB go through the shared bounce buffer.
    "two_copy": JobSpec(2, {
        "suite": {
            "configs": configs(2), "steps": STEPS, "timeout": 10.0,
            # 4 KiB travels inline, so each large message follows an inline one on its channel.
            "sizes": [["uint8", 4 * KiB], ["uint8", MiB]], "huge": [["uint8", 64 * MiB]], "huge_steps": 1,
            "batch": [["uint8", MiB]],
        },
        "expect_single_copy": False,
    }, 180, {"MEGATRON_P2P_SHM_SINGLE_COPY": "0"}),
}
WORLDS = (1, 2, 3, 4, 8)


@pytest.fixture(scope="module")
def job():
    """job(name) -> every rank's result of that job, run once per module."""
    done: dict[str, Any] = {}

    def get(name: str) -> list[dict[str, Any]]:
        if name not in done:
            spec = JOBS[name]
            try:
                done[name] = run_job("matching_exchange.py", spec.nproc, spec.params, spec.timeout, spec.env)
            except pytest.fail.Exception as exc:  # killed past its limit: fail every test of it
                done[name] = exc
        if isinstance(done[name], BaseException):
            pytest.fail(str(done[name]), pytrace=False)
        return [r["value"] for r in done[name].ok()]

    return get


# ---- what every rank should have seen ------------------------------------------------------------

def recvs(topo: str, kind: str, rank: int, size: int) -> int:
    """Receives a rank posts in one exchange: a chain's ends skip the ops across the wrap."""
    has_prev = topo == "ring" or rank > 0
    has_next = topo == "ring" or rank < size - 1
    return (kind in ("both", "fwd")) * has_prev + (kind in ("both", "bwd")) * has_next


def expected_checks(spec: dict, topo: str, rank: int, size: int) -> dict[str, int]:
    per_case = sum(recvs(topo, KINDS[s % 3], rank, size) for s in range(spec["steps"]))
    counts = {
        "dtypes": len(spec.get("dtypes", [])) * len(spec.get("dtype_numels", [])) * per_case,
        "sizes": len(spec.get("sizes", [])) * per_case,
        "huge": len(spec.get("huge", [])) * sum(recvs(topo, KINDS[s % 3], rank, size) for s in range(spec.get("huge_steps", 1))),
        "inflight": len(spec.get("inflight", []))
        * sum(recvs(topo, KINDS[k % 3], rank, size) for k in range(spec.get("inflight_depth", 0))),
    }
    return {g: n for g, n in counts.items() if n}


def expected_origins(topo: str, rank: int, size: int, prev: int, nxt: int) -> dict[str, list[str]]:
    """recv_prev gets the previous stage's activation, recv_next the next stage's gradient."""
    out = {}
    if topo == "ring" or rank > 0:
        out["recv_prev"] = [f"{prev}:fwd"]
    if topo == "ring" or rank < size - 1:
        out["recv_next"] = [f"{nxt}:bwd"]
    return out


def problems(results: list[dict], config: str, want_checks, want_origins, part: str = "world") -> list[str]:
    """Everything wrong with one section (a config, or the isend / batch runs) on any rank."""
    out = []
    for g, value in enumerate(results):
        res = value[part]
        if not res["neighbours"]:
            out.append(f"rank {g}: no communicator was created: {res['errors']}")
            continue
        n = next(iter(res["neighbours"].values()))
        rank, size, prev, nxt = n["rank"], n["size"], n["prev"], n["next"]
        who = f"rank {g}"
        out += [f"{who}: {f['text']}" for f in res["failures"] if f["config"] == config]
        lost = sum(c for k, c in res["nfailures"].items() if k.split(" ")[0] == config)
        shown = sum(1 for f in res["failures"] if f["config"] == config)
        if lost > shown:
            out.append(f"{who}: and {lost - shown} more failure(s) in {config}")
        got = res["checks"].get(config, {})
        want = want_checks(rank, size)
        if got != want:
            out.append(f"{who}: {config} checked {got} messages, expected {want}")
        origins = res["origins"].get(config, {})
        want_o = want_origins(rank, size, prev, nxt)
        if origins != want_o:
            out.append(f"{who}: {config} received from {origins}, expected {want_o}")
    return out


def exchange_problems(results, world_suite, topo, mode, lanes, part="world"):
    return problems(
        results, f"{topo}/{mode}/lanes{lanes}",
        lambda r, n: expected_checks(world_suite, topo, r, n),
        lambda r, n, p, x: expected_origins(topo, r, n, p, x),
        part,
    )


def report(lines: list[str]) -> str:
    return f"{len(lines)} problem(s):\n" + "\n".join(lines[:30])


def group_failures(results, groups, part="world"):
    """Failures of some case groups ("dtypes", "sizes", "huge", "inflight"; "error": a section
    that raised) in any section, on any rank."""
    return [f"rank {g}: {f['text']}" for g, v in enumerate(results) for f in v[part]["failures"] if f["group"] in groups]


CONFIG_IDS = [f"{m}-lanes{lanes}" for m in MODES for lanes in LANES]
CONFIG_PARAMS = [(m, lanes) for m in MODES for lanes in LANES]


# ---- the tests ---------------------------------------------------------------------------------

@pytest.mark.parametrize("world", WORLDS)
def test_neighbours_are_the_global_ranks_around_the_ring(job, world):
    """rank, size and ranks describe the group; prev_rank and next_rank are global ranks and wrap."""
    for g, value in enumerate(job(f"world{world}")):
        assert value["world"]["neighbours"] == {str(lanes): {
            "rank": g, "global_rank": g, "size": world, "ranks": list(range(world)),
            "prev": (g - 1) % world, "next": (g + 1) % world, "lanes": lanes,
        } for lanes in LANES}


@pytest.mark.parametrize("mode,lanes", CONFIG_PARAMS, ids=CONFIG_IDS)
@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_chain_exchange_delivers_each_message_to_its_neighbour(job, world, mode, lanes):
    """On a chain (the ends post nothing across the wrap) every rank receives exactly its
    neighbours' messages, activations in recv_prev and gradients in recv_next, at every step."""
    results = job(f"world{world}")
    found = exchange_problems(results, JOBS[f"world{world}"].params["suite"], "chain", mode, lanes)
    assert not found, report(found)


@pytest.mark.parametrize("mode,lanes", CONFIG_PARAMS, ids=CONFIG_IDS)
@pytest.mark.parametrize("world", WORLDS)
def test_ring_exchange_delivers_each_message_to_its_neighbour(job, world, mode, lanes):
    """On a ring (all four ops on every rank, wrapping around) every rank receives exactly its
    neighbours' messages, activations in recv_prev and gradients in recv_next, at every step."""
    results = job(f"world{world}")
    found = exchange_problems(results, JOBS[f"world{world}"].params["suite"], "ring", mode, lanes)
    assert not found, report(found)


@pytest.mark.parametrize("mode,lanes", CONFIG_PARAMS, ids=CONFIG_IDS)
def test_pp2_activations_arrive_in_recv_prev_and_gradients_in_recv_next(job, mode, lanes):
    """With two stages prev == next, and the directions must still not swap: recv_prev gets the
    peer's send_next and recv_next the peer's send_prev, on a chain and on a ring."""
    results = job("world2")
    spec = JOBS["world2"].params["suite"]
    config_problems = []
    for topo in ("chain", "ring"):
        config_problems += exchange_problems(results, spec, topo, mode, lanes)
    assert not config_problems, report(config_problems)
    got = {(rank, slot): origin for rank, v in enumerate(results)
           for slot, origin in v["world"]["origins"][f"ring/{mode}/lanes{lanes}"].items()}
    assert got == {(0, "recv_prev"): ["1:fwd"], (0, "recv_next"): ["1:bwd"],
                   (1, "recv_prev"): ["0:fwd"], (1, "recv_next"): ["0:bwd"]}


@pytest.mark.parametrize("mode,lanes", CONFIG_PARAMS, ids=CONFIG_IDS)
def test_one_rank_exchanges_with_itself(job, mode, lanes):
    """With one rank prev == next == self: its activation comes back in recv_prev and its
    gradient in recv_next."""
    results = job("world1")
    found = exchange_problems(results, JOBS["world1"].params["suite"], "ring", mode, lanes)
    assert not found, report(found)
    assert results[0]["world"]["origins"][f"ring/{mode}/lanes{lanes}"] == {"recv_prev": ["0:fwd"], "recv_next": ["0:bwd"]}


@pytest.mark.parametrize("world", WORLDS)
def test_every_dtype_arrives_bytewise_in_both_directions(job, world):
    """Each supported dtype (float8 and bool included, compared as bytes) arrives intact at one
    element, at 4 KiB and one element past 4 KiB, as an activation and as a gradient."""
    results = job(f"world{world}")
    spec = JOBS[f"world{world}"].params["suite"]
    found = group_failures(results, {"dtypes", "error"})
    assert not found, report(found)
    for rank, value in enumerate(results):  # WORLD: group rank == global rank
        res = value["world"]
        assert res["dtypes"] == {"recv_prev": sorted(ALL_DTYPES), "recv_next": sorted(ALL_DTYPES)}
        assert sum(c.get("dtypes", 0) for c in res["checks"].values()) == sum(
            expected_checks(spec, topo, rank, world).get("dtypes", 0) for topo, _, _ in spec["configs"])


@pytest.mark.parametrize("world", WORLDS)
def test_messages_from_0_bytes_to_64_MiB_arrive_intact(job, world):
    """0 B, 1 B, 4 KiB and 1 MiB arrive intact on every world size, 64 MiB where it is run
    (1, 2 and 4 ranks): every byte, in every mode, lane count and topology."""
    results = job(f"world{world}")
    spec = JOBS[f"world{world}"].params["suite"]
    found = group_failures(results, {"sizes", "huge", "error"})
    assert not found, report(found)
    sizes = {0, 1, 4 * KiB, MiB} | {n for _, n in spec["huge"]}
    for rank, value in enumerate(results):  # WORLD: group rank == global rank
        res = value["world"]
        assert sizes <= set(res["sizes"])
        for topo, mode, lanes in spec["configs"]:
            want = expected_checks(spec, topo, rank, world)
            got = res["checks"].get(f"{topo}/{mode}/lanes{lanes}", {})
            assert (got.get("sizes"), got.get("huge")) == (want.get("sizes"), want.get("huge"))


@pytest.mark.parametrize("world", WORLDS)
def test_exchanges_in_flight_beyond_the_descriptor_slots_match_in_order(job, world):
    """Ten exchanges posted before any wait (more than the transport's slots per channel) still
    pair the k-th send with the k-th receive of each channel."""
    results = job(f"world{world}")
    spec = JOBS[f"world{world}"].params["suite"]
    found = group_failures(results, {"inflight", "error"})
    assert not found, report(found)
    for rank, value in enumerate(results):  # WORLD: group rank == global rank
        res = value["world"]
        for topo, mode, lanes in spec["configs"]:
            got = res["checks"].get(f"{topo}/{mode}/lanes{lanes}", {}).get("inflight")
            assert got == expected_checks(spec, topo, rank, world)["inflight"]


@pytest.mark.parametrize("lanes", LANES)
@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_isend_irecv_chain_matches_in_call_order(job, world, lanes):
    """isend / irecv one by one, even ranks sending first and odd ranks receiving first, on a
    chain: each receive gets the message its neighbour sent in the same direction."""
    results = job(f"world{world}")
    spec = JOBS[f"world{world}"].params["suite"]
    found = problems(
        results, f"isend-chain/lanes{lanes}",
        lambda r, n: {"isend": len(spec["isend"]) * STEPS * recvs("chain", "both", r, n)},
        lambda r, n, p, x: expected_origins("chain", r, n, p, x),
    )
    assert not found, report(found)


@pytest.mark.parametrize("lanes", LANES)
@pytest.mark.parametrize("world", WORLDS)
def test_batch_isend_irecv_ring_pairs_the_kth_send_with_the_kth_receive(job, world, lanes):
    """All four ring ops in one batch_isend_irecv group, listed sends first or receives first:
    between a pair the k-th send meets the k-th receive, so the activation (listed first)
    lands in the receive from prev and the gradient in the receive from next."""
    results = job(f"world{world}")
    spec = JOBS[f"world{world}"].params["suite"]
    found = problems(
        results, f"batch-ring/lanes{lanes}",
        lambda r, n: {"batch": len(spec["batch"]) * STEPS * 2},
        lambda r, n, p, x: expected_origins("ring", r, n, p, x),
    )
    assert not found, report(found)


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_large_messages_use_a_single_copy_by_default(job, world):
    """Between two ranks of one host, messages past 4 KiB are read with process_vm_readv."""
    for value in job(f"world{world}"):
        assert value["world"]["single_copy"] == {str(lanes): {"next": True, "prev": True} for lanes in LANES}


def test_two_copy_path_delivers_1_MiB_and_64_MiB_messages(job):
    """With MEGATRON_P2P_SHM_SINGLE_COPY=0 large messages go through the bounce buffer, and
    1 MiB and 64 MiB messages, each following inline 4 KiB ones on its channel, still arrive
    intact on chains and rings, in every mode and lane count, and through batch_isend_irecv."""
    results = job("two_copy")
    spec = JOBS["two_copy"].params["suite"]
    for value in results:
        assert value["world"]["single_copy"] == {"1": {"next": False, "prev": False}, "2": {"next": False, "prev": False}}
    config_problems = []
    for topo, mode, lanes in spec["configs"]:
        config_problems += exchange_problems(results, spec, topo, mode, lanes)
    for lanes in LANES:
        config_problems += problems(
            results, f"batch-ring/lanes{lanes}",
            lambda r, n: {"batch": len(spec["batch"]) * STEPS * 2},
            lambda r, n, p, x: expected_origins("ring", r, n, p, x),
        )
    assert not config_problems, report(config_problems)
    for value in results:
        assert {4 * KiB, MiB, 64 * MiB} <= set(value["world"]["sizes"])


def test_strided_pipeline_groups_exchange_within_their_own_group_at_once(job):
    """Megatron-style pipeline groups {0, 2} and {1, 3} of 4 ranks (dist.new_group on every
    rank) exchange at the same time: each rank's neighbours are its group partner's global
    rank, and everything it receives comes from that partner, in the right direction."""
    results = job("world4")
    spec = JOBS["world4"].params["subgroup_suite"]
    for g, value in enumerate(results):
        group = SUBGROUPS[g % 2]
        partner = group[1 - group.index(g)]
        assert value["subgroup"]["neighbours"] == {str(lanes): {
            "rank": group.index(g), "global_rank": g, "size": 2, "ranks": group,
            "prev": partner, "next": partner, "lanes": lanes,
        } for lanes in LANES}
        assert value["subgroup"]["single_copy"] == {"1": {"next": True, "prev": True}, "2": {"next": True, "prev": True}}
    config_problems = []
    for topo, mode, lanes in spec["configs"]:
        config_problems += exchange_problems(results, spec, topo, mode, lanes, part="subgroup")
    for lanes in LANES:
        config_problems += problems(
            results, f"isend-chain/lanes{lanes}",
            lambda r, n: {"isend": len(spec["isend"]) * STEPS * recvs("chain", "both", r, n)},
            lambda r, n, p, x: expected_origins("chain", r, n, p, x), part="subgroup",
        )
        config_problems += problems(
            results, f"batch-ring/lanes{lanes}",
            lambda r, n: {"batch": len(spec["batch"]) * STEPS * 2},
            lambda r, n, p, x: expected_origins("ring", r, n, p, x), part="subgroup",
        )
    assert not config_problems, report(config_problems)
