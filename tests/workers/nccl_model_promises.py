"""What the fake libcuda and libnccl promise, observed through ctypes (no torch, no package):
prints one JSON object of observations for tests/test_nccl_model.py. Run in a process of its own,
since it loads a library named libcuda.so.1."""
import ctypes
import json
import os
import sys
import threading
import time
from typing import Any

fakes = sys.argv[1]
os.environ["MPFAKE_CUDA_DEVICES"] = "2"  # two devices, each with its own launch order (read by cuInit)
cuda = ctypes.CDLL(f"{fakes}/libcuda.so.1", mode=ctypes.RTLD_GLOBAL)
nccl = ctypes.CDLL(f"{fakes}/libnccl.so.2")
out: dict[str, Any] = {}
p = ctypes.c_void_p
KERNEL = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
cuda.mpfake_stream_enqueue.argtypes = [p, p, KERNEL, p]
for name in ("cuCtxSetCurrent", "cuEventRecord", "cuEventQuery", "cuStreamWaitEvent", "cuStreamSynchronize"):
    getattr(cuda, name).argtypes = [p] * {"cuEventRecord": 2, "cuStreamWaitEvent": 2}.get(name, 1) + (
        [ctypes.c_uint] if name == "cuStreamWaitEvent" else [])

out["before_init"] = cuda.cuDeviceGet(ctypes.byref(ctypes.c_int()), 0)
assert cuda.cuInit(0) == 0
ctx, a, b, ev = p(), p(), p(), p()
out["stream_without_context"] = cuda.cuStreamCreateWithPriority(ctypes.byref(a), 1, 0)
assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
out["still_without_context"] = cuda.cuStreamCreateWithPriority(ctypes.byref(a), 1, 0)
assert cuda.cuCtxSetCurrent(ctx) == 0
out["stream_with_context"] = cuda.cuStreamCreateWithPriority(ctypes.byref(a), 1, 0)
assert cuda.cuStreamCreateWithPriority(ctypes.byref(b), 1, 0) == 0
assert cuda.cuEventCreate(ctypes.byref(ev), 2) == 0

order: list[str] = []
gate = threading.Event()


def slow_kernel(_: int | None) -> None:
    gate.wait(5)
    order.append("a")


slow_k = KERNEL(slow_kernel)
quick = KERNEL(lambda _: order.append("b"))
assert cuda.mpfake_stream_enqueue(ctx, a, slow_k, None) == 0
assert cuda.cuEventRecord(ev, a) == 0
assert cuda.cuStreamWaitEvent(b, ev, 0) == 0
assert cuda.mpfake_stream_enqueue(ctx, b, quick, None) == 0
time.sleep(0.1)
out["query_while_work_runs"] = cuda.cuEventQuery(ev)
out["order_while_blocked"] = list(order)
gate.set()
assert cuda.cuStreamSynchronize(b) == 0
out["query_after_work"] = cuda.cuEventQuery(ev)
out["order"] = order


# ---- libnccl -------------------------------------------------------------------------------------
class Config(ctypes.Structure):
    _fields_ = [("size", ctypes.c_size_t), ("magic", ctypes.c_uint), ("version", ctypes.c_uint),
                ("blocking", ctypes.c_int)]


CONFIG_SIZE = Config.blocking.offset + ctypes.sizeof(ctypes.c_int)  # the fields set, not the padding


class UniqueId(ctypes.Structure):  # passed by value
    _fields_ = [("internal", ctypes.c_char * 128)]


uid = UniqueId()
assert nccl.ncclGetUniqueId(ctypes.byref(uid)) == 0
nccl.ncclCommInitRankConfig.argtypes = [ctypes.POINTER(p), ctypes.c_int, UniqueId, ctypes.c_int, ctypes.c_void_p]
nccl.ncclSend.argtypes = [p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, p, p]
nccl.ncclRecv.argtypes = nccl.ncclSend.argtypes
nccl.ncclCommAbort.argtypes = [p]
nccl.ncclGetLastError.argtypes = [p]
nccl.ncclGetLastError.restype = ctypes.c_char_p
nccl.ncclCommGetAsyncError.argtypes = [p, ctypes.POINTER(ctypes.c_int)]
comm, other = p(), p()
cfg = Config(ctypes.sizeof(Config), 0xcafebeef, 21400, 1)
assert nccl.ncclCommInitRankConfig(ctypes.byref(comm), 1, uid, 0, ctypes.byref(cfg)) == 0
other_uid = UniqueId()
assert nccl.ncclGetUniqueId(ctypes.byref(other_uid)) == 0
assert nccl.ncclCommInitRankConfig(ctypes.byref(other), 1, other_uid, 0, ctypes.byref(cfg)) == 0
src = (ctypes.c_uint8 * 8)(*range(8))
dst = (ctypes.c_uint8 * 8)()
out["group_end_without_start"] = nccl.ncclGroupEnd()
out["says_after_group_end_without_start"] = nccl.ncclGetLastError(comm).decode()
out["lone_self_send"] = nccl.ncclSend(src, 8, 1, 0, comm, a)
assert nccl.ncclGroupStart() == 0
nccl.ncclSend(src, 8, 1, 0, comm, a)
nccl.ncclRecv(dst, 8, 1, 0, comm, a)
out["paired_self_send"] = nccl.ncclGroupEnd()
assert cuda.cuStreamSynchronize(a) == 0
out["self_bytes"] = list(dst)
assert cuda.cuCtxSetCurrent(None) == 0
out["send_without_context"] = nccl.ncclSend(src, 8, 1, 0, comm, a)
assert cuda.cuCtxSetCurrent(ctx) == 0
out["send_before_abort"] = (nccl.ncclGroupStart(), nccl.ncclSend(src, 8, 1, 0, comm, a),
                            nccl.ncclRecv(dst, 8, 1, 0, comm, a), nccl.ncclGroupEnd())
assert nccl.ncclCommAbort(comm) == 0
out["send_after_abort"] = nccl.ncclSend(src, 8, 1, 0, comm, a)
out["after_abort_says"] = nccl.ncclGetLastError(comm).decode()

# NCCL's last error is the process's: the same through any communicator, or none, and a later
# successful call (a self exchange on the other communicator) leaves it as it was.
out["says_through_another_comm"] = nccl.ncclGetLastError(other).decode()
out["says_through_no_comm"] = nccl.ncclGetLastError(None).decode()
assert nccl.ncclGroupStart() == 0
nccl.ncclSend(src, 8, 1, 0, other, a)
nccl.ncclRecv(dst, 8, 1, 0, other, a)
out["success_after_abort"] = nccl.ncclGroupEnd(), cuda.cuStreamSynchronize(a)
out["says_after_success"] = nccl.ncclGetLastError(other).decode()

# A call on a communicator still in progress, and on one whose initialisation failed: two
# nonblocking ranks 0 of one two-rank communicator; the second to join fails, the first waits for
# a rank 1 that never comes.
os.environ["MPFAKE_NCCL_INIT_IN_PROGRESS_MS"] = "0"
two_uid = UniqueId()
assert nccl.ncclGetUniqueId(ctypes.byref(two_uid)) == 0
nonblocking = Config(ctypes.sizeof(Config), 0xcafebeef, 21400, 0)
twins = [p(), p()]
for twin in twins:
    assert nccl.ncclCommInitRankConfig(ctypes.byref(twin), 2, two_uid, 0, ctypes.byref(nonblocking)) == 7
    time.sleep(0.05)


def async_state(c: p) -> int:
    state = ctypes.c_int()
    assert nccl.ncclCommGetAsyncError(c, ctypes.byref(state)) == 0
    return state.value


deadline = time.monotonic() + 10
while sorted(async_state(t) != 7 for t in twins) != [False, True] and time.monotonic() < deadline:
    time.sleep(0.01)
failed, pending = sorted(twins, key=lambda t: async_state(t) == 7)
out["joined_twice"] = async_state(failed)
says_before = nccl.ncclGetLastError(None).decode()
out["send_on_comm_in_error"] = nccl.ncclSend(src, 8, 1, 0, failed, a)
out["send_on_comm_in_error_warned"] = nccl.ncclGetLastError(None).decode() != says_before
out["send_on_comm_in_progress"] = nccl.ncclSend(src, 8, 1, 0, pending, a)
out["in_progress_says"] = nccl.ncclGetLastError(None).decode()
assert nccl.ncclCommAbort(failed) == 0 and nccl.ncclCommAbort(pending) == 0

# NCCL reads NCCL_COMM_BLOCKING once per process (src/include/param.h NCCL_PARAM): set after this
# process's first init, 1 leaves a nonblocking init nonblocking (ncclInProgress, 7).
os.environ["NCCL_COMM_BLOCKING"] = "1"
one_uid, one = UniqueId(), p()
assert nccl.ncclGetUniqueId(ctypes.byref(one_uid)) == 0
out["nonblocking_init_with_NCCL_COMM_BLOCKING=1_set_late"] = nccl.ncclCommInitRankConfig(
    ctypes.byref(one), 1, one_uid, 0, ctypes.byref(nonblocking))
while async_state(one) == 7:
    time.sleep(0.01)
assert nccl.ncclCommAbort(one) == 0
del os.environ["NCCL_COMM_BLOCKING"]
# ---- ncclCommAbort waits for the CUDA graphs that captured work on the communicator ---------------
# NCCL 2.30: a captured plan holds comm->localPersistentRefs until its graph is destroyed
# (src/enqueue.cc ncclLaunchPrepare, persistentDestructor); the abort waits for 0 (src/init.cc
# commDestroySync).
for name, types in {"cuStreamBeginCapture_v2": [p, ctypes.c_int], "cuStreamEndCapture": [p, ctypes.POINTER(p)],
                    "cuGraphInstantiateWithFlags": [ctypes.POINTER(p), p, ctypes.c_ulonglong],
                    "cuGraphLaunch": [p, p], "cuGraphDestroy": [p], "cuGraphExecDestroy": [p],
                    "cuStreamQuery": [p], "cuDevicePrimaryCtxRetain": [ctypes.POINTER(p), ctypes.c_int]}.items():
    getattr(cuda, name).argtypes = types
nccl.mpfake_nccl_group_threads.restype = ctypes.c_long


class SplitConfig(ctypes.Structure):
    _fields_ = [("size", ctypes.c_size_t), ("magic", ctypes.c_uint), ("version", ctypes.c_uint),
                ("blocking", ctypes.c_int), ("cgaClusterSize", ctypes.c_int), ("minCTAs", ctypes.c_int),
                ("maxCTAs", ctypes.c_int), ("netName", ctypes.c_char_p), ("splitShare", ctypes.c_int)]


UNDEF = -2147483648


def new_comm(nranks: int = 1, rank: int = 0, the_uid: UniqueId | None = None, blocking: bool = True,
             split_share: int | None = None) -> p:
    """A communicator; with `split_share`, made with a config through splitShare (2.18)."""
    if the_uid is None:
        the_uid = UniqueId()
        assert nccl.ncclGetUniqueId(ctypes.byref(the_uid)) == 0
    c = p()
    config = (Config(CONFIG_SIZE, 0xcafebeef, 21400, int(blocking)) if split_share is None else
              SplitConfig(ctypes.sizeof(SplitConfig), 0xcafebeef, 21800, int(blocking), UNDEF, UNDEF, UNDEF, None,
                          split_share))
    assert nccl.ncclCommInitRankConfig(ctypes.byref(c), nranks, the_uid, rank, ctypes.byref(config)) in (0, 7)
    return c


def settled(c: p) -> int:
    while (state := async_state(c)) == 7:
        time.sleep(0.001)
    return state


def new_stream() -> p:
    s = p()
    assert cuda.cuStreamCreateWithPriority(ctypes.byref(s), 1, 0) == 0
    return s


def group(ops: list) -> int:
    """ops: (is_send, buffer, peer, comm, stream); a nonblocking group is settled."""
    assert nccl.ncclGroupStart() == 0
    for is_send, buf, peer, c, s in ops:
        assert (nccl.ncclSend if is_send else nccl.ncclRecv)(buf, len(buf), 1, peer, c, s) == 0
    r = nccl.ncclGroupEnd()
    return settled(ops[0][3]) if r == 7 else r


def abort_on_a_thread(c: p) -> dict:
    box: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: box.update(r=nccl.ncclCommAbort(c), at=time.monotonic()))
    thread.start()
    return {"thread": thread, "box": box}


bare = new_comm()
started = time.monotonic()
assert nccl.ncclCommAbort(bare) == 0
out["abort_without_graph_s"] = time.monotonic() - started

held, s = new_comm(), new_stream()
src, dst = (ctypes.c_uint8 * 8)(*range(8)), (ctypes.c_uint8 * 8)()
graph, instance = p(), p()
assert cuda.cuStreamBeginCapture_v2(s, 2) == 0  # RELAXED
assert group([(1, src, 0, held, s), (0, dst, 0, held, s)]) == 0
assert cuda.cuStreamEndCapture(s, ctypes.byref(graph)) == 0
assert cuda.cuGraphInstantiateWithFlags(ctypes.byref(instance), graph, 0) == 0
assert cuda.cuGraphLaunch(instance, s) == 0 and cuda.cuStreamSynchronize(s) == 0
out["captured_bytes"] = list(dst)
aborting = abort_on_a_thread(held)
time.sleep(0.3)
out["abort_returned_with_graph_and_instance"] = "at" in aborting["box"]
assert cuda.cuGraphDestroy(graph) == 0
time.sleep(0.3)
out["abort_returned_with_instance_only"] = "at" in aborting["box"]
last_destroyed = time.monotonic()
assert cuda.cuGraphExecDestroy(instance) == 0
aborting["thread"].join(5)
out["abort_after_last_holder_s"] = aborting["box"].get("at", float("inf")) - last_destroyed
out["abort_with_graph_result"] = aborting["box"].get("r")

# ---- a nonblocking ncclGroupEnd with work: ncclInProgress, and a thread of its own ---------------
# NCCL 2.30: src/group.cc ncclGroupEndInternal (the nonblocking branch starts the thread; the
# blocking branch launches on the caller's); src/init.cc ncclCommGetAsyncError joins it.
os.environ["MPFAKE_NCCL_GROUP_IN_PROGRESS_MS"] = "0"
os.environ.pop("MPFAKE_NCCL_GROUP_THREAD", None)  # the default, as NCCL: a thread per group
nonblocking_comm, blocking_comm, s = new_comm(blocking=False), new_comm(), new_stream()
settled(nonblocking_comm)
answers, threads = [], []
for _ in range(5):
    before = nccl.mpfake_nccl_group_threads()
    assert nccl.ncclGroupStart() == 0
    nccl.ncclSend(src, 8, 1, 0, nonblocking_comm, s)
    nccl.ncclRecv(dst, 8, 1, 0, nonblocking_comm, s)
    answers.append(nccl.ncclGroupEnd())
    threads.append(nccl.mpfake_nccl_group_threads() - before)
    assert settled(nonblocking_comm) == 0
out["nonblocking_group_end"] = answers
out["nonblocking_group_threads"] = threads
assert cuda.cuStreamSynchronize(s) == 0
out["nonblocking_group_bytes"] = list(dst)
before = nccl.mpfake_nccl_group_threads()
out["blocking_group_end"] = group([(1, src, 0, blocking_comm, s), (0, dst, 0, blocking_comm, s)])
out["blocking_group_threads"] = nccl.mpfake_nccl_group_threads() - before
before = nccl.mpfake_nccl_group_threads()
assert nccl.ncclGroupStart() == 0
out["empty_nonblocking_group_end"] = nccl.ncclGroupEnd()
out["empty_group_threads"] = nccl.mpfake_nccl_group_threads() - before
assert nccl.ncclCommAbort(blocking_comm) == 0

# A group still in progress (its thread waits 2 s): a send on its communicator is refused, and an
# abort joins the thread at once, launching nothing.
os.environ["MPFAKE_NCCL_GROUP_IN_PROGRESS_MS"] = "2000"
os.environ["MPFAKE_NCCL_GROUP_IN_PROGRESS_EVERY"] = "1"
slow = new_comm(blocking=False)
settled(slow)
lone = (ctypes.c_uint8 * 8)()
assert nccl.ncclGroupStart() == 0
nccl.ncclSend(src, 8, 1, 0, slow, s)
nccl.ncclRecv(lone, 8, 1, 0, slow, s)
out["slow_group_end"] = nccl.ncclGroupEnd()
out["send_while_group_in_progress"] = nccl.ncclSend(src, 8, 1, 0, slow, s)
out["send_while_group_in_progress_says"] = nccl.ncclGetLastError(None).decode()
started = time.monotonic()
assert nccl.ncclCommAbort(slow) == 0
out["abort_during_group_thread_s"] = time.monotonic() - started
assert cuda.cuStreamSynchronize(s) == 0
out["aborted_group_bytes"] = list(lone)
del os.environ["MPFAKE_NCCL_GROUP_IN_PROGRESS_EVERY"]
os.environ["MPFAKE_NCCL_GROUP_IN_PROGRESS_MS"] = "0"
out["send_after_group_settled"] = group([(1, src, 0, nonblocking_comm, s), (0, dst, 0, nonblocking_comm, s)])
assert nccl.ncclCommAbort(nonblocking_comm) == 0
os.environ["MPFAKE_NCCL_GROUP_THREAD"] = "0"
undelayed = new_comm(blocking=False)  # the option: an undelayed group launches on the caller
settled(undelayed)
before = nccl.mpfake_nccl_group_threads()
assert nccl.ncclGroupStart() == 0
nccl.ncclSend(src, 8, 1, 0, undelayed, s)
nccl.ncclRecv(dst, 8, 1, 0, undelayed, s)
out["undelayed_group_end_without_group_thread"] = nccl.ncclGroupEnd(), nccl.mpfake_nccl_group_threads() - before
assert nccl.ncclCommAbort(undelayed) == 0
del os.environ["MPFAKE_NCCL_GROUP_THREAD"]


# ---- a small send may complete before its receive (MPFAKE_NCCL_EAGER_BYTES) -------------------------
# NCCL 2.30: the send primitive needs only a free step of the connection's buffer
# (src/device/prims_simple.h waitPeer); the connection exists once the peer took part
# (src/transport.cc ncclTransportP2pSetup).
def both_ranks(fn, contexts: list) -> list:
    """fn(rank) on one thread per rank, each with its rank's context current."""
    results = [None, None]

    def run(r: int) -> None:
        assert cuda.cuCtxSetCurrent(contexts[r]) == 0
        results[r] = fn(r)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert cuda.cuCtxSetCurrent(ctx) == 0
    return results


def two_ranks(env: dict) -> list:
    os.environ.update(env)
    the_uid = UniqueId()
    assert nccl.ncclGetUniqueId(ctypes.byref(the_uid)) == 0
    comms = [new_comm(2, r, the_uid, blocking=False) for r in range(2)]
    for c in comms:
        assert settled(c) == 0
    for k in env:
        del os.environ[k]
    return comms


def completes(s: p, within: float) -> bool:
    deadline = time.monotonic() + within
    while (r := cuda.cuStreamQuery(s)) == 600 and time.monotonic() < deadline:
        time.sleep(0.005)
    return r == 0


def buffered(eager: str, sizes: list) -> dict:
    c0, c1 = two_ranks({"MPFAKE_NCCL_EAGER_BYTES": eager})
    s0, s1 = new_stream(), new_stream()
    one, got = (ctypes.c_uint8 * 1)(7), (ctypes.c_uint8 * 1)()
    # the connection, made by both ranks at once
    assert both_ranks(lambda r: group([(1 - r, (one, got)[r], 1 - r, (c0, c1)[r], (s0, s1)[r])]), [ctx, ctx]) == [0, 0]
    assert cuda.cuStreamSynchronize(s0) == 0 and cuda.cuStreamSynchronize(s1) == 0
    sent = [(ctypes.c_uint8 * n)(*((k * 31 + i) % 251 for i in range(n))) for k, n in enumerate(sizes)]
    for buf in sent:
        assert group([(1, buf, 1, c0, s0)]) == 0
    before_receive = completes(s0, 0.3)
    received = [(ctypes.c_uint8 * n)() for n in sizes]
    assert group([(0, buf, 0, c1, s1) for buf in received]) == 0
    ended = completes(s1, 5) and completes(s0, 5)
    exact = ended and [list(b) for b in received] == [list(b) for b in sent]
    for c in (c0, c1):
        assert nccl.ncclCommAbort(c) == 0
    return {"completed_without_receive": before_receive, "exact": exact}


out["eager_small"] = buffered("4096", [1024])
out["eager_off"] = buffered("0", [1024])
out["eager_above"] = buffered("4096", [8192])
out["eager_several_in_order"] = buffered("4096", [100, 4096, 7])


# ---- launch order (MPFAKE_NCCL_LAUNCH_ORDER_IMPLICIT) -------------------------------------------------
# NCCL 2.30: src/enqueue.cc getImplicitOrder, ncclLaunchPrepare, ncclLaunchFinish; rank 0 on device 0
# issues comm A's group then comm B's, rank 1 on device 1 issues B's then A's.
ctx1 = p()
assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx1), 1) == 0


def opposite_orders(mode: str) -> dict:
    contexts = [ctx, ctx1]
    a, b = [], []
    env = {"MPFAKE_NCCL_LAUNCH_ORDER_IMPLICIT": mode}
    os.environ.update(env)
    uids = [UniqueId(), UniqueId()]
    for u in uids:
        assert nccl.ncclGetUniqueId(ctypes.byref(u)) == 0
    streams = {}
    for r in range(2):
        assert cuda.cuCtxSetCurrent(contexts[r]) == 0
        a.append(new_comm(2, r, uids[0], blocking=False))
        b.append(new_comm(2, r, uids[1], blocking=False))
        streams[r] = (new_stream(), new_stream())
    del os.environ["MPFAKE_NCCL_LAUNCH_ORDER_IMPLICIT"]
    for c in a + b:
        assert settled(c) == 0
    for which in (0, 1):  # connected first, both ranks at once, as a job's warm-up does
        both_ranks(lambda r: group([(1, (ctypes.c_uint8 * 1)(), 1 - r, (a, b)[which][r], streams[r][which]),
                                    (0, (ctypes.c_uint8 * 1)(), 1 - r, (a, b)[which][r], streams[r][which])]),
                   contexts)
    bufs = [(ctypes.c_uint8 * 64)() for _ in range(8)]
    for r, order in ((0, (0, 1)), (1, (1, 0))):
        assert cuda.cuCtxSetCurrent(contexts[r]) == 0
        for which in order:
            c, s = (a, b)[which][r], streams[r][which]
            assert group([(1, bufs[4 * r + 2 * which], 1 - r, c, s), (0, bufs[4 * r + 2 * which + 1], 1 - r, c, s)]) == 0

    def all_complete(within: float) -> bool:
        deadline = time.monotonic() + within
        done = True
        for r in range(2):
            assert cuda.cuCtxSetCurrent(contexts[r]) == 0
            done &= all(completes(s, max(0.0, deadline - time.monotonic())) for s in streams[r])
        return done

    completed = all_complete(1.0)
    for c in a + b:
        assert nccl.ncclCommAbort(c) == 0
    ended = all_complete(5.0)
    assert cuda.cuCtxSetCurrent(ctx) == 0
    return {"completed": completed, "ended_after_abort": ended}


# ---- ncclCommSplit, and a blocking launch that connects ------------------------------------------
# NCCL 2.30: src/init.cc ncclCommSplit runs ncclCommInitChildComm as an async job in the parent's
# mode (src/group.cc ncclAsyncLaunch); with splitShare the child shares the parent's abort flag
# (ncclCommInitChildComm) and connections (src/channel.cc initChannel). A launch connects a new pair
# of ranks and waits for the peer's side (src/transport.cc ncclTransportP2pSetup), ended only by the
# abort flag (src/bootstrap.cc checkAbort). The user guide's "Fault Tolerance" allows an abort only
# with no other thread inside a call on the communicator.
nccl.ncclCommSplit.argtypes = [p, ctypes.c_int, ctypes.c_int, ctypes.POINTER(p), ctypes.c_void_p]
nccl.mpfake_nccl_unsafe_aborts.restype = ctypes.c_long
nccl.mpfake_nccl_parallel_calls.restype = ctypes.c_long


def split(parent: p, rank: int, share: int) -> tuple[int, int, p]:
    """(ncclCommSplit's answer, the parent's state right after it, the child, set once settled)."""
    child = p()
    config = SplitConfig(ctypes.sizeof(SplitConfig), 0xcafebeef, 21800, 1, UNDEF, UNDEF, UNDEF, None, share)
    answer = nccl.ncclCommSplit(parent, 0, rank, ctypes.byref(child), ctypes.byref(config))
    return answer, async_state(parent), child


def split_pair(parent_share: int, child_share: int) -> tuple[list, list, list, list]:
    """Two ranks (one context each) of a nonblocking parent made with splitShare=`parent_share`,
    each split into a blocking child whose own config says `child_share`:
    (split answers, parents, children, streams)."""
    the_uid = UniqueId()
    assert nccl.ncclGetUniqueId(ctypes.byref(the_uid)) == 0
    contexts, streams, parents = [ctx, ctx1], [], []
    for r in range(2):
        assert cuda.cuCtxSetCurrent(contexts[r]) == 0
        parents.append(new_comm(2, r, the_uid, blocking=False, split_share=parent_share))
        streams.append(new_stream())
    for c in parents:
        assert settled(c) == 0
    # One rank after the other, from this thread: rank 0's state is read before rank 1 has split,
    # so its child's init cannot have ended, and what rank 0 reads is the state during the split
    # whatever the scheduling.
    answers = []
    for r in range(2):
        assert cuda.cuCtxSetCurrent(contexts[r]) == 0
        answers.append(split(parents[r], r, child_share))
    for r in range(2):
        assert cuda.cuCtxSetCurrent(contexts[r]) == 0
        assert settled(parents[r]) == 0
    assert cuda.cuCtxSetCurrent(ctx) == 0
    return answers, parents, [a[2] for a in answers], streams


def connecting_pair(parent_share: int, child_share: int) -> dict:
    answers, parents, children, streams = split_pair(parent_share, child_share)
    result = {"split_answer": answers[0][0], "parent_during_split": answers[0][1],
              "child_delivered": all(c.value for c in children)}
    # Rank 0 launches a send to rank 1, which has not reached the connection: the launch waits.
    box: dict[str, float] = {}
    buf = (ctypes.c_uint8 * 8)(*range(8))
    before_threads = nccl.mpfake_nccl_group_threads()

    def launch() -> None:
        assert cuda.cuCtxSetCurrent(ctx) == 0
        box["r"] = group([(1, buf, 1, children[0], streams[0])])
        box["at"] = time.monotonic()

    thread = threading.Thread(target=launch)
    thread.start()
    time.sleep(0.3)
    result["launch_waits_for_the_peer"] = "r" not in box
    parallel_before = nccl.mpfake_nccl_parallel_calls()
    assert cuda.cuCtxSetCurrent(ctx) == 0
    async_state(children[0])  # while the launching thread is inside a call on the child
    result["parallel_calls"] = nccl.mpfake_nccl_parallel_calls() - parallel_before
    unsafe_before = nccl.mpfake_nccl_unsafe_aborts()
    assert cuda.cuCtxSetCurrent(ctx) == 0
    aborted_at = time.monotonic()
    assert nccl.ncclCommAbort(parents[0]) == 0
    thread.join(0.5)
    result["parent_abort_ends_the_launch"] = "r" in box
    if "r" not in box:  # not shared: only the child's own abort reaches it
        assert nccl.ncclCommAbort(children[0]) == 0
        thread.join(5)
    result["launch_result"] = box.get("r")
    result["ended_after_s"] = box.get("at", float("inf")) - aborted_at
    result["unsafe_aborts"] = nccl.mpfake_nccl_unsafe_aborts() - unsafe_before
    result["group_threads"] = nccl.mpfake_nccl_group_threads() - before_threads
    return result


def connected_pair() -> dict:
    """Both ranks launch their side: the blocking child's launch connects, delivers, starts no thread."""
    contexts = [ctx, ctx1]
    _, parents, children, streams = split_pair(1, 0)
    bufs = [(ctypes.c_uint8 * 8)(*range(8)), (ctypes.c_uint8 * 8)()]
    before = nccl.mpfake_nccl_group_threads()
    answers = both_ranks(lambda r: group([(1 - r, bufs[r], 1 - r, children[r], streams[r])]), contexts)
    threads = nccl.mpfake_nccl_group_threads() - before
    both_ranks(lambda r: cuda.cuStreamSynchronize(streams[r]), contexts)
    for c in children + parents:
        assert nccl.ncclCommAbort(c) == 0
    return {"answers": answers, "group_threads": threads, "bytes": list(bufs[1])}


os.environ["MPFAKE_NCCL_GROUP_IN_PROGRESS_MS"] = "0"
out["split_shared"] = connecting_pair(1, 0)
out["split_child_only"] = connecting_pair(0, 1)  # what the transport did before: NCCL shares nothing
out["split_unshared"] = connecting_pair(0, 0)
out["split_connected"] = connected_pair()


def config_overreach(size: int) -> int:
    """How many configs the model counted as covering bytes past their version's fields, for one
    init with a 2.14 config of `size` bytes."""
    nccl.mpfake_nccl_config_overreach.restype = ctypes.c_long
    before = nccl.mpfake_nccl_config_overreach()
    c = p()
    uid = UniqueId()
    assert nccl.ncclGetUniqueId(ctypes.byref(uid)) == 0
    config = Config(size, 0xcafebeef, 21400, 0)
    assert nccl.ncclCommInitRankConfig(ctypes.byref(c), 1, uid, 0, ctypes.byref(config)) in (0, 7)
    settled(c)
    nccl.ncclCommAbort(c)
    return nccl.mpfake_nccl_config_overreach() - before


out["config_overreach"] = {"padded": config_overreach(ctypes.sizeof(Config)), "exact": config_overreach(CONFIG_SIZE)}
out["launch_order_none"] = opposite_orders("0")
out["launch_order_serial"] = opposite_orders("1")
out["launch_order_launch"] = opposite_orders("2")
print(json.dumps(out))
