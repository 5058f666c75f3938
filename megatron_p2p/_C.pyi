from collections.abc import Callable, Iterable, Sequence
from typing import Final, Literal, NotRequired, Self, TypeAlias, TypedDict, final, type_check_only

import torch
from typing_extensions import CapsuleType

# simulate()'s op: (rank, call, step, index, seq, kind, peer, lane, bytes, dtype, slot, label,
# partner_state, partner_posted, posted_round, done_round); -1: never.
_SimOp: TypeAlias = tuple[int, int, int, int, int, int, int, int, int, int, int, int, int, int, int, int]
_SimResult: TypeAlias = tuple[
    str,  # verdict: 'ok', 'deadlock' or 'mismatch'
    int,  # rounds
    tuple[_SimOp, _SimOp] | None,  # mismatch: (send, recv)
    list[tuple[_SimOp, int]],  # cycle: (op, waits_for_rank)
    bool,  # cycle_closed
    list[_SimOp],  # pending
    int,  # num_pending
    list[_SimOp],  # ops
]
# _nccl_issue_trace()'s calls: ('group_start',), ('group_end', lane),
# ('send' | 'recv', lane, peer, count, nccl_datatype, index).
_NcclCall: TypeAlias = tuple[str] | tuple[str, int] | tuple[str, int, int, int, int, int]
# cycle_report()'s rank: (rank, peer, pid, kind, what, nbytes, dtype, lane, message, call, label,
# partner_posted, lanes_serialized, partner_count)
_CycleRank: TypeAlias = tuple[int, int, int, str, str, int, str, int, int, str, str, bool, bool, int]

# exchange()'s tensors by slot, for callers that gather them in a dict; None: the slot is unused.
@type_check_only
class _ExchangeTensors(TypedDict, total=False):
    send_next: torch.Tensor | None
    recv_prev: torch.Tensor | None
    send_prev: torch.Tensor | None
    recv_next: torch.Tensor | None

@type_check_only
class _ReceivedByPath(TypedDict):
    inline: int
    single_copy: int
    bounce: int
    arena: int

@type_check_only
class _Stats(TypedDict):
    sends: int
    recvs: int
    bytes_sent: int
    bytes_received: int
    wait_seconds: float
    received_by_path: NotRequired[_ReceivedByPath]  # shm only

@type_check_only
class _RecentOp(TypedDict):
    kind: str
    label: str
    peer: int
    nbytes: int
    dtype: str
    lane: int
    step: int
    seq: int
    group_size: int
    call: int
    call_name: str
    state: str
    error: str
    t_posted: float
    t_completed: float | None
    waited: bool

class P2PError(RuntimeError): ...
class P2PTimeoutError(P2PError, TimeoutError): ...
class DeadlockError(P2PTimeoutError): ...
class MismatchError(P2PError): ...
class PeerFailureError(P2PError): ...
class BackendUnavailableError(P2PError): ...

DTYPE_NAMES: Final[tuple[str, ...]]
SLOT_NAMES: Final[tuple[str, str, str, str]]
MODE_NAMES: Final[tuple[str, str]]
MAX_LANES: Final[int]
DEFAULT_ARENA_BYTES: Final[int]
MAX_ARENA_BYTES: Final[int]
ARENA_WAIT_BYTES: Final[int]
MAX_EAGER_THRESHOLD: Final[int]
_C_API: Final[CapsuleType]

def _after_fork_in_child() -> None: ...
def new_unique_id() -> str: ...
def check_tensor(tensor: torch.Tensor, name: str = ..., device: int = ...) -> None: ...
def plan(
    mode: str, lanes: int, rank: int, ops: Iterable[str], prev_is_self: bool = ..., next_is_self: bool = ...
) -> list[tuple[int, tuple[str, ...]]]: ...
def nccl_load(env_path: str | None, bundled: Iterable[str]) -> tuple[int, str, str]: ...
def nccl_unique_id() -> bytes: ...
def _nccl_issue_trace(
    steps: Iterable[tuple[int, Sequence[tuple[bool, int, int, int]]]], nccl_version: int, /
) -> list[_NcclCall]: ...
def cycle_report(ranks: Sequence[_CycleRank], /) -> str: ...
def simulate(
    size: int,
    lanes: int,
    eager_threshold: int,
    streams: tuple[bytes, ...],
    details: bool = ...,
    serialize_lanes: bool = ...,
    timeline: bool = ...,
) -> _SimResult: ...

@final
class Communicator:
    def __new__(
        cls,
        backend: str,
        unique_id: str | bytes,
        group_rank: int,
        ranks: Iterable[int],
        *,
        lanes: int = ...,
        eager_threshold: int = ...,
        timeout: float = ...,
        single_copy: bool = ...,
        device: int = ...,
        stream: Callable[[], int] | None = ...,
        high_priority: bool = ...,
        # None only when the message itself could not be built
        on_abort: Callable[[str | None], object] | None = ...,
        check: bool = ...,
        pids: Iterable[int] | None = ...,
        peer_failed: Callable[[], str | None] | None = ...,
        arena_bytes: int = ...,
    ) -> Self: ...
    def exchange(
        self,
        send_next: torch.Tensor | None = ...,
        recv_prev: torch.Tensor | None = ...,
        send_prev: torch.Tensor | None = ...,
        recv_next: torch.Tensor | None = ...,
        *,
        mode: str = ...,
        prev_rank: int | None = ...,
        next_rank: int | None = ...,
        call: str | None = ...,
    ) -> dict[str, Request]: ...
    def isend(self, tensor: torch.Tensor, peer: int, *, call: str | None = ...) -> Request: ...
    def irecv(self, tensor: torch.Tensor, peer: int, *, call: str | None = ...) -> Request: ...
    def batch(
        self, ops: Iterable[tuple[bool, torch.Tensor, int]], *, lane: int = ..., call: str | None = ...
    ) -> list[Request]: ...
    def abort(
        self, *, rank: int | None = ..., reason: str | None = ..., peer_failed: bool = ..., deadlock: bool = ...
    ) -> None: ...
    def close(self) -> None: ...
    def stats(self) -> _Stats: ...
    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor: ...
    def recent_ops(self) -> list[_RecentOp]: ...
    def watchdog_check(self) -> P2PError | None: ...
    def check_tensor(self, tensor: torch.Tensor, name: str = ..., /) -> None: ...
    def single_copy(self, peer: int, /) -> bool: ...
    def __enter__(self) -> Self: ...
    def __exit__(self, *args: object) -> Literal[False]: ...
    @property
    def rank(self) -> int: ...
    @property
    def global_rank(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def ranks(self) -> tuple[int, ...]: ...
    @property
    def prev_rank(self) -> int: ...
    @property
    def next_rank(self) -> int: ...
    @property
    def lanes(self) -> int: ...
    @property
    def timeout(self) -> float: ...
    @property
    def eager_threshold(self) -> int: ...
    @property
    def buffered_at_most(self) -> int: ...
    @property
    def backend(self) -> str: ...
    @property
    def arena_bytes(self) -> int: ...
    @property
    def device(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    @property
    def host_waiting(self) -> bool: ...
    @property
    def id(self) -> str: ...
    @property
    def group_picture(self) -> str | None: ...
    @group_picture.setter
    def group_picture(self, value: str | None) -> None: ...
    @group_picture.deleter
    def group_picture(self) -> None: ...
    @property
    def on_error(self) -> Callable[[P2PError], object] | None: ...
    @on_error.setter
    def on_error(self, value: Callable[[P2PError], object] | None) -> None: ...
    @on_error.deleter
    def on_error(self) -> None: ...

@final
class Request:
    def wait(self, timeout: float | None = ...) -> Literal[True]: ...
    def synchronize(self, timeout: float | None = ...) -> Literal[True]: ...
    def is_completed(self) -> bool: ...
    @property
    def label(self) -> str: ...
    @property
    def peer(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def lane(self) -> int: ...
    @property
    def seq(self) -> int: ...
    @property
    def is_send(self) -> bool: ...
    @property
    def tensor(self) -> torch.Tensor: ...
