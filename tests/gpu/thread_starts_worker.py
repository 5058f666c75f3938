"""Run by gpu_checks with count_thread_starts.so preloaded, once with the environment as it is
(blocking data communicators) and once started with NCCL_COMM_BLOCKING=0 (nonblocking ones: NCCL
reads the variable once per process, so each mode needs a process of its own). Prints, as JSON, the
threads started while EXCHANGES parity exchanges were posted and waited, and the host's median
time to post one."""
from __future__ import annotations

import ctypes
import json
import os
import statistics
import time

import gpu_checks
import torch

EXCHANGES = 2000


def main() -> None:
    counter = ctypes.CDLL(os.environ["LD_PRELOAD"])
    counter.thread_starts.restype = ctypes.c_long
    a, b = torch.arange(1024.0, device="cuda"), torch.zeros(1024, device="cuda")
    comm = gpu_checks.communicator()
    for _ in range(20):  # the connections are made, and the first launches are over
        for r in comm.exchange(send_next=a, recv_prev=b).values():
            r.synchronize(timeout=30.0)
    torch.cuda.synchronize()
    before = counter.thread_starts()
    posting = []
    for _ in range(EXCHANGES):
        start = time.perf_counter_ns()
        reqs = comm.exchange(send_next=a, recv_prev=b, mode="parity")
        posting.append((time.perf_counter_ns() - start) / 1e3)
        for r in reqs.values():
            r.wait()
    torch.cuda.synchronize()
    threads = counter.thread_starts() - before
    assert torch.equal(a, b)
    comm.close()
    print(json.dumps({"exchanges": EXCHANGES, "threads": threads, "post_us_median": statistics.median(posting)}))


if __name__ == "__main__":
    main()
