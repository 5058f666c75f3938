"""The shape round of variable_seq_lengths, without buffering: each 64-byte shape header travels
right ahead of its tensor, in the exchange's own steps.

Before P2PCommunicator can post a data receive it needs the tensor's shape. megatron-core sends
every header of a call in a round of its own, before the data; under rendezvous (shm with
eager_threshold 0, NCCL without the buffering it does not promise) that round can wait on a
header send whose receive the peer posts only after data this rank has not yet received, and the
interleaved schedule deadlocks (Megatron-LM #5100; megatron_p2p/programs/
megatron_shape_round_pp2.json is megatron-core's round).

Here the exchange keeps its plan (csrc/core/plan.c: the steps parity or batched mode issues on
each lane) and each step carries its own headers:

- a step with receives is preceded, on its lane, by a step of their headers' receives, which
  the rank waits for (it needs the shapes to allocate the buffers);
- in the step itself each send is preceded by its header, to the same peer on the same lane.

A header and its tensor are thus posted on one channel, one after the other, by both ranks, and
the step order is the plan's. What a step waits for is what it waited for without the headers:
the header receive waits for the peer's step that holds the matching send, as the data receive
did. `python -m megatron_p2p.check --grid --reduced` proves megatron-core's schedules free of
deadlock with it under strict rendezvous, with and without lanes serialized.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence

from . import _C

SENDS = tuple(s for s in _C.SLOT_NAMES if s.startswith("send_"))  # the C core's slot names
RECVS = tuple(s for s in _C.SLOT_NAMES if s.startswith("recv_"))


def round_steps(plan: Sequence[tuple[int, Sequence[str]]]) -> Iterator[tuple[bool, int, list[tuple[str, bool]]]]:
    """The steps of an exchange with its shape headers, from the exchange's parity plan
    [(lane, slots)]: (headers, lane, ops), each op (slot, is_header). headers=True: the receives
    of the next step's headers, to be waited for before it is posted; False: the plan's step,
    each send preceded by its header."""
    for lane, slots in plan:
        recvs = [(s, True) for s in slots if s in RECVS]
        if recvs:
            yield True, lane, recvs
        yield False, lane, [op for s in slots for op in (((s, True), (s, False)) if s in SENDS else ((s, False),))]
