"""`make test-stress`: the timing-sensitive tests, repeated while CPU-bound processes keep every
core busy, so that a test assuming a timing fails here before CI meets it.

The burners run at the suite's own priority: a busy CI machine does not lower its other jobs'
priority either. Each round is one pytest run of STRESS_FILES; the summary lists every test that
failed in any round, with how often.

    python tests/stress.py [--rounds N] [--burners N] [pytest arguments...]
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The files whose tests carry a deadline ("within N s") or race a peer's death, a signal or a
# thread against the transport.
STRESS_FILES = [
    "tests/test_deadlock.py",
    "tests/test_failures.py",
    "tests/test_faults.py",
    "tests/test_interrupts.py",
    "tests/test_nccl_graph_rules.py",
    "tests/test_nccl_model.py",
    "tests/test_nccl_model_suites.py",
    "tests/test_peer_death.py",
    "tests/test_schedules.py",
    "tests/test_watchdog.py",
]

_FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.MULTILINE)


def _start_burners(count: int) -> list[subprocess.Popen]:
    # Each in a session of its own, so that a Ctrl-C test's SIGINT to its group cannot reach them.
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
            for _ in range(count)]


def _stop(burners: list[subprocess.Popen]) -> None:
    for proc in burners:
        proc.kill()
    for proc in burners:
        proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="pytest runs of the files (default 3)")
    parser.add_argument("--burners", type=int, default=os.cpu_count() or 2,
                        help="CPU-bound processes beside the tests (default: one per core)")
    args, pytest_args = parser.parse_known_args()
    if args.rounds < 1 or args.burners < 0:
        parser.error(f"--rounds must be >= 1 and --burners >= 0, got {args.rounds} and {args.burners}")

    failures: Counter[str] = Counter()
    burners = _start_burners(args.burners)
    try:
        for round_no in range(1, args.rounds + 1):
            started = time.monotonic()
            run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE",
                                  *pytest_args, *STRESS_FILES], cwd=ROOT, capture_output=True, text=True)
            found = _FAILED.findall(run.stdout)
            failures.update(found)
            tail = run.stdout.strip().splitlines()[-1:] or ["(no output)"]
            print(f"round {round_no}/{args.rounds} beside {args.burners} burners, "
                  f"{time.monotonic() - started:.0f} s: {tail[0]}", flush=True)
            if run.returncode not in (0, 1):  # 1: tests failed; anything else: pytest itself did
                print(run.stdout[-4000:], run.stderr[-4000:], sep="\n", file=sys.stderr)
                return run.returncode
    finally:
        _stop(burners)
    for test, count in sorted(failures.items()):
        print(f"  failed {count}/{args.rounds}: {test}")
    print("no test failed in any round" if not failures else f"{len(failures)} tests failed in some round")
    return 1 if failures else 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a killed run still stops its burners
    sys.exit(main())
