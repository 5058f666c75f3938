from collections.abc import Callable, Iterable

from ._C import Communicator

def corrupt_segment(comm: Communicator, seed: int, fields: int = ...) -> list[str]: ...
def pingpong(name: str, rank: int, round_trips: int, timeout: float = ...) -> list[float]: ...

# _C.Communicator's arguments, without the backend (it is "null").
def null_communicator(
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
    on_abort: Callable[[str | None], object] | None = ...,
    check: bool = ...,
    pids: Iterable[int] | None = ...,
    peer_failed: Callable[[], str | None] | None = ...,
    arena_bytes: int = ...,
) -> Communicator: ...
