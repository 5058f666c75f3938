"""What one process can reach of another: run (as its source, with `python -I -c`, so that a
process of another uid needs no access to the source tree) by test_security.py and security.py.

argv[1] is JSON: segment (a /dev/shm path), pid, addr, nbytes (a range of that pid's memory).
Prints JSON: for each way in, the bytes it got (hex) or the errno name that refused it."""
import ctypes
import errno
import json
import os
import sys


class IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def errno_name(code: int | None) -> str:
    return str(code) if code is None else errno.errorcode.get(code, str(code))


def open_segment(path: str, flags: int) -> str:
    try:
        os.close(os.open(path, flags))
    except OSError as exc:
        return errno_name(exc.errno)
    return "ok"


def cma_read(pid: int, addr: int, nbytes: int) -> str:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.process_vm_readv.restype = ctypes.c_ssize_t
    buf = ctypes.create_string_buffer(nbytes)
    local, remote = IoVec(ctypes.addressof(buf), nbytes), IoVec(addr, nbytes)
    got = libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    if got < 0:
        return errno_name(ctypes.get_errno())
    return buf.raw[:got].hex()


def proc_mem_read(pid: int, addr: int, nbytes: int) -> str:
    try:
        fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
        try:
            return os.pread(fd, nbytes, addr).hex()
        finally:
            os.close(fd)
    except OSError as exc:
        return errno_name(exc.errno)


def main() -> None:
    target = json.loads(sys.argv[1])
    pid, addr, nbytes = target["pid"], target["addr"], target["nbytes"]
    print(json.dumps({
        "uid": os.getuid(),
        "open_rw": open_segment(target["segment"], os.O_RDWR),
        "open_ro": open_segment(target["segment"], os.O_RDONLY),
        "cma": cma_read(pid, addr, nbytes),
        "proc_mem": proc_mem_read(pid, addr, nbytes),
    }))


main()
