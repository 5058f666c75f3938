"""Creating a communicator when /dev/shm lacks room, on 2 ranks that share a private tmpfs on
/dev/shm (the test runs the job under `unshare -m`). Rank 0 takes the room away with a filler
file, then both ranks create a communicator (params["row"]):

- full: no room left at all;
- too_small: room for a quarter of what the segment needs at most (what creation says when
  there is no room: rank 0 asks alone first), more than the creation check's minimum today,
  less than what a bidirectional exchange over the bounce buffers (single copy off) on both
  lanes touches.

Every rank reports what creation raised and, when it did not, what a 4 MiB exchange raised;
rank 0 finally lists the segments left on the private /dev/shm. The rows run as separate
jobs: a rank that dies of SIGBUS takes its whole report with it.

params: row, timeout (the communicator timeout)."""
import os
import re
from typing import Any

import harness

FILLER = "/dev/shm/fault-filler"
NBYTES = 4 << 20


def leave_free(nbytes):
    """Resizes the filler file so that `nbytes` of /dev/shm stay free."""
    if os.path.exists(FILLER):
        os.unlink(FILLER)
    fs = os.statvfs("/dev/shm")
    take = fs.f_bavail * fs.f_frsize - nbytes
    fd = os.open(FILLER, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        if take > 0:
            os.posix_fallocate(fd, 0, take)
    finally:
        os.close(fd)


def needed_mib(mp):
    """What the segment of this job's group needs at most, as creation with no room says."""
    leave_free(0)
    try:
        mp.Communicator("shm", mp._C.new_unique_id(), 0, [0, 1], timeout=1.0).close()
    except mp.P2PError as exc:
        found = re.search(r"needs up to (\d+) MiB", str(exc))
        if found:
            return int(found.group(1))
        raise
    raise RuntimeError("creation succeeded with no room left in /dev/shm")


def attempt(torch, mp, timeout):
    made = []
    out: dict[str, Any] = {"create": harness.caught(lambda: made.append(mp.init_communicator(timeout=timeout)))}
    for comm in made:
        bufs = {k: torch.full((NBYTES,), comm.rank + 1, dtype=torch.uint8) if k.startswith("send")
                else torch.zeros(NBYTES, dtype=torch.uint8) for k in ("send_next", "recv_prev", "send_prev", "recv_next")}
        out["exchange"] = harness.caught(lambda: [r.wait() for r in comm.exchange(**bufs).values()])
        out["exact"] = all(bool((bufs[k] == 2 - comm.rank).all()) for k in ("recv_prev", "recv_next"))
        comm.close()
    return out


def body(params):
    import torch

    import megatron_p2p as mp

    me = int(os.environ["RANK"])
    out = {}
    if params["row"] == "too_small":
        if me == 0:
            out["needed_mib"] = needed_mib(mp)
            leave_free(out["needed_mib"] << 18)  # a quarter of it
        os.environ["MEGATRON_P2P_SHM_SINGLE_COPY"] = "0"  # large messages go through the segment itself
    elif me == 0:
        leave_free(0)
    harness.barrier("start")
    out[params["row"]] = attempt(torch, mp, params["timeout"])
    harness.barrier("end")
    if me == 0:
        out["segments_left"] = sorted(n for n in os.listdir("/dev/shm") if n.startswith("mp2p-"))
        os.unlink(FILLER)
    return out


harness.run(body)
