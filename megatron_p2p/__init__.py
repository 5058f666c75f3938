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
  ordering bugs show up at every tensor size; receive buffers from comm.empty(shape, dtype)
  (megatron-core's, through P2PCommunicator) lie in shared memory the peers have mapped, so a
  message into them is one memcpy by its sender;
- every wait bounded: P2PTimeoutError lists the pending ops and aborts the communicator so
  peers fail too; a dead peer raises PeerFailureError; a size or dtype disagreement raises
  MismatchError on both sides;
- deadlocks named at once (shm): ranks that are all blocked in waits, each needing the next to
  post an op it has not posted, raise DeadlockError within about 50 ms, whatever the timeout,
  with one line per rank of the cycle (op, peer, bytes, dtype, lane, message number, the call
  that posted it, and what the peer has posted); ranks only waiting on them get the same report;
- on GPUs (backend="nccl" or "auto"), NCCL grouped send/recv on dedicated CUDA streams, one
  NCCL communicator per lane, libnccl found at run time (nccl_version() says which);
  Request.wait() makes the current stream wait, Request.synchronize() blocks the host; a
  watchdog thread times the device work no host wait times, aborts and reports it (and under
  torchrun ends the process); exchanges can be captured into CUDA graphs; MEGATRON_P2P_CHECK=1
  compares every transfer's bytes, dtype and shape with its receiver's before the data moves.

Megatron drop-in (megatron-core 0.14+ and the older module-level functions):
- P2PCommunicator(pp_group, config): megatron-core's class, same methods and return values,
  to pass to its schedules as p2p_communicator= (with pg_collection=);
- patch_megatron() / unpatch_megatron(): swap it (and the legacy functions) wherever
  megatron-core binds them, and back; `with patch_megatron():` does both;
- megatron_p2p.p2p_communication: _p2p_ops, _batched_p2p_ops and the legacy functions;
- isend / irecv / batch_isend_irecv / P2POp / send / recv / send_object_list / recv_object_list
  take torch.distributed's signatures, finding the communicator of `group` (create it first:
  init_communicator(group), or register_communicator).

torch.distributed.pipelining (GPipe, 1F1B, LoopedBFS, Interleaved1F1B, InterleavedZeroBubble,
ZBVZeroBubble, DualPipeV):
- patch_pipelining(comm=None) / unpatch_pipelining(): every point-to-point call its schedules and
  stages make goes over megatron_p2p (the communicator `comm`, or each group's registered one);
  nothing else in torch.distributed changes; `with patch_pipelining():` does both.
"""
from ._C import (
    BackendUnavailableError,
    Communicator,
    DeadlockError,
    MismatchError,
    P2PError,
    P2PTimeoutError,
    PeerFailureError,
    Request,
)
from ._megatron_cpu import megatron_on_cpu
from ._version import __version__, warn_if_untested_torch
from .communicator import init_communicator
from .megatron_patch import patch_megatron, unpatch_megatron
from .nccl import NcclVersion, nccl_version
from .ops import (
    P2POp,
    batch_isend_irecv,
    get_communicator,
    irecv,
    isend,
    recv,
    recv_object_list,
    register_communicator,
    send,
    send_object_list,
)
from .p2p_communication import P2PCommunicator
from .pipelining_patch import patch_pipelining, unpatch_pipelining

warn_if_untested_torch()
del warn_if_untested_torch

__all__ = [
    "BackendUnavailableError",
    "Communicator",
    "DeadlockError",
    "MismatchError",
    "NcclVersion",
    "P2PError",
    "P2PCommunicator",
    "P2POp",
    "P2PTimeoutError",
    "PeerFailureError",
    "Request",
    "batch_isend_irecv",
    "get_communicator",
    "init_communicator",
    "irecv",
    "isend",
    "megatron_on_cpu",
    "nccl_version",
    "patch_megatron",
    "patch_pipelining",
    "recv",
    "recv_object_list",
    "register_communicator",
    "send",
    "send_object_list",
    "unpatch_megatron",
    "unpatch_pipelining",
    "__version__",
]
