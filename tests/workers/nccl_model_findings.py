"""One-rank probes of the review findings on the NCCL backend (params["case"]), over the fakes:
  context  the calling thread's current CUDA context before and after each call of the package
  refused  the driver refuses every cuCtxSetCurrent after creation: what an exchange does then
  interrupt SIGINT 0.3 s into a host wait on an op that never completes: how soon the wait
           leaves, whether the op is still pending, and what abort() then makes of it
  create_interrupt SIGINT 0.3 s into creating a two-rank communicator whose rank 1 never comes
  abort    an exchange stuck in ncclGroupEnd's ncclInProgress, and abort() from another thread
  close    close() with an exchange pending that the fake never runs (the rank is silent)
  watch    an exchange waited on the stream only (Request.wait()), then the host idles past the
           timeout: does the next call learn that the op never completed?"""
import ctypes
import threading
import time
from typing import Any

import harness
import nccl_model_cuda


def current_context(cuda) -> int:
    ctx = ctypes.c_void_p()
    assert cuda.cuCtxGetCurrent(ctypes.byref(ctx)) == 0
    return ctx.value or 0


def body(params):
    nccl_model_cuda.install()
    import torch

    import megatron_p2p as mp

    on = nccl_model_cuda.on_device
    case = params["case"]
    out: dict[str, Any] = {}
    cuda = ctypes.CDLL(nccl_model_cuda.ENV["MEGATRON_P2P_CUDA_LIBRARY"])
    if case in ("context", "refused") and params.get("torch_context"):
        # torch's runtime makes the device's primary context current on a thread that uses it.
        ctx = ctypes.c_void_p()
        assert cuda.cuInit(0) == 0 and cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
        assert cuda.cuCtxSetCurrent(ctx) == 0
    if case == "create_interrupt":
        import signal

        signal.signal(signal.SIGINT, signal.default_int_handler)  # ignored when the suite runs in the background
        mp.nccl_version()  # loads libnccl, as init_communicator does
        ids = b"".join(mp._C.nccl_unique_id() for _ in range(2))
        main = threading.main_thread().ident
        assert main is not None  # a started thread's
        threading.Timer(0.3, lambda: signal.pthread_kill(main, signal.SIGINT)).start()
        start = time.monotonic()
        try:
            mp._C.Communicator("nccl", ids, 0, [0, 1], device=0, stream=mp.nccl.stream_handle(0), timeout=20.0)
            out["interrupted"] = False
        except KeyboardInterrupt:
            out["interrupted"] = True
        out["left_after"] = time.monotonic() - start
        return out
    seen = {}
    if case == "context":
        cuda.cuInit(0)
        seen["before"] = current_context(cuda)
    comm = mp.init_communicator(backend="nccl", timeout=params.get("timeout", 20.0))
    t = torch.ones(64, dtype=torch.float32)
    got = torch.zeros(64, dtype=torch.float32)
    if case == "context":
        seen["init"] = current_context(cuda)
        reqs = comm.exchange(send_next=on(t), recv_prev=on(got))
        seen["exchange"] = current_context(cuda)
        for r in reqs.values():
            r.wait()
        seen["wait"] = current_context(cuda)
        for r in reqs.values():
            r.synchronize()
        seen["synchronize"] = current_context(cuda)
        comm.close()
        seen["close"] = current_context(cuda)
        out["unchanged"] = {k: v == seen["before"] for k, v in seen.items()}
        out["had_context"] = seen["before"] != 0
        return out
    if case == "refused":
        cuda.mpfake_fail_set_current_after(ctypes.c_long(0))
        out["exchange"] = harness.caught(lambda: [r.synchronize() for r in
                                                  comm.exchange(send_next=on(t), recv_prev=on(got)).values()])
        out["exact"] = bool(torch.equal(got, t))
    if case == "interrupt":
        import signal

        signal.signal(signal.SIGINT, signal.default_int_handler)  # ignored when the suite runs in the background
        reqs = comm.exchange(send_next=on(t), recv_prev=on(got))
        req = reqs["recv_prev"]
        main_ident = threading.main_thread().ident
        assert main_ident is not None  # a started thread's
        threading.Timer(0.3, lambda: signal.pthread_kill(main_ident, signal.SIGINT)).start()
        start = time.monotonic()
        try:
            req.synchronize()
            out["interrupted"] = False
        except KeyboardInterrupt:
            out["interrupted"] = True
        out["left_after"] = time.monotonic() - start
        out["pending_after"] = not req.is_completed()
        comm.abort()
        out["after_abort"] = harness.caught(req.synchronize)
    if case == "abort":
        start = time.monotonic()
        aborted = {}

        def abort_later():
            time.sleep(params["abort_after"])
            called = time.monotonic()
            comm.abort()
            aborted["returned_after"] = time.monotonic() - called

        thread = threading.Thread(target=abort_later)
        thread.start()
        out["exchange"] = harness.caught(lambda: [r.synchronize() for r in
                                                  comm.exchange(send_next=on(t), recv_prev=on(got)).values()])
        out["exchange"]["since_start"] = time.monotonic() - start
        thread.join()
        out["abort_returned_after"] = aborted["returned_after"]
    if case == "close":
        comm.exchange(send_next=on(t), recv_prev=on(got))
    if case == "watch":
        reqs = comm.exchange(send_next=on(t), recv_prev=on(got))
        out["wait"] = harness.caught(lambda: [r.wait() for r in reqs.values()])
        time.sleep(params["idle"])
        out["next_call"] = harness.caught(lambda: comm.exchange(send_next=on(t), recv_prev=on(got)))
    start = time.monotonic()
    comm.close()
    out["close_seconds"] = time.monotonic() - start
    return out


harness.run(body)
