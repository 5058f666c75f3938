"""The faults job of the two-process device checks (two_process_worker.py runs the parts, in this
order; two_process_checks.py launches them with FAULTS_ENV): what a user's mistake or a peer's
failure must produce over NCCL, each case that must be reported beside one that must not.

- naive_ring:   the send-first ring (isend to the next rank, then irecv from the previous one,
                each its own call), with messages above what NCCL can buffer, is a DeadlockError
                on both ranks within DEADLOCK_WITHIN_S under a 300 s timeout; the same ring of
                1 KiB messages, which NCCL buffers, completes unreported and exact;
- never_posts:  a rank that never posts: its peer's host wait raises P2PTimeoutError at the
                timeout with the group's picture, its posts and close() return at once, and the
                silent rank's next call hears of the abort; a peer that posts late but within
                the timeout completes;
- size_mismatch: MEGATRON_P2P_CHECK=1 and a send of more bytes than its receive: named, with
                both sizes, on both ranks; agreeing sizes before it are delivered;
- replay:       `python -m megatron_p2p.replay --backend nccl` of a shipped program that completes
                (OK) and of a shipped deadlocking one, its messages made larger than NCCL can
                buffer: each verdict is the checker's for NCCL's buffering (simulate with
                buffered_at_most);
- peer_death:   rank 1 SIGKILLed while rank 0 waits on it: PeerFailureError naming it within
                PEER_DEATH_WITHIN_S of the death. Last: torchrun ends the job once a rank dies.

Each needs two ranks; a lone rank (the self-loop) reports the part as not run.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import target
import torch
from two_process_common import (
    T,
    checked_communicator,
    communicator,
    disagreement,
    full,
    pattern,
    raised,
    same_bytes,
    settle,
    zeros,
)

import megatron_p2p as mp
from megatron_p2p.communicator import _env_rendezvous
from megatron_p2p.verify import program, replay, simulate  # replay: its _tensor is patched below

# NCCL's own parameters, so that what it may buffer (Communicator.buffered_at_most) is 1 MiB: one
# channel of NCCL_STEPS (8) steps of 128 KiB (csrc/nccl/nccl_buffering.c). The model buffers sends
# of up to MPFAKE_NCCL_EAGER_BYTES as NCCL does (src/device/prims_simple.h waitPeer); NCCL ignores it.
FAULTS_ENV = {"NCCL_MAX_P2P_NCHANNELS": "1", "NCCL_BUFFSIZE": str(1 << 20), "MPFAKE_NCCL_EAGER_BYTES": "4096"}
DEADLOCK_WITHIN_S = 3.0
DEADLOCK_TIMEOUT_S = 300.0
BUFFERED_BYTES = 1 << 10
NEVER_POSTS_TIMEOUT_S = 3.0
PEER_DEATH_WITHIN_S = 2.0


def _two_ranks(part: Callable[[mp.Communicator], dict], **kwargs: Any) -> Callable[[], dict]:
    """`part` on a fresh communicator; on a lone rank, not run (each case needs a peer)."""
    def run() -> dict:
        comm = communicator(**kwargs)
        try:
            if comm.size < 2:
                return {"detail": "not run: one rank (the self-loop) has no peer", "skipped": True}
            return part(comm)
        finally:
            comm.close()
    run.__doc__ = part.__doc__
    return run


def _ring(comm: mp.Communicator, nbytes: int, timeout: float) -> tuple[BaseException | None, float, bool]:
    """isend to the next rank, then irecv from the previous one, then host waits on both: (what
    the waits raised, when, whether the bytes are exact)."""
    sent = pattern(nbytes, torch.uint8, "ring", nbytes, comm.rank)
    got = zeros(nbytes, dtype=torch.uint8)
    start = time.monotonic()
    s = comm.isend(sent, comm.next_rank)
    r = comm.irecv(got, comm.prev_rank)
    exc, _ = raised(lambda: settle([s, r], timeout=timeout))
    elapsed = time.monotonic() - start
    return exc, elapsed, exc is None and same_bytes(got, pattern(nbytes, torch.uint8, "ring", nbytes, comm.prev_rank))


def naive_ring(comm: mp.Communicator) -> dict:
    """The send-first ring: a deadlock above NCCL's buffering, named on both ranks; below it, done."""
    small_exc, small_s, small_exact = _ring(comm, BUFFERED_BYTES, timeout=30.0)
    bound = comm.buffered_at_most
    with communicator(timeout=DEADLOCK_TIMEOUT_S) as strict:
        big_exc, big_s, _ = _ring(strict, 4 * bound, timeout=DEADLOCK_TIMEOUT_S)
    assert small_exc is None and small_exact, f"a ring of {BUFFERED_BYTES} B sends (NCCL buffers them): {small_exc!r}"
    assert isinstance(big_exc, mp.DeadlockError), f"a ring of {4 * bound} B sends: {big_exc!r} after {big_s:.1f} s"
    assert big_s < DEADLOCK_WITHIN_S, f"the deadlock was named after {big_s:.2f} s (limit {DEADLOCK_WITHIN_S} s)"
    message = str(big_exc)
    for says in ("this wait-for cycle can never resolve", f"is blocked on isend to rank {comm.next_rank}"):
        assert says in message, f"{says!r} not in: {message}"
    return {"detail": f"{4 * bound} B ring (NCCL buffers at most {bound} B): DeadlockError in {big_s:.2f} s under a "
                      f"{DEADLOCK_TIMEOUT_S:.0f} s timeout; {BUFFERED_BYTES} B ring: completed exact in {small_s:.2f} s",
            "deadlock_s": big_s, "buffered_at_most": bound, "report": message[:1500]}


def never_posts(comm: mp.Communicator) -> dict:
    """Rank 1 posts late within the timeout (delivered), then never (rank 0 times out)."""
    x, y = full(1 << 10, float(comm.rank)), zeros(1 << 10)
    late_s = NEVER_POSTS_TIMEOUT_S / 3
    with communicator(timeout=NEVER_POSTS_TIMEOUT_S) as short:
        if comm.rank == 1:
            time.sleep(late_s)
        late_exc, late_wait = raised(lambda: settle(short.exchange(send_next=x, recv_prev=y),
                                                    timeout=NEVER_POSTS_TIMEOUT_S))
        late_exact = late_exc is None and same_bytes(y, full(1 << 10, float(comm.prev_rank)))
        if comm.rank == 1:
            time.sleep(NEVER_POSTS_TIMEOUT_S + 3.0)  # posts nothing: rank 0's timeout, then its relayed abort
            exc, elapsed = raised(lambda: settle(short.exchange(send_next=x, recv_prev=y), timeout=5.0))
            assert late_exact, f"an exchange posted {late_s:.1f} s late: {late_exc!r}"
            assert isinstance(exc, mp.P2PError) and elapsed < 1.0, f"the silent rank's next call: {exc!r}, {elapsed:.1f} s"
            assert "rank 0" in str(exc), str(exc)
            return {"detail": f"a post {late_s:.1f} s late was delivered; after staying silent its next call raised "
                              f"{type(exc).__name__} in {elapsed:.2f} s, naming rank 0"}
        posted = time.monotonic()
        reqs = short.exchange(send_next=x, recv_prev=y, call="unanswered")
        post_s = time.monotonic() - posted
        exc, _ = raised(lambda: settle(reqs, timeout=60.0))  # the communicator's timeout ends it, not this
        raised_after = time.monotonic() - posted
        close_exc, close_s = raised(short.close)
    message = str(exc)
    assert late_exact, f"an exchange with a peer {late_s:.1f} s late: {late_exc!r} after {late_wait:.1f} s"
    assert post_s < 0.5, f"posting took {post_s:.2f} s: the posting thread waited inside a call"
    assert isinstance(exc, mp.P2PTimeoutError), f"waiting on a peer that never posts: {exc!r}"
    assert NEVER_POSTS_TIMEOUT_S <= raised_after < NEVER_POSTS_TIMEOUT_S + 2.0, f"raised after {raised_after:.2f} s"
    for says in ("pending ops of rank 0", "send_next to rank 1", "the group as its stalled ranks published it"):
        assert says in message, f"{says!r} not in: {message}"
    assert close_exc is None and close_s < 2.0, f"close() after the timeout: {close_exc!r} in {close_s:.2f} s"
    return {"detail": f"a peer {late_s:.1f} s late: delivered; a peer that never posts: posted in {post_s * 1e3:.1f} ms, "
                      f"P2PTimeoutError with the group's picture at {raised_after:.2f} s (timeout "
                      f"{NEVER_POSTS_TIMEOUT_S} s), close() in {close_s:.2f} s",
            "raised_after_s": raised_after, "post_s": post_s, "report": message[:1500]}


def size_mismatch(comm: mp.Communicator) -> dict:
    """Debug matching: agreeing sizes delivered; rank 0 sending 1000 floats into 999 named on both."""
    with checked_communicator(timeout=20.0) as checked:
        agree = zeros(1000)
        ops: mp._C._ExchangeTensors = {"send_next": full(1000, 7.0)} if comm.rank == 0 else {"recv_prev": agree}
        settle(checked.exchange(**ops, call="agreeing"))
        assert comm.rank == 0 or same_bytes(agree, full(1000, 7.0)), "agreeing sizes delivered wrong bytes"
        ops = {"send_next": full(1000, 1.0)} if comm.rank == 0 else {"recv_prev": zeros(999)}
        exc, elapsed, _ = disagreement(checked, ops, "too_big", sender=comm.rank == 0)
    message = str(exc)
    assert isinstance(exc, mp.P2PError), f"rank {comm.rank} of a size disagreement: {exc!r}"
    for says in ("sends 4000 bytes", "receives 3996 bytes", "rank 0's send_next", "rank 1's recv_prev"):
        assert says in message, f"{says!r} not in rank {comm.rank}'s error: {message}"
    assert comm.rank == 0 or isinstance(exc, mp.MismatchError), f"the receiver raised {exc!r}"
    assert elapsed < 10.0, f"the disagreement took {elapsed:.1f} s to surface"
    return {"detail": f"{type(exc).__name__} naming both ranks and both sizes in {elapsed:.2f} s; agreeing sizes exact",
            "error": message[:800]}


def peer_death(comm: mp.Communicator) -> dict:
    """Rank 1 dies by SIGKILL once rank 0 waits on it (torchrun's store carries the moment)."""
    store, _, _ = _env_rendezvous()
    got = zeros(1 << 16)
    settle(comm.exchange(send_next=full(1 << 16, 1.0), recv_prev=got))  # both ranks up and connected
    if comm.rank == 1:
        store.wait(["mp_gpu/peer_death/posted"])
        time.sleep(0.3)  # rank 0 is in its host wait
        store.set("mp_gpu/peer_death/died_at", repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    # torchrun sends SIGTERM to the job once a rank has died: this rank reports first.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    req = comm.irecv(got, comm.prev_rank)
    store.set("mp_gpu/peer_death/posted", "1")
    exc, _ = raised(lambda: settle([req], timeout=60.0))
    ended = time.time()
    after = ended - float(store.get("mp_gpu/peer_death/died_at"))
    next_exc, next_s = raised(lambda: comm.exchange(send_next=full(4, 1.0)))
    assert isinstance(exc, mp.PeerFailureError), f"waiting on a killed peer: {exc!r}"
    assert "rank 1 (pid" in str(exc) and "is gone" in str(exc), str(exc)
    assert after < PEER_DEATH_WITHIN_S, f"reported {after:.2f} s after the death (limit {PEER_DEATH_WITHIN_S} s)"
    assert isinstance(next_exc, mp.P2PError) and next_s < 0.5, f"the next call: {next_exc!r} in {next_s:.2f} s"
    return {"detail": f"PeerFailureError {after:.2f} s after the peer's SIGKILL, naming it; the next call raised "
                      f"in {next_s * 1e3:.0f} ms", "after_death_s": after, "error": str(exc)[:800]}


REPLAYED = {"torch_interleaved_pp2.json": "ok", "torch_defer_pp_recv_interleaved_pp2.json": "deadlock"}
PROGRAMS = Path(mp.__file__).resolve().parent / "programs"


def _every_op_sized(obj: Any, nbytes: int) -> Any:
    """A program file's contents with every op `nbytes` long (a multiple of every dtype's size)."""
    if isinstance(obj, dict):
        return {k: nbytes if k == "bytes" else _every_op_sized(v, nbytes) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_every_op_sized(v, nbytes) for v in obj]
    return obj


def replay_programs(comm: mp.Communicator) -> dict:
    """The replay tool's verdicts on NCCL against the checker's under NCCL's buffering."""
    bound = comm.buffered_at_most
    tmp = Path(tempfile.mkdtemp(prefix="mp_gpu_replay_"))
    files, expected = [], []
    for name, verdict in REPLAYED.items():
        path = PROGRAMS / name
        if verdict == "deadlock":  # above what NCCL buffers, or NCCL may complete it
            path = tmp / name
            path.write_text(json.dumps(_every_op_sized(json.loads((PROGRAMS / name).read_text()), 2 * bound)))
        checked = simulate.simulate(program.load(path), buffered_at_most=bound).verdict
        assert checked == verdict, f"the checker says {checked} for {path.name} under NCCL's buffering, not {verdict}"
        files.append(path)
        expected.append(verdict)
    if target.on_model():  # torch has no CUDA here: replay's buffers become the model's device memory
        to_device = replay._tensor
        replay._tensor = lambda nbytes, dtype, device, fill=None: T.own(to_device(nbytes, dtype, torch.device("cpu"), fill))
    out = io.StringIO()
    start = time.monotonic()
    with contextlib.redirect_stdout(out):
        status = replay.main(["--backend", "nccl", "--json", "--timeout", "60", *map(str, files)])
    seconds = time.monotonic() - start
    if comm.rank != 0:
        return {"detail": f"replayed {len(files)} programs in {seconds:.1f} s (rank 0 judges)"}
    got = [json.loads(line) for line in out.getvalue().splitlines() if line.startswith("{")]
    verdicts = [g["verdict"] for g in got]
    assert verdicts == expected, f"replay on NCCL: {verdicts}, the checker: {expected}; {got}"
    assert status == 1, f"replay exited {status} with a deadlocking program"
    return {"detail": f"replay --backend nccl in {seconds:.1f} s: " + ", ".join(
                f"{Path(g['file']).name} {g['verdict']}" for g in got) + f" (the deadlocking one at {2 * bound} B a "
                "message), as the checker says under NCCL's buffering", "verdicts": got}


PARTS: dict[str, Callable[[], dict]] = {
    "naive_ring": _two_ranks(naive_ring, timeout=30.0),
    "never_posts": _two_ranks(never_posts),
    "size_mismatch": _two_ranks(size_mismatch),
    "replay": _two_ranks(replay_programs),
    "peer_death": _two_ranks(peer_death, timeout=60.0),
}
SURVIVOR = {"peer_death": 0}  # parts where only this rank reports: the other is killed
