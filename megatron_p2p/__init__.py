"""megatron_p2p: pipeline-parallel point-to-point communication for Megatron-style training.

    comm = megatron_p2p.init_communicator(group=None, backend="shm", timeout=30.0)
    reqs = comm.exchange(send_next=act, recv_prev=act_buf, send_prev=grad, recv_next=grad_buf,
                         mode="parity")          # or "batched"
    for r in reqs.values():
        r.wait()

What you get:
- one C call per pipeline exchange, in Megatron's parity order or as groups, with the two
  directions on independent lanes so activations and gradients never cross (also at PP=2);
- a shared-memory CPU transport with NCCL's semantics (strict rendezvous by default), so
  ordering bugs show up at every tensor size;
- every wait bounded: P2PTimeoutError lists the pending ops and aborts the communicator so
  peers fail too; a dead peer raises PeerFailureError; a size or dtype disagreement raises
  MismatchError on both sides.
"""
from ._C import (
    BackendUnavailableError,
    Communicator,
    MismatchError,
    P2PError,
    P2PTimeoutError,
    PeerFailureError,
    Request,
)
from .communicator import init_communicator
from .ops import P2POp, batch_isend_irecv, irecv, isend

__all__ = [
    "BackendUnavailableError",
    "Communicator",
    "MismatchError",
    "P2PError",
    "P2POp",
    "P2PTimeoutError",
    "PeerFailureError",
    "Request",
    "batch_isend_irecv",
    "init_communicator",
    "irecv",
    "isend",
]
