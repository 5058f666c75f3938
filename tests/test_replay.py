"""The replayer runs program files on the shm transport and reaches the checker's verdict:
programs that complete under the simulated semantics complete with exact bytes, those that
deadlock raise DeadlockError naming the cycle, those whose pairs disagree raise MismatchError.
One torchrun job replays the shipped bug files and a set of random programs (20 here;
MEGATRON_P2P_VERIFY_REPLAYS raises the count, as `make verify` does)."""
import json
import os
from pathlib import Path

import pytest
from conftest import run_in_session, run_job
from random_programs import random_program

from megatron_p2p import program, simulate

PROGRAMS = Path(__import__("megatron_p2p").__path__[0]) / "programs"
COUNT = int(os.environ.get("MEGATRON_P2P_VERIFY_REPLAYS", "20"))
WORLD = 6  # the largest random program


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    """{file: (check's verdict, replay's verdict, replay's record)} for every replayed file."""
    tmp = tmp_path_factory.mktemp("programs")
    files = sorted(str(p) for p in PROGRAMS.glob("*.json"))
    for seed in range(COUNT):
        path = tmp / f"random{seed}.json"
        path.write_text(program.dumps(random_program(seed)))
        files.append(str(path))
    checked = {f: simulate.simulate(program.load(f)).verdict for f in files}
    job = run_job("replay_files.py", WORLD, params={"files": files, "timeout": 30.0}, timeout=120 + 10 * len(files))
    replayed = {}
    for line in job.output.splitlines():
        if line.startswith('{"file"'):
            record = json.loads(line)
            replayed[record["file"]] = record
    assert set(replayed) == set(files), f"no verdict for {set(files) - set(replayed)}\n{job.output[-4000:]}"
    return {f: (checked[f], replayed[f]["verdict"], replayed[f]) for f in files}


def test_shipped_bug_files_replay_as_deadlock_and_mismatch(verdicts):
    by_name = {Path(f).name: v for f, v in verdicts.items()}
    assert by_name["naive_send_first_ring.json"][1] == "deadlock"
    assert by_name["megatron_batched_order_pp2.json"][1] == "mismatch"
    assert by_name["parity_ring.json"][1] == "ok"


def test_replay_reaches_the_checkers_verdict_on_every_file(verdicts):
    disagree = {Path(f).name: (c, r, rec["errors"]) for f, (c, r, rec) in verdicts.items() if c != r}
    assert not disagree, disagree


def test_random_programs_cover_every_verdict(verdicts):
    """The agreement above means something only if the mix holds each verdict."""
    seen = {c for f, (c, _, _) in verdicts.items() if "random" in Path(f).name}
    assert seen == {"ok", "deadlock", "mismatch"}, seen


def test_a_deadlock_replay_names_the_cycle_well_before_the_timeout(verdicts):
    record = next(rec for f, (c, r, rec) in verdicts.items() if Path(f).name == "naive_send_first_ring.json")
    messages = "\n".join(record["errors"].values())
    assert "DeadlockError" in messages and "deadlock: ranks 0 -> 1 -> 2 -> 3 -> 0" in messages, messages


def replay_command(*files: Path, limit: float = 120.0) -> tuple[int, str, str]:
    """`python -m megatron_p2p.replay FILE...` as a user types it (it starts its own torchrun)."""
    import sys

    done = run_in_session([sys.executable, "-m", "megatron_p2p.replay", *map(str, files)], limit)
    return done.returncode, done.stdout, done.stderr


@pytest.mark.torchrun
def test_the_replay_command_ends_with_the_verdict_and_exits_with_it():
    code, out, err = replay_command(PROGRAMS / "torch_defer_pp_recv_interleaved_pp2.json")
    assert code == 1, out + err
    lines = out.rstrip().splitlines()
    assert lines[0].endswith("torch_defer_pp_recv_interleaved_pp2.json: DEADLOCK (ranks 0, 1)"), out
    assert "Traceback" not in err and "ChildFailedError" not in err, err[-3000:]


@pytest.mark.torchrun
def test_the_replay_command_of_a_completing_program_says_ok_and_exits_0():
    code, out, err = replay_command(PROGRAMS / "torch_interleaved_pp2.json")
    assert code == 0 and out.rstrip().splitlines()[-1] == "replay: ok", out + err
