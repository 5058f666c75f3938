"""The NCCL backend on one GPU: a one-rank communicator exchanging with itself (prev == next ==
self), which NCCL allows inside a group. Plain functions, so the device script can run them with
or without pytest (`python tests/gpu/gpu_checks.py`); tests/gpu/test_gpu_nccl.py runs them under
pytest, skipped without CUDA."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[2]))  # the source tree, when not installed
import megatron_p2p as mp  # noqa: E402

SIZES = [0, 1, 8, 1 << 10, 1 << 20, 64 << 20]  # bytes; 1 GiB runs for two dtypes below
HUGE = 1 << 30
DTYPES = [
    "float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16", "int32", "int64", "bool",
    "complex64", "float8_e4m3fn", "float8_e5m2",
]


def one_rank_environment() -> None:
    """torchrun's variables for a job of one, so init_communicator finds a store."""
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0")


def communicator(**kwargs) -> mp.Communicator:
    one_rank_environment()
    return mp.init_communicator(backend="nccl", timeout=kwargs.pop("timeout", 60.0), **kwargs)


def random_bytes(nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    if dtype == torch.bool:
        return (raw & 1).bool()
    return raw.view(dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.numel() == b.numel() and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def check_self_exchange_all_dtypes_and_sizes_both_modes() -> None:
    comm = communicator()
    assert comm.backend == "nccl" and comm.size == 1 and comm.prev_rank == comm.next_rank == 0
    cases = [(d, n) for d in DTYPES for n in SIZES] + [("float32", HUGE), ("uint8", HUGE)]
    for mode in ("parity", "batched"):
        for name, nbytes in cases:
            dtype = getattr(torch, name)
            size = torch.empty(0, dtype=dtype).element_size()
            act, grad = random_bytes(nbytes // size * size, dtype), random_bytes(nbytes // size * size, dtype)
            act_in, grad_in = torch.empty_like(act), torch.empty_like(grad)
            reqs = comm.exchange(send_next=act, recv_prev=act_in, send_prev=grad, recv_next=grad_in, mode=mode)
            assert sorted(reqs) == ["recv_next", "recv_prev", "send_next", "send_prev"]
            for r in reqs.values():
                r.wait()
            torch.cuda.current_stream().synchronize()
            assert same_bytes(act_in, act), (mode, name, nbytes, "activations")
            assert same_bytes(grad_in, grad), (mode, name, nbytes, "gradients")
            del act, grad, act_in, grad_in, reqs
        torch.cuda.empty_cache()
    comm.close()


def check_wait_orders_the_current_stream_without_blocking_the_host() -> None:
    comm = communicator()
    src = random_bytes(256 << 20, torch.uint8)
    dst = torch.zeros_like(src)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time queued ahead of the exchange
    start = time.perf_counter()
    reqs = comm.exchange(send_next=src, recv_prev=dst, mode="batched")
    for r in reqs.values():
        r.wait()
    seen = dst.clone()  # queued on the current stream: must see the received bytes
    host = time.perf_counter() - start
    pending = not reqs["recv_prev"].is_completed()
    torch.cuda.synchronize()
    assert same_bytes(seen, src), "work queued after wait() did not see the received data"
    assert pending, "the exchange finished before the GPU sleep did: the lane did not wait on the current stream"
    assert host < 0.25, f"exchange + wait() held the host for {host:.3f} s"
    reqs["recv_prev"].synchronize(timeout=30.0)
    comm.close()


def check_a_send_buffer_freed_after_posting_still_sends_exact_data() -> None:
    comm = communicator()
    expected = random_bytes(64 << 20, torch.uint8)
    dst = torch.zeros_like(expected)
    torch.cuda._sleep(500_000_000)  # the send runs after the caller has dropped its buffer
    send = expected.clone()
    reqs = comm.exchange(send_next=send, recv_prev=dst, mode="parity")
    del send
    reqs.pop("send_next")  # the caller keeps no handle to the send either
    garbage = [torch.full((64 << 20,), 0xAB, dtype=torch.uint8, device="cuda") for _ in range(4)]
    reqs["recv_prev"].synchronize(timeout=60.0)
    torch.cuda.synchronize()
    assert same_bytes(dst, expected), "a freed send buffer was reused before the send read it"
    del garbage
    comm.close()


def check_bad_tensors_are_refused_before_anything_is_posted() -> None:
    comm = communicator()
    ok = torch.ones(16, device="cuda")
    refusals = {
        "cpu tensor": lambda: comm.isend(torch.ones(16), 0),
        "non-contiguous": lambda: comm.exchange(send_next=torch.ones(8, 8, device="cuda").t(), recv_prev=ok),
        "unsupported dtype": lambda: comm.isend(torch.ones(4, device="cuda").to_sparse(), 0),
    }
    for what, post in refusals.items():
        try:
            post()
        except (ValueError, TypeError):
            continue
        raise AssertionError(f"{what} was accepted")
    # Still usable after the refusals.
    got = torch.zeros(16, device="cuda")
    for r in comm.exchange(send_next=ok, recv_prev=got).values():
        r.synchronize(timeout=30.0)
    assert torch.equal(got, ok)
    comm.close()


def check_synchronize_times_out_with_a_report_and_aborts() -> None:
    comm = communicator(timeout=60.0)
    torch.cuda._sleep(5_000_000_000)  # several seconds: longer than the timeout below
    buf = torch.zeros(1 << 20, device="cuda")
    reqs = comm.exchange(send_next=torch.ones_like(buf), recv_prev=buf, mode="batched")
    start = time.perf_counter()
    try:
        reqs["recv_prev"].synchronize(timeout=0.5)
    except mp.P2PTimeoutError as exc:
        message = str(exc)
    else:
        raise AssertionError("synchronize(timeout=0.5) returned although the GPU was busy for seconds")
    assert time.perf_counter() - start < 5.0
    assert "recv_prev" in message and "lane 0" in message, message
    try:
        comm.exchange(send_next=buf, recv_prev=buf)
    except mp.P2PError as exc:
        assert "aborted" in str(exc)
    else:
        raise AssertionError("an aborted communicator accepted an exchange")
    torch.cuda.synchronize()
    comm.close()


def check_high_priority_lanes_and_one_lane_work() -> None:
    for kwargs in ({"high_priority": True}, {"lanes": 1}):
        comm = communicator(**kwargs)
        a, b = torch.arange(1000.0, device="cuda"), torch.zeros(1000, device="cuda")
        for r in comm.exchange(send_next=a, recv_prev=b, send_prev=a, recv_next=torch.zeros_like(a)).values():
            r.synchronize(timeout=30.0)
        assert torch.equal(a, b), kwargs
        comm.close()


def thread_starts_over_exchanges(*envs: dict[str, str]) -> list[dict]:
    """Runs thread_starts_worker.py once per env, each in a process of its own started with that
    env added and count_thread_starts.so (built here with cc) preloaded: the threads each
    started and its posting time."""
    here = Path(__file__).resolve().parent
    base = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "NCCL_COMM_BLOCKING")}
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        shim = os.path.join(tmp, "count_thread_starts.so")
        subprocess.run(["cc", "-std=c11", "-shared", "-fPIC", "-o", shim, str(here / "count_thread_starts.c"),
                        "-ldl"], check=True)
        for env in envs:
            done = subprocess.run([sys.executable, str(here / "thread_starts_worker.py")],
                                  env={**base, **env, "LD_PRELOAD": shim}, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stdout + done.stderr
            out.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return out


def check_steady_state_exchanges_start_no_thread_and_nonblocking_data_comms_do() -> None:
    """The data path's blocking children (docs/nccl-backend.md, "Communicator mode"): posting exchanges starts no
    thread; with NCCL_COMM_BLOCKING=0 from the process's start (NCCL reads it once per process) NCCL
    starts one per group end (src/group.cc ncclGroupEndInternal), so at least one per exchange."""
    blocking, nonblocking = thread_starts_over_exchanges({}, {"NCCL_COMM_BLOCKING": "0"})
    print(f"over {blocking['exchanges']} parity exchanges: threads started {blocking['threads']} with blocking "
          f"data communicators, {nonblocking['threads']} with nonblocking ones; median host time to post "
          f"{blocking['post_us_median']:.1f} us against {nonblocking['post_us_median']:.1f} us")
    assert blocking["threads"] == 0, blocking
    assert nonblocking["threads"] >= nonblocking["exchanges"], nonblocking


CHECKS = [value for name, value in sorted(globals().items()) if name.startswith("check_")]


def main() -> int:
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")
    v = mp.nccl_version()
    print(f"libnccl {'.'.join(map(str, v.version))} from {v.path} ({v.source})")
    failed = 0
    for check in CHECKS:
        start = time.perf_counter()
        try:
            check()
            print(f"PASS {check.__name__} ({time.perf_counter() - start:.1f} s)", flush=True)
        except Exception:
            failed += 1
            print(f"FAIL {check.__name__}\n{traceback.format_exc()}", flush=True)
    print(f"{len(CHECKS) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
