"""One grammar for a deadlock's report (csrc/core/cycle_report.h): one program's wait-for cycle
reads the same, word for word, whether shm's run-time detection found it, the checker found it
offline, `trace` found it in the flight recorder's dumps, or NCCL's stall analysis found it over
the model of libnccl. One job replays the program on both backends (workers/cycle_report_paths.py)."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, run_job

from megatron_p2p import _C
from megatron_p2p.verify import program, simulate, trace

FAKES = ROOT / "build" / "fakes"
MODEL_ENV = {
    "MEGATRON_P2P_NCCL_LIBRARY": str(FAKES / "libnccl.so.2"),
    "MEGATRON_P2P_CUDA_LIBRARY": str(FAKES / "libcuda.so.1"),
    "MEGATRON_P2P_ASYNC_ERROR_HANDLING": "raise",
    # NCCL buffers at most 1 MiB of a send here: the ring's 4 MiB sends need their receives.
    "NCCL_MAX_P2P_NCHANNELS": "1",
    "NCCL_BUFFSIZE": str(1 << 20),
}
SIZE, NBYTES = 3, 4 << 20


def send_first_ring() -> str:
    """Each rank isends to its next rank, then irecvs from its previous one, and waits for both:
    on one lane, every receive is queued behind its rank's own blocked send."""
    ranks = [[{"steps": [[{"kind": "send", "peer": (r + 1) % SIZE, "bytes": NBYTES, "dtype": "float32"}]],
               "wait": False, "call": "isend"},
              {"steps": [[{"kind": "recv", "peer": (r - 1) % SIZE, "bytes": NBYTES, "dtype": "float32"}]],
               "wait": False, "call": "irecv"}] for r in range(SIZE)]
    return json.dumps({"format": "megatron_p2p.program/1", "size": SIZE, "lanes": 1, "eager_threshold": 0,
                       "ranks": ranks})


REPORT = re.compile(r"deadlock: ranks .*?can never resolve:(?:\n  rank [^\n]*)+(?:\n  processes: [^\n]*)?")


def report_in(message: str) -> str:
    """The cycle's report inside an error's message."""
    found = REPORT.search(message)
    assert found, message
    return found.group(0)


def without_processes(report: str) -> str:
    return re.sub(r"\n  processes: [^\n]*$", "", report)


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    dumps = tmp_path_factory.mktemp("dumps")
    job = run_job("cycle_report_paths.py", SIZE, {"program": send_first_ring(), "trace_dir": str(dumps),
                                                  "timeout": 60.0}, timeout=300, env=MODEL_ENV)
    ranks = [r["value"] for r in job.ok()]
    for r in ranks:
        for backend in ("shm", "nccl"):
            assert r[backend]["outcome"] == "deadlock", (backend, r)
    return {"ranks": ranks, "dumps": Path(dumps)}


@pytest.mark.torchrun
def test_every_rank_of_the_cycle_words_it_alike_at_run_time(paths):
    for backend in ("shm", "nccl"):
        reports = {report_in(r[backend]["error"]) for r in paths["ranks"]}
        assert len(reports) == 1, (backend, reports)
        for r in paths["ranks"]:  # each op's own failure points at the report that follows it
            first = r[backend]["error"].split("\n")[0]
            assert first.endswith("failed: this rank is in a wait-for cycle that can never resolve (the deadlock "
                                  "report follows)"), (backend, first)


@pytest.mark.torchrun
def test_shm_at_run_time_and_trace_on_its_dumps_give_the_same_words(paths):
    shm = report_in(paths["ranks"][0]["shm"]["error"])
    (cycle,) = trace.analyse(trace.load_dumps(paths["dumps"])).findings("cycle")
    assert cycle.text == shm
    assert "\n  processes: rank 0 (pid " in shm  # the run knows its processes, the checker does not


@pytest.mark.torchrun
def test_the_checker_gives_the_run_times_words_without_the_processes(paths):
    verdict = simulate.simulate(program.loads(send_first_ring()))
    assert verdict.report == without_processes(report_in(paths["ranks"][0]["shm"]["error"]))
    assert verdict.report in verdict.detail()


@pytest.mark.torchrun
def test_nccls_stall_analysis_gives_shms_words(paths):
    """Two runs, two sets of pids: the words are the same, the pids their own."""
    nccl = report_in(paths["ranks"][0]["nccl"]["error"])
    shm = report_in(paths["ranks"][0]["shm"]["error"])
    assert without_processes(nccl) == without_processes(shm)
    assert "\n  processes: rank 0 (pid " in nccl


def test_the_report_starts_at_the_lowest_rank_whichever_rank_found_the_cycle():
    edge = ("send", "isend", 64, "float32", 0, 0, "isend", "", True, False, 1)
    a = _C.cycle_report([(2, 0, 0, *edge), (0, 1, 0, *edge), (1, 2, 0, *edge)])
    b = _C.cycle_report([(0, 1, 0, *edge), (1, 2, 0, *edge), (2, 0, 0, *edge)])
    assert a == b and a.startswith("deadlock: ranks 0 -> 1 -> 2 -> 0 ")


def test_a_partner_not_posted_is_worded_apart_from_a_queued_one():
    queued = _C.cycle_report([(0, 1, 0, "send", "isend", 64, "float32", 0, 3, "", "", True, False, 4)])
    missing = _C.cycle_report([(0, 1, 0, "send", "isend", 64, "float32", 0, 3, "", "", False, False, 3)])
    assert "rank 1 has posted the matching receive, but it is queued on lane 0 behind rank 1's own blocked op" in queued
    assert "rank 1 has posted only 3 receives from rank 0 on lane 0" in missing
    assert "queued" not in missing.split("\n", 1)[1] and "posted only" not in queued


def test_the_processes_line_appears_only_when_every_pid_is_known():
    edge = ("send", "isend", 64, "float32", 0, 0, "", "", True, False, 1)
    known = _C.cycle_report([(0, 1, 10, *edge), (1, 0, 11, *edge)])
    partly = _C.cycle_report([(0, 1, 10, *edge), (1, 0, 0, *edge)])
    assert known.endswith("\n  processes: rank 0 (pid 10), rank 1 (pid 11)")
    assert "processes" not in partly


@pytest.mark.parametrize("ranks, error, says", [
    ([], ValueError, "at least one rank"),
    ([(0, 1)], TypeError, "cycle_report() takes tuples"),
    ([[0, 1, 0, "send", "isend", 64, "float32", 0, 0, "", "", True, False, 1]], TypeError, "expected a tuple"),
    ([(0, 1, 0, "put", "isend", 64, "float32", 0, 0, "", "", True, False, 1)], ValueError, "kind must be 'send' or"),
])
def test_cycle_report_names_a_malformed_rank(ranks, error, says):
    with pytest.raises(error, match=re.escape(says)):
        _C.cycle_report(ranks)
