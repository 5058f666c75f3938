"""Soak: a long run of exchanges of random sizes, dtypes, modes, directions and lane counts over
every transfer path, and many communicators created and closed, carry every byte exactly and
leave each process holding what it held after its warm-up: memory, descriptors, threads and
shared-memory segments stay flat; and one communicator left open does show in those measures.

The figures are printed (`pytest -s`). `make test` runs a short soak; `make soak` raises it
through MEGATRON_P2P_SOAK_EXCHANGES and MEGATRON_P2P_SOAK_COMMUNICATORS."""
import os

import pytest
from conftest import run_job

EXCHANGES = int(os.environ.get("MEGATRON_P2P_SOAK_EXCHANGES", "3000"))
COMMUNICATORS = int(os.environ.get("MEGATRON_P2P_SOAK_COMMUNICATORS", "20"))
RANKS = int(os.environ.get("MEGATRON_P2P_SOAK_RANKS", "2"))
SEED = int(os.environ.get("MEGATRON_P2P_SOAK_SEED", "10"))
# Private memory is not exact: glibc keeps freed memory in per-thread arenas, Python keeps its
# object arenas, torch grows small caches on first use; none of it grows with the number of
# exchanges. A leak of 100 bytes per exchange passes this in the short soak, not in `make soak`.
RSS_SLACK = 4 << 20
# Under AddressSanitizer (make sanitize) freed memory waits in its quarantine (256 MiB), so memory
# says nothing there; the counts still do.
MEMORY_MEANINGFUL = not os.environ.get("MEGATRON_P2P_EXPECT_SANITIZED")
COUNTED = ("fds", "threads", "segments", "segment_mappings")
MODES = ("parity", "batched", "isend_irecv", "batch_isend_irecv")
DIRECTIONS = ("forward", "backward", "both")
PATHS = ("inline", "eager", "bounce", "single_copy")


def grown(before, after):
    """The measures that grew from `before` to `after`: any count, or private memory past the slack."""
    out = [k for k in COUNTED if after[k] > before[k]]
    if MEMORY_MEANINGFUL and after["rss_anon"] - before["rss_anon"] > RSS_SLACK:
        out.append("rss_anon")
    return out


@pytest.fixture(scope="module")
def soak():
    """The soak on RANKS ranks: each rank's result (see tests/workers/soak.py)."""
    params = {"exchanges": EXCHANGES, "communicators": COMMUNICATORS, "seed": SEED, "timeout": 120.0}
    limit = 120 + EXCHANGES / 100 + COMMUNICATORS  # generous: a loaded 2-core machine
    values = [r["value"] for r in run_job("soak.py", RANKS, params=params, timeout=limit).ok()]
    for rank, v in enumerate(values):
        print(figures(rank, v))
    return values


def figures(rank, v):
    stages = ("warm", "after_exchanges", "closed", "after_churn")
    mib = ("rss", "rss_anon", "rss_shmem", "segment_bytes")
    lines = [
        f"\nsoak rank {rank}: {EXCHANGES} exchanges ({v['messages']} ops, {v['bytes'] / 2**30:.2f} GiB) in "
        f"{v['exchange_seconds']:.1f} s = {EXCHANGES / v['exchange_seconds']:.0f} exchanges/s; {COMMUNICATORS} "
        f"communicators created and closed in {v['churn_seconds']:.1f} s",
        f"  {'':>16}" + "".join(f"{s:>19}" for s in stages),
    ]
    for k in mib + COUNTED:
        cells = [f"{v[s][k] / 2**20:.1f} MiB" if k in mib else str(v[s][k]) for s in stages]
        lines.append(f"  {k:>16}" + "".join(f"{c:>19}" for c in cells))
    lines.append(f"  ops by path: { {p: v['counts'].get('path:' + p, 0) for p in PATHS} }")
    return "\n".join(lines)


def test_every_mode_direction_path_and_lane_count_is_exercised(soak):
    """The random schedule reaches every mode, direction, transfer path and communicator kind,
    and the single-copy communicators do copy once (the others use the bounce buffer)."""
    for v in soak:
        counts = v["counts"]
        wanted = [f"mode:{m}" for m in MODES] + [f"direction:{d}" for d in DIRECTIONS] + [f"path:{p}" for p in PATHS]
        assert [k for k in wanted if not counts.get(k)] == [], counts
        assert sum(1 for k in counts if k.startswith("config:")) == 8, counts
        for name, single_copy in v["single_copy"].items():
            assert single_copy == name.endswith("single_copy"), v["single_copy"]


def test_every_message_arrives_exactly(soak):
    """Every receive matched its sender's bytes exactly, with the guard bytes around it intact
    (a rank raises at the first wrong byte), and the ranks agree on what was carried."""
    assert len({(v["messages"], v["bytes"]) for v in soak}) == 1
    assert soak[0]["messages"] >= EXCHANGES * 2


def test_a_wrong_byte_or_a_write_outside_the_tensor_is_reported(soak):
    """The checker's twin: an exact copy passes it; one byte off inside the tensor, or one
    byte written just past it, fails it."""
    for v in soak:
        caught = v["verify_catches"]
        assert caught["exact"] == "", caught
        assert "differ" in caught["one_byte_off"], caught
        assert "outside its tensor" in caught["guard_written"], caught


def test_exchanges_leave_the_process_as_the_warm_up_left_it(soak):
    """No descriptor, thread, segment or mapping more, private memory within the slack; shared
    pages grow only inside the segments already mapped (first touches of bounce buffers and
    descriptor slots)."""
    for rank, v in enumerate(soak):
        before, after = v["warm"], v["after_exchanges"]
        assert grown(before, after) == [], figures(rank, v)
        assert after["segment_bytes"] == before["segment_bytes"] and after["rss_shmem"] <= after["segment_bytes"]


def test_creating_and_closing_communicators_leaves_nothing(soak):
    """Closing releases every segment and its pages; creating and closing many more communicators
    leaves counts and memory where closing left them."""
    for rank, v in enumerate(soak):
        before, after = v["closed"], v["after_churn"]
        assert before["segments"] == before["segment_mappings"] == before["rss_shmem"] == 0, figures(rank, v)
        assert grown(before, after) == [], figures(rank, v)
        assert not MEMORY_MEANINGFUL or after["rss"] - before["rss"] <= RSS_SLACK, figures(rank, v)


def test_a_communicator_left_open_is_reported(soak):
    """The twin: one communicator kept open after the churn shows as its progress thread and its
    mapping (and whatever descriptor it keeps), so the measures above can see a leak."""
    for v in soak:
        found = grown(v["after_churn"], v["with_one_open"])
        assert {"threads", "segment_mappings"} <= set(found) <= {"threads", "segment_mappings", "fds"}, found
