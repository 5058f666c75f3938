"""What the fake libcuda and libnccl promise, observed through ctypes (no torch, no package):
prints one JSON object of observations for tests/test_nccl_model.py. Run in a process of its own,
since it loads a library named libcuda.so.1."""
import ctypes
import json
import os
import sys
import threading
import time

fakes = sys.argv[1]
cuda = ctypes.CDLL(f"{fakes}/libcuda.so.1", mode=ctypes.RTLD_GLOBAL)
nccl = ctypes.CDLL(f"{fakes}/libnccl.so.2")
out = {}
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

order = []
gate = threading.Event()
slow = KERNEL(lambda _: (gate.wait(5), order.append("a")))
quick = KERNEL(lambda _: order.append("b"))
assert cuda.mpfake_stream_enqueue(ctx, a, slow, None) == 0
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
out["send_before_abort"] = nccl.ncclGroupStart(), nccl.ncclSend(src, 8, 1, 0, comm, a), nccl.ncclRecv(dst, 8, 1, 0, comm, a), nccl.ncclGroupEnd()
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

# NCCL_COMM_BLOCKING overrides a nonblocking config when it reads 0 or 1: forced to 1, a one-rank
# nonblocking init returns done (0) instead of ncclInProgress (7).
for forced in ("1", "0", "yes"):
    os.environ["NCCL_COMM_BLOCKING"] = forced
    one_uid, one = UniqueId(), p()
    assert nccl.ncclGetUniqueId(ctypes.byref(one_uid)) == 0
    out[f"nonblocking_init_with_NCCL_COMM_BLOCKING={forced}"] = nccl.ncclCommInitRankConfig(
        ctypes.byref(one), 1, one_uid, 0, ctypes.byref(nonblocking))
    while async_state(one) == 7:
        time.sleep(0.01)
    assert nccl.ncclCommAbort(one) == 0
del os.environ["NCCL_COMM_BLOCKING"]
print(json.dumps(out))
