"""Failure modes that two live ranks can show, one section each, every section on a communicator
of its own so that one failing section cannot hide the others:

  mismatch   a send and a receive that disagree on size or dtype, then a matched message
  bad_input  arguments rejected before anything is posted, then an exchange on the same comm
  lifetime   a send whose tensor and Request are dropped right after posting
  lifecycle  abort()/close() idempotent; the context manager closes
  abort      abort() on one rank fails the other rank's pending wait fast
  timeout    a receive with no sender times out with a report; the silent peer sees the abort
  shapes     with MEGATRON_P2P_CHECK=1, a send and a receive of the same bytes in other shapes
  answered_then_closed  the receiver answers a send (mismatch, or matched) and then closes with
             an op pending while the sender is stopped: the sender gets the answer, not the close
  clean_exit a peer that closes its communicator and exits is not reported as dead (last: rank 1 exits)

Every expected error is caught and recorded as {type, mro, msg, elapsed}; the test asserts on it.
Runs on 2 ranks."""
import gc
import glob
import os
import time
import traceback
from typing import Any

import harness
from harness import caught

SECTIONS = ("mismatch", "bad_input", "lifetime", "lifecycle", "abort", "timeout", "shapes", "answered_then_closed",
            "clean_exit")


def wait_all(reqs):
    for r in (reqs.values() if isinstance(reqs, dict) else reqs):
        r.wait()


def exchange_check(torch, comm, tag):
    """A full four-op exchange with the other rank; returns whether both payloads were exact."""
    me, peer = comm.rank, 1 - comm.rank
    send_next = torch.full((300,), tag * 10 + me, dtype=torch.float64)
    send_prev = torch.full((300,), -(tag * 10 + me), dtype=torch.float64)
    recv_prev = torch.zeros(300, dtype=torch.float64)
    recv_next = torch.zeros(300, dtype=torch.float64)
    wait_all(comm.exchange(send_next=send_next, recv_prev=recv_prev, send_prev=send_prev, recv_next=recv_next))
    return bool((recv_prev == tag * 10 + peer).all()) and bool((recv_next == -(tag * 10 + peer)).all())


def mismatch(torch, mp, comm):
    """Rank 0 sends, rank 1 receives something else; after each case, a matched message."""
    peer = comm.next_rank
    cases = {
        # name: (what rank 0 sends, what rank 1 receives into)
        "size": (torch.ones(1024, dtype=torch.float32), torch.zeros(2048, dtype=torch.float32)),  # 4 KiB vs 8 KiB
        "dtype": (torch.ones(1024, dtype=torch.float32), torch.zeros(1024, dtype=torch.int32)),  # same 4 KiB
        "size_large": (torch.ones(1 << 18, dtype=torch.float32), torch.zeros(1 << 19, dtype=torch.float32)),  # 1 vs 2 MiB
        "matched": (torch.ones(1024, dtype=torch.float32), torch.zeros(1024, dtype=torch.float32)),
    }
    out = {}
    for k, (name, (sent, buf)) in enumerate(cases.items()):
        if comm.rank == 0:
            res = caught(lambda: comm.isend(sent, peer).wait())
        else:
            res = caught(lambda: comm.irecv(buf, peer).wait())
            if name == "matched":
                res["received_exactly"] = torch.equal(buf, sent)
        res["after_ok"] = exchange_check(torch, comm, k)  # the communicator is still usable
        out[name] = res
    return out


def bad_input(torch, mp, comm):
    """Each bad call is made on both ranks, together with a valid op where the call takes several:
    if anything were posted, the valid op would leak into the exchange checked at the end."""
    peer = comm.next_rank
    poison = torch.full((300,), 666.0, dtype=torch.float64)
    buf = torch.zeros(300, dtype=torch.float64)
    before = comm.stats()
    out = {
        "non_contiguous": caught(lambda: comm.exchange(
            send_next=poison, recv_prev=torch.zeros(300, 2, dtype=torch.float64)[:, 0])),
        "meta_device": caught(lambda: comm.exchange(send_next=poison, recv_prev=torch.empty(4, device="meta"))),
        "peer_out_of_range": caught(lambda: comm.isend(poison, comm.size + 5)),
        "peer_out_of_range_in_batch": caught(lambda: mp.batch_isend_irecv([
            mp.P2POp(mp.isend, poison, peer, comm=comm), mp.P2POp(mp.irecv, buf, 99, comm=comm)])),
        "self_send": caught(lambda: comm.isend(poison, comm.global_rank)),
        "non_tensor": caught(lambda: comm.isend([1.0, 2.0], peer)),
        "non_tensor_in_exchange": caught(lambda: comm.exchange(send_next=poison, recv_prev=[0.0] * 300)),
        "bad_mode": caught(lambda: comm.exchange(send_next=poison, recv_prev=buf, mode="interleaved")),
    }
    other = mp.init_communicator(timeout=10.0)  # collective: both ranks make it and close it
    other.close()
    out["closed_isend"] = caught(lambda: other.isend(poison, peer))
    out["closed_exchange"] = caught(lambda: other.exchange(send_next=poison, recv_prev=buf))
    out["posted_nothing"] = comm.stats() == before
    out["after_ok"] = exchange_check(torch, comm, 7)
    out["after_ok_again"] = exchange_check(torch, comm, 8)
    return out


def lifetime(torch, mp, comm):
    """Rank 0 posts a send and keeps nothing, or keeps the tensor but swaps its storage away
    (`t.data = ...`, as megatron-core's deallocate_output_tensor does); it frees and reuses the
    memory while rank 1 waits before posting its receive. Lane 0 runs in order, so rank 0's ack
    receive ends after the send."""
    peer = comm.next_rank
    out = {}
    for nbytes, how in ((4096, "dropped"), (8 << 20, "dropped"), (8 << 20, "swapped")):
        def pattern():
            return (torch.arange(nbytes, dtype=torch.int32) % 251).to(torch.uint8)

        key = f"{nbytes}-{how}"
        if comm.rank == 0:
            sent = pattern()
            comm.isend(sent, peer)  # the Request is not kept
            if how == "swapped":
                sent.data = torch.empty(1, dtype=torch.uint8)
            else:
                del sent
            gc.collect()
            junk = [torch.full((nbytes,), 0xEE, dtype=torch.uint8) for _ in range(8)]
            ack = torch.zeros(1, dtype=torch.int64)
            comm.irecv(ack, peer).wait()
            del junk
            out[key] = {"ack": int(ack)}
        else:
            time.sleep(1.0)
            got = torch.zeros(nbytes, dtype=torch.uint8)
            comm.irecv(got, peer).wait()
            want = pattern()
            out[key] = {"exact": torch.equal(got, want), "wrong_bytes": int((got != want).sum()),
                        "single_copy": comm.single_copy(peer)}
            comm.isend(torch.ones(1, dtype=torch.int64), peer).wait()
    return out


def lifecycle(torch, mp, comm):
    out = {}
    with mp.init_communicator(timeout=10.0) as ctx:
        out["ctx_closed_inside"] = ctx.closed
        out["ctx_exchange_ok"] = exchange_check(torch, ctx, 1)
    out["ctx_closed_after"] = ctx.closed
    out["ctx_use_after"] = caught(lambda: ctx.isend(torch.zeros(4), ctx.next_rank))

    twice = mp.init_communicator(timeout=10.0)
    out["abort_twice"] = caught(lambda: (twice.abort(), twice.abort()))
    out["use_after_abort"] = caught(lambda: twice.isend(torch.zeros(4), twice.next_rank))
    out["close_twice"] = caught(lambda: (twice.close(), twice.close()))
    out["closed_after_close"] = twice.closed
    out["abort_after_close"] = caught(twice.abort)
    return out


def abort(torch, mp, comm):
    """Rank 0 aborts after a second, saying why; rank 1 is waiting on a receive from it with a 60 s
    timeout."""
    if comm.rank == 0:
        time.sleep(1.0)
        comm.abort(reason="the loss went NaN")
        return {"use_after_abort": caught(lambda: comm.isend(torch.zeros(4), comm.next_rank))}
    req = comm.irecv(torch.zeros(4), comm.prev_rank)
    return {"pending_wait": caught(lambda: req.wait(timeout=60.0))}


def timeout(torch, mp, comm, secs):
    """First a late sender inside the timeout (completes), then a receive with no sender at all:
    rank 0 times out. Rank 1 posts nothing it could match and computes meanwhile (were it
    waiting too, the two waits would be a deadlock, raised at once), then waits with a long
    timeout."""
    peer = comm.next_rank
    out = {"timeout": comm.timeout}
    if comm.rank == 0:
        buf = torch.zeros(1024, dtype=torch.float32)  # 4096 bytes
        req = comm.irecv(buf, peer)
        out["late_sender"] = caught(req.wait)
        out["late_sender_exact"] = bool((buf == 5.0).all())
        req = comm.irecv(buf, peer)
        out["no_sender"] = caught(req.wait)
    else:
        time.sleep(min(1.0, secs / 3))
        comm.isend(torch.full((1024,), 5.0), peer).wait()
        req = comm.irecv(torch.zeros(16, dtype=torch.int64), peer)  # from the rank that will time out
        time.sleep(secs + 1.0)
        out["silent_peer"] = caught(lambda: req.wait(timeout=120.0))
    return out


def shapes(torch, mp, comm):
    """Rank 0 sends [rows, cols] float32, rank 1 receives into [cols, rows] (the [s, b, h] against
    [b, s, h] bug: the same bytes), small (in the slot) and large (copied), on communicators made
    with MEGATRON_P2P_CHECK=1; then each size with agreeing shapes, and with the transposed
    shapes on a communicator without it."""
    out = {}
    for check in ("1", "0"):
        os.environ["MEGATRON_P2P_CHECK"] = check
        try:
            c = mp.init_communicator(timeout=20.0)
        finally:
            del os.environ["MEGATRON_P2P_CHECK"]
        for size, (rows, cols) in (("small", (10, 20)), ("large", (512, 1024))):
            for agree in ((False, True) if check == "1" else (False,)):
                sent = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)
                buf = torch.zeros((rows, cols) if agree else (cols, rows))
                if comm.rank == 0:
                    res = caught(lambda: c.isend(sent, 1).wait())
                else:
                    res = caught(lambda: c.irecv(buf, 0).wait())
                    res["arrived"] = torch.equal(buf.flatten(), sent.flatten())
                out[f"check={check} {size} {'agree' if agree else 'transposed'}"] = res
        c.close()
    return out


def answered_then_closed(torch, mp, comm):
    """Rank 0 posts a send of 1024 floats; rank 1 stops rank 0's process (SIGSTOP), receives it into
    2048 floats (a mismatch) or 1024 (matched), posts a receive nobody sends and closes the
    communicator with it pending, then resumes rank 0. Rank 0's engine then meets the answer and
    the close's abort in the same pass: its wait must give the answer."""
    import signal

    mine, theirs = torch.tensor([os.getpid()]), torch.zeros(1, dtype=torch.int64)
    wait_all(mp.batch_isend_irecv([mp.P2POp(mp.isend, mine, comm.next_rank, comm=comm),
                                   mp.P2POp(mp.irecv, theirs, comm.next_rank, comm=comm)]))
    sender_pid = int(theirs) if comm.rank == 1 else os.getpid()
    out = {}
    for name, numel in (("mismatch", 2048), ("matched", 1024)):
        c = mp.init_communicator(timeout=20.0)
        if comm.rank == 0:
            req = c.isend(torch.ones(1024), 1)
            time.sleep(0.2)  # the progress thread publishes the send before the process is stopped
            _barrier(torch, comm)
            out[name] = caught(req.wait)
        else:
            _barrier(torch, comm)
            os.kill(sender_pid, signal.SIGSTOP)
            while _state(sender_pid) != "T":
                time.sleep(0.001)
            out[name] = caught(lambda: c.irecv(torch.zeros(numel), 0).wait())
            c.irecv(torch.zeros(1), 0)  # pending at the close
            c.close()
            os.kill(sender_pid, signal.SIGCONT)
        _barrier(torch, comm)
        c.close()
    return out


def clean_exit(torch, mp, comm):
    """Rank 1 tells rank 0 its pid, closes, and exits; rank 0 waits until that process is gone,
    then keeps using the communicator (a self exchange) and must see no failure."""
    peer = comm.next_rank
    pid = torch.tensor([os.getpid()], dtype=torch.int64)
    if comm.rank == 1:
        comm.isend(pid, peer).wait()
        comm.close()
        return {}
    comm.irecv(pid, peer).wait()
    start = time.monotonic()
    while time.monotonic() - start < 30 and _alive(int(pid)):
        time.sleep(0.02)
    out: dict[str, Any] = {"peer_gone": not _alive(int(pid))}
    time.sleep(0.5)  # many liveness periods
    mine = torch.arange(10.0)
    got = torch.zeros(10)
    out["self_exchange"] = caught(lambda: wait_all(mp.batch_isend_irecv([
        mp.P2POp(mp.isend, mine, comm.global_rank, comm=comm), mp.P2POp(mp.irecv, got, comm.global_rank, comm=comm)])))
    out["self_exchange_exact"] = torch.equal(got, mine)
    return out


def _state(pid):
    """The process's state letter (R, S, T stopped, Z zombie, ...); None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def _alive(pid):
    return _state(pid) not in (None, "Z")  # a zombie has exited


def _barrier(torch, comm):
    token = torch.zeros(1)
    reqs = comm.exchange(send_prev=token, recv_next=torch.empty(1), mode="parity")  # lane 1: lane 0 counts stay
    for r in reqs.values():
        r.wait()


def body(params):
    import torch

    import megatron_p2p as mp

    results: dict[str, Any] = {"pid": os.getpid()}
    for name in params.get("sections", SECTIONS):
        secs = params.get("timeout", 3.0) if name == "timeout" else 20.0
        try:
            comm = mp.init_communicator(timeout=secs)
            # Every rank unlinks the segment's name before init returns (the test keeps the names
            # made by this job's ranks: other jobs may run at the same time).
            results.setdefault("segments_after_init", []).extend(
                os.path.basename(p) for p in glob.glob("/dev/shm/mp2p-*"))
            _barrier(torch, comm)  # no rank reaches the next section's init before all have looked
            fn = globals()[name]
            results[name] = fn(torch, mp, comm, secs) if name == "timeout" else fn(torch, mp, comm)
            comm.close()
        except Exception as exc:  # unexpected: recorded, and the next section goes on
            results[name] = {"unexpected": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    return results


harness.run(body)
