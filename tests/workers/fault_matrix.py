"""The fault matrix's rows that leave the job running, on 2 ranks, one communicator each, in
this order (a seccomp filter cannot be lifted, so the refused single copy comes last):

- single_copy_allowed: an 8 MiB message arrives exactly by single copy, and nothing is logged
  about single copy;
- descriptors_exhausted: rank 1 runs out of file descriptors (RLIMIT_NOFILE lowered, then
  filled) and creates its communicator: it raises at once; rank 0, whose peer never attaches,
  times out naming it;
- stopped_peer: rank 1 stops itself (SIGSTOP); rank 0's receive from it times out after the
  communicator's short timeout; rank 0 then resumes it (SIGCONT) and rank 1's next op reports
  the abort;
- single_copy_refused: a seccomp filter makes process_vm_readv/writev fail with EPERM in both
  ranks; an 8 MiB message still arrives exactly, by the bounce buffer, and the fallback is
  logged once.

Each row reports the threads and descriptors a rank holds after it closed the communicator
that it did not hold before creating it (fault_resources.left_behind).

params: stop_timeout (the stopped peer's communicator timeout), nofile_timeout (rank 0's
timeout waiting for the rank without descriptors), timeout (the other rows')."""
import ctypes
import logging
import os
import resource
import signal
import struct
import time

import fault_resources
import harness

NBYTES = 8 << 20
LOGGER = "megatron_p2p.communicator"


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append({"level": record.levelname, "msg": record.getMessage()})


def logged_init(mp, timeout):
    """Creates a communicator, returning it with what was logged to LOGGER meanwhile."""
    handler = Records()
    logger = logging.getLogger(LOGGER)
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        return mp.init_communicator(timeout=timeout), handler.records
    finally:
        logger.removeHandler(handler)


def message_arrives_exactly(torch, comm):
    pattern = torch.arange(NBYTES, dtype=torch.int64).remainder(251).to(torch.uint8)
    if comm.rank == 0:
        comm.isend(pattern, 1).wait()
        return True
    got = torch.zeros(NBYTES, dtype=torch.uint8)
    comm.irecv(got, 0).wait()
    return bool(torch.equal(got, pattern))


def single_copy_row(torch, mp, timeout):
    before = fault_resources.snapshot()
    comm, records = logged_init(mp, timeout)
    out = {"single_copy": comm.single_copy(1 - comm.rank), "exact": message_arrives_exactly(torch, comm),
           "records": records}
    comm.close()
    return out | {"left": fault_resources.left_behind(before, fault_resources.snapshot())}


def descriptors_exhausted(mp, me, timeout):
    before = fault_resources.snapshot()
    held, limits = [], resource.getrlimit(resource.RLIMIT_NOFILE)
    if me == 1:
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(before["fds"]) + 16, limits[1]))
        try:
            while True:
                held.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            pass
    made = []
    record = harness.caught(lambda: made.append(mp.init_communicator(timeout=timeout)))
    for fd in held:
        os.close(fd)
    resource.setrlimit(resource.RLIMIT_NOFILE, limits)
    for comm in made:
        comm.close()
    return {"call": record, "left": fault_resources.left_behind(before, fault_resources.snapshot())}


def is_stopped(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def stopped_peer(torch, mp, store, me, timeout):
    before = fault_resources.snapshot()
    comm = mp.init_communicator(timeout=timeout)
    buf = torch.zeros(4, dtype=torch.uint8)
    if me == 1:
        store.set("stopping", str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)
        out = {"after_resume": harness.caught(lambda: comm.isend(buf, 0).wait())}
    else:
        peer = int(store.get("stopping"))
        while not is_stopped(peer):
            time.sleep(0.005)
        out = {"call": harness.caught(lambda: comm.irecv(buf, 1).wait())}
        os.kill(peer, signal.SIGCONT)
    comm.close()
    return out | {"left": fault_resources.left_behind(before, fault_resources.snapshot())}


# seccomp: a classic BPF program over struct seccomp_data {int nr; u32 arch; ...}.
SYS_PROCESS_VM_READV, SYS_PROCESS_VM_WRITEV, SYS_SECCOMP = 310, 311, 317  # x86_64
AUDIT_ARCH_X86_64 = 0xC000003E
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO, EPERM = 0x7FFF0000, 0x00050000, 1
BPF_LD_W_ABS, BPF_JEQ_K, BPF_RET_K = 0x20, 0x15, 0x06
PR_SET_NO_NEW_PRIVS, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC = 38, 1, 1


def refuse_single_copy():
    """Makes process_vm_readv/writev fail with EPERM in every thread of this process, as a
    container's seccomp profile does."""
    if os.uname().machine != "x86_64":
        raise RuntimeError("the seccomp filter here is written for x86_64 system call numbers")
    insns = [
        (BPF_LD_W_ABS, 0, 0, 4),  # arch
        (BPF_JEQ_K, 1, 0, AUDIT_ARCH_X86_64),
        (BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW),
        (BPF_LD_W_ABS, 0, 0, 0),  # nr
        (BPF_JEQ_K, 2, 0, SYS_PROCESS_VM_READV),
        (BPF_JEQ_K, 1, 0, SYS_PROCESS_VM_WRITEV),
        (BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW),
        (BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | EPERM),
    ]
    code = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *i) for i in insns))
    prog = struct.pack("HxxxxxxQ", len(insns), ctypes.addressof(code))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    prog_buf = ctypes.create_string_buffer(prog)
    if libc.syscall(SYS_SECCOMP, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC, prog_buf) != 0:
        raise OSError(ctypes.get_errno(), "seccomp(SECCOMP_SET_MODE_FILTER)")


def body(params):
    import torch

    import megatron_p2p as mp
    from megatron_p2p.communicator import _env_rendezvous

    store, me, _ = _env_rendezvous()
    torch.ones(8).sum()  # torch's lazy setup, before the first snapshot
    out = {"pid": os.getpid(), "single_copy_allowed": single_copy_row(torch, mp, params["timeout"])}
    # Each row starts on both ranks together: a row that fails fast on one rank must not eat into
    # the other rank's timeout of the next.
    harness.barrier("descriptors_exhausted")
    out["descriptors_exhausted"] = descriptors_exhausted(mp, me, params["nofile_timeout"])
    harness.barrier("stopped_peer")
    out["stopped_peer"] = stopped_peer(torch, mp, store, me, params["stop_timeout"])
    refuse_single_copy()
    harness.barrier("single_copy_refused")
    out["single_copy_refused"] = single_copy_row(torch, mp, params["timeout"])
    return out


harness.run(body)
