"""A communicator belongs to the process that created it: fork children of both ranks, one case
per section, each case on a communicator of its own (2 ranks, shm):

  parent_calls  no fork: the creating process makes every call (the "must not be reported" twin)
  os_exit       os.fork(), the child calls os._exit(0)
  sys_exit      os.fork(), the child calls sys.exit(0): interpreter shutdown, atexit, GC
  mp_process    multiprocessing.get_context("fork").Process with a target that does nothing
  dataloader    torch DataLoader, num_workers=2, fork start method, iterated to the end
  uses_comm     os.fork(), the child makes every call on the inherited communicator (each must
                raise P2PError at once), closes it and exits with sys.exit(0)

Every section: both ranks create a communicator, exchange once (keeping a completed Request),
leave one receive pending into a buffer from comm.empty() (all but parent_calls), note the
shared memory of the communicator they map, run their child (both ranks at once), meet at a
store barrier, complete the pending receive (its message is the first thing the peer sends after
the children), exchange three more rounds with known data both ways, note their mappings and
this job's /dev/shm entries again, and close. A child's outcome is its wait status, its stderr
(fd 2 is a temporary file while it runs) and, for os.fork children, a JSON report through a
pipe. Children have a wall-clock limit, past which they are killed and reported hung.

Every section runs on both ranks whatever the other did: a rank that fails records the
traceback and still arrives at the section's barriers."""
import faulthandler
import json
import os
import select
import sys
import tempfile
import time
import traceback
from typing import Any

import harness
from harness import caught

SECTIONS = ("parent_calls", "os_exit", "sys_exit", "mp_process", "dataloader", "uses_comm")
CHILD_LIMIT = 10.0  # seconds a child may live before it is killed and reported hung
BARRIER_LIMIT = 90.0
N = 300  # elements per message (float64)

MAIN_PID = os.getpid()
_child_exit_code = None  # set by an os.fork child before it raises SystemExit through harness.run


# ---- rank synchronisation through torchrun's store ----------------------------------------------


class Barriers:
    def __init__(self, store, world):
        self.store, self.world, self.arrived = store, world, set()

    def arrive(self, key):
        if key not in self.arrived:
            self.arrived.add(key)
            self.store.add(f"fork_cases/{key}", 1)

    def wait(self, key):
        self.arrive(key)
        deadline = time.monotonic() + BARRIER_LIMIT
        while int(self.store.add(f"fork_cases/{key}", 0)) < self.world:
            if time.monotonic() > deadline:
                raise TimeoutError(f"barrier {key} not reached by every rank within {BARRIER_LIMIT} s")
            time.sleep(0.005)


# ---- helpers --------------------------------------------------------------------------------------


def segments_of(pids):
    """This job's /dev/shm entries of the package (names "mp2p-<pid>...")."""
    out = []
    for name in os.listdir("/dev/shm"):
        if name.startswith("mp2p-"):
            pid = name.split("-")[1]
            if pid.isdigit() and int(pid) in pids:
                out.append(name)
    return sorted(out)


def mapped_segments():
    """The package's shared memory this process maps (the segment and the arenas: unlinked once
    every rank has attached, so they are only seen here)."""
    with open("/proc/self/maps") as f:
        return sorted({line.split(None, 5)[-1].strip() for line in f if "/mp2p-" in line})


def child_pids(child):
    """The pids of a section's children, whatever kind they are."""
    if not child:
        return []
    return [p for p in ([child.get("pid")] + list(child.get("pids") or [])) if p]


def value(case, k, rank, what):
    """The known payload of message (case, round k, sender rank, op)."""
    return 1000.0 * (case + 1) + 100.0 * k + 10.0 * rank + {"next": 1, "prev": 2, "one": 3, "pending": 4}[what]


def wait_all(reqs):
    for r in (reqs.values() if isinstance(reqs, dict) else reqs):
        r.wait()


def check_rounds(torch, comm, case, rounds=(1, 2, 3)):
    """Exchanges with the peer (all four ops, then an isend/irecv pair on lane 0 each way); returns
    per round whether every payload received is exactly the peer's. A payload that a child posted
    (poison, -7) and the peer received instead would show here."""
    me, peer = comm.rank, 1 - comm.rank
    out = {}
    for k in rounds:
        bufs = {"recv_prev": torch.zeros(N, dtype=torch.float64), "recv_next": torch.zeros(N, dtype=torch.float64)}
        wait_all(comm.exchange(
            send_next=torch.full((N,), value(case, k, me, "next"), dtype=torch.float64), recv_prev=bufs["recv_prev"],
            send_prev=torch.full((N,), value(case, k, me, "prev"), dtype=torch.float64), recv_next=bufs["recv_next"]))
        one = torch.zeros(N, dtype=torch.float64)
        mine = torch.full((N,), value(case, k, me, "one"), dtype=torch.float64)
        if me == 0:
            comm.isend(mine, peer).wait()
            comm.irecv(one, peer).wait()
        else:
            comm.irecv(one, peer).wait()
            comm.isend(mine, peer).wait()
        got = {"recv_prev": bufs["recv_prev"], "recv_next": bufs["recv_next"], "one": one}
        want = {"recv_prev": value(case, k, peer, "next"), "recv_next": value(case, k, peer, "prev"),
                "one": value(case, k, peer, "one")}
        out[k] = {name: {"exact": bool((t == want[name]).all()), "first": float(t[0]), "want": want[name]}
                  for name, t in got.items()}
    return out


def post_pending(torch, comm, case):
    """A receive left pending across the fork, into a buffer from the receive arena: rank 0's on
    lane 0 (irecv), rank 1's on lane 1 (recv_next), so that completing both after the children
    cannot cross. Whatever a child does at its exit (closing what it inherited, freeing the
    buffer) must not fail it or the parent's arena."""
    buf = comm.empty((N,), torch.float64)  # in the receive arena, as megatron-core's buffers are
    buf.zero_()
    if comm.rank == 0:
        return comm.irecv(buf, 1), buf
    return comm.exchange(recv_next=buf)["recv_next"], buf


def complete_pending(torch, comm, case, pending):
    """The first message each rank sends after the children is the one the peer's pending receive
    waits for; the pending receive must get exactly it."""
    req, buf = pending
    me, peer = comm.rank, 1 - comm.rank
    mine = torch.full((N,), value(case, 0, me, "pending"), dtype=torch.float64)
    if me == 0:
        send = comm.exchange(send_prev=mine)["send_prev"]  # matched by rank 1's recv_next
    else:
        send = comm.isend(mine, 0)  # matched by rank 0's irecv
    req.wait()
    send.wait()
    return {"exact": bool((buf == value(case, 0, peer, "pending")).all()), "first": float(buf[0]),
            "want": value(case, 0, peer, "pending")}


def child_calls(torch, comm, peer, done_req, pending_req):
    """Every call on the communicator and on its Requests, each recorded with caught(). Sends
    carry poison (-7) of the same size and dtype as the parent's, so a send that got through would
    be received by the peer in place of the parent's next message."""
    poison = lambda: torch.full((N,), -7.0, dtype=torch.float64)  # noqa: E731
    buf = lambda: torch.zeros(N, dtype=torch.float64)  # noqa: E731
    calls = {}
    calls["exchange"] = caught(lambda: comm.exchange(send_next=poison(), recv_prev=buf(), send_prev=poison(),
                                                     recv_next=buf()))
    calls["exchange_batched"] = caught(lambda: comm.exchange(send_next=poison(), recv_prev=buf(), mode="batched"))
    calls["isend"] = caught(lambda: comm.isend(poison(), peer))
    calls["irecv"] = caught(lambda: comm.irecv(buf(), peer))
    calls["batch"] = caught(lambda: comm.batch([(True, poison(), peer), (False, buf(), peer)]))
    calls["wait_completed"] = caught(lambda: done_req.wait(timeout=1.5))
    calls["synchronize_completed"] = caught(lambda: done_req.synchronize(timeout=1.5))
    calls["is_completed_completed"] = caught(lambda: done_req.is_completed())
    calls["wait_pending"] = caught(lambda: pending_req.wait(timeout=1.5))
    calls["synchronize_pending"] = caught(lambda: pending_req.synchronize(timeout=1.5))
    calls["is_completed_pending"] = caught(lambda: pending_req.is_completed())
    calls["stats"] = caught(lambda: comm.stats())
    calls["empty"] = caught(lambda: comm.empty((N,), torch.float64))
    calls["abort"] = caught(lambda: comm.abort())
    return calls


# ---- running a child ------------------------------------------------------------------------------


def _redirected_stderr():
    """A temporary file (already unlinked) that becomes fd 2 for what is forked while it is in place."""
    sys.stderr.flush()
    errfile = tempfile.TemporaryFile()
    saved = os.dup(2)
    os.dup2(errfile.fileno(), 2)
    return errfile, saved


def _restore_stderr(saved):
    sys.stderr.flush()
    os.dup2(saved, 2)
    os.close(saved)


def _read_back(errfile):
    errfile.seek(0)
    text = errfile.read().decode(errors="replace")
    errfile.close()
    return text


def reap(pid, rfd):
    """Waits (bounded) for an os.fork child, reading its report from the pipe meanwhile."""
    deadline = time.monotonic() + CHILD_LIMIT
    data, status, hung = b"", None, False
    os.set_blocking(rfd, False)
    eof = False
    while True:
        if not eof:
            ready, _, _ = select.select([rfd], [], [], 0.02)
            if ready:
                chunk = os.read(rfd, 65536)
                data += chunk
                eof = not chunk
        done, st = os.waitpid(pid, os.WNOHANG)
        if done:
            status = st
            if not eof:  # drain what is left
                try:
                    while chunk := os.read(rfd, 65536):
                        data += chunk
                except BlockingIOError:
                    pass
            break
        if time.monotonic() > deadline:
            hung = True
            os.kill(pid, 9)
            _, status = os.waitpid(pid, 0)
            break
        if eof:
            time.sleep(0.005)
    os.close(rfd)
    report = None
    if data:
        try:
            report = json.loads(data.decode())
        except ValueError:
            report = {"unparsable": data.decode(errors="replace")[-2000:]}
    return {"exitcode": os.waitstatus_to_exitcode(status), "hung": hung, "report": report}


def fork_child(kind, torch, comm, peer, done_req, pending_req):
    """os.fork(); the child does `kind` and exits; the parent collects its outcome."""
    global _child_exit_code
    rfd, wfd = os.pipe()
    errfile, saved = _redirected_stderr()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # ---- the child
        try:
            os.close(rfd)
            report = {"pid": os.getpid(), "ppid": os.getppid(), "parent": parent, "maps": mapped_segments()}
            if kind == "uses_comm":
                report["calls"] = child_calls(torch, comm, peer, done_req, pending_req)
                report["close"] = caught(lambda: comm.close())
            os.write(wfd, json.dumps(report).encode())
            os.close(wfd)
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(70)
        if kind == "os_exit":
            os._exit(0)
        # sys_exit, uses_comm: the genuine interpreter exit. harness.run catches the SystemExit and
        # writes this rank's result file (the parent overwrites it later: it waits for this child
        # first); the module then calls sys.exit(_child_exit_code) at top level.
        _child_exit_code = 0
        sys.exit(0)
    # ---- the parent
    _restore_stderr(saved)
    os.close(wfd)
    start = time.monotonic()
    out = reap(pid, rfd)
    out.update(pid=pid, stderr=_read_back(errfile)[-6000:], seconds=time.monotonic() - start)
    return out


def _nothing():
    pass


def mp_child():
    import multiprocessing

    errfile, saved = _redirected_stderr()
    try:
        p = multiprocessing.get_context("fork").Process(target=_nothing)
        p.start()
    finally:
        _restore_stderr(saved)
    start = time.monotonic()
    p.join(CHILD_LIMIT)
    hung = p.is_alive()
    if hung:
        p.kill()
        p.join()
    return {"pid": p.pid, "exitcode": p.exitcode, "hung": hung, "stderr": _read_back(errfile)[-6000:],
            "seconds": time.monotonic() - start}


class _Items:
    def __len__(self):
        return 16

    def __getitem__(self, i):
        import torch

        return torch.tensor([i, os.getpid()], dtype=torch.int64)


def dataloader_children(torch):
    errfile, saved = _redirected_stderr()
    out: dict[str, Any] = {"error": None}
    workers = []
    start = time.monotonic()
    try:
        loader = torch.utils.data.DataLoader(_Items(), batch_size=2, num_workers=2, multiprocessing_context="fork",
                                             timeout=CHILD_LIMIT)
        it = iter(loader)
        workers = list(getattr(it, "_workers", []))
        items, pids = [], set()
        for batch in it:
            items += batch[:, 0].tolist()
            pids |= set(batch[:, 1].tolist())
        out["items_exact"] = sorted(items) == list(range(16))
        out["worker_pids"] = sorted(pids)
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        _restore_stderr(saved)
    hung = False
    codes = []
    for w in workers:
        w.join(CHILD_LIMIT)
        if w.is_alive():
            hung = True
            w.kill()
            w.join()
        codes.append(w.exitcode)
    out.update(pids=[w.pid for w in workers], exitcodes=codes, hung=hung, stderr=_read_back(errfile)[-6000:],
               seconds=time.monotonic() - start)
    return out


# ---- the sections ---------------------------------------------------------------------------------


def parent_calls(torch, comm, case):
    """The creating process makes the calls a fork child may not; each is matched by the peer."""
    me, peer = comm.rank, 1 - comm.rank
    mine = lambda what: torch.full((N,), value(case, 9, me, what), dtype=torch.float64)  # noqa: E731
    want = lambda what: value(case, 9, peer, what)  # noqa: E731
    calls, exact = {}, {}
    bufs = [torch.zeros(N, dtype=torch.float64) for _ in range(6)]
    reqs: dict[str, Any] = {}
    calls["exchange"] = caught(lambda: reqs.update(x=comm.exchange(
        send_next=mine("next"), recv_prev=bufs[0], send_prev=mine("prev"), recv_next=bufs[1])))
    calls["wait"] = caught(lambda: wait_all(reqs["x"]))
    exact["exchange"] = bool((bufs[0] == want("next")).all()) and bool((bufs[1] == want("prev")).all())
    if me == 0:
        calls["isend"] = caught(lambda: reqs.update(s=comm.isend(mine("one"), peer)))
        calls["synchronize"] = caught(lambda: reqs["s"].synchronize())
        calls["irecv"] = caught(lambda: reqs.update(r=comm.irecv(bufs[2], peer)))
        calls["wait_irecv"] = caught(lambda: reqs["r"].wait())
    else:
        calls["irecv"] = caught(lambda: reqs.update(r=comm.irecv(bufs[2], peer)))
        calls["wait_irecv"] = caught(lambda: reqs["r"].wait())
        calls["isend"] = caught(lambda: reqs.update(s=comm.isend(mine("one"), peer)))
        calls["synchronize"] = caught(lambda: reqs["s"].synchronize())
    exact["irecv"] = bool((bufs[2] == want("one")).all())
    calls["is_completed"] = caught(lambda: reqs.update(done=reqs["r"].is_completed() and reqs["s"].is_completed()))
    exact["is_completed_true"] = reqs.get("done") is True
    calls["batch"] = caught(lambda: reqs.update(b=comm.batch([(True, mine("pending"), peer), (False, bufs[3], peer)])))
    calls["wait_batch"] = caught(lambda: wait_all(reqs["b"]))
    exact["batch"] = bool((bufs[3] == want("pending")).all())
    calls["exchange_batched"] = caught(lambda: reqs.update(y=comm.exchange(
        send_next=mine("next"), recv_prev=bufs[4], mode="batched")))
    calls["wait_batched"] = caught(lambda: wait_all(reqs["y"]))
    exact["exchange_batched"] = bool((bufs[4] == want("next")).all())
    calls["stats"] = caught(lambda: comm.stats())
    calls["empty"] = caught(lambda: reqs.update(e=comm.empty((N,), torch.float64)))
    exact["empty_shape"] = "e" in reqs and tuple(reqs["e"].shape) == (N,)
    reqs.pop("e", None)
    return {"calls": calls, "exact": exact}


def section(name, case, torch, mp, store_barriers, pids, params):
    me = int(os.environ["RANK"])
    out: dict[str, Any] = {}
    comm = None
    try:
        comm = mp.init_communicator(timeout=params.get("timeout", 5.0))
        peer = 1 - comm.rank
        # A first exchange: its receive's Request stays, completed, for the child to wait on.
        got = torch.zeros(N, dtype=torch.float64)
        reqs = comm.exchange(send_next=torch.full((N,), value(case, 0, me, "next"), dtype=torch.float64),
                             recv_prev=got)
        wait_all(reqs)
        done_req = reqs["recv_prev"]
        out["before_exact"] = bool((got == value(case, 0, peer, "next")).all())
        pending = post_pending(torch, comm, case) if name != "parent_calls" else None
        out["maps_before"] = mapped_segments()
        if name == "parent_calls":
            out["parent"] = parent_calls(torch, comm, case)
        elif name in ("os_exit", "sys_exit", "uses_comm"):
            out["child"] = fork_child(name, torch, comm, peer, done_req, pending[0] if pending else None)
        elif name == "mp_process":
            out["child"] = mp_child()
        elif name == "dataloader":
            out["child"] = dataloader_children(torch)
        store_barriers.wait(f"{name}/children_done")
        if pending is not None:
            out["pending"] = complete_pending(torch, comm, case, pending)
        out["after"] = check_rounds(torch, comm, case)
        out["maps_after"] = mapped_segments()
        # Nothing named after this job's ranks or children is in /dev/shm (the segment and arenas
        # are unlinked once attached; a child must not create or re-create any).
        out["shm_now"] = segments_of(set(pids) | set(child_pids(out.get("child"))))
    except Exception as exc:
        out["unexpected"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()
    finally:
        # An os.fork child leaving through sys.exit passes here too: it must not touch the store
        # or close anything explicitly (its exit alone is the case).
        if os.getpid() == MAIN_PID:
            store_barriers.arrive(f"{name}/children_done")
            try:
                store_barriers.wait(f"{name}/end")
            except Exception as exc:
                out.setdefault("unexpected", f"{type(exc).__name__}: {exc}")
            if comm is not None:
                out["close"] = caught(lambda: comm.close())
    return out


def body(params):
    import torch
    import torch.distributed as dist

    import megatron_p2p as mp

    faulthandler.enable()  # a crash (in a child too) names itself on fd 2
    store, me, world = next(dist.rendezvous("env://"))
    barriers = Barriers(store, world)
    store.set(f"fork_cases/pid/{me}", str(os.getpid()))
    pids = {int(store.get(f"fork_cases/pid/{r}")) for r in range(world)}
    result = {"pid": os.getpid(), "pids": sorted(pids)}
    only = params.get("sections") or SECTIONS
    for case, name in enumerate(SECTIONS):
        if name in only:
            result[name] = section(name, case, torch, mp, barriers, pids, params)
    return result


harness.run(body)
if os.getpid() != MAIN_PID:  # an os.fork child that left through sys.exit (see fork_child)
    sys.exit(_child_exit_code if _child_exit_code is not None else 71)
