"""Who can reach a communicator's shared memory and a rank's memory, observed on two ranks.

Rank 0 publishes its pid and the address of 64 random bytes (a tensor's storage), then creates
the communicator. Rank 1 delays its own attach: while rank 0 waits for it, rank 1 finds rank 0's
segment in /dev/shm, records its mode and owner, and runs security_probe.py as its own uid and,
when `other_uid` is given, as that uid (setpriv): each tries to open the segment and to read
rank 0's bytes. Then rank 1 attaches; after init both ranks list what is left of the segment,
and exchange 1 MiB each way (single copy where the kernel allows it).

params: other_uid (None: no other-uid probe); strace (strace and its options, as a list) and
trace_dir (None: not traced): every rank re-runs itself under strace, writing
<trace_dir>/rank<N>.strace, and ends with a prctl that marks the end of its trace."""
import ctypes
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import harness

PROBE_SOURCE = (Path(__file__).resolve().parent / "security_probe.py").read_text()
SECRET_BYTES = 64
FIND_LIMIT = 60.0  # seconds for rank 0's segment to appear: a loaded 2-core machine


def run_under_strace(strace: list[str], trace_dir: str) -> None:
    """Replaces this process by strace running it again (once: the flag marks the traced run)."""
    os.environ["MP_SECURITY_TRACED"] = "1"
    out = str(Path(trace_dir) / f"rank{os.environ['RANK']}.strace")
    os.execvp(strace[0], [*strace, "-o", out, sys.executable, *sys.argv])


def mark_end_of_trace() -> None:
    """A prctl that changes nothing: its line in the trace shows that strace saw this rank to the end."""
    PR_GET_DUMPABLE = 3
    ctypes.CDLL(None).prctl(PR_GET_DUMPABLE, 0, 0, 0, 0)


def shm_names(pid: int, arenas: bool = False) -> list[str]:
    """The /dev/shm names process `pid` made: its segments, or its receive arenas ("...-a<rank>")."""
    names = (p.name for p in Path("/dev/shm").glob(f"mp2p-{pid}-*"))
    return sorted(n for n in names if bool(re.search(r"-a\d+$", n)) == arenas)


def find_shm(pid: int, arenas: bool = False) -> Path:
    """Rank 0's segment (or arena), once it has made it."""
    what = "arena" if arenas else "segment"
    deadline = time.monotonic() + FIND_LIMIT
    while not (names := shm_names(pid, arenas)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 (pid {pid}) made no {what} within {FIND_LIMIT:.0f} s")
        time.sleep(0.005)
    return Path("/dev/shm") / names[0]


def probe(segment: Path, pid: int, addr: int, as_uid) -> dict:
    """security_probe.py's findings, run as this process's uid (None) or as `as_uid`."""
    target = json.dumps({"segment": str(segment), "pid": pid, "addr": addr, "nbytes": SECRET_BYTES})
    switch = [] if as_uid is None else ["setpriv", f"--reuid={as_uid}", f"--regid={as_uid}", "--clear-groups"]
    done = subprocess.run([*switch, os.path.realpath(sys.executable), "-I", "-c", PROBE_SOURCE, target],
                          capture_output=True, text=True, cwd="/", timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"probe as uid {as_uid} failed: {done.stderr}")
    return json.loads(done.stdout)


def exchange_once(torch, comm) -> bool:
    """1 MiB each way with the other rank; whether both arrived exactly."""
    mine = torch.full((1 << 20,), comm.global_rank + 1, dtype=torch.uint8)
    got = torch.zeros(1 << 20, dtype=torch.uint8)
    reqs = comm.exchange(send_next=mine, recv_prev=got, mode="batched")
    for r in reqs.values():
        r.wait()
    return bool((got == comm.prev_rank + 1).all())


def body(params):
    import torch

    import megatron_p2p as mp
    from megatron_p2p.communicator import _env_rendezvous

    store = _env_rendezvous()[0]
    me = int(os.environ["RANK"])
    out: dict[str, Any] = {"pid": os.getpid(), "uid": os.getuid()}
    # The transport is created directly (init_communicator would have rank 0 wait for every rank
    # to arrive before it makes the segment): rank 1 holds back its attach to look at it.
    if me == 0:
        secret = torch.tensor(list(os.urandom(SECRET_BYTES)), dtype=torch.uint8)
        name = mp._C.new_unique_id()
        store.set("security/rank0", json.dumps({"pid": os.getpid(), "addr": secret.data_ptr(),
                                                "secret": bytes(secret.tolist()).hex(), "name": name}))
        comm = mp._C.Communicator("shm", name, 0, [0, 1], timeout=120.0)
    else:
        rank0 = json.loads(store.get("security/rank0"))
        segment = find_shm(rank0["pid"])
        st = segment.stat()
        out.update(rank0=rank0, segment=segment.name, mode=st.st_mode & 0o7777, owner=st.st_uid,
                   own_uid=probe(segment, rank0["pid"], rank0["addr"], None))
        if params["other_uid"] is not None:
            out["other_uid"] = probe(segment, rank0["pid"], rank0["addr"], params["other_uid"])
        out["segment_before_attach"] = shm_names(rank0["pid"])
        comm = mp._C.Communicator("shm", rank0["name"], 1, [0, 1], timeout=120.0)
    out["segment_after_init"] = shm_names(json.loads(store.get("security/rank0"))["pid"])
    out["exchanged_exactly"] = exchange_once(torch, comm)
    comm.close()
    mark_end_of_trace()
    return out


if __name__ == "__main__":
    job_params = json.loads(os.environ.get("MP_PARAMS", "{}"))
    if job_params.get("trace_dir") and not os.environ.get("MP_SECURITY_TRACED"):
        run_under_strace(job_params["strace"], job_params["trace_dir"])
    harness.run(body)
