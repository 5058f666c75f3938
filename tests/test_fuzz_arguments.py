"""The argument layer under random arguments (tests/workers/fuzz_arguments.py): exchange,
isend / irecv, batch_isend_irecv, the Communicator's methods, init_communicator and
P2PCommunicator, with random Python objects and tensors (strided, 0-dim, huge, every dtype,
complex, sparse, quantized, meta, nested, mkldnn, conjugate and negative views). Every call must
move exact data on both ranks, or raise TypeError / ValueError before anything is posted, and
the communicator must work afterwards."""
from __future__ import annotations

import os

from conftest import run_job

EXAMPLES = int(os.environ.get("MEGATRON_P2P_FUZZ_EXAMPLES", "300"))
APIS = ("exchange", "isend_irecv", "comm_isend_irecv", "batch_isend_irecv", "comm_batch", "init_communicator",
        "P2PCommunicator")


def test_random_arguments_move_exact_data_or_are_rejected_before_posting():
    ranks = run_job("fuzz_arguments.py", 2, {"examples": EXAMPLES, "seed": 20240610}, timeout=300).ok()
    outcomes = ranks[0]["value"]["outcomes"]
    # The draw reaches both sides of every API: calls that move data and calls that are refused.
    for api in APIS:
        assert outcomes.get(f"{api}: accepted", 0) > 0, (api, outcomes)
        assert outcomes.get(f"{api}: rejected", 0) > 0, (api, outcomes)
