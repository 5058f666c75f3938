"""Trace dumps and the analyser. The analyser runs on dumps the tests write (no processes): each
problem it must report is paired with a case it must not report. One torchrun job proves that
real ranks dump on SIGUSR1 and at exit, and that a clean run analyses clean."""
from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import run_job

from megatron_p2p import check, flight_recorder, program, trace
from megatron_p2p.simulate import simulate

ROOT = Path(__file__).resolve().parent.parent
COMM = "5eedc0de"


# ---- writing synthetic dumps ----------------------------------------------------------------

def op(kind: str, peer: int, seq: int, *, lane: int = 0, step: int | None = None, call: int | None = None,
       nbytes: int = 64, dtype: str = "float32", state: str = "completed", error: str = "", waited: bool = True,
       call_name: str = "", group_size: int = 1) -> dict[str, Any]:
    """One recent_ops() entry; step and call default to one per op, numbered by write_dump."""
    return {"kind": kind, "label": "isend" if kind == "send" else "irecv", "peer": peer, "nbytes": nbytes,
            "dtype": dtype, "lane": lane, "step": step, "seq": seq, "group_size": group_size, "call": call,
            "call_name": call_name, "state": state, "error": error, "t_posted": 1000.0,
            "t_completed": 1000.5 if state == "completed" else None, "waited": waited}


def write_dump(directory: Path, rank: int, ops: list[dict], *, ranks: tuple[int, ...] = (0, 1), lanes: int = 2,
               reason: str = "exit", error: str | None = None, time: float = 2000.0, comm: str = COMM,
               **override: Any) -> Path:
    steps: dict[int, int] = {}
    for i, entry in enumerate(ops):
        if entry["step"] is None:
            entry["step"] = steps.get(entry["lane"], 0)
        steps[entry["lane"]] = entry["step"] + 1
        if entry["call"] is None:
            entry["call"] = i
    record = {"format": flight_recorder.FORMAT, "communicator": comm, "rank": rank, "group_rank": ranks.index(rank),
              "size": len(ranks), "ranks": list(ranks), "backend": "shm", "lanes": lanes, "eager_threshold": 0,
              "pid": 100 + rank, "hostname": "node", "reason": reason, "error": error, "time": time, "ops": ops}
    record.update(override)
    path = directory / f"rank{rank}.{comm}.json"
    path.write_text(json.dumps(record))
    return path


@dataclass
class Cli:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def run_cli(capsys):
    """run_cli(*args) -> Cli: `python -m megatron_p2p.trace ARGS`, in this process (torch loads once)."""
    def run(*args: str) -> Cli:
        capsys.readouterr()
        code = trace.main(list(args))
        out = capsys.readouterr()
        return Cli(code, out.out, out.err)
    return run


def analyse(directory: Path, **kwargs: Any) -> trace.Report:
    return trace.analyse(trace.load_dumps(directory), **kwargs)


def kinds(report: trace.Report) -> set[str]:
    return {f.kind for f in report.findings()}


def clean_pair(directory: Path, messages: int = 3) -> None:
    """Rank 0 sends `messages` activations to rank 1, which receives them all; both exit."""
    write_dump(directory, 0, [op("send", 1, k, call_name="send_forward") for k in range(messages)])
    write_dump(directory, 1, [op("recv", 0, k, call_name="recv_forward") for k in range(messages)])


def send_first_ring(directory: Path, size: int = 3) -> None:
    """The naive ring: every rank blocks in its send to the next, so no receive is ever posted."""
    ranks = tuple(range(size))
    for r in ranks:
        write_dump(directory, r, [op("send", (r + 1) % size, 0, state="failed", error="deadlock",
                                     call_name="send_forward")], ranks=ranks, reason="error",
                   error="DeadlockError: wait-for cycle")


# ---- a clean run -----------------------------------------------------------------------------

def test_clean_run_reports_nothing_and_exits_0(tmp_path, run_cli):
    clean_pair(tmp_path)
    report = analyse(tmp_path)
    assert report.ok and report.findings() == []
    cli = run_cli(str(tmp_path))
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert "trace: clean" in cli.stdout


def test_module_entry_point_runs(tmp_path):
    clean_pair(tmp_path)
    cli = subprocess.run([sys.executable, "-m", "megatron_p2p.trace", str(tmp_path)], capture_output=True,
                         text=True, cwd=ROOT, timeout=120)
    assert cli.returncode == 0 and "trace: clean" in cli.stdout, cli.stderr


def test_json_output_has_one_object_per_communicator(tmp_path, run_cli):
    clean_pair(tmp_path)
    write_dump(tmp_path, 0, [op("send", 1, 0, state="posted")], comm="feedf00d", reason="signal")
    write_dump(tmp_path, 1, [], comm="feedf00d", reason="signal")
    cli = run_cli(str(tmp_path), "--json")
    lines = [json.loads(line) for line in cli.stdout.splitlines()]
    assert cli.returncode == 1
    assert {(o["communicator"], o["verdict"]) for o in lines} == {(COMM, "clean"), ("feedf00d", "problem")}


def test_communicator_option_analyses_only_that_one(tmp_path, run_cli):
    clean_pair(tmp_path)
    write_dump(tmp_path, 0, [op("send", 1, 0, state="posted")], comm="feedf00d", reason="signal")
    write_dump(tmp_path, 1, [], comm="feedf00d", reason="signal")
    assert run_cli(str(tmp_path), "--communicator", COMM).returncode == 0
    assert run_cli(str(tmp_path), "--communicator", "feedf00d").returncode == 1


# ---- the wait-for cycle ----------------------------------------------------------------------

def test_cycle_is_reported_with_its_ranks_and_ops(tmp_path, run_cli):
    send_first_ring(tmp_path, size=3)
    report = analyse(tmp_path)
    cycles = report.findings("cycle")
    assert len(cycles) == 1
    assert sorted(cycles[0].ranks) == [0, 1, 2]
    for r in range(3):
        assert f"rank {r} is blocked on isend to rank {(r + 1) % 3}: 64 bytes of float32, lane 0, message #0, " \
               "posted by send_forward" in cycles[0].text
    assert "has posted only 0 receives from rank" in cycles[0].text
    assert not report.findings("unmatched")  # the cycle explains its ops; they are not listed twice
    cli = run_cli(str(tmp_path))
    assert cli.returncode == 1 and "CYCLE" in cli.stdout


def test_cycle_through_lane_order_is_reported(tmp_path):
    # One lane: each rank's receive is posted, but queued behind its own blocked send.
    lane_order_cycle(tmp_path)
    report = analyse(tmp_path)
    (cycle,) = report.findings("cycle")
    assert sorted(cycle.ranks) == [0, 1]
    assert "has posted the matching receive, but it is queued on lane 0 behind rank 0's own blocked op" in cycle.text
    assert not report.findings("unmatched")  # every op has its partner; only the order is wrong


def lane_order_cycle(directory: Path, **settings: Any) -> None:
    for r in (0, 1):
        write_dump(directory, r, [op("send", 1 - r, 0, state="posted"), op("recv", 1 - r, 0, state="posted")],
                   lanes=1, reason="signal", **settings)


def test_a_cycle_of_sends_larger_than_the_transport_buffers_is_reported(tmp_path):
    lane_order_cycle(tmp_path, buffered_at_most=63)  # the sends are 64 bytes
    assert analyse(tmp_path).findings("cycle")


def test_a_cycle_of_sends_the_transport_may_buffer_is_not_reported(tmp_path):
    """NCCL may complete each send without its receive (buffered_at_most, docs/trace-format.md):
    the dumps cannot show that the cycle will not resolve."""
    lane_order_cycle(tmp_path, buffered_at_most=64)
    report = analyse(tmp_path)
    assert not report.findings("cycle"), report.text()


@pytest.mark.parametrize("settings, error", [
    ({"eager_threshold": 128, "buffered_at_most": 64}, r"\.buffered_at_most: must be >= eager_threshold"),
    ({"buffered_at_most": "64"}, r"\.buffered_at_most"),
])
def test_a_buffered_at_most_below_the_eager_threshold_is_refused(tmp_path, settings, error):
    write_dump(tmp_path, 0, [], **settings)
    with pytest.raises(trace.TraceError, match=error):
        trace.load_dumps(tmp_path)


def test_a_dump_without_buffered_at_most_buffers_up_to_its_eager_threshold(tmp_path):
    write_dump(tmp_path, 0, [], eager_threshold=128)
    (dump,) = trace.load_dumps(tmp_path)
    assert dump.buffered_at_most == 128


def test_dumps_that_disagree_on_buffered_at_most_are_refused(tmp_path):
    write_dump(tmp_path, 0, [], buffered_at_most=64)
    write_dump(tmp_path, 1, [], buffered_at_most=128)
    with pytest.raises(trace.TraceError, match="buffered_at_most: 128 disagrees with 64"):
        trace.load_dumps(tmp_path)


def test_ops_in_flight_that_can_complete_are_not_a_cycle(tmp_path):
    # A snapshot mid-exchange: the send and its receive are both posted, they will meet.
    write_dump(tmp_path, 0, [op("send", 1, 0), op("send", 1, 1, state="posted")], reason="signal")
    write_dump(tmp_path, 1, [op("recv", 0, 0), op("recv", 0, 1, state="matched")], reason="signal")
    report = analyse(tmp_path)
    assert report.ok, report.text()
    assert any("in flight" in n for n in report.communicators[0].notes)


# ---- mismatches ------------------------------------------------------------------------------

@pytest.mark.parametrize("recv_bytes, recv_dtype", [(32, "float32"), (64, "bfloat16")])
def test_mismatch_names_the_pair(tmp_path, recv_bytes, recv_dtype):
    write_dump(tmp_path, 0, [op("send", 1, 0), op("send", 1, 1, state="failed", error="mismatch")],
               reason="error", error="MismatchError: ...")
    write_dump(tmp_path, 1, [op("recv", 0, 0), op("recv", 0, 1, nbytes=recv_bytes, dtype=recv_dtype,
                                                   state="failed", error="mismatch")],
               reason="error", error="MismatchError: ...")
    (mismatch,) = analyse(tmp_path).findings("mismatch")
    assert mismatch.ranks == (0, 1)
    assert f"message #1: 64 bytes of float32 sent, {recv_bytes} bytes of {recv_dtype} received" in mismatch.text
    assert not analyse(tmp_path).findings("cycle")


def test_matching_pairs_are_not_mismatches(tmp_path):
    clean_pair(tmp_path, messages=5)
    assert not analyse(tmp_path).findings("mismatch")


# ---- unmatched ops and the recorder's window -------------------------------------------------

def test_unmatched_op_is_reported(tmp_path):
    # An eager send completes without its receive; rank 1 exited without ever posting it.
    write_dump(tmp_path, 0, [op("send", 1, 0), op("send", 1, 1)], eager_threshold=64)
    write_dump(tmp_path, 1, [op("recv", 0, 0)], eager_threshold=64)
    (alone,) = analyse(tmp_path).findings("unmatched")
    assert alone.ranks == (0, 1)
    assert "rank 0: send to rank 1, 64 bytes of float32, lane 0, message #1" in alone.text
    assert "rank 1 has posted receives from rank 0 on lane 0 up to message #0" in alone.text


def full_ring_dump(directory: Path, first_seq: int, count: int) -> None:
    """Rank 0 kept sends first_seq .. first_seq+count-1; rank 1 recorded all receives from 0."""
    write_dump(directory, 0, [op("send", 1, k) for k in range(first_seq, first_seq + count)])
    write_dump(directory, 1, [op("recv", 0, k) for k in range(first_seq + count)])


def test_ops_cut_off_by_the_ring_are_not_unmatched(tmp_path):
    full_ring_dump(tmp_path, first_seq=100, count=trace.RING_CAPACITY)
    report = analyse(tmp_path)
    assert report.ok, report.text()
    assert any("not compared" in n for n in report.communicators[0].notes)


def test_ops_missing_from_a_complete_record_are_unmatched(tmp_path):
    full_ring_dump(tmp_path, first_seq=100, count=10)  # not full: nothing was cut off
    (alone,) = analyse(tmp_path).findings("unmatched")
    assert "100 ops without a partner" in alone.text


# ---- missing and dead ranks ------------------------------------------------------------------

def test_missing_rank_is_reported(tmp_path):
    ranks = (0, 1, 2)
    write_dump(tmp_path, 0, [op("send", 1, 0)], ranks=ranks)
    write_dump(tmp_path, 1, [op("recv", 0, 0), op("send", 2, 0, state="posted")], ranks=ranks, reason="signal")
    report = analyse(tmp_path)
    assert [f.ranks for f in report.findings("missing")] == [(2,)]
    assert not report.findings("unmatched")  # the missing rank's channels cannot be compared


def test_present_ranks_are_not_missing(tmp_path):
    clean_pair(tmp_path)
    assert not analyse(tmp_path).findings("missing")


def three_ranks_waiting_on_2(directory: Path, *, rank2: list[dict], time2: float, reason2: str) -> None:
    ranks = (0, 1, 2)
    write_dump(directory, 0, [op("recv", 2, 0, state="posted", call_name="recv_backward")], ranks=ranks,
               reason="signal")
    write_dump(directory, 1, [op("recv", 2, 0, state="posted")], ranks=ranks, reason="signal")
    write_dump(directory, 2, rank2, ranks=ranks, reason=reason2, time=time2)


def test_rank_whose_record_stops_early_is_stopped_and_not_called_dead(tmp_path):
    three_ranks_waiting_on_2(tmp_path, rank2=[op("send", 0, 0, state="posted")], time2=2000.0 - 300, reason2="signal")
    report = analyse(tmp_path)
    (stopped,) = report.findings("stopped")
    assert stopped.ranks == (2,) and "stops 300 s before" in stopped.text
    assert not report.findings("dead")


def test_a_live_rank_with_nothing_pending_that_peers_wait_on_is_idle_and_not_called_dead(tmp_path):
    three_ranks_waiting_on_2(tmp_path, rank2=[], time2=2000.0, reason2="signal")
    report = analyse(tmp_path)
    (idle,) = report.findings("idle")
    assert idle.ranks == (2,)
    assert "rank 0 waits on it (recv from rank 2" in idle.text and "idle (computing, or outside communication)" in idle.text
    assert not report.findings("dead")
    assert "IDLE: rank 2" in report.text() and "DEAD" not in report.text()


def test_a_rank_that_exited_while_peers_wait_on_it_is_dead(tmp_path):
    three_ranks_waiting_on_2(tmp_path, rank2=[], time2=2000.0, reason2="exit")
    (dead,) = analyse(tmp_path).findings("dead")
    assert dead.ranks == (2,) and "but it exited" in dead.text


def test_rank_waiting_itself_is_not_dead(tmp_path):
    # Rank 2 is blocked too (on a receive nobody sends): a hang, but rank 2 is alive.
    three_ranks_waiting_on_2(tmp_path, rank2=[op("recv", 1, 0, state="posted")], time2=2000.0, reason2="signal")
    report = analyse(tmp_path)
    assert not report.findings("dead")
    assert report.findings("unmatched")


def test_rank_that_finished_early_is_not_dead(tmp_path):
    # Rank 1's exit dump is old, but everything it owed arrived: it just finished first.
    write_dump(tmp_path, 0, [op("recv", 1, 0)], time=2000.0)
    write_dump(tmp_path, 1, [op("send", 0, 0)], time=2000.0 - 300)
    assert analyse(tmp_path).ok


def test_rank_errors_are_reported(tmp_path):
    send_first_ring(tmp_path, size=2)
    errors = analyse(tmp_path).findings("error")
    assert [f.ranks for f in errors] == [(0,), (1,)]
    assert "DeadlockError: wait-for cycle" in errors[0].text


# ---- bad input -------------------------------------------------------------------------------

def test_bad_directory_exits_2(tmp_path, run_cli):
    cli = run_cli(str(tmp_path / "nowhere"))
    assert cli.returncode == 2 and "not a directory" in cli.stderr
    cli = run_cli(str(tmp_path))
    assert cli.returncode == 2 and "no trace dumps" in cli.stderr


@pytest.mark.parametrize("override, message", [
    ({"format": "other/1"}, "format: expected 'megatron_p2p.trace/1'"),
    ({"reason": "crash"}, "(rank 1).reason: must be one of"),
    ({"size": 3}, "ranks: must list 3 distinct global ranks"),
    ({"group_rank": 0}, "(rank 1).group_rank: rank 1 is group rank 1"),
])
def test_bad_dump_header_is_named(tmp_path, override, message, run_cli):
    clean_pair(tmp_path)
    write_dump(tmp_path, 1, [], **override)
    cli = run_cli(str(tmp_path))
    assert cli.returncode == 2 and message in cli.stderr, cli.stderr


@pytest.mark.parametrize("field, value, message", [
    ("lane", 2, "ops[0].lane: must be below lanes=2"),
    ("peer", 9, "ops[0].peer: not a rank of the group [0, 1]"),
    ("state", "lost", "ops[0].state: must be one of"),
    ("dtype", "float", "ops[0].dtype: unknown dtype"),
    ("waited", None, "ops[0].waited: bad value"),
    ("nbytes", 6, "ops[0].nbytes: must be a multiple of float32's 4 bytes"),
])
def test_bad_op_is_named_with_its_rank(tmp_path, field, value, message, run_cli):
    clean_pair(tmp_path)
    bad = op("recv", 0, 0)
    bad[field] = value
    write_dump(tmp_path, 1, [bad])
    cli = run_cli(str(tmp_path))
    assert cli.returncode == 2 and f"(rank 1).{message}" in cli.stderr, cli.stderr


def test_a_message_recorded_twice_is_named(tmp_path, run_cli):
    clean_pair(tmp_path)
    write_dump(tmp_path, 1, [op("recv", 0, 0), op("recv", 0, 0)])
    cli = run_cli(str(tmp_path))
    assert cli.returncode == 2 and "(rank 1).ops[1].seq: recv #0 on channel (0, 1, 0) is recorded twice" in cli.stderr


def test_not_json_is_named(tmp_path, run_cli):
    clean_pair(tmp_path)
    (tmp_path / f"rank1.{COMM}.json").write_text("{ truncated")
    cli = run_cli(str(tmp_path))
    assert cli.returncode == 2 and f"rank1.{COMM}.json: not JSON" in cli.stderr


def test_ranks_that_disagree_on_the_group_are_named(tmp_path, run_cli):
    clean_pair(tmp_path)
    write_dump(tmp_path, 1, [], lanes=1)
    cli = run_cli(str(tmp_path))
    assert cli.returncode == 2 and "lanes: 1 disagrees with 2" in cli.stderr


def test_unknown_communicator_exits_2(tmp_path, run_cli):
    clean_pair(tmp_path)
    cli = run_cli(str(tmp_path), "--communicator", "nope")
    assert cli.returncode == 2 and "--communicator nope: no dump of it" in cli.stderr


# ---- dumps as a program ----------------------------------------------------------------------

def check_verdict(path: Path, capsys) -> tuple[int, dict]:
    """`python -m megatron_p2p.check --json PATH`: its exit status and its verdict object."""
    capsys.readouterr()
    code = check.main(["--json", str(path)])
    return code, json.loads(capsys.readouterr().out.splitlines()[0])


def test_program_of_a_cycle_checks_as_deadlock(tmp_path, run_cli, capsys):
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    send_first_ring(dumps, size=3)
    out = tmp_path / "hang.json"
    assert run_cli(str(dumps), "--program", str(out)).returncode == 1
    loaded = program.load(out)
    assert loaded.size == 3 and loaded.lanes == 2
    assert [[c.name for c in calls] for calls in loaded.ranks] == [["send_forward"]] * 3
    assert loaded.ranks[2][0].steps[0][0] == program.Op("send", 0, 0, 64, "float32", "2>0 lane 0 #0")
    code, verdict = check_verdict(out, capsys)
    assert (code, verdict["verdict"], sorted(verdict["ranks"])) == (1, "deadlock", [0, 1, 2])


def test_program_of_a_clean_run_checks_ok(tmp_path, run_cli, capsys):
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    clean_pair(dumps)
    out = tmp_path / "run.json"
    assert run_cli(str(dumps), "--program", str(out)).returncode == 0
    loaded = program.load(out)
    assert [len(calls) for calls in loaded.ranks] == [3, 3]
    assert simulate(loaded).verdict == "ok"
    assert check_verdict(out, capsys)[:1] == (0,)


def test_program_keeps_groups_waits_and_group_ranks(tmp_path):
    # Global ranks 4 and 6 form the group; one batched call of two ops per rank, on lane 1, not waited.
    ranks = (4, 6)
    for me, peer in ((4, 6), (6, 4)):
        write_dump(tmp_path, me, [op("send", peer, 0, lane=1, step=0, call=0, group_size=2, waited=False),
                                  op("recv", peer, 0, lane=1, step=0, call=0, group_size=2, waited=False)],
                   ranks=ranks)
    built = trace.to_program(trace.load_dumps(tmp_path))
    (call,) = built.ranks[1]
    assert not call.wait and len(call.steps) == 1
    assert [(o.kind, o.peer, o.lane) for o in call.steps[0]] == [("send", 0, 1), ("recv", 0, 1)]
    assert simulate(built).verdict == "ok"


def test_program_of_a_cut_record_starts_where_both_sides_recorded(tmp_path):
    full_ring_dump(tmp_path, first_seq=100, count=trace.RING_CAPACITY)
    built = trace.to_program(trace.load_dumps(tmp_path))
    assert [len(calls) for calls in built.ranks] == [trace.RING_CAPACITY, trace.RING_CAPACITY]
    assert built.ranks[1][0].steps[0][0].label == "0>1 lane 0 #100"
    assert simulate(built).verdict == "ok"


def test_program_of_several_communicators_needs_one_named(tmp_path, run_cli):
    clean_pair(tmp_path)
    write_dump(tmp_path, 0, [], comm="feedf00d")
    write_dump(tmp_path, 1, [], comm="feedf00d")
    out = tmp_path / "out.json"
    cli = run_cli(str(tmp_path), "--program", str(out))
    assert cli.returncode == 2 and "name one with --communicator" in cli.stderr and not out.exists()
    done = run_cli(str(tmp_path), "--program", str(out), "--communicator", COMM)
    assert done.returncode == 0 and f"trace: wrote {out}" in done.stderr
    assert program.load(out).size == 2


def test_program_of_a_mismatch_checks_as_mismatch(tmp_path):
    write_dump(tmp_path, 0, [op("send", 1, 0, state="failed", error="mismatch")], reason="error")
    write_dump(tmp_path, 1, [op("recv", 0, 0, nbytes=32, state="failed", error="mismatch")], reason="error")
    assert simulate(trace.to_program(trace.load_dumps(tmp_path))).verdict == "mismatch"


# ---- the flight recorder ---------------------------------------------------------------------

class FakeComm:
    """What the recorder reads of a communicator."""

    def __init__(self, ops: list[dict]) -> None:
        self.id, self.global_rank, self.rank, self.size, self.ranks = COMM, 3, 1, 2, (2, 3)
        self.backend, self.lanes, self.eager_threshold, self.buffered_at_most = "nccl", 2, 0, 1 << 28
        self.on_error = None
        self._ops = ops

    def recent_ops(self) -> list[dict]:
        return self._ops


def test_dump_writes_the_documented_record(tmp_path, monkeypatch):
    monkeypatch.setenv(flight_recorder.ENV, str(tmp_path))
    entries = [op("recv", 2, 0, step=0, call=0, state="posted")]
    path = flight_recorder.dump(FakeComm(entries), "error", "P2PTimeoutError: late")
    assert path is not None and path == tmp_path / f"rank3.{COMM}.json"
    record = json.loads(path.read_text())
    assert record["ops"] == entries
    assert {k: record[k] for k in ("format", "communicator", "rank", "group_rank", "size", "ranks", "backend",
                                   "lanes", "buffered_at_most", "reason", "error", "pid")} == {
        "format": "megatron_p2p.trace/1", "communicator": COMM, "rank": 3, "group_rank": 1, "size": 2,
        "ranks": [2, 3], "backend": "nccl", "lanes": 2, "buffered_at_most": 1 << 28, "reason": "error",
        "error": "P2PTimeoutError: late",
        "pid": os.getpid()}
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # the temporary file was renamed


def test_dump_that_fails_warns_instead_of_raising(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(flight_recorder.ENV, str(blocker))
    with caplog.at_level(logging.WARNING):
        assert flight_recorder.dump(FakeComm([]), "error") is None
    assert "could not write the trace dump" in caplog.text


def test_install_without_the_variable_changes_nothing(monkeypatch):
    monkeypatch.delenv(flight_recorder.ENV, raising=False)
    before = signal.getsignal(signal.SIGUSR1)
    comm = FakeComm([])
    flight_recorder.install(comm)
    assert comm.on_error is None and signal.getsignal(signal.SIGUSR1) is before
    assert flight_recorder.dump(comm, "exit") is None


def test_install_with_a_file_for_directory_names_the_variable(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv(flight_recorder.ENV, str(tmp_path / "file"))
    with pytest.raises(ValueError, match=f"{flight_recorder.ENV}=.*: expected a directory .*\\(not a directory\\)"):
        flight_recorder.install(FakeComm([]))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_install_with_a_read_only_directory_names_the_variable(tmp_path, monkeypatch):
    tmp_path.chmod(0o500)
    monkeypatch.setenv(flight_recorder.ENV, str(tmp_path))
    try:
        with pytest.raises(ValueError, match=f"{flight_recorder.ENV}=.*: expected a directory .*\\(it is not writable\\)"):
            flight_recorder.install(FakeComm([]))
    finally:
        tmp_path.chmod(0o700)


def test_install_dumps_on_error_signal_and_exit(tmp_path):
    # In a child process: install sets process-wide hooks (atexit, SIGUSR1).
    script = f"""
import json, os, signal, sys
sys.path.insert(0, {str(ROOT)!r})
from megatron_p2p import flight_recorder
class FakeComm:
    id, global_rank, rank, size, ranks, backend, lanes, eager_threshold = "{COMM}", 3, 1, 2, (2, 3), "shm", 2, 0
    buffered_at_most = 0
    on_error = None
    def recent_ops(self):
        return []
seen = []
signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))
comm = FakeComm()
flight_recorder.install(comm)
path = {str(tmp_path)!r} + "/rank3.{COMM}.json"
comm.on_error(RuntimeError("boom"))
print(json.load(open(path))["reason"], json.load(open(path))["error"])
os.kill(os.getpid(), signal.SIGUSR1)
print(json.load(open(path))["reason"], seen == [signal.SIGUSR1])
"""
    env = dict(os.environ, **{flight_recorder.ENV: str(tmp_path)})
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert child.returncode == 0, child.stderr
    assert child.stdout.splitlines() == ["error RuntimeError: boom", "signal True"]
    at_exit = json.loads((tmp_path / f"rank3.{COMM}.json").read_text())
    assert (at_exit["reason"], at_exit["error"]) == ("exit", "RuntimeError: boom")  # the error outlives it


@pytest.fixture(scope="module")
def real_job(tmp_path_factory) -> tuple[Path, list[dict]]:
    """A 2-rank torchrun job with dumps on (tests/workers/trace_dump.py): its dump directory and results."""
    directory = tmp_path_factory.mktemp("dumps")
    job = run_job("trace_dump.py", 2, env={flight_recorder.ENV: str(directory)}, timeout=90)
    return directory, job.ok()


def test_real_rank_dumps_on_signal_while_computing(real_job):
    _, results = real_job
    assert results[0]["value"]["computing"] == {"reason": "signal", "error": None, "pending": []}


def test_real_rank_dumps_on_signal_while_blocked_in_a_wait(real_job):
    # What a hang needs: the dump is taken while the rank is stuck, showing what it waits on.
    _, results = real_job
    blocked = results[0]["value"]["blocked"]
    assert blocked["reason"] == "signal"
    assert blocked["pending"] in ([["recv", 1, "posted"]], [["recv", 1, "matched"]])


def test_real_ranks_dump_on_error(real_job):
    _, results = real_job
    for r in results:
        assert r["value"]["raised"] == "MismatchError"
        dumped = r["value"]["error_dump"]
        assert dumped["reason"] == "error" and dumped["error"].startswith("MismatchError")


def test_real_ranks_dump_at_exit_and_analyse_clean(real_job):
    directory, results = real_job
    dumps = [d for d in trace.load_dumps(directory) if d.communicator == results[0]["value"]["clean"]]
    assert [(d.rank, d.reason) for d in dumps] == [(0, "exit"), (1, "exit")]
    assert {o.call_name for d in dumps for o in d.ops} == {"send_forward_recv_backward", "recv_forward_send_backward",
                                                           "late_message"}
    report = trace.analyse(dumps)
    assert report.ok, report.text()


def test_real_mismatch_is_found_in_the_exit_dumps(real_job):
    directory, results = real_job
    report = trace.analyse(trace.load_dumps(directory), communicator=results[0]["value"]["mismatched"])
    assert {(f.kind, f.ranks) for f in report.findings()} == {("error", (0,)), ("error", (1,)), ("mismatch", (0, 1))}


def documented_schema() -> dict:
    """The JSON Schema in docs/trace-format.md."""
    blocks = re.findall(r"```json\n(.*?)```", (ROOT / "docs" / "trace-format.md").read_text(), re.S)
    return next(json.loads(b) for b in blocks if '"$schema"' in b)


def test_real_dumps_have_the_documented_fields(real_job):
    directory, _ = real_job
    schema = documented_schema()
    for path in directory.glob("rank*.json"):
        record = json.loads(path.read_text())
        assert set(record) == set(schema["required"]) == set(schema["properties"])
        assert record["ops"] and all(set(o) == set(schema["$defs"]["op"]["required"]) for o in record["ops"])
        assert path.name == f"rank{record['rank']}.{record['communicator']}.json"
