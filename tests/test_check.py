"""`python -m megatron_p2p.check`: verdicts on the shipped bug files and their correct
counterparts, errors on bad files (field and rank named), --json, exit codes, generated
schedules, a reduced grid, and random programs cross-checked against an exhaustive search,
with lanes side by side and serialized in issue order (--serialize-lanes)."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from random_programs import random_program

from megatron_p2p import check
from megatron_p2p import program as prog
from megatron_p2p.program import ProgramBuilder, ProgramError, dumps, from_dict, load, loads, to_dict
from megatron_p2p.simulate import simulate

PROGRAMS = Path(__import__("megatron_p2p").__path__[0]) / "programs"  # the shipped programs
ROOT = Path(__file__).resolve().parent.parent


def run_check(capsys, *argv: str) -> tuple[int, str, str]:
    code = check.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


# ---- the shipped files ------------------------------------------------------------------------

def test_naive_send_first_ring_is_a_deadlock_of_all_four_ranks(capsys):
    code, out, _ = run_check(capsys, str(PROGRAMS / "naive_send_first_ring.json"))
    assert code == 1
    assert "DEADLOCK: ranks 0 -> 1 -> 2 -> 3 -> 0" in out
    assert "rank 2 is blocked on isend to rank 3: 4096 bytes of float32, lane 0, message #0, posted by isend" in out
    assert "rank 3 has posted the matching receive, but it is queued on lane 0 behind rank 3's own blocked op" in out


def test_parity_ring_is_ok(capsys):
    code, out, _ = run_check(capsys, str(PROGRAMS / "parity_ring.json"))
    assert code == 0
    assert out.strip().endswith("OK in 2 rounds")


def test_megatron_batched_order_at_pp2_is_a_mismatch_naming_the_pair(capsys):
    code, out, _ = run_check(capsys, str(PROGRAMS / "megatron_batched_order_pp2.json"))
    assert code == 1
    assert "MISMATCH: rank 0 sends 2048 bytes of float32, 'grad 0->1' to rank 1, which expects 4096 bytes" in out
    assert "rank 1: receive from rank 0, 4096 bytes of float32" in out


def test_batched_exchange_at_pp2_is_ok(capsys):
    code, out, _ = run_check(capsys, str(PROGRAMS / "batched_exchange_pp2.json"))
    assert code == 0 and "OK in" in out


def test_megatron_core_shape_round_deadlocks_under_rendezvous(capsys):
    """megatron-core's own variable_seq_lengths shape round (one batched group of the four 64-byte
    shape ops, all waited, before the data: Megatron-LM #5100) in the interleaved schedule."""
    code, out, _ = run_check(capsys, str(PROGRAMS / "megatron_shape_round_pp2.json"))
    assert code == 1
    assert "DEADLOCK: ranks 0 -> 1 -> 0" in out
    assert "64 bytes of int64, lane 1, message #0, posted by _communicate_shapes, label 'shape grad mb0 chunk1'" in out


def test_megatron_core_shape_round_completes_with_its_headers_buffered(tmp_path, capsys):
    """What megatron-core relies on: the same program, the 64-byte headers buffered."""
    doc = json.loads((PROGRAMS / "megatron_shape_round_pp2.json").read_text())
    doc["eager_threshold"] = 64
    buffered = tmp_path / "buffered.json"
    buffered.write_text(json.dumps(doc))
    code, out, _ = run_check(capsys, str(buffered))
    assert code == 0 and "OK in" in out


def test_json_prints_one_object_per_file(capsys):
    files = [PROGRAMS / "naive_send_first_ring.json", PROGRAMS / "parity_ring.json",
             PROGRAMS / "megatron_batched_order_pp2.json"]
    code, out, _ = run_check(capsys, "--json", *map(str, files))
    records = [json.loads(line) for line in out.splitlines()]
    assert code == 1
    assert [(r["file"], r["verdict"], r["ranks"]) for r in records] == [
        (str(files[0]), "deadlock", [0, 1, 2, 3]), (str(files[1]), "ok", []), (str(files[2]), "mismatch", [0, 1])]
    assert records[0]["detail"].startswith("DEADLOCK")


def test_all_ok_files_exit_zero_and_one_bad_verdict_exits_one(capsys):
    assert run_check(capsys, str(PROGRAMS / "parity_ring.json"), str(PROGRAMS / "batched_exchange_pp2.json"))[0] == 0
    assert run_check(capsys, str(PROGRAMS / "parity_ring.json"), str(PROGRAMS / "naive_send_first_ring.json"))[0] == 1


def test_unreadable_file_exits_two_with_its_name(capsys, tmp_path):
    missing = tmp_path / "missing.json"
    code, _, err = run_check(capsys, str(missing))
    assert code == 2 and "missing.json: cannot read" in err


def test_usage_errors_exit_two(capsys):
    with pytest.raises(SystemExit) as e:
        check.main([])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        check.main(["--schedule", "1f1b"])
    assert e.value.code == 2
    assert "--schedule needs --pp" in capsys.readouterr().err


def test_module_runs_as_a_command():
    done = subprocess.run([sys.executable, "-m", "megatron_p2p.check", str(PROGRAMS / "naive_send_first_ring.json")],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 1 and "DEADLOCK" in done.stdout


def test_shipped_files_are_package_data():
    names = {p.name for p in PROGRAMS.glob("*.json")}
    assert {"naive_send_first_ring.json", "megatron_batched_order_pp2.json", "parity_ring.json",
            "batched_exchange_pp2.json"} <= names


# ---- bad files: each error names the field and the rank ------------------------------------------

def _base(**over) -> dict:
    op = {"kind": "send", "peer": 1, "bytes": 16, "dtype": "float32", "label": "a"}
    back = {"kind": "recv", "peer": 0, "bytes": 16, "dtype": "float32", "label": "a"}
    obj = {"format": prog.FORMAT, "size": 2, "lanes": 1, "ranks": [[{"steps": [[op]]}], [{"steps": [[back]]}]]}
    obj.update(over)
    return obj


def _error(obj) -> str:
    with pytest.raises(ProgramError) as e:
        from_dict(obj)
    return str(e.value)


def test_a_well_formed_base_program_loads():
    assert simulate(from_dict(_base())).verdict == "ok"


def test_wrong_format_is_named():
    assert _error(_base(format="megatron_p2p.program/9")).startswith("format: must be")


def test_peer_outside_the_group_names_path_and_rank():
    obj = _base()
    obj["ranks"][1][0]["steps"][0][0]["peer"] = 7
    assert _error(obj) == "ranks[1][0].steps[0][0].peer: rank 1, call 0: peer 7 is outside a group of 2 ranks"


def test_unknown_key_is_an_error():
    obj = _base()
    obj["ranks"][0][0]["steps"][0][0]["byte"] = 16
    assert _error(obj).startswith("ranks[0][0].steps[0][0].byte: rank 0, call 0: unknown key 'byte'")


def test_unknown_dtype_is_named():
    obj = _base()
    obj["ranks"][0][0]["steps"][0][0]["dtype"] = "float33"
    assert _error(obj).startswith("ranks[0][0].steps[0][0].dtype: rank 0, call 0: unknown dtype \"float33\"")


def test_bytes_not_whole_items_is_an_error():
    obj = _base()
    obj["ranks"][0][0]["steps"][0][0]["bytes"] = 6
    assert "ranks[0][0].steps[0][0].bytes: rank 0, call 0: 6 bytes is not a whole number of float32" in _error(obj)


def test_ops_of_one_step_on_two_lanes_is_an_error():
    obj = _base(lanes=2)
    obj["ranks"][0][0]["steps"][0].append({"kind": "recv", "peer": 1, "lane": 1, "bytes": 16, "dtype": "float32"})
    assert "ranks[0][0].steps[0][1].lane: rank 0, call 0: lane 1 differs from lane 0" in _error(obj)


def test_lane_beyond_the_program_lanes_is_an_error():
    obj = _base()
    obj["ranks"][0][0]["steps"][0][0]["lane"] = 1
    assert _error(obj).startswith("ranks[0][0].steps[0][0].lane: rank 0, call 0: lane 1 is not one of")


def test_self_send_outside_its_receives_step_is_an_error():
    obj = _base()
    obj["ranks"][0] = [{"steps": [[{"kind": "send", "peer": 0, "bytes": 4, "dtype": "float32"}],
                                  [{"kind": "recv", "peer": 0, "bytes": 4, "dtype": "float32"}]]}]
    assert _error(obj).startswith("ranks[0][0].steps[0]: rank 0, call 0: a send to this rank itself")


def test_await_of_a_later_call_is_an_error():
    obj = _base()
    obj["ranks"][0].append({"steps": [], "await": [1]})
    assert _error(obj).startswith("ranks[0][1].await[0]: rank 0, call 1: an awaited call must be an integer from 0 to 0")


def test_exchange_slot_typo_is_an_error():
    obj = _base()
    obj["ranks"][0] = [{"exchange": {"send_nxt": {"bytes": 4, "dtype": "float32"}}}]
    assert _error(obj).startswith("ranks[0][0].exchange.send_nxt: rank 0, call 0: unknown key 'send_nxt'")


def test_wrong_number_of_ranks_is_an_error():
    obj = _base(size=3)
    assert _error(obj) == "ranks: has 2 entries for a group of size 3"


def test_bad_json_names_the_file(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{\"format\": ")
    with pytest.raises(ProgramError, match="broken.json: not valid JSON"):
        load(path)


def test_bad_file_exits_two_with_the_error(capsys, tmp_path):
    obj = _base()
    obj["ranks"][1][0]["steps"][0][0]["peer"] = 7
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(obj))
    code, _, err = run_check(capsys, str(path))
    assert code == 2 and "ranks[1][0].steps[0][0].peer: rank 1, call 0: peer 7" in err


# ---- format round trips -------------------------------------------------------------------------

def test_programs_round_trip_through_json():
    for seed in range(50):
        p = random_program(seed)
        assert loads(dumps(p)) == p
        assert from_dict(to_dict(p)) == p


# ---- schedules and the grid ---------------------------------------------------------------------

def test_schedule_check_and_dump(capsys, tmp_path):
    dump = tmp_path / "sched.json"
    code, out, _ = run_check(capsys, "--schedule", "interleaved", "--pp", "4", "--vpp", "2", "--microbatches", "8",
                             "--mode", "batched", "--lanes", "1", "--overlap", "--dump", str(dump))
    assert code == 0 and "OK in" in out
    assert simulate(load(dump)).verdict == "ok"


def test_schedule_json(capsys):
    code, out, _ = run_check(capsys, "--json", "--schedule", "1f1b", "--pp", "3")
    record = json.loads(out)
    assert code == 0 and record["verdict"] == "ok" and record["schedule"]["pp"] == 3


def test_reduced_grid_prints_a_table_and_a_total(capsys):
    code, out, _ = run_check(capsys, "--grid", "--reduced", "--family", "megatron", "--jobs", "2")
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["1f1b", "bat", "1L"]
    assert any(line.startswith("pp 3-4 ") for line in lines)
    total = next(line for line in lines if line.startswith("grid: "))
    assert "refused by megatron-core" in total
    assert code == (0 if "0 DEADLOCK, 0 MISMATCH" in total else 1)


def test_reduced_grid_with_variable_seq_lengths_completes_under_strict_rendezvous():
    """P2PCommunicator's shape round (_shape_headers.py), in both modes and lane counts, with no
    send buffered; megatron-core's own round deadlocks (test_megatron_core_shape_round_deadlocks_
    under_rendezvous)."""
    from megatron_p2p.schedules import generate
    variable = [r for r in check.grid_results(full=False, jobs=2) if r[0]["variable_seq_lengths"]]
    assert {(c["mode"], c["lanes"]) for c, _, _, _ in variable} == {(m, n) for m in ("parity", "batched") for n in (1, 2)}
    assert len(variable) > 100 and all(v == "ok" for _, v, _, _ in variable), [r for r in variable if r[1] != "ok"]
    config = variable[0][0]
    program = generate(config["schedule"], config["pp"], **{k: v for k, v in config.items() if k not in ("schedule", "pp")})
    assert program.eager_threshold == 0


def test_reduced_grid_is_deadlock_free_with_lanes_serialized(capsys):
    """Each rank's lanes run one after another in issue order, the worst case NCCL allows for
    communicators sharing a device: every configuration still completes, paired right."""
    code, out, _ = run_check(capsys, "--grid", "--reduced", "--family", "megatron", "--jobs", "2", "--serialize-lanes")
    total = next(line for line in out.splitlines() if line.startswith("grid: "))
    assert code == 0 and " 0 DEADLOCK, 0 MISMATCH" in total and total.endswith("lanes serialized in issue order")


def test_torch_schedule_check_names_defer_pp_recvs_cycle_and_dumps_it(capsys, tmp_path):
    dump = tmp_path / "torch.json"
    code, out, _ = run_check(capsys, "--schedule", "torch:Interleaved1F1B", "--pp", "2", "--microbatches", "2",
                             "--defer-pp-recv", "--dump", str(dump))
    assert code == 1 and out.startswith("torch:Interleaved1F1B pp=2 microbatches=2 defer_pp_recv: DEADLOCK: ranks 0 -> 1")
    assert "posted by isend, label 'act mb1 s2->s3'" in out
    assert simulate(load(dump)).verdict == "deadlock"


def test_torch_schedule_check_without_defer_is_ok_with_the_first_step(capsys):
    code, out, _ = run_check(capsys, "--json", "--schedule", "torch:DualPipeV", "--pp", "3", "--microbatches", "6",
                             "--first-step", "metadata", "--lazy-comms")
    record = json.loads(out)
    assert code == 0 and record["verdict"] == "ok" and record["schedule"]["first_step"] == "metadata"


@pytest.mark.parametrize("argv,problem", [
    (["--schedule", "torch:PipeDream", "--pp", "2"], "NAME must be one of"),
    (["--schedule", "torch:GPipe", "--pp", "2", "--vpp", "2"], "take --stages-per-rank"),
    (["--schedule", "1f1b", "--pp", "2", "--defer-pp-recv"], "go with torch:NAME"),
    (["--schedule", "zb", "--pp", "2"], "must be 1f1b, interleaved or torch:NAME"),
    (["--family", "torch", "x.json"], "go with --grid"),
])
def test_torch_usage_errors_exit_two_naming_the_problem(capsys, argv, problem):
    with pytest.raises(SystemExit) as e:
        check.main(argv)
    assert e.value.code == 2 and problem in capsys.readouterr().err


def test_torch_schedule_torch_refuses_exits_two_with_torchs_reason(capsys):
    code, _, err = run_check(capsys, "--schedule", "torch:1F1B", "--pp", "4", "--microbatches", "2")
    assert code == 2 and "torch refuses 1F1B" in err and "must be greater than" in err


def test_reduced_torch_grid_prints_a_row_per_class_and_defer_failures_leave_the_status_zero(capsys):
    code, out, _ = run_check(capsys, "--grid", "--reduced", "--family", "torch", "--jobs", "1")
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["torch.distributed.pipelining", "pp", "2"]
    rows = {line.split("  ")[0] for line in lines[1:]}
    assert {"GPipe", "1F1B", "DualPipeV", "Interleaved1F1B +defer", "ZBVZeroBubble +defer buffered"} <= rows
    assert next(line for line in lines if line.startswith("Interleaved1F1B ")).split()[1:3] == ["all", "8"]
    assert "M /" in next(line for line in lines if line.startswith("ZBVZeroBubble +defer buffered"))
    total = next(line for line in lines if line.startswith("grid: "))
    assert code == 0 and " by torch;" in total and " 0 DEADLOCK" not in total


def two_rank_lane_pair(path: Path, backward_lane_first: bool) -> str:
    """A program file: rank 0 sends an activation on lane 0, then receives a gradient on lane 1;
    rank 1 receives the activation and sends the gradient, in lane order or lane 1 first."""
    builder = ProgramBuilder(2, 2)
    builder.steps(0, [(0, [("send", 1, 4096, "float32", "act")]), (1, [("recv", 1, 2048, "float32", "grad")])])
    rank1 = [(0, [("recv", 0, 4096, "float32", "act")]), (1, [("send", 0, 2048, "float32", "grad")])]
    builder.steps(1, rank1[::-1] if backward_lane_first else rank1)
    path.write_text(dumps(builder.build()))
    return str(path)


def test_serialize_lanes_reports_ranks_that_issue_their_lanes_in_opposite_orders(capsys, tmp_path):
    code, out, _ = run_check(capsys, "--serialize-lanes", two_rank_lane_pair(tmp_path / "p.json", True))
    assert code == 1 and "DEADLOCK: ranks 0 -> 1 -> 0" in out and "lanes serialized" in out


def test_serialize_lanes_passes_ranks_that_issue_their_lanes_in_one_order(capsys, tmp_path):
    code, out, _ = run_check(capsys, "--serialize-lanes", two_rank_lane_pair(tmp_path / "p.json", False))
    assert code == 0 and "OK in" in out


def test_reduced_grid_verdicts_are_the_simulators_and_1f1b_is_ok():
    results = check.grid_results(full=False, jobs=1)
    assert len(results) > 100
    from megatron_p2p.schedules import generate
    config, verdict, _, _ = results[len(results) // 2]
    kwargs = {k: v for k, v in config.items() if k not in ("schedule", "pp")}
    assert simulate(generate(config["schedule"], config["pp"], **kwargs)).verdict == verdict
    assert all(v == "ok" for c, v, _, _ in results if c["schedule"] == "1f1b")


# ---- random programs against an exhaustive search ------------------------------------------------

class Oracle:
    """Every interleaving of the semantics' atomic actions, searched exhaustively: a rank issues
    its next call (after the previous call's ops if it waits, and after what it awaits), a send is
    published (active, after the previous send on its channel, with one of 8 slots free), an eager
    send completes, a receive meets its published send (active, after the previous receive).
    A step is active at the head of its lane's queue, or of its rank's one queue when lanes are
    serialized. Returns every terminal state: (set of ops done, whether a pair disagreed)."""

    def __init__(self, program: prog.Program, serialize_lanes: bool = False) -> None:
        self.ops: list[tuple] = []  # (rank, call, step, index, op)
        self.calls: dict[tuple[int, int], list[int]] = {}
        lane_steps: dict[tuple[int, int], list[tuple[int, int]]] = {}
        self.step_ops: dict[tuple[int, int, int], list[int]] = {}
        counters: Counter = Counter()
        self.seq = []
        for r, calls in enumerate(program.ranks):
            for c, call in enumerate(calls):
                ids = []
                for s, step in enumerate(call.steps):
                    lane_steps.setdefault((r, 0 if serialize_lanes else step[0].lane), []).append((c, s))
                    for i, op in enumerate(step):
                        src, dst = (r, op.peer) if op.kind == "send" else (op.peer, r)
                        key = (op.kind, src, dst, op.lane)
                        self.seq.append(counters[key])
                        counters[key] += 1
                        self.step_ops.setdefault((r, c, s), []).append(len(self.ops))
                        ids.append(len(self.ops))
                        self.ops.append((r, c, s, i, op))
                self.calls[r, c] = ids
        self.program = program
        self.lane_steps = lane_steps
        self.by_channel = {}
        for n, (r, _c, _s, _i, op) in enumerate(self.ops):
            src, dst = (r, op.peer) if op.kind == "send" else (op.peer, r)
            self.by_channel[op.kind, src, dst, op.lane, self.seq[n]] = n
        self.awaited = {}
        for r, calls in enumerate(program.ranks):
            for c, call in enumerate(calls):
                need = []
                for a in call.awaits:
                    if isinstance(a, int):
                        need += self.calls[r, a]
                    else:
                        target, which = a
                        ids = self.calls[r, target]
                        if isinstance(which, str):
                            need += [n for n in ids if self.ops[n][4].slot == which]
                        else:
                            need.append(ids[which])
                self.awaited[r, c] = need

    def explore(self, limit: int = 200_000) -> set:
        size = self.program.size
        start: tuple[tuple[int, ...], frozenset, frozenset, bool] = (tuple([0] * size), frozenset(), frozenset(), False)
        seen = {start}
        todo = [start]
        terminals = set()
        while todo:
            state = todo.pop()
            successors = list(self._moves(state))
            if not successors:
                terminals.add((state[1], state[3]))
            for nxt in successors:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
            if len(seen) > limit:
                raise OverflowError
        return terminals

    def _active(self, next_call, done) -> set[int]:
        active = set()
        for (r, _lane), steps in self.lane_steps.items():
            for c, s in steps:
                ids = self.step_ops[r, c, s]
                if all(n in done for n in ids):
                    continue
                if c < next_call[r]:
                    active.update(ids)
                break
        return active

    def _moves(self, state):
        next_call, done, published, bad = state
        eager = self.program.eager_threshold
        for r in range(self.program.size):
            c = next_call[r]
            if c >= len(self.program.ranks[r]):
                continue
            prev_ok = c == 0 or not self.program.ranks[r][c - 1].wait or all(n in done for n in self.calls[r, c - 1])
            if prev_ok and all(n in done for n in self.awaited[r, c]):
                yield next_call[:r] + (c + 1,) + next_call[r + 1:], done, published, bad
        active = self._active(next_call, done)
        for n in active:
            r, c, s, i, op = self.ops[n]
            k = self.seq[n]
            if op.kind == "send":
                if n in published:
                    continue
                before = self.by_channel.get(("send", r, op.peer, op.lane, k - 1))
                slot_holder = self.by_channel.get(("recv", r, op.peer, op.lane, k - 8))
                if (before is None or before in published) and (slot_holder is None or slot_holder in done):
                    yield next_call, done, published | {n}, bad
            elif n not in done:
                before = self.by_channel.get(("recv", op.peer, r, op.lane, k - 1))
                send = self.by_channel.get(("send", op.peer, r, op.lane, k))
                if (before is None or before in done) and send is not None and send in published:
                    sop = self.ops[send][4]
                    finished = {n} if sop.bytes <= eager else {n, send}
                    yield next_call, done | finished, published, bad or (sop.bytes, sop.dtype) != (op.bytes, op.dtype)
        for n in published - done:
            if self.ops[n][4].bytes <= eager:
                yield next_call, done | {n}, published, bad


def _assert_consistent(v, p) -> None:
    """What each verdict promises, checked against the program itself."""
    if v.verdict == "ok":
        assert v.num_pending == 0 and not v.cycle and v.mismatch is None
    elif v.verdict == "mismatch":
        send, recv = v.mismatch
        assert send.op.kind == "send" and recv.op.kind == "recv"
        assert (send.op.peer, recv.op.peer, send.op.lane, send.seq) == (recv.rank, send.rank, recv.op.lane, recv.seq)
        assert (send.op.bytes, send.op.dtype) != (recv.op.bytes, recv.op.dtype)
        assert p.ranks[send.rank][send.call].steps[send.step][send.index] == send.op
    else:
        assert v.num_pending == len(v.pending) > 0 and v.cycle
        pending = {(o.rank, o.call, o.step, o.index) for o in v.pending}
        for edge in v.cycle:
            ref = edge.blocked_on
            assert (ref.rank, ref.call, ref.step, ref.index) in pending
            assert edge.rank == ref.rank and edge.waits_for == ref.op.peer != edge.rank
        if v.cycle_closed:
            assert [e.waits_for for e in v.cycle] == [e.rank for e in v.cycle[1:]] + [v.cycle[0].rank]


# `make verify` raises the count.
RANDOM_PROGRAMS = int(os.environ.get("MEGATRON_P2P_VERIFY_PROGRAMS", "300"))


def agree_with_exhaustive_search(seeds, serialize_lanes: bool) -> tuple[Counter, Counter]:
    """Simulates each seed's program and, where it is small, compares the verdict (and the ops
    left pending) with the exhaustive search's single outcome. Returns the verdicts' counts, of
    all programs and of those searched."""
    verdicts: Counter = Counter()
    searched: Counter = Counter()
    for seed in seeds:
        p = random_program(seed)
        v = simulate(p, serialize_lanes=serialize_lanes)
        verdicts[v.verdict] += 1
        _assert_consistent(v, p)
        if p.num_ops() > 16:
            continue
        oracle = Oracle(p, serialize_lanes)
        try:
            terminals = oracle.explore()
        except OverflowError:
            continue
        assert len(terminals) == 1, f"seed {seed}: the outcome depends on the interleaving"
        (done, bad), = terminals
        expected = "mismatch" if bad else "ok" if len(done) == len(oracle.ops) else "deadlock"
        assert v.verdict == expected, f"seed {seed}: simulator {v.summary()}, search {expected}\n{dumps(p)}"
        if expected == "deadlock":
            stuck = {oracle.ops[n][:4] for n in range(len(oracle.ops)) if n not in done}
            assert {(o.rank, o.call, o.step, o.index) for o in v.pending} == stuck, f"seed {seed}"
        searched[expected] += 1
    return verdicts, searched


def test_random_programs_agree_with_exhaustive_search():
    verdicts, searched = agree_with_exhaustive_search(range(RANDOM_PROGRAMS), serialize_lanes=False)
    assert min(verdicts[k] for k in ("ok", "deadlock", "mismatch")) >= 30, verdicts
    assert min(searched[k] for k in ("ok", "deadlock", "mismatch")) >= 10, searched


def test_random_programs_agree_with_exhaustive_search_with_lanes_serialized():
    two_lanes = [seed for seed in range(RANDOM_PROGRAMS) if random_program(seed).lanes == 2]
    verdicts, searched = agree_with_exhaustive_search(two_lanes, serialize_lanes=True)
    assert min(verdicts[k] for k in ("ok", "deadlock", "mismatch")) >= 15, verdicts
    assert min(searched[k] for k in ("ok", "deadlock", "mismatch")) >= 5, searched
    small = [random_program(seed) for seed in two_lanes if random_program(seed).num_ops() <= 16]
    changed = [p for p in small if simulate(p).verdict != simulate(p, serialize_lanes=True).verdict]
    assert changed, "no program searched whose outcome serializing its lanes changes"


# ---- the C binding ----------------------------------------------------------------------------------

def test_simulate_binding_rejects_each_misuse_up_front():
    from megatron_p2p import _C
    ok = (b"",)
    with pytest.raises(ValueError, match="size must be from 1"):
        _C.simulate(0, 1, 0, ())
    with pytest.raises(ValueError, match="lanes must be 1 or 2"):
        _C.simulate(1, 3, 0, ok)
    with pytest.raises(ValueError, match="eager_threshold must be >= 0"):
        _C.simulate(1, 1, -1, ok)
    with pytest.raises(TypeError, match="streams must be a tuple of 2"):
        _C.simulate(2, 1, 0, ok)
    with pytest.raises(TypeError, match=r"streams\[0\] must be bytes"):
        _C.simulate(1, 1, 0, ("x",))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"streams\[0\] holds 3 bytes"):
        _C.simulate(1, 1, 0, (b"abc",))
    assert _C.simulate(1, 1, 0, ok)[0] == "ok"


def test_malformed_packed_streams_are_rejected_never_crash():
    """Random int64 streams (valid programs with values changed): each either runs or raises
    ValueError naming the rank and position."""
    import random
    from array import array

    from megatron_p2p import _C
    rng = random.Random(7)
    rejected = 0
    for seed in range(300):
        p = random_program(seed)
        size, lanes, eager, packed = p.packed()
        streams = list(packed)
        r = rng.randrange(size)
        values = array("q", streams[r])
        if not values:
            continue
        values[rng.randrange(len(values))] = rng.choice([-1, 2, 3, 7, 1 << 40, -(1 << 62)])
        if rng.random() < 0.3:
            values = values[:rng.randrange(len(values))]
        streams[r] = values.tobytes()
        try:
            _C.simulate(size, lanes, eager, tuple(streams))
        except ValueError as e:
            assert str(e).startswith(f"packed program: rank {r}, value ")
            rejected += 1
    assert rejected > 50


class _Stream(io.StringIO):
    def __init__(self, terminal: bool):
        super().__init__()
        self.terminal = terminal

    def isatty(self) -> bool:
        return self.terminal


def test_the_grid_shows_its_progress_on_a_terminal_and_clears_it():
    stream = _Stream(terminal=True)
    results = check.grid_results(full=False, family="megatron", progress_to=stream)
    shown = stream.getvalue()
    assert f"\rgrid: {len(results)} of {len(results)} configs checked" in shown and shown.endswith("\r\033[K")


def test_the_grid_prints_no_progress_where_its_output_is_not_a_terminal():
    stream = _Stream(terminal=False)
    check.grid_results(full=False, family="megatron", progress_to=stream)
    assert stream.getvalue() == ""
