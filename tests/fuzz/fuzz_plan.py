"""atheris target: the plan of one exchange (csrc/core/plan.c, through _C.plan). Any mode, lane
count, rank, op names and self flags: a ValueError for a name or mode it does not know, else a
plan where every op posted appears once, on its own lane, lane 0's steps come before lane 1's
(one lane order on every rank, as NCCL needs of communicators sharing a device), a self send
shares its step with its receive, and batched mode issues one step per lane. Anything else is a
finding.

    python tests/fuzz/fuzz_plan.py -max_total_time=60 WORK_DIR tests/fuzz/corpus/plan
"""
from __future__ import annotations

import sys

import atheris

from megatron_p2p import _C

SLOTS = ("send_next", "recv_prev", "send_prev", "recv_next")
FORWARD = ("send_next", "recv_prev")
INT32 = (-2 ** 31, 2 ** 31 - 1)


@atheris.instrument_func
def draw(fdp: atheris.FuzzedDataProvider) -> tuple[str, int, int, list[str], bool, bool]:
    mode = ("parity", "batched")[fdp.ConsumeIntInRange(0, 1)] if fdp.ConsumeBool() else fdp.ConsumeUnicodeNoSurrogates(8)
    lanes = fdp.ConsumeIntInRange(*INT32)
    rank = fdp.ConsumeIntInRange(*INT32)
    names = [SLOTS[fdp.ConsumeIntInRange(0, 3)] if fdp.ConsumeProbability() < 0.9 else fdp.ConsumeUnicodeNoSurrogates(10)
             for _ in range(fdp.ConsumeIntInRange(0, 6))]
    return mode, lanes, rank, names, fdp.ConsumeBool(), fdp.ConsumeBool()


@atheris.instrument_func
def check(data: bytes) -> None:
    mode, lanes, rank, names, prev_self, next_self = draw(atheris.FuzzedDataProvider(data))
    try:
        steps = _C.plan(mode, lanes, rank, names, prev_self, next_self)
    except ValueError:
        if mode in ("parity", "batched") and all(n in SLOTS for n in names):
            raise
        return
    planned = [op for _, ops in steps for op in ops]
    if sorted(planned) != sorted(set(names)):
        raise AssertionError(f"plan {steps} does not post each of {sorted(set(names))} once")
    two = lanes >= 2
    for lane, ops in steps:
        if not ops or any(lane != (1 if two and op not in FORWARD else 0) for op in ops):
            raise AssertionError(f"step {ops} on lane {lane} (lanes={lanes})")
    issued = [lane for lane, _ in steps]
    if issued != sorted(issued):
        raise AssertionError(f"lane 1 issued before lane 0: {steps}")
    step_of = {op: i for i, (_, ops) in enumerate(steps) for op in ops}
    if prev_self and next_self:  # a one-rank ring: each send's receive is this rank's own
        for send, recv in (("send_next", "recv_prev"), ("send_prev", "recv_next")):
            if send in step_of and recv in step_of and step_of[send] != step_of[recv]:
                raise AssertionError(f"a self send and its receive are in different steps: {steps}")
    if mode == "batched" and len({lane for lane, _ in steps}) != len(steps):
        raise AssertionError(f"batched mode issued a lane in several steps: {steps}")


def main() -> None:
    atheris.Setup(sys.argv, check)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
