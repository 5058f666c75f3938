"""NCCL_COMM_BLOCKING as the fake libnccl reads it, through ctypes: a one-rank nonblocking init with
the environment the process started with, then another after setting the variable to argv[2].
Prints [first, second]: each init's result, 0 (done: the config was made blocking) or 7
(ncclInProgress: nonblocking)."""
import ctypes
import json
import os
import sys
import time

fakes, late = sys.argv[1], sys.argv[2]
cuda = ctypes.CDLL(f"{fakes}/libcuda.so.1", mode=ctypes.RTLD_GLOBAL)
nccl = ctypes.CDLL(f"{fakes}/libnccl.so.2")
p = ctypes.c_void_p
cuda.cuCtxSetCurrent.argtypes = [p]


class Config(ctypes.Structure):
    _fields_ = [("size", ctypes.c_size_t), ("magic", ctypes.c_uint), ("version", ctypes.c_uint),
                ("blocking", ctypes.c_int)]


class UniqueId(ctypes.Structure):  # passed by value
    _fields_ = [("internal", ctypes.c_char * 128)]


def nonblocking_init() -> int:
    uid, comm, state = UniqueId(), p(), ctypes.c_int(7)
    assert nccl.ncclGetUniqueId(ctypes.byref(uid)) == 0
    config = Config(ctypes.sizeof(Config), 0xcafebeef, 21400, 0)
    result = nccl.ncclCommInitRankConfig(ctypes.byref(comm), 1, uid, 0, ctypes.byref(config))
    while state.value == 7:
        assert nccl.ncclCommGetAsyncError(comm, ctypes.byref(state)) == 0
        time.sleep(0.01)
    assert state.value == 0 and nccl.ncclCommAbort(comm) == 0
    return result


ctx = p()
assert cuda.cuInit(0) == 0 and cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
assert cuda.cuCtxSetCurrent(ctx) == 0
first = nonblocking_init()
os.environ["NCCL_COMM_BLOCKING"] = late
print(json.dumps([first, nonblocking_init()]))
