"""The NCCL data path's launches on the model: how many threads NCCL starts for the exchanges
(case "threads"; with params["poll_every"], a thread polls comm.watchdog_check() meanwhile, as
the watchdog does, and the model counts NCCL calls made in parallel on one communicator), and a launch
that must connect to a peer outside the warm-up's ring (case
"connect": rank 0 sends to rank 2 of 4, which posts its receive after params["peer_delay"]
seconds, or never when it is None)."""
import ctypes
import os
import threading
import time

import harness
import nccl_model_cuda


def body(params):
    nccl_model_cuda.install()
    import torch

    import megatron_p2p as mp

    on = nccl_model_cuda.on_device
    nccl = ctypes.CDLL(os.environ["MEGATRON_P2P_NCCL_LIBRARY"])  # the copy the package loaded
    nccl.mpfake_nccl_group_threads.restype = ctypes.c_long
    nccl.mpfake_nccl_unsafe_aborts.restype = ctypes.c_long
    nccl.mpfake_nccl_parallel_calls.restype = ctypes.c_long
    out = {}
    harness.barrier("create")
    comm = mp.init_communicator(backend="nccl", timeout=params.get("timeout", 20.0))
    if params["case"] == "threads":
        t, got = torch.ones(256), torch.zeros(256)
        before = nccl.mpfake_nccl_group_threads()
        stop = threading.Event()
        poller = threading.Thread(target=lambda: [comm.watchdog_check() for _ in iter(
            lambda: stop.wait(params["poll_every"]), True)]) if params.get("poll_every") else None
        if poller:
            poller.start()
        for _ in range(params["exchanges"]):
            for r in comm.exchange(send_next=on(t), recv_prev=on(got), send_prev=on(t), recv_next=on(got),
                                   mode="parity").values():
                r.synchronize()
        stop.set()
        if poller:
            poller.join()
        out["group_threads"] = nccl.mpfake_nccl_group_threads() - before
    elif comm.rank == 0:
        sent = torch.arange(64, dtype=torch.float32)
        started = time.monotonic()
        out["send"] = harness.caught(lambda: comm.isend(on(sent), 2).synchronize())
        out["send"]["since_start"] = time.monotonic() - started
    elif comm.rank == 2 and params.get("peer_delay") is not None:
        time.sleep(params["peer_delay"])
        got = torch.zeros(64, dtype=torch.float32)
        out["recv"] = harness.caught(lambda: comm.irecv(on(got), 0).synchronize())
        out["exact"] = got.tolist() == list(range(64))
    else:
        time.sleep(params.get("idle", 0.0))
    out["close"] = harness.caught(comm.close)
    out["unsafe_aborts"] = nccl.mpfake_nccl_unsafe_aborts()
    out["parallel_calls"] = nccl.mpfake_nccl_parallel_calls()
    nccl.mpfake_nccl_config_overreach.restype = ctypes.c_long
    out["config_overreach"] = nccl.mpfake_nccl_config_overreach()
    return out


harness.run(body)
