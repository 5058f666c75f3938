"""Timelines (megatron_p2p.timeline): `check --timeline` draws a program's simulated rounds and
`trace --timeline` a job's flight-recorder dumps, as a Chrome trace (.json) or a picture (.png).
The JSON is held to the trace-event format; the cycle's ops are marked, and only theirs."""
from __future__ import annotations

import json
import struct
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from test_trace import clean_pair, op, send_first_ring, write_dump

from megatron_p2p import check, timeline, trace
from megatron_p2p.program import load
from megatron_p2p.simulate import simulate

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = ROOT / "megatron_p2p" / "programs"
RING = PROGRAMS / "naive_send_first_ring.json"
METADATA = {"process_name": "name", "thread_name": "name", "process_sort_index": "sort_index"}


def trace_events(path: Path) -> list[dict]:
    """The events of a Chrome trace file, each checked against the trace-event format: the
    required keys, the phase, numeric ts and dur, int pid and tid; every row named."""
    doc = json.loads(path.read_text())
    assert isinstance(doc, dict) and isinstance(doc["traceEvents"], list)
    assert doc.get("displayTimeUnit") in ("ms", "ns")
    events = doc["traceEvents"]
    named_processes, named_threads = set(), set()
    for e in events:
        assert {"name", "ph", "pid", "tid"} <= e.keys(), e
        assert isinstance(e["name"], str) and type(e["pid"]) is int and type(e["tid"]) is int, e
        assert e["ph"] in ("X", "M"), e
        if e["ph"] == "M":
            key = METADATA[e["name"]]
            assert key in e["args"], e
            if e["name"] == "process_name":
                named_processes.add(e["pid"])
            elif e["name"] == "thread_name":
                named_threads.add((e["pid"], e["tid"]))
        else:
            assert isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float)), e
            assert e["ts"] >= 0 and e["dur"] >= 0, e
            assert isinstance(e["cat"], str) and isinstance(e["args"], dict), e
    spans = [e for e in events if e["ph"] == "X"]
    assert spans, "no op spans"
    assert {e["pid"] for e in spans} <= named_processes
    assert {(e["pid"], e["tid"]) for e in spans} <= named_threads
    return spans


def dump_dir(tmp_path: Path, write: Callable[[Path], object]) -> Path:
    """A directory of flight-recorder dumps, as `write` (test_trace's writers) makes them."""
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    write(dumps)
    return dumps


def png_dimensions(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


# ---- the checker ------------------------------------------------------------------------------


def test_check_timeline_json_marks_the_ring_cycle(tmp_path, capsys):
    out = tmp_path / "ring.json"
    assert check.main([str(RING), "--timeline", str(out)]) == 1
    spans = trace_events(out)
    cycle = [e for e in spans if e["cat"] == "cycle"]
    # Each rank of the 4-rank ring is blocked in its send to the next; its receive waits behind it.
    assert sorted((e["pid"], e["args"]["peer"]) for e in cycle) == [(0, 1), (1, 2), (2, 3), (3, 0)]
    assert all(e["name"].startswith("send") and e["args"]["cycle"] and e["cname"] == "terrible" for e in cycle)
    assert sorted(e["pid"] for e in spans if e["cat"] == "unfinished") == [0, 1, 2, 3]
    assert all(e["args"]["done_round"] is None for e in spans)


def test_check_names_the_timeline_it_wrote_on_stderr(tmp_path, capsys):
    out = tmp_path / "parity.json"
    assert check.main([str(PROGRAMS / "parity_ring.json"), "--timeline", str(out)]) == 0
    err = capsys.readouterr().err
    assert err == f"check: wrote {out}\n"


def test_check_without_a_timeline_names_no_file(capsys):
    assert check.main([str(PROGRAMS / "parity_ring.json")]) == 0
    assert "wrote" not in capsys.readouterr().err


def test_trace_names_the_timeline_it_wrote_on_stderr(tmp_path, capsys):
    dumps = dump_dir(tmp_path, clean_pair)
    out = tmp_path / "t.json"
    assert trace.main([str(dumps), "--timeline", str(out)]) == 0
    assert capsys.readouterr().err == f"trace: wrote {out}\n"


def test_check_timeline_json_of_a_completing_program_marks_nothing(tmp_path, capsys):
    out = tmp_path / "parity.json"
    assert check.main([str(PROGRAMS / "parity_ring.json"), "--timeline", str(out)]) == 0
    spans = trace_events(out)
    assert {e["cat"] for e in spans} == {"op"}
    # spans run from the round posted to the round completed
    assert all(e["dur"] == (e["args"]["done_round"] - e["args"]["posted_round"]) * timeline.ROUND_US for e in spans)
    assert len(spans) == load(PROGRAMS / "parity_ring.json").num_ops()


def test_check_timeline_png_of_the_shipped_ring(tmp_path, capsys):
    out = tmp_path / "ring.png"
    assert check.main([str(RING), "--timeline", str(out)]) == 1
    program = load(RING)
    expected = timeline.png_size(timeline.of_simulation(program, simulate(program, timeline=True)))
    assert out.stat().st_size > 0
    assert png_dimensions(out) == expected == (1200, 440)  # 12 x (2.4 + 0.5 per row) inches at 100 dpi, 4 rows


def test_check_timeline_of_a_schedule_shows_its_rounds(tmp_path, capsys):
    out = tmp_path / "intl.json"
    assert check.main(["--schedule", "torch:Interleaved1F1B", "--pp", "4", "--defer-pp-recv",
                       "--timeline", str(out)]) == 1
    spans = trace_events(out)
    assert {e["pid"] for e in spans if e["cat"] == "cycle"} == {0, 1, 2, 3}
    assert max(e["ts"] + e["dur"] for e in spans) > 3 * timeline.ROUND_US  # rounds ran before it stuck


@pytest.mark.parametrize("args, message", [
    (["--timeline", "out.txt", str(RING)], "must end in .json"),
    (["--timeline", "out.json", str(RING), str(RING)], "draws one program"),
    (["--timeline", "out.json", "--grid", "--reduced"], "draws one program"),
])
def test_check_timeline_misuse_is_named(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        check.main(args)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_check_timeline_png_without_matplotlib_is_named(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(SystemExit) as exc:
        check.main(["--timeline", str(tmp_path / "ring.png"), str(RING)])
    assert exc.value.code == 2
    assert "needs matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "ring.png").exists()
    assert check.main(["--timeline", str(tmp_path / "ring.json"), str(RING)]) == 1  # a .json needs nothing


def test_simulate_without_timeline_lists_no_ops():
    assert simulate(load(RING)).timeline == []
    with pytest.raises(ValueError, match="timeline=True"):
        timeline.of_simulation(load(RING), simulate(load(RING)))


# ---- the flight recorder ------------------------------------------------------------------------


def test_trace_timeline_json_marks_the_cycle(tmp_path, capsys):
    dumps = dump_dir(tmp_path, send_first_ring)
    out = tmp_path / "ring.json"
    assert trace.main([str(dumps), "--timeline", str(out)]) == 1
    spans = trace_events(out)
    assert sorted((e["pid"], e["args"]["peer"]) for e in spans if e["cat"] == "cycle") == [(0, 1), (1, 2), (2, 0)]
    # unfinished ops run to their rank's dump: 1000 s posted, dumped at 2000 s
    assert all(e["dur"] == pytest.approx(1000.0 * 1e6) for e in spans)


def test_trace_timeline_of_a_clean_run_marks_nothing(tmp_path, capsys):
    dumps = dump_dir(tmp_path, clean_pair)
    out = tmp_path / "clean.json"
    assert trace.main([str(dumps), "--timeline", str(out)]) == 0
    spans = trace_events(out)
    assert {e["cat"] for e in spans} == {"op"} and len(spans) == 6
    assert all(e["dur"] == pytest.approx(0.5e6) for e in spans)


def test_trace_timeline_of_two_communicators_needs_one_named(tmp_path, capsys):
    dumps = dump_dir(tmp_path, clean_pair)
    write_dump(dumps, 0, [op("send", 1, 0)], comm="0ther")
    write_dump(dumps, 1, [op("recv", 0, 0)], comm="0ther")
    out = tmp_path / "one.json"
    assert trace.main([str(dumps), "--timeline", str(out)]) == 2
    assert "name one with --communicator" in capsys.readouterr().err and not out.exists()
    assert trace.main([str(dumps), "--timeline", str(out), "--communicator", "0ther"]) == 0
    spans = trace_events(out)
    assert len(spans) == 2 and {e["args"]["communicator"] for e in spans} == {"0ther"}


def test_trace_timeline_png(tmp_path, capsys):
    dumps = dump_dir(tmp_path, send_first_ring)
    out = tmp_path / "ring.png"
    assert trace.main([str(dumps), "--timeline", str(out)]) == 1
    assert png_dimensions(out) == (1200, 390)  # 3 rows


def test_trace_timeline_bad_suffix_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        trace.main([str(tmp_path), "--timeline", "out.svg"])
    assert exc.value.code == 2
    assert "must end in .json" in capsys.readouterr().err


# ---- what the picture tells apart -------------------------------------------------------------

def healthy_spans() -> list[timeline.Span]:
    program = load(PROGRAMS / "batched_exchange_pp2.json")  # all four slots, completing
    return timeline.of_simulation(program, simulate(program, timeline=True)).spans


def test_a_healthy_timeline_colours_sends_receives_forward_and_backward_each_their_own_way():
    by_op = {(s.args["kind"], s.args["slot"]): timeline.style(s) for s in healthy_spans()}
    assert set(by_op) == {("send", "send_next"), ("recv", "recv_prev"), ("send", "send_prev"), ("recv", "recv_next")}
    assert len(set(by_op.values())) == 4 and all(hatch is None for _, hatch in by_op.values()), by_op
    legend = {colour for _, colour, _ in timeline.legend_entries()}
    assert {colour for colour, _ in by_op.values()} <= legend


def test_a_cycles_op_is_red_and_an_unfinished_one_hatched_whatever_its_kind():
    span = healthy_spans()[0]
    cycle = timeline.Span(span.rank, span.lane, span.name, span.start, span.end, False, True, span.args)
    assert timeline.style(cycle) == (timeline.CYCLE_COLOUR, "//")
    unfinished = timeline.Span(span.rank, span.lane, span.name, span.start, span.end, False, False, span.args)
    assert timeline.style(unfinished) == (timeline.style(span)[0], "//")


def test_a_bar_says_the_ops_name_where_it_fits_its_kind_and_peer_where_only_that_fits_and_nothing_below():
    span = next(s for s in healthy_spans() if s.args["kind"] == "send")
    assert span.name.startswith("send -> ")
    assert timeline.bar_text(span, 400) == span.name
    assert timeline.bar_text(span, 30) == f"S{span.args['peer']}"
    assert timeline.bar_text(span, 5) == ""
