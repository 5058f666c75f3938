"""What the fake libcuda and libnccl promise, observed through ctypes (no torch, no package):
prints one JSON object of observations for tests/test_nccl_model.py. Run in a process of its own,
since it loads a library named libcuda.so.1."""
import ctypes
import json
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
comm = p()
cfg = Config(ctypes.sizeof(Config), 0xcafebeef, 21400, 1)
assert nccl.ncclCommInitRankConfig(ctypes.byref(comm), 1, uid, 0, ctypes.byref(cfg)) == 0
src = (ctypes.c_uint8 * 8)(*range(8))
dst = (ctypes.c_uint8 * 8)()
out["group_end_without_start"] = nccl.ncclGroupEnd()
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
print(json.dumps(out))
