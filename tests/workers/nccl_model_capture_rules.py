"""One rank exchanging with itself on the NCCL backend over the fakes, in the situations CUDA
graph capture and a live graph make for it: params["case"] picks one, and the body returns what
the test asserts on. The fake driver logs every call a capture refuses (MPFAKE_CUDA_CAPTURE_LOG)."""
import ctypes
import os
import threading
import time
from typing import Any

import harness
import nccl_model_cuda

p = ctypes.c_void_p
N = 64


def aborting_threads() -> int:
    """The package's threads running ncclCommAbort (csrc/nccl/nccl_reaper.c names them)."""
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                count += f.read().strip() == "mp2p-ncclabort"
        except (FileNotFoundError, ProcessLookupError):  # it ended meanwhile (before or during the read)
            pass
    return count


def body(params):
    nccl_model_cuda.install()
    import torch

    import megatron_p2p as mp

    cuda = nccl_model_cuda.driver()
    stream = nccl_model_cuda.side_stream(cuda)
    comm = mp.init_communicator(backend="nccl", timeout=params.get("timeout", 20.0))
    send, recv = torch.zeros(N), torch.zeros(N)
    s, r = nccl_model_cuda.on_device(send), nccl_model_cuda.on_device(recv)

    def exchange():
        return list(comm.exchange(send_next=s, recv_prev=r, mode="batched").values())

    def capture(wait_inside=True):
        """Captures one exchange in the global mode (torch.cuda.graph's default): its Requests and
        the instantiated graph."""
        assert cuda.cuStreamBeginCapture_v2(stream, 0) == 0
        reqs = exchange()
        out: dict[str, Any] = {"wait_inside": [harness.caught(q.wait) for q in reqs] if wait_inside else []}
        graph, exe = p(), p()
        out["end_capture"] = cuda.cuStreamEndCapture(stream, ctypes.byref(graph))
        if out["end_capture"] == 0:
            assert cuda.cuGraphInstantiateWithFlags(ctypes.byref(exe), graph, 0) == 0
        return reqs, graph, exe, out

    def replay(exe, runs):
        got = []
        for run in range(runs):
            send.copy_(torch.arange(N, dtype=torch.float32) + 1000.0 * run)
            assert cuda.cuGraphLaunch(exe, stream) == 0 and cuda.cuStreamSynchronize(stream) == 0
            got.append(recv.tolist() == send.tolist())
        return got

    case = params["case"]
    out = {}
    if case == "capture_after_eager":
        # As megatron-core: eager exchanges waited in stream order only, then the stream is
        # synchronized (as torch.cuda.graph does before it captures), then the capture.
        for run in range(3):
            send.fill_(float(run + 1))
            for q in exchange():
                q.wait()
        out["synchronized"] = cuda.cuStreamSynchronize(stream)
        out["eager_arrived"] = recv.tolist() == [3.0] * N
        _, graph, exe, captured = capture()
        out.update(captured)
        out["replays_exact"] = replay(exe, 3) if captured["end_capture"] == 0 else []
    elif case == "eager_pending_under_capture":
        # An eager exchange still running (its kernel starts MPFAKE_NCCL_DELAY_MS late) when the
        # stream begins a capture: the capturing stream cannot wait on it.
        send.fill_(7.0)
        eager = exchange()
        assert cuda.cuStreamBeginCapture_v2(stream, 0) == 0
        out["wait_under_capture"] = harness.caught(eager[0].wait)
        graph = p()
        out["end_capture"] = cuda.cuStreamEndCapture(stream, ctypes.byref(graph))
        out["synchronize_after"] = harness.caught(lambda: [q.synchronize() for q in eager])
        out["eager_arrived"] = recv.tolist() == [7.0] * N
    elif case == "captured_waited_outside":
        reqs, graph, exe, captured = capture()
        out.update(captured)
        out["wait_after_capture"] = harness.caught(reqs[0].wait)
        other = nccl_model_cuda.side_stream(cuda)  # a second capture, on another stream
        assert cuda.cuStreamBeginCapture_v2(other, 0) == 0
        out["wait_in_other_capture"] = harness.caught(reqs[0].wait)
        g2 = p()
        out["other_end_capture"] = cuda.cuStreamEndCapture(other, ctypes.byref(g2))
        assert stream.value is not None
        nccl_model_cuda.use_stream(stream.value)
        out["replays_exact"] = replay(exe, 2)
        out["eager_after"] = harness.caught(lambda: [q.synchronize() for q in exchange()])
    elif case in ("abort_with_live_graph", "abort_after_graph_destroyed"):
        _, graph, exe, captured = capture()
        out.update(captured)
        out["replays_exact"] = replay(exe, 1)
        if case == "abort_after_graph_destroyed":
            assert cuda.cuGraphExecDestroy(exe) == 0 and cuda.cuGraphDestroy(graph) == 0
        timed: dict[str, Any] = {}
        worker = threading.Thread(target=lambda: timed.update(abort=harness.caught(comm.abort),
                                                              close=harness.caught(comm.close)))
        worker.start()
        worker.join(10.0)
        out["returned"] = not worker.is_alive()
        out.update(timed)
        out["aborting_after_close"] = aborting_threads()
        exiting = time.monotonic() + 0.2  # a reaper whose abort returned may still be exiting its thread
        while aborting_threads() and time.monotonic() < exiting:
            time.sleep(0.005)
        out["aborting_0_2_s_after_close"] = aborting_threads()
        if case == "abort_with_live_graph":
            assert cuda.cuGraphExecDestroy(exe) == 0 and cuda.cuGraphDestroy(graph) == 0
            deadline = time.monotonic() + 5.0
            while aborting_threads() and time.monotonic() < deadline:
                time.sleep(0.01)
            out["aborting_after_graph_destroyed"] = aborting_threads()
    elif case == "timeout_with_live_graph":
        # The rank's own ops never run (MPFAKE_NCCL_SILENT_RANK=0); a graph of an earlier capture
        # lives on, never launched; then the process exits with it alive.
        _, graph, exe, captured = capture()
        out.update(captured)
        pending = exchange()
        out["timed_out"] = harness.caught(lambda: pending[0].synchronize(timeout=0.5))
        out["close"] = harness.caught(comm.close)
    elif case == "gil_while_posting_blocked":
        # Every group end stays ncclInProgress for a while: one thread's exchange holds the
        # transport's posting lock meanwhile, and a second thread's exchange queues behind it.
        # This thread must keep running Python all along.
        send.fill_(5.0)
        results = {}

        def post(name):
            results[name] = harness.caught(lambda: [q.synchronize() for q in exchange()])

        def longest_gap_until(done):
            """The longest this thread went without running Python, sampled every 5 ms until
            done() and once after it: never empty, however soon the threads finish."""
            longest, last = 0.0, time.monotonic()
            while True:
                finished = done()
                time.sleep(0.005)
                now = time.monotonic()
                longest, last = max(longest, now - last), now
                if finished:
                    return longest

        first = threading.Thread(target=post, args=("first",))
        second = threading.Thread(target=post, args=("second",))
        first.start()
        start = time.monotonic()
        # The second thread starts 0.2 s in (or once the first is done): with groups in progress,
        # into the first's hold of the posting lock.
        gap = longest_gap_until(lambda: time.monotonic() - start >= 0.2 or not first.is_alive())
        second.start()
        gap = max(gap, longest_gap_until(lambda: not (first.is_alive() or second.is_alive())))
        first.join()
        second.join()
        out.update(results, longest_gap=gap, arrived=recv.tolist() == [5.0] * N)
    else:
        raise ValueError(f"unknown case {case!r}")
    if not comm.closed:
        comm.close()
    return out


harness.run(body)
