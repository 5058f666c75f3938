"""The Megatron drop-in, checked against the real megatron-core (0.19.2, installed by `make`):
signatures by inspect, the nine methods side by side (megatron-core over gloo, this package over
shm), the fixes (each shown wrong in megatron-core and right here), megatron-core's own schedules
stock against swapped, and patch_megatron().

Importing megatron-core costs seconds per process, so one 4-rank job
(workers/megatron_dropin.py) runs every multi-rank part and the tests read their section."""
import importlib
import inspect
import warnings

import pytest
import torch.distributed as dist
from conftest import run_job

import megatron_p2p as mp
from megatron_p2p import ops
from megatron_p2p import p2p_communication as ours

MEGATRON = "megatron.core.pipeline_parallel.p2p_communication"
METHODS = ["recv_forward", "recv_backward", "send_forward", "send_backward", "send_forward_recv_backward",
           "send_backward_recv_forward", "send_forward_recv_forward", "send_backward_recv_backward",
           "send_forward_backward_recv_forward_backward"]
PRIVATE = ["_communicate", "_communicate_shapes"]
# Our additions, all keyword-only, so megatron-core's positional and keyword calls are unaffected.
EXTRA_KEYWORDS = {"__init__": {"backend", "mode", "timeout", "lanes", "comm"},
                  "send_forward_recv_backward": {"overlap_p2p_comm"},
                  "send_backward_recv_forward": {"overlap_p2p_comm"}}
CONFIGS = ["parity", "parity variable", "batched", "batched variable"]
SCHEDULES = ["1f1b pp4", "1f1b pp4 parity", "1f1b pp4 variable", "1f1b pp2", "1f1b pp2 variable",
             "interleaved pp4 vpp2", "interleaved pp4 vpp2 overlap"]


@pytest.fixture(scope="module")
def mcore():
    """megatron-core's p2p_communication module; skips (saying why) where it does not import."""
    try:
        with warnings.catch_warnings():  # its import warns about optional GPU packages
            warnings.simplefilter("ignore")
            return importlib.import_module(MEGATRON)
    except Exception as exc:  # not installed, or an import it needs is missing
        pytest.skip(f"megatron-core does not import here ({type(exc).__name__}: {exc}); `make test` installs it")


@pytest.fixture(scope="module")
def job(mcore):
    """workers/megatron_dropin.py on 4 ranks; per rank, {section: {"ok", "value" | "error"}}."""
    params = {"timeout": 20.0, "hidden": 8, "microbatches": 4}
    ranks = run_job("megatron_dropin.py", 4, params=params, timeout=400).ok()
    return [r["value"] for r in ranks]


def section(job, name):
    """Every rank's value of one section, failing with the traceback of any rank it failed on."""
    bad = [f"rank {r}: {res[name]['traceback']}" for r, res in enumerate(job) if not res[name]["ok"]]
    assert not bad, "\n".join(bad)
    return [res[name]["value"] for res in job]


def params_of(fn, drop=()):
    """(name, kind, default) per parameter: annotations differ by design (config is duck-typed)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values() if p.name not in drop]


# ---- signatures -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["__init__", *METHODS, *PRIVATE])
def test_p2pcommunicator_method_signature_matches_megatron_core(mcore, name):
    """Same parameter names, kinds, order and defaults as megatron-core's P2PCommunicator; our
    extra options are keyword-only and listed in EXTRA_KEYWORDS."""
    extra = EXTRA_KEYWORDS.get(name, set())
    mine = getattr(ours.P2PCommunicator, name)
    assert params_of(mine, drop=extra) == params_of(getattr(mcore.P2PCommunicator, name))
    kinds = {p.name: p.kind for p in inspect.signature(mine).parameters.values()}
    assert all(kinds[k] is inspect.Parameter.KEYWORD_ONLY for k in extra)


@pytest.mark.parametrize("name", ["is_pp_first_stage", "is_pp_last_stage", "total_stages", "current_stage"])
def test_p2pcommunicator_property_matches_megatron_core(mcore, name):
    assert isinstance(getattr(mcore.P2PCommunicator, name), property)
    assert isinstance(getattr(ours.P2PCommunicator, name), property)


@pytest.mark.parametrize("name", ["_p2p_ops", "_batched_p2p_ops", "is_single_shape"])
def test_module_function_signature_matches_megatron_core(mcore, name):
    assert params_of(getattr(ours, name)) == params_of(getattr(mcore, name))


def test_shape_alias_and_is_single_shape_agree_with_megatron_core(mcore):
    assert ours.Shape == mcore.Shape
    for x in ([3, 2, 4], (3, 2, 4), [], (), [[3, 2, 4]], [(3, 2, 4), (3, 2, 4)], [3, 2.0]):
        assert ours.is_single_shape(x) == mcore.is_single_shape(x), x


# Facts about megatron-core <= 0.12 and 0.13 (REFERENCE.md): the parameters before the flag.
LEGACY = {
    "recv_forward": (["tensor_shape", "config"], "is_first_stage"),
    "recv_backward": (["tensor_shape", "config"], "is_last_stage"),
    "send_forward": (["output_tensor", "config"], "is_last_stage"),
    "send_backward": (["input_tensor_grad", "config"], "is_first_stage"),
    "send_forward_recv_backward": (["output_tensor", "tensor_shape", "config"], "is_last_stage"),
    "send_backward_recv_forward": (["input_tensor_grad", "tensor_shape", "config"], "is_first_stage"),
    "send_forward_recv_forward": (["output_tensor", "recv_prev", "tensor_shape", "config", "overlap_p2p_comm"], None),
    "send_backward_recv_backward": (["input_tensor_grad", "recv_next", "tensor_shape", "config",
                                     "overlap_p2p_comm"], None),
    "send_forward_backward_recv_forward_backward": (["output_tensor", "input_tensor_grad", "recv_prev", "recv_next",
                                                     "tensor_shape", "config"], None),
}


@pytest.mark.parametrize("name", sorted(LEGACY))
def test_legacy_function_takes_both_older_signatures(name):
    """One function serves megatron-core <= 0.12 (no stage flag) and 0.13 (trailing flag)."""
    head, flag = LEGACY[name]
    names = list(inspect.signature(getattr(ours, name)).parameters)
    assert names == head + ([flag] if flag else [])
    if flag:
        assert inspect.signature(getattr(ours, name)).parameters[flag].default is None


@pytest.mark.parametrize("name", ["isend", "irecv", "P2POp", "batch_isend_irecv"])
def test_torch_style_op_signature_matches_torch_distributed(name):
    """megatron_p2p.isend / irecv / P2POp / batch_isend_irecv take torch.distributed's
    parameters (plus the keyword-only comm=)."""
    mine = getattr(ops, name).__init__ if name == "P2POp" else getattr(ops, name)
    theirs = getattr(dist, name).__init__ if name == "P2POp" else getattr(dist, name)
    assert params_of(mine, drop={"comm"}) == params_of(theirs)


# ---- the nine methods, side by side -----------------------------------------------------------


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("method", [*METHODS, "_communicate"])
def test_method_returns_what_megatron_core_returns(job, method, config):
    """On 4 ranks, the same calls through megatron-core's P2PCommunicator (gloo) and ours (shm):
    the same tensors (values, shapes, dtype, requires_grad), Nones, single-vs-list forms, handle
    keys with overlap_p2p_comm=True, and timer calls. Ours runs with batch_p2p_sync=False."""
    for rank, res in enumerate(section(job, "methods")):
        mc, mine = res[config]["megatron"][method], res[config]["ours"][method]
        assert mc, f"rank {rank}: the script made no {method} call"
        assert mine == mc, f"rank {rank}"


def test_shape_exchange_returns_what_megatron_core_returns(job):
    for res in section(job, "methods"):
        for config in ("parity variable", "batched variable"):
            assert res[config]["ours"]["_communicate_shapes"] == res[config]["megatron"]["_communicate_shapes"]


def test_timers_get_megatron_core_names_and_levels(job):
    """Every method starts and stops config.timers(name, log_level=2) with megatron-core's names."""
    names: set[str] = set()
    for res in section(job, "methods"):
        for _method, records in res["parity"]["ours"].items():
            for r in records:
                names.update(entry[1] for entry in r["timers"])
                assert [e for e in r["timers"] if e[0] == "get" and e[2] is not None] == [
                    e for e in r["timers"] if e[0] == "get" and e[2] == 2]
    assert names == {"forward-recv", "backward-recv", "forward-send", "backward-send", "forward-send-backward-recv",
                     "backward-send-forward-recv", "forward-send-forward-recv", "backward-send-backward-recv",
                     "forward-backward-send-forward-backward-recv"}


def test_attributes_and_properties_match_megatron_core(job):
    for rank, res in enumerate(section(job, "methods")):
        attrs = res["attributes"]
        assert attrs["ours"] == attrs["megatron"], f"rank {rank}"
        assert attrs["ours"]["current_stage"] == rank and attrs["ours"]["virtual_pipeline_model_parallel_size"] == 2


# ---- fixes over megatron-core -----------------------------------------------------------------


def test_pp2_batched_exchange_pairs_activations_and_gradients(job):
    """2 pipeline ranks, both directions at once in batched mode: megatron-core hands each rank
    its peer's gradient as the activation and vice versa; ours pairs them right."""
    for rank, res in enumerate(section(job, "pp2")):
        mc, mine = res["batched megatron"]["value"], res["batched ours"]["value"]
        assert not mc["recv_prev_is_activation"] and not mc["recv_next_is_gradient"], rank
        assert mine["recv_prev_is_activation"] and mine["recv_next_is_gradient"], rank


def test_pp2_shape_exchange_pairs_shapes(job):
    """2 pipeline ranks, variable_seq_lengths, activation (3, 2, 4) and gradient (4, 2, 3):
    megatron-core's shape exchange swaps the two shapes (also in parity mode, which its shape
    exchange ignores); ours receives each shape in its direction, in both modes."""
    for rank, res in enumerate(section(job, "pp2")):
        mc = res["shapes megatron"]["value"]
        assert mc["recv_prev_shape"] == [4, 2, 3] and not mc["recv_prev_is_activation"], rank
        for key in ("shapes ours", "shapes ours batched"):
            mine = res[key]["value"]
            assert mine["recv_prev_shape"] == [3, 2, 4] and mine["recv_next_shape"] == [4, 2, 3], (rank, key)
            assert mine["recv_prev_is_activation"] and mine["recv_next_is_gradient"], (rank, key)


def test_shape_exchange_dtype_disagreement_raises_mismatch_naming_both_ranks(job):
    """Stage 0 sends float16, stage 1 expects bfloat16 (same byte count): megatron-core
    reinterprets the bytes silently; ours raises MismatchError on the receiver naming both
    ranks, the sender completes, and the communicator stays usable."""
    for rank, res in enumerate(section(job, "pp2")):
        mc, mine, after = res["dtype mismatch megatron"], res["dtype mismatch ours"], res["dtype mismatch ours after"]
        assert mc["ok"] and after["ok"], rank
        if rank % 2 == 0:
            assert mine["ok"] and mine["value"] == {"sent": True}, rank
            continue
        assert mc["value"] == {"dtype": "torch.bfloat16", "values_equal": False}, rank
        assert mine["error_type"] == "MismatchError", (rank, mine)
        assert f"rank {rank}" in mine["error"] and f"rank {rank - 1}" in mine["error"], mine["error"]
        assert "bfloat16" in mine["error"] and "float16" in mine["error"]
        said = mine["error"]  # the megatron-core method, and the shape announced
        assert said.startswith(f"rank {rank}: recv_forward: shape exchange: ") and "in shape [" in said, said


def test_shape_exchange_with_agreeing_dtypes_reports_nothing(job):
    for rank, res in enumerate(section(job, "pp2")):
        for key in ("dtype match megatron", "dtype match ours"):
            assert res[key]["ok"], (rank, key, res[key].get("error"))
            if rank % 2:
                assert res[key]["value"] == {"dtype": "torch.float16", "values_equal": True}, (rank, key)


def test_variable_seq_lengths_setting_disagreement_raises_on_both_sides(job):
    """Stage 0 exchanges shapes, stage 1 does not expect them: the header meets stage 1's data
    receive, and both ranks raise MismatchError naming each other (the shape message is not
    taken as data, and nothing waits for the timeout)."""
    for rank, res in enumerate(section(job, "pp2")):
        got = res["setting mismatch ours"]
        assert got.get("error_type") == "MismatchError", (rank, got)
        peer = rank - 1 if rank % 2 else rank + 1
        assert f"rank {rank}" in got["error"] and f"rank {peer}" in got["error"], got["error"]


@pytest.mark.parametrize("mode", ["parity", "batched"])
def test_shape_headers_ride_ahead_of_their_tensors_in_parity_order_without_device_sync(job, mode):
    """megatron-core's shape exchange always batches and then synchronizes the device, whatever
    batch_p2p_comm says. Ours issues the exchange step by step in parity order in both modes,
    each send after its header and each receive after its header's receive
    (_shape_headers.round_steps), and never synchronizes on CPU."""
    for rank, res in enumerate(section(job, "modes")):
        mc, mine = res[mode]["megatron"], res[mode]["ours"]
        assert mc["calls"]["batch_isend_irecv"] >= 1 and mc["synchronize"] >= 1
        send, header_recv, recv = ["send", "send"], ["recv"], ["recv"]
        assert mine["modes"] == []
        assert mine["batches"] == ([send, header_recv, recv] if rank % 2 == 0 else [header_recv, recv, send]), rank
        assert mine["synchronize"] == 0


def test_batch_p2p_sync_and_nvtx_apply_only_when_cuda_is_in_use(job):
    """A CUDA backend (simulated) synchronizes after a batched call only with batch_p2p_sync, and
    opens one NVTX range per call; shm does neither. Results are right either way."""
    for res in section(job, "cuda_only"):
        assert res["nccl sync=True"] == {"synchronize": 1, "nvtx_push": 1, "nvtx_pop": 1, "ok": True}
        assert res["nccl sync=False"] == {"synchronize": 0, "nvtx_push": 1, "nvtx_pop": 1, "ok": True}
        for sync in (True, False):
            assert res[f"shm sync={sync}"] == {"synchronize": 0, "nvtx_push": 0, "nvtx_pop": 0, "ok": True}


def test_1f1b_calls_accept_overlap_and_return_handles(job, mcore):
    """send_forward_recv_backward / send_backward_recv_forward take overlap_p2p_comm=True
    (megatron-core's do not: issue #4385) and return (tensor, handles) keyed by the posted ops."""
    for name in ("send_forward_recv_backward", "send_backward_recv_forward"):
        assert "overlap_p2p_comm" not in inspect.signature(getattr(mcore.P2PCommunicator, name)).parameters
    for rank, res in enumerate(section(job, "overlap_1f1b")):
        for mode in ("parity", "batched"):
            for rec in res[mode]:
                assert rec["right"], (rank, mode, rec)
                skipping = (rec["method"] == "send_forward_recv_backward" and rank == 3) or (
                    rec["method"] == "send_backward_recv_forward" and rank == 0)
                want = [] if skipping else (["recv_next", "send_next"] if rec["method"] == "send_forward_recv_backward"
                                            else ["recv_prev", "send_prev"])
                assert rec["keys"] == want, (rank, mode, rec)


# ---- observability, registry, ops, legacy -----------------------------------------------------


def test_exchanges_log_under_megatron_p2p_at_debug_only(job):
    for res in section(job, "logging"):
        assert res["INFO"] == []
        assert res["DEBUG"] and all(name.startswith("megatron_p2p.") for name, _, _ in res["DEBUG"])
        assert any("exchange (batched)" in msg for _, _, msg in res["DEBUG"])


def test_group_arguments_need_an_explicitly_created_communicator(job):
    """_p2p_ops / _batched_p2p_ops find the communicator init_communicator(group) made; without
    one (before, or after it is closed) they raise an error naming the fix, never create one."""
    for rank, res in enumerate(section(job, "registry")):
        for key in ("before", "after close"):
            assert res[key]["error_type"] == "P2PError", (rank, key)
            assert "init_communicator(group)" in res[key]["error"]
        assert "was closed" not in res["before"]["error"] and "was closed" in res["after close"]["error"]
        assert res["found"]
        assert res["_p2p_ops"]["value"]["type"] == "dict" and res["_p2p_ops"]["value"]["right"]
        assert res["_batched_p2p_ops"]["value"]["type"] == "list" and res["_batched_p2p_ops"]["value"]["right"]
        want = ["recv_prev"] if rank % 2 else ["send_next"]
        assert res["_p2p_ops"]["value"]["keys"] == want and res["_batched_p2p_ops"]["value"]["keys"] == want


def test_torch_style_ops_over_a_group(job):
    for rank, res in enumerate(section(job, "ops")):
        assert res["isend_irecv"] and res["batch"] and res["comm_keyword"]["ok"], rank
        assert res["tag"]["error_type"] == "ValueError" and "tag=3" in res["tag"]["error"]


def test_legacy_functions_of_both_generations_over_parallel_state(job):
    for rank, res in enumerate(section(job, "legacy")):
        assert res["missing communicator"]["error_type"] == "P2PError", rank
        assert res["0.12 recv_forward"] is (None if rank == 0 else True)
        assert res["0.13 recv_backward"] is (None if rank == 3 else True)
        assert res["overlap keys"] == ["recv_prev", "send_next"] and res["overlap right"]
        assert ["start", "forward-send-forward-recv"] in res["timers"]


# ---- megatron-core's schedules -----------------------------------------------------------------


@pytest.mark.parametrize("name", SCHEDULES)
def test_megatron_schedule_gives_bitwise_equal_losses_and_grads_when_swapped(job, name):
    """megatron-core's own forward_backward function on CPU, small model, float32: with our
    P2PCommunicator passed as p2p_communicator= (with pg_collection=) the losses and every
    gradient equal megatron-core's own communicator's bit for bit, and a one-process run of the
    same model."""
    for rank, res in enumerate(section(job, "schedules")):
        runs = res[name]
        for how in ("reference", "stock", "swapped"):
            assert runs[how]["ok"], (rank, how, runs[how].get("traceback"))
        assert runs["swapped"]["value"] == runs["stock"]["value"], rank
        assert runs["swapped"]["value"] == runs["reference"]["value"], rank
        assert (len(runs["swapped"]["value"]["losses"]) > 0) == (rank == 3 or (name.startswith("1f1b pp2") and rank % 2))


@pytest.mark.parametrize("name", ["interleaved pp4 vpp2 variable", "interleaved pp4 vpp2 variable parity"])
def test_interleaved_schedule_with_variable_seq_lengths_runs_where_megatron_core_deadlocks(job, name):
    """Interleaved pp4 vpp2 with variable_seq_lengths and 4 microbatches: megatron-core's blocking
    shape round deadlocks over a rendezvous transport (gloo; not run here for that reason). Ours
    completes in both modes, equal bit for bit to the one-process run."""
    for rank, res in enumerate(section(job, "schedules")):
        runs = res[name]
        assert "stock" not in runs
        assert runs["swapped"]["ok"], runs["swapped"].get("traceback")
        assert runs["swapped"]["value"] == runs["reference"]["value"], rank


def test_patch_megatron_swaps_runs_and_unpatches(job):
    """With neither p2p_communicator nor pg_collection, under patch_megatron(), megatron-core's
    schedule constructs our class from parallel_state: traffic goes through our communicator and
    the result equals the stock run bit for bit; afterwards megatron-core's class is back."""
    for rank, res in enumerate(section(job, "schedules")):
        patched = res["patch_megatron"]
        assert patched["ok"], patched.get("traceback")
        got = patched["value"]
        assert got["binding before"] == got["binding after"] == MEGATRON
        assert got["binding during"] == "megatron_p2p.p2p_communication"
        assert got["sends through ours"] > 0
        assert got["run"] == res["1f1b pp4"]["stock"]["value"], rank


def test_naive_order_in_megatron_cores_real_1f1b_raises_deadlock_error_well_under_the_timeout(job):
    """megatron-core's real 1F1B, our communicator posting every op by itself with sends first on
    one lane: the ranks that form the cycle raise DeadlockError naming it within a few seconds of a
    60 s timeout, and every rank fails instead of hanging. Paired with the correct order above,
    which raises nothing and gives megatron-core's own losses."""
    results = [res["naive_order"] for res in section(job, "schedules")]
    types = [r["type"] for r in results]
    assert "DeadlockError" in types and None not in types, results
    for r in results:
        assert r["elapsed"] < 10.0, results  # far from the 60 s timeout
    cycle = next(r["msg"] for r in results if r["type"] == "DeadlockError")
    assert "deadlock: ranks" in cycle and "posted by naive send_" in cycle, cycle


def test_patch_megatron_is_reversible_in_process(mcore):
    schedules = importlib.import_module("megatron.core.pipeline_parallel.schedules")
    original = mcore.P2PCommunicator, mcore._p2p_ops, mcore._batched_p2p_ops, schedules.P2PCommunicator
    with mp.patch_megatron(timeout=30.0) as patch:
        assert mp.megatron_patch.is_patched() and mp.patch_megatron() is patch  # idempotent
        assert issubclass(schedules.P2PCommunicator, ours.P2PCommunicator)
        assert mcore.P2PCommunicator is schedules.P2PCommunicator
        assert mcore._p2p_ops is ours._p2p_ops and mcore._batched_p2p_ops is ours._batched_p2p_ops
        assert (MEGATRON, "P2PCommunicator") in patch.swapped
        assert ("megatron.core.pipeline_parallel.schedules", "P2PCommunicator") in patch.swapped
    assert (mcore.P2PCommunicator, mcore._p2p_ops, mcore._batched_p2p_ops, schedules.P2PCommunicator) == original
    assert not mp.megatron_patch.is_patched()
    mp.patch_megatron()
    mp.unpatch_megatron()
    mp.unpatch_megatron()  # idempotent
    assert schedules.P2PCommunicator is original[0]
