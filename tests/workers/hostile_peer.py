"""Rounds of garbage written into a live shm segment, as a hostile or broken peer could.

Each round runs on a fresh communicator (lanes, eager threshold, single copy and the receive
buffers vary with the round; buffers: "arena", from `comm.empty`, so that the large message is
written by its sender into the receiver's arena, which the receiver offered it; "plain", plain
memory while an arena exists, so that senders still wait for the offer; "no_arena", no arena at
all): an exchange that must be exact, then one rank (alternating) overwrites `fields` random
fields of the shared segment with `megatron_p2p._testing.corrupt_segment` at one of three moments of the next
exchange, which both ranks run: before it ("rest"), once the peer has posted its side and this
rank not yet ("peer_posted": the peer's descriptors wait in their slots), or once both have
("posted"). Every `control_every`-th round writes nothing: both its exchanges must be exact.

Each rank records, per round and exchange, what it gave ("exact", "wrong data", or the
exception raised, with its message) and how long it took, and how long close() took; the
hostile rank also records what it overwrote. Runs on 2 ranks."""
import os
import random
import time

import harness

SMALL = 256  # float32 elements: travels inline in the descriptor
LARGE = 512 * 1024  # 2 MiB (ARENA_WAIT_BYTES: its sender waits for the answer): arena, single copy or bounce
PEER_POSTS = 0.02  # seconds the hostile rank gives its peer to post first ("peer_posted")
MOMENTS = ("rest", "peer_posted", "posted")
BUFFERS = ("arena", "plain", "no_arena")


def payloads(torch, tag, rank):
    """This rank's two payloads for exchange number `tag`."""
    return {
        "send_next": torch.arange(SMALL, dtype=torch.float32) + 1000 * tag + rank,
        "send_prev": torch.arange(LARGE, dtype=torch.float32) - 1000 * tag - rank,
    }


def zeroed(torch, comm, numel, arena):
    """A zeroed receive buffer: from the communicator's arena, or plain memory."""
    return (comm.empty((numel,), torch.float32) if arena else torch.empty(numel, dtype=torch.float32)).zero_()


def exact(torch, tag, peer, received):
    expected = payloads(torch, tag, peer)
    return torch.equal(received["recv_prev"], expected["send_next"]) and torch.equal(
        received["recv_next"], expected["send_prev"])


def exchange(torch, comm, tag, timeout, arena, corrupt=None, moment="rest"):
    """One exchange, each wait limited to `timeout`, with corrupt() called at `moment`; receive
    buffers from the arena when `arena`. Returns its outcome, with the paths that carried what
    this rank received."""
    before = comm.stats()["received_by_path"]
    outcome = exchange_outcome(torch, comm, tag, timeout, arena, corrupt, moment)
    after = comm.stats()["received_by_path"]
    outcome["paths"] = {p: after[p] - before[p] for p in after if after[p] != before[p]}
    return outcome


def exchange_outcome(torch, comm, tag, timeout, arena, corrupt, moment):
    start = time.monotonic()
    sent = payloads(torch, tag, comm.rank)
    received = {"recv_prev": zeroed(torch, comm, SMALL, arena), "recv_next": zeroed(torch, comm, LARGE, arena)}
    try:
        if corrupt and moment != "posted":
            if moment == "peer_posted":
                time.sleep(PEER_POSTS)
            corrupt()
        reqs = comm.exchange(**sent, **received)
        if corrupt and moment == "posted":
            corrupt()
        for req in reqs.values():
            req.wait(timeout)
    except Exception as exc:  # the test asserts on the class and message
        return {"kind": type(exc).__name__, "mro": [c.__name__ for c in type(exc).__mro__], "msg": str(exc),
                "elapsed": time.monotonic() - start}
    return {"kind": "exact" if exact(torch, tag, 1 - comm.rank, received) else "wrong data",
            "elapsed": time.monotonic() - start}


def round_config(i):
    return {"lanes": 1 + i % 2, "eager_threshold": 4096 * (i // 2 % 2), "single_copy": i // 4 % 2 == 0,
            "buffers": BUFFERS[i // 8 % len(BUFFERS)]}


def body(params):
    import torch

    import megatron_p2p as mp
    from megatron_p2p import _testing

    rounds, timeout, fields = params["rounds"], params["timeout"], params["fields"]
    init_timeout = params["init_timeout"]  # creation on a loaded machine: not what is measured
    control_every, seed = params["control_every"], params["seed"]
    out = []
    for i in range(rounds):
        cfg = round_config(i)
        os.environ["MEGATRON_P2P_SHM_SINGLE_COPY"] = "1" if cfg["single_copy"] else "0"
        comm = mp.init_communicator(timeout=init_timeout, lanes=cfg["lanes"], eager_threshold=cfg["eager_threshold"],
                                    arena_bytes=0 if cfg["buffers"] == "no_arena" else None)
        arena = cfg["buffers"] == "arena"
        round_seed = seed * 1_000_003 + i
        record = dict(cfg, round=i, control=i % control_every == 0, hostile=i % 2,
                      moment=random.Random(round_seed).choice(MOMENTS))
        record["first"] = exchange(torch, comm, 2 * i, timeout, arena)
        corrupt = None
        if not record["control"] and comm.rank == record["hostile"]:
            def corrupt():
                record["overwritten"] = _testing.corrupt_segment(comm, round_seed, fields=fields)
        record["second"] = exchange(torch, comm, 2 * i + 1, timeout, arena, corrupt, record["moment"])
        start = time.monotonic()
        comm.close()
        record["close_elapsed"] = time.monotonic() - start
        out.append(record)
    return {"pid": os.getpid(), "rounds": out}


harness.run(body)
