"""What the fake libcuda and libnccl promise about CUDA stream capture and graphs, observed
through ctypes (no torch, no package): prints one JSON object of observations for
tests/test_nccl_model_capture.py. Run in a process of its own, since it loads a library named
libcuda.so.1.

    nccl_model_capture_promises.py FAKES LOG            the single-process observations
    nccl_model_capture_promises.py FAKES LOG RANK IDFILE one of two ranks replaying a captured exchange
"""
import ctypes
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

fakes, log_path = sys.argv[1], sys.argv[2]
os.environ["MPFAKE_CUDA_CAPTURE_LOG"] = log_path
cuda = ctypes.CDLL(f"{fakes}/libcuda.so.1", mode=ctypes.RTLD_GLOBAL)
nccl = ctypes.CDLL(f"{fakes}/libnccl.so.2")
p = ctypes.c_void_p
KERNEL = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
GLOBAL, THREAD_LOCAL, RELAXED = 0, 1, 2

SIGNATURES: dict[str, list[Any]] = {
    "cuCtxSetCurrent": [p], "cuStreamCreateWithPriority": [ctypes.POINTER(p), ctypes.c_uint, ctypes.c_int],
    "cuEventCreate": [ctypes.POINTER(p), ctypes.c_uint], "cuEventRecord": [p, p], "cuEventQuery": [p],
    "cuEventSynchronize": [p], "cuStreamWaitEvent": [p, p, ctypes.c_uint], "cuStreamSynchronize": [p],
    "cuStreamQuery": [p], "cuMemAlloc_v2": [ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_size_t],
    "cuStreamBeginCapture_v2": [p, ctypes.c_int], "cuStreamEndCapture": [p, ctypes.POINTER(p)],
    "cuStreamIsCapturing": [p, ctypes.POINTER(ctypes.c_int)],
    "cuStreamGetCaptureInfo_v2": [p, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_ulonglong), p, p, p],
    "cuThreadExchangeStreamCaptureMode": [ctypes.POINTER(ctypes.c_int)],
    "cuGraphInstantiateWithFlags": [ctypes.POINTER(p), p, ctypes.c_ulonglong], "cuGraphLaunch": [p, p],
    "cuGraphExecDestroy": [p], "cuGraphDestroy": [p], "mpfake_stream_enqueue": [p, p, KERNEL, p],
}
for name, argtypes in SIGNATURES.items():
    getattr(cuda, name).argtypes = argtypes

assert cuda.cuInit(0) == 0
ctx = p()
assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
assert cuda.cuCtxSetCurrent(ctx) == 0
kernels: list[Any] = []  # ctypes callbacks must outlive every replay


def stream(blocking: bool = False) -> p:
    s = p()
    assert cuda.cuStreamCreateWithPriority(ctypes.byref(s), 0 if blocking else 1, 0) == 0
    return s


def event() -> p:
    e = p()
    assert cuda.cuEventCreate(ctypes.byref(e), 2) == 0
    return e


def kernel(s: p | None, body: Callable[[], None]) -> int:
    k = KERNEL(lambda _: body())
    kernels.append(k)
    return cuda.mpfake_stream_enqueue(ctx, s, k, None)


def status(s: p) -> int:
    st = ctypes.c_int(-1)
    assert cuda.cuStreamIsCapturing(s, ctypes.byref(st)) == 0
    return st.value


def begin(s: p, mode: int = GLOBAL) -> None:
    assert cuda.cuStreamBeginCapture_v2(s, mode) == 0


def end(s: p) -> tuple[int, p]:
    g = p()
    return cuda.cuStreamEndCapture(s, ctypes.byref(g)), g


def instantiate(g: p) -> p:
    x = p()
    assert cuda.cuGraphInstantiateWithFlags(ctypes.byref(x), g, 0) == 0
    return x


def exchange_mode(mode: int) -> int:
    m = ctypes.c_int(mode)
    assert cuda.cuThreadExchangeStreamCaptureMode(ctypes.byref(m)) == 0
    return m.value


def in_thread(fn: Callable[[], Any]) -> Any:
    """Runs fn on a new thread that has the context current."""
    box: list[Any] = []

    def main() -> None:
        assert cuda.cuCtxSetCurrent(ctx) == 0
        box.append(fn())

    t = threading.Thread(target=main)
    t.start()
    t.join()
    return box[0]


def log_lines() -> list[str]:
    if not os.path.exists(log_path):
        return []
    with open(log_path) as f:
        lines = f.read().splitlines()
    os.remove(log_path)
    return lines


# ---- capture and replay ----------------------------------------------------------------------------

def captured_work_runs_only_when_launched() -> dict:
    s, ran = stream(), []
    before = status(s)
    begin(s)
    during = status(s)
    enqueued = kernel(s, lambda: ran.append(1))
    time.sleep(0.05)
    ran_during_capture = len(ran)
    r, g = end(s)
    x = instantiate(g)
    for _ in range(3):
        assert cuda.cuGraphLaunch(x, s) == 0
    assert cuda.cuStreamSynchronize(s) == 0
    assert cuda.cuGraphExecDestroy(x) == 0 and cuda.cuGraphDestroy(g) == 0
    return {"before": before, "during": during, "after": status(s), "enqueued": enqueued,
            "ran_during_capture": ran_during_capture, "end": r, "runs_after_3_launches": len(ran)}


def capture_ids_are_unique() -> dict:
    s, ids = stream(), []
    for _ in range(2):
        begin(s)
        st, cid = ctypes.c_int(), ctypes.c_ulonglong()
        assert cuda.cuStreamGetCaptureInfo_v2(s, ctypes.byref(st), ctypes.byref(cid), None, None, None) == 0
        ids.append((st.value, cid.value))
        assert end(s)[0] == 0
    return {"ids": ids}


def fork_join(join_back: bool) -> dict:
    """origin: A, record e1; side waits e1: B (slow), record e2; origin waits e2 (if join_back): C."""
    origin, side, e1, e2, order = stream(), stream(), event(), event(), []
    begin(origin)
    kernel(origin, lambda: order.append("A"))
    assert cuda.cuEventRecord(e1, origin) == 0
    assert cuda.cuStreamWaitEvent(side, e1, 0) == 0
    side_joined = status(side)
    def slow_b() -> None:
        time.sleep(0.02)
        order.append("B")

    kernel(side, slow_b)
    assert cuda.cuEventRecord(e2, side) == 0
    if join_back:
        assert cuda.cuStreamWaitEvent(origin, e2, 0) == 0
    kernel(origin, lambda: order.append("C"))
    end_on_side = end(side)[0]
    r, g = end(origin)
    out = {"side_joined": side_joined, "end_on_side": end_on_side, "end": r, "graph": bool(g.value),
           "side_after": status(side), "ran_during_capture": list(order)}
    if r == 0:
        x = instantiate(g)
        for _ in range(3):
            assert cuda.cuGraphLaunch(x, origin) == 0
            kernel(origin, lambda: order.append("after"))
        assert cuda.cuStreamSynchronize(origin) == 0
        out["order"] = list(order)
    return out


def end_capture_from_another_thread(mode: int) -> dict:
    s = stream()
    begin(s, mode)
    r = in_thread(lambda: end(s)[0])
    still = status(s)
    if still:
        assert end(s)[0] == 0
    return {"end": r, "status_after": still}


# ---- what a capture refuses ------------------------------------------------------------------------

def refused_then_allowed(call: Callable[[p, p], int]) -> dict:
    """call(stream, captured_event) during the capture, then again after it ended."""
    s, e = stream(), event()
    begin(s)
    assert cuda.cuEventRecord(e, s) == 0
    during = call(s, e)
    status_after = status(s)
    later = kernel(s, lambda: None)
    r, _ = end(s)
    return {"during": during, "status": status_after, "later_work": later, "end": r, "after_end": call(s, e)}


def unsafe_call_across_threads(capture_mode: int, call: Callable[[], int]) -> dict:
    """call() from another thread (GLOBAL mode, then RELAXED) and from the capturing thread."""
    s, out = stream(), {}
    begin(s, capture_mode)
    out["other_thread_relaxed"] = in_thread(lambda: (exchange_mode(RELAXED), call())[1])
    out["status_after_relaxed"] = status(s)
    out["other_thread_global"] = in_thread(call)
    out["status_after_global"] = status(s)
    out["capturing_thread"] = call()
    out["status_after_own"] = status(s)
    previous = exchange_mode(RELAXED)
    out["capturing_thread_relaxed"] = call()
    exchange_mode(previous)
    out["end"] = end(s)[0]
    return out


def waits_across_the_capture_boundary() -> dict:
    s, other, outside, never, inside = stream(), stream(), event(), event(), event()
    assert cuda.cuEventRecord(outside, other) == 0
    assert cuda.cuStreamSynchronize(other) == 0
    out = {}
    begin(s)
    out["never_recorded"] = cuda.cuStreamWaitEvent(s, never, 0)
    assert cuda.cuEventRecord(inside, s) == 0
    out["recorded_inside"] = cuda.cuStreamWaitEvent(s, inside, 0)
    out["status_before"] = status(s)
    out["recorded_outside"] = cuda.cuStreamWaitEvent(s, outside, 0)
    out["status_after"] = status(s)
    out["end"] = end(s)[0]
    a, b, in_a = stream(), stream(), event()
    begin(a)
    begin(b)
    assert cuda.cuEventRecord(in_a, a) == 0
    out["other_capture"] = cuda.cuStreamWaitEvent(b, in_a, 0)
    out["merge_ends"] = [end(a)[0], end(b)[0]]
    return out


def legacy_stream_during_capture(blocking: bool) -> dict:
    s, ran = stream(blocking), []
    begin(s)
    out = {"legacy_work": kernel(None, lambda: ran.append(1))}
    out["end"] = end(s)[0]
    assert cuda.cuStreamSynchronize(None) == 0
    out["ran"] = len(ran)
    return out


def null_stream_capture() -> dict:
    return {"begin": cuda.cuStreamBeginCapture_v2(None, GLOBAL)}


# ---- libnccl under capture -------------------------------------------------------------------------

class Config(ctypes.Structure):
    _fields_ = [("size", ctypes.c_size_t), ("magic", ctypes.c_uint), ("version", ctypes.c_uint),
                ("blocking", ctypes.c_int)]


class UniqueId(ctypes.Structure):  # passed by value
    _fields_ = [("internal", ctypes.c_char * 128)]


nccl.ncclCommInitRankConfig.argtypes = [ctypes.POINTER(p), ctypes.c_int, UniqueId, ctypes.c_int, ctypes.c_void_p]
nccl.ncclSend.argtypes = [p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, p, p]
nccl.ncclRecv.argtypes = nccl.ncclSend.argtypes
nccl.ncclCommGetAsyncError.argtypes = [p, ctypes.POINTER(ctypes.c_int)]
nccl.ncclGetLastError.argtypes = [p]
nccl.ncclGetLastError.restype = ctypes.c_char_p
UINT8 = 1


def communicator(nranks: int = 1, rank: int = 0, uid: UniqueId | None = None, blocking: bool = True) -> p:
    if uid is None:
        uid = UniqueId()
        assert nccl.ncclGetUniqueId(ctypes.byref(uid)) == 0
    comm = p()
    cfg = Config(ctypes.sizeof(Config), 0xcafebeef, 21400, int(blocking))
    r = nccl.ncclCommInitRankConfig(ctypes.byref(comm), nranks, uid, rank, ctypes.byref(cfg))
    while r == 7:
        time.sleep(0.001)
        st = ctypes.c_int()
        assert nccl.ncclCommGetAsyncError(comm, ctypes.byref(st)) == 0
        r = st.value
    assert r == 0, r
    return comm


def settle(comm: p) -> int:
    st = ctypes.c_int(7)
    while st.value == 7:
        assert nccl.ncclCommGetAsyncError(comm, ctypes.byref(st)) == 0
        time.sleep(0.001)
    return st.value


def exchange(comm: p, s: p, src: Any, dst: Any, peer: int) -> int:
    assert nccl.ncclGroupStart() == 0
    assert nccl.ncclSend(src, len(src), UINT8, peer, comm, s) == 0
    assert nccl.ncclRecv(dst, len(dst), UINT8, peer, comm, s) == 0
    return nccl.ncclGroupEnd()


def captured_self_exchange_replays(replays: int) -> dict:
    comm, s = communicator(), stream()
    src, dst = (ctypes.c_uint8 * 16)(), (ctypes.c_uint8 * 16)()
    begin(s)
    group = exchange(comm, s, src, dst, 0)
    time.sleep(0.02)
    moved_during_capture = any(dst)
    r, g = end(s)
    x = instantiate(g)
    delivered = []
    for i in range(replays):
        ctypes.memmove(src, bytes([(i + j) % 256 for j in range(16)]), 16)
        assert cuda.cuGraphLaunch(x, s) == 0
        assert cuda.cuStreamSynchronize(s) == 0
        delivered.append(bytes(dst) == bytes(src))
    ctypes.memset(dst, 0, 16)
    eager = exchange(comm, s, src, dst, 0)
    assert cuda.cuStreamSynchronize(s) == 0
    assert cuda.cuGraphExecDestroy(x) == 0 and cuda.cuGraphDestroy(g) == 0
    return {"group_end": group, "moved_during_capture": moved_during_capture, "end": r,
            "replays_delivered": sum(delivered), "eager_after": eager, "eager_delivered": bytes(dst) == bytes(src)}


def group_across_captures(same_capture: bool) -> dict:
    """One communicator's send on the capturing stream, its receive on a second stream: joined into
    the same capture, or left uncaptured."""
    comm, s, side, forked = communicator(), stream(), stream(), event()
    src, dst = (ctypes.c_uint8 * 8)(*range(8)), (ctypes.c_uint8 * 8)()
    begin(s)
    if same_capture:
        assert cuda.cuEventRecord(forked, s) == 0
        assert cuda.cuStreamWaitEvent(side, forked, 0) == 0
    assert nccl.ncclGroupStart() == 0
    send = nccl.ncclSend(src, 8, UINT8, 0, comm, s)
    recv = nccl.ncclRecv(dst, 8, UINT8, 0, comm, side)
    group = nccl.ncclGroupEnd()
    says = (nccl.ncclGetLastError(comm) or b"").decode()
    if same_capture:
        joined = event()
        assert cuda.cuEventRecord(joined, side) == 0
        assert cuda.cuStreamWaitEvent(s, joined, 0) == 0
    r, g = end(s)
    out = {"send": send, "recv": recv, "group_end": group, "says": says, "end": r}
    if r == 0 and group == 0:
        x = instantiate(g)
        assert cuda.cuGraphLaunch(x, s) == 0
        assert cuda.cuStreamSynchronize(s) == 0
        out["delivered"] = list(dst)
    return out


def nonblocking_group_in_capture(settle_before_end: bool) -> dict:
    comm, s = communicator(blocking=False), stream()
    src, dst = (ctypes.c_uint8 * 8)(*range(8)), (ctypes.c_uint8 * 8)()
    begin(s)
    group = exchange(comm, s, src, dst, 0)
    state = settle(comm) if settle_before_end else None
    r, g = end(s)
    if not settle_before_end:
        time.sleep(0.05)  # past the in-progress time: the next poll launches the group
        state = settle(comm)
    out = {"group_end": group, "state": state, "end": r,
           "says": (nccl.ncclGetLastError(comm) or b"").decode() if state else ""}
    if state == 0:
        x = instantiate(g)
        assert cuda.cuGraphLaunch(x, s) == 0
        assert cuda.cuStreamSynchronize(s) == 0
        out["delivered"] = list(dst)
    return out


def peer_replays(rank: int, idfile: str, replays: int) -> dict:
    """Two ranks each capture fill-send-receive-collect with the other, then launch it `replays`
    times back to back: the k-th replay must receive the peer's k-th fill."""
    uid = UniqueId()
    if rank == 0:
        assert nccl.ncclGetUniqueId(ctypes.byref(uid)) == 0
        with open(idfile + ".tmp", "wb") as f:
            f.write(bytes(uid.internal))
        os.rename(idfile + ".tmp", idfile)
    else:
        while not os.path.exists(idfile):
            time.sleep(0.01)
        with open(idfile, "rb") as idf:
            uid.internal = idf.read()
    comm, s = communicator(2, rank, uid), stream()
    src, dst = (ctypes.c_uint8 * 4096)(), (ctypes.c_uint8 * 4096)()
    filled: list[int] = []
    received: list[list[int]] = []

    def fill() -> None:
        ctypes.memset(src, (rank * 100 + len(filled)) % 256, len(src))
        filled.append(1)

    begin(s)
    kernel(s, fill)
    assert exchange(comm, s, src, dst, 1 - rank) == 0
    kernel(s, lambda: received.append(sorted(set(bytes(dst)))))
    r, g = end(s)
    x = instantiate(g)
    for _ in range(replays):
        assert cuda.cuGraphLaunch(x, s) == 0
    assert cuda.cuStreamSynchronize(s) == 0
    expected = [[((1 - rank) * 100 + i) % 256] for i in range(replays)]
    return {"end": r, "replays": len(received), "in_order": received == expected}


def observed(scenario: Callable[..., dict], *args: Any) -> dict:
    """The scenario's observations, with the capture refusals it logged."""
    log_lines()
    out = scenario(*args)
    out["log"] = log_lines()
    return out


if len(sys.argv) > 3:
    print(json.dumps(observed(peer_replays, int(sys.argv[3]), sys.argv[4], 100)))
    sys.exit(0)


def query_uncaptured() -> int:
    return cuda.cuEventQuery(uncaptured)


def synchronize_uncaptured() -> int:
    return cuda.cuStreamSynchronize(idle)


def allocate() -> int:
    ptr = ctypes.c_ulonglong()
    return cuda.cuMemAlloc_v2(ctypes.byref(ptr), 256)


idle, uncaptured = stream(), event()
assert cuda.cuEventRecord(uncaptured, idle) == 0
out = {
    "captured_work": observed(captured_work_runs_only_when_launched),
    "capture_ids": observed(capture_ids_are_unique),
    "joined": observed(fork_join, True),
    "unjoined": observed(fork_join, False),
    "end_other_thread_global": observed(end_capture_from_another_thread, GLOBAL),
    "end_other_thread_relaxed": observed(end_capture_from_another_thread, RELAXED),
    "query_captured_event": observed(refused_then_allowed, lambda s, e: cuda.cuEventQuery(e)),
    "synchronize_captured_event": observed(refused_then_allowed, lambda s, e: cuda.cuEventSynchronize(e)),
    "synchronize_capturing_stream": observed(refused_then_allowed, lambda s, e: cuda.cuStreamSynchronize(s)),
    "query_capturing_stream": observed(refused_then_allowed, lambda s, e: cuda.cuStreamQuery(s)),
    "global_query": observed(unsafe_call_across_threads, GLOBAL, query_uncaptured),
    "thread_local_query": observed(unsafe_call_across_threads, THREAD_LOCAL, query_uncaptured),
    "global_synchronize": observed(unsafe_call_across_threads, GLOBAL, synchronize_uncaptured),
    "global_alloc": observed(unsafe_call_across_threads, GLOBAL, allocate),
    "relaxed_capture_query": observed(unsafe_call_across_threads, RELAXED, query_uncaptured),
    "waits": observed(waits_across_the_capture_boundary),
    "legacy_blocking": observed(legacy_stream_during_capture, True),
    "legacy_nonblocking": observed(legacy_stream_during_capture, False),
    "null_stream_capture": observed(null_stream_capture),
    "nccl_self_replays": observed(captured_self_exchange_replays, 100),
    "nccl_group_same_capture": observed(group_across_captures, True),
    "nccl_group_mixed": observed(group_across_captures, False),
}
os.environ["MPFAKE_NCCL_GROUP_IN_PROGRESS_EVERY"] = "1"
os.environ["MPFAKE_NCCL_GROUP_IN_PROGRESS_MS"] = "20"
out["nccl_nonblocking_settled"] = observed(nonblocking_group_in_capture, True)
out["nccl_nonblocking_unsettled"] = observed(nonblocking_group_in_capture, False)
print(json.dumps(out))
