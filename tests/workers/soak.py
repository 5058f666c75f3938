"""Soak: many exchanges of random sizes, dtypes, modes and directions over communicators of
every kind (lanes 1 and 2; strict or eager; single copy or bounce buffer), then many
communicators created and closed. What the process holds (RSS, descriptors, threads,
shared-memory segments and mappings) is measured after a warm-up, after the exchanges, and
after the churn.

Every rank draws the same schedule from the seed, so sizes, dtypes, offsets and modes agree
without any message about them. Every rank also holds the same seeded source bytes: a sender
sends a slice of them, and its receiver compares what arrived with the same slice, exactly,
and checks that the guard bytes around it were not touched.

Params: exchanges, communicators, seed, timeout."""
from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import harness

SOURCE_BYTES = 8 << 20
MAX_BYTES = 6 << 20  # past the 4 MiB of one process_vm_readv call
EAGER_THRESHOLD = 16 << 10
GUARD_BYTES = 64
GUARD_VALUE = 0xA5
BLOCK = 50  # exchanges in a row on one communicator
MODES = ("parity", "batched", "isend_irecv", "batch_isend_irecv")
DIRECTIONS = {"forward": ("send_next", "recv_prev"), "backward": ("send_prev", "recv_next"),
              "both": ("send_next", "recv_prev", "send_prev", "recv_next")}
DTYPE_NAMES = ("uint8", "int16", "float32", "bfloat16", "float64", "complex64")
# (lanes, eager_threshold, single_copy): every path a message can take.
CONFIGS = [(lanes, eager, single_copy) for lanes in (1, 2) for eager in (0, EAGER_THRESHOLD)
           for single_copy in (True, False)]


def config_name(config: tuple[int, int, bool]) -> str:
    lanes, eager, single_copy = config
    return f"lanes={lanes} eager={eager} {'single_copy' if single_copy else 'bounce'}"


def message_path(nbytes: int, config: tuple[int, int, bool]) -> str:
    """The transport path a message of nbytes takes (csrc/shm/): inside the descriptor slot
    (4 KiB, or the eager threshold when larger), else CMA or the bounce buffer."""
    _, eager, single_copy = config
    if nbytes <= max(4096, eager):
        return "eager" if nbytes <= eager else "inline"
    return "single_copy" if single_copy else "bounce"


def holdings(pid_prefix: str) -> dict[str, int]:
    """What this process holds now."""
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    kib = {key: int(status[key].split()[0]) << 10 for key in ("VmRSS", "RssAnon", "RssShmem")}
    segment_maps = [line for line in Path("/proc/self/maps").read_text().splitlines() if "/dev/shm/mp2p-" in line]
    return {
        "rss": kib["VmRSS"],
        "rss_anon": kib["RssAnon"],
        "rss_shmem": kib["RssShmem"],
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": len(os.listdir("/proc/self/task")),
        "segments": sum(1 for name in os.listdir("/dev/shm") if name.startswith(pid_prefix)),
        "segment_mappings": len(segment_maps),
        "segment_bytes": sum(int(end, 16) - int(start, 16) for start, end in
                             (line.split()[0].split("-") for line in segment_maps)),
    }


class Soak:
    def __init__(self, mp: Any, torch: Any, seed: int, timeout: float):
        self.mp, self.torch, self.timeout = mp, torch, timeout
        self.rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        self.source = torch.randint(0, 256, (SOURCE_BYTES,), dtype=torch.uint8, generator=gen)
        # One receive buffer per direction: both may be in flight at once.
        # Filled, so that every page is resident before the first measure.
        self.inbox = {"recv_prev": torch.empty(SOURCE_BYTES, dtype=torch.uint8).fill_(0),
                      "recv_next": torch.empty(SOURCE_BYTES, dtype=torch.uint8).fill_(0)}
        self.dtypes = {name: getattr(torch, name) for name in DTYPE_NAMES}
        self.counts: dict[str, int] = {}
        self.messages = 0
        self.bytes = 0

    def count(self, key: str) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1

    def open(self, config: tuple[int, int, bool]) -> Any:
        lanes, eager, single_copy = config
        # init_communicator takes the single-copy switch from the environment only.
        os.environ["MEGATRON_P2P_SHM_SINGLE_COPY"] = "1" if single_copy else "0"
        return self.mp.init_communicator(timeout=self.timeout, lanes=lanes, eager_threshold=eager)

    def draw_size(self) -> int:
        roll = self.rng.random()
        if roll < 0.02:
            return 0
        if roll < 0.03:
            return self.rng.randrange(4 << 20, MAX_BYTES)
        return int(2 ** self.rng.uniform(0, 20))  # log-uniform up to 1 MiB

    def draw_message(self, size_ranks: int) -> dict[str, Any]:
        """One direction's message: byte count, dtype, and each sender's source offset."""
        name = self.rng.choice(DTYPE_NAMES)
        item = self.dtypes[name].itemsize
        nbytes = self.draw_size() // item * item
        offsets = [self.rng.randrange(0, SOURCE_BYTES - nbytes + 1) // 64 * 64 for _ in range(size_ranks)]
        inbox_offset = self.rng.randrange(GUARD_BYTES, SOURCE_BYTES - nbytes - GUARD_BYTES) // 64 * 64
        return {"dtype": name, "nbytes": nbytes, "offsets": offsets, "inbox_offset": inbox_offset}

    def exchange(self, comm: Any, config: tuple[int, int, bool]) -> None:
        """One exchange, drawn from the shared schedule; raises on any wrong byte."""
        mode = self.rng.choice(MODES)
        direction = self.rng.choice(tuple(DIRECTIONS))
        forward, backward = self.draw_message(comm.size), self.draw_message(comm.size)
        me = comm.rank
        prev, nxt = comm.ranks.index(comm.prev_rank), comm.ranks.index(comm.next_rank)
        plan = {"send_next": (forward, me), "recv_prev": (forward, prev),
                "send_prev": (backward, me), "recv_next": (backward, nxt)}
        tensors = {}
        for op in DIRECTIONS[direction]:
            message, sender = plan[op]
            tensors[op] = self.tensor(op, message, sender)
        reqs = self.post(comm, mode, tensors)
        for req in reqs:
            req.wait()
        for op in DIRECTIONS[direction]:
            message, sender = plan[op]
            self.messages += 1
            self.bytes += message["nbytes"]
            self.count(f"mode:{mode}")
            self.count(f"direction:{direction}")
            self.count(f"dtype:{message['dtype']}")
            self.count(f"path:{message_path(message['nbytes'], config)}")
            if op.startswith("recv"):
                self.verify(op, message, sender)

    def tensor(self, op: str, message: dict[str, Any], sender: int) -> Any:
        nbytes, dtype = message["nbytes"], self.dtypes[message["dtype"]]
        if op.startswith("send"):
            start = message["offsets"][sender]
            return self.source[start:start + nbytes].view(dtype)
        start = message["inbox_offset"]
        box = self.inbox[op]
        box[start - GUARD_BYTES:start].fill_(GUARD_VALUE)
        box[start + nbytes:start + nbytes + GUARD_BYTES].fill_(GUARD_VALUE)
        return box[start:start + nbytes].view(dtype)

    def verify(self, op: str, message: dict[str, Any], sender: int) -> None:
        nbytes, start = message["nbytes"], message["inbox_offset"]
        box = self.inbox[op]
        sent = message["offsets"][sender]
        if not self.torch.equal(box[start:start + nbytes], self.source[sent:sent + nbytes]):
            raise AssertionError(f"{op}: {nbytes} bytes ({message['dtype']}) from group rank {sender} differ")
        guards = self.torch.cat([box[start - GUARD_BYTES:start], box[start + nbytes:start + nbytes + GUARD_BYTES]])
        if not bool((guards == GUARD_VALUE).all()):
            raise AssertionError(f"{op}: a receive of {nbytes} bytes wrote outside its tensor")

    def verify_catches(self) -> dict[str, str]:
        """The checker's own twin, without a transfer: an exact copy passes, one wrong byte in
        the tensor or one written guard byte fails. What each case raised ('' for nothing)."""
        size, start = 4096, 4096
        message = {"dtype": "uint8", "nbytes": size, "offsets": [0], "inbox_offset": start}
        box = self.inbox["recv_prev"]
        outcome = {}
        for case, position in (("exact", None), ("one_byte_off", start + size // 2), ("guard_written", start + size)):
            self.tensor("recv_prev", message, 0)
            box[start:start + size].copy_(self.source[:size])
            if position is not None:
                box[position] ^= 1
            try:
                self.verify("recv_prev", message, 0)
                outcome[case] = ""
            except AssertionError as exc:
                outcome[case] = str(exc)
        return outcome

    def post(self, comm: Any, mode: str, tensors: dict[str, Any]) -> list[Any]:
        mp = self.mp
        if mode in ("parity", "batched"):
            return list(comm.exchange(mode=mode, **tensors).values())
        peers = {"send_next": comm.next_rank, "recv_prev": comm.prev_rank,
                 "send_prev": comm.prev_rank, "recv_next": comm.next_rank}
        if mode == "batch_isend_irecv":
            ops = [mp.P2POp(mp.isend if op.startswith("send") else mp.irecv, t, peers[op], comm=comm)
                   for op, t in tensors.items()]
            return mp.batch_isend_irecv(ops)
        # isend / irecv run one by one on lane 0: odd ranks swap each (send, recv) pair, Megatron's
        # parity order, so that strict rendezvous cannot deadlock.
        order = list(tensors)
        if comm.rank % 2:
            order = [op for pair in zip(order[1::2], order[0::2]) for op in pair]
        return [(mp.isend if op.startswith("send") else mp.irecv)(tensors[op], peers[op], comm=comm) for op in order]

    def run_exchanges(self, comms: dict[tuple[int, int, bool], Any], count: int) -> None:
        """count exchanges, in blocks on communicators drawn at random."""
        done = 0
        while done < count:
            config = self.rng.choice(CONFIGS)
            self.count(f"config:{config_name(config)}")
            for _ in range(min(BLOCK, count - done)):
                self.exchange(comms[config], config)
                done += 1

    def warm_up(self, comms: dict[tuple[int, int, bool], Any]) -> None:
        """A block on every communicator, so that what is allocated once is allocated."""
        for config, comm in comms.items():
            for _ in range(BLOCK):
                self.exchange(comm, config)


def timed(fn: Callable[[], None]) -> float:
    start = time.monotonic()
    fn()
    return time.monotonic() - start


def body(params: dict[str, Any]) -> dict[str, Any]:
    import torch

    import megatron_p2p as mp

    soak = Soak(mp, torch, params["seed"], params["timeout"])
    prefix = f"mp2p-{os.getpid()}-"
    comms = {config: soak.open(config) for config in CONFIGS}
    single_copy = {config_name(c): comm.single_copy(comm.next_rank) for c, comm in comms.items()}
    soak.warm_up(comms)
    warm = holdings(prefix)
    messages, nbytes = soak.messages, soak.bytes
    exchange_seconds = timed(lambda: soak.run_exchanges(comms, params["exchanges"]))
    after_exchanges = holdings(prefix)
    measured_messages, measured_bytes = soak.messages - messages, soak.bytes - nbytes
    for comm in comms.values():
        comm.close()
    closed = holdings(prefix)

    def churn() -> None:
        for i in range(params["communicators"]):
            config = CONFIGS[i % len(CONFIGS)]
            comm = soak.open(config)
            soak.exchange(comm, config)  # each one carries data before it is closed
            comm.close()

    churn_seconds = timed(churn)
    after_churn = holdings(prefix)
    # The control: one communicator left open must show in the same measures.
    kept = soak.open(CONFIGS[0])
    soak.exchange(kept, CONFIGS[0])
    with_one_open = holdings(prefix)
    kept.close()
    return {
        "verify_catches": soak.verify_catches(),
        "pid": os.getpid(),
        "single_copy": single_copy,
        "counts": soak.counts,
        "messages": measured_messages,
        "bytes": measured_bytes,
        "exchange_seconds": exchange_seconds,
        "churn_seconds": churn_seconds,
        "warm": warm,
        "after_exchanges": after_exchanges,
        "closed": closed,
        "after_churn": after_churn,
        "with_one_open": with_one_open,
    }


harness.run(body)
