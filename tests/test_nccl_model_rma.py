"""The model's one-sided RMA (tests/fakes/nccl_rma.c) as NCCL 2.30.7's source describes it
(docs/nccl-model.md), driven by tests/c/nccl_rma_check.c: two ranks as processes, no package
in between. tests/gpu/run_device_checks.sh runs these tests on a GPU against the real libnccl
and libcuda, with MEGATRON_P2P_RMA_CHECK naming the program built against them; the tests of
the model's own knobs and hazard counters are skipped there."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT

# NCCL's result codes (nccl.h)
UNHANDLED_CUDA_ERROR, SYSTEM_ERROR, INTERNAL_ERROR, INVALID_ARGUMENT, INVALID_USAGE = 1, 2, 3, 4, 5


REAL = os.environ.get("MEGATRON_P2P_RMA_CHECK")
model_only = pytest.mark.skipif(bool(REAL), reason="the model's own knob or hazard counter")


@pytest.fixture(scope="module")
def check(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if REAL:
        return Path(REAL)
    binary = tmp_path_factory.mktemp("rma") / "nccl_rma_check"
    subprocess.run(["make", "-s", str(binary)], cwd=ROOT, check=True, timeout=300)
    return binary


def run(check: Path, scenario: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "MPFAKE_"))}
    return subprocess.run([str(check), scenario, *args], capture_output=True, text=True, timeout=120,
                          env={**clean, **env})


def by_rank(check: Path, scenario: str, *args: str, **env: str) -> dict[int, dict]:
    done = run(check, scenario, *args, **env)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    return {line["rank"]: line for line in lines}


def test_two_ranks_on_one_node_have_host_rma_and_without_rma_contexts_or_in_two_teams_none(check):
    for p in by_rank(check, "properties").values():
        assert p["result"] == 0 and p["nRanks"] == 2 and p["hostRmaSupport"] and p["nLsaTeams"] == 1, p
    for p in by_rank(check, "properties", NCCL_NUM_RMA_CTX="0").values():  # init.cc envConfigOverride
        assert not p["hostRmaSupport"] and p["deviceApiSupport"], p
    for p in by_rank(check, "properties", NCCL_LSA_TEAM_SIZE="1").values():  # two teams, no GIN
        assert not p["hostRmaSupport"] and not p["deviceApiSupport"] and p["nLsaTeams"] == 2, p


@model_only
def test_ranks_on_two_nodes_have_no_host_rma_without_a_network_rma_plugin(check):
    for p in by_rank(check, "properties", MPFAKE_NCCL_RANKS_PER_NODE="1").values():
        assert not p["hostRmaSupport"] and p["nLsaTeams"] == 2, p


def test_an_older_callers_struct_gets_no_rma_field_and_a_struct_not_made_by_nccl_is_refused(check):
    for p in by_rank(check, "properties").values():
        assert not p["old_version_hostRmaSupport"] and p["bad_magic"] == INVALID_USAGE, p


@pytest.mark.parametrize("nbytes", [1, 4096, (1 << 20) + 3])
def test_a_put_lands_exact_in_the_peers_window_both_ways(check, nbytes):
    for p in by_rank(check, "exchange", str(nbytes)).values():
        assert p["bytes"] == nbytes and p["wrong_bytes"] == 0, p


def test_puts_to_one_peer_land_in_program_order(check):
    assert by_rank(check, "order")[1]["in_order"]


def test_a_wait_counts_the_signals_that_came_before_it_and_waits_for_the_rest(check):
    waiter = by_rank(check, "early")[1]
    assert waiter["three_done"] and waiter["fourth_pending"], waiter


def test_each_misuse_gets_the_result_code_nccls_checks_give(check):
    expected = {
        "put_ctx": INVALID_ARGUMENT, "put_sig_idx": INVALID_ARGUMENT, "put_flags": INVALID_ARGUMENT,
        "put_peer_out_of_range": INVALID_ARGUMENT, "put_no_window": INVALID_ARGUMENT,
        "put_no_source": INVALID_ARGUMENT, "put_source_outside_windows": INVALID_ARGUMENT,
        "put_offset_past_window": INVALID_ARGUMENT, "signal_peer_out_of_range": INVALID_ARGUMENT,
        "wait_no_descriptors": INVALID_ARGUMENT, "wait_zero_count": INVALID_ARGUMENT,
        "wait_sig_idx": INVALID_ARGUMENT, "wait_ctx": INVALID_ARGUMENT,
        "register_plain_memory": UNHANDLED_CUDA_ERROR, "register_null": INVALID_ARGUMENT,
        "register_misaligned": INVALID_ARGUMENT, "mem_alloc_null": UNHANDLED_CUDA_ERROR, "deregister_null": 0,
    }
    for p in by_rank(check, "refusals").values():
        assert {k: p[k] for k in expected} == expected


@model_only
def test_a_driver_before_12_5_refuses_every_rma_call(check):
    done = run(check, "exchange", "4096", MPFAKE_CUDA_DRIVER_VERSION="12040")
    assert done.returncode == 1 and "ncclPutSignal(base, bytes, MP_NCCL_UINT8" in done.stderr
    assert f"failed ({INVALID_USAGE})" in done.stderr


def test_without_cumem_registration_gives_no_window(check):
    done = run(check, "exchange", "4096", NCCL_CUMEM_ENABLE="0")
    assert done.returncode == 1 and "gave no window" in done.stderr, done.stderr


@model_only
def test_the_model_counts_a_put_past_the_end_of_the_peers_window_and_not_one_inside(check):
    sender = by_rank(check, "overrun")[0]
    assert sender["inside"] == 0 and sender["past_the_end"] == 1, sender


@model_only
def test_the_model_counts_a_window_deregistered_with_an_op_queued_and_not_one_after(check):
    rank0 = by_rank(check, "deregister")[0]
    assert rank0["while_queued"] == 1 and rank0["after_it_ran"] == 0, rank0
