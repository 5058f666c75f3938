"""A 1F1B step of two pipeline stages (three microbatches, both lanes, parity and batched
calls), on the NCCL backend over the fakes: run eagerly, then captured into a CUDA graph on a
non-blocking stream and replayed params["replays"] times. Before each run the host writes that
run's values into the send buffers; after it, each rank reports what arrived. Also reports what
a captured Request answers to synchronize() and is_completed(), and what MEGATRON_P2P_CHECK=1
makes of a capture (params["check"]). Then params["captures"] more captures of the step, each
launched once and destroyed, with the run's values and the driver's live events after each."""
import ctypes
import os
from typing import Any

import harness
import nccl_model_cuda

MICROBATCHES = 3
p = ctypes.c_void_p


def body(params):
    nccl_model_cuda.install()
    import torch

    import megatron_p2p as mp

    cuda = nccl_model_cuda.driver()
    stream = nccl_model_cuda.side_stream(cuda)

    on = nccl_model_cuda.on_device
    comm = mp.init_communicator(backend="nccl", timeout=20.0)
    first = comm.rank == 0
    sends = [torch.zeros(256) for _ in range(MICROBATCHES)]   # activations (first stage) or gradients (last)
    recvs = [torch.zeros(256) for _ in range(MICROBATCHES)]
    s, r = [on(t) for t in sends], [on(t) for t in recvs]

    def step():
        """What each stage of 1F1B posts, in order: warm-up forward, steady 1F1B, cool-down backward."""
        calls = []
        if first:
            calls.append(comm.exchange(send_next=s[0], call="send_forward"))
            for m in range(1, MICROBATCHES):
                calls.append(comm.exchange(send_next=s[m], recv_next=r[m - 1], mode="batched",
                                           call="send_forward_recv_backward"))
            calls.append(comm.exchange(recv_next=r[-1], call="recv_backward"))
        else:
            calls.append(comm.exchange(recv_prev=r[0], call="recv_forward"))
            for m in range(1, MICROBATCHES):
                calls.append(comm.exchange(send_prev=s[m - 1], recv_prev=r[m], call="send_backward_recv_forward"))
            calls.append(comm.exchange(send_prev=s[-1], call="send_backward"))
        return [req for call in calls for req in call.values()]

    def fill(run):
        for m, t in enumerate(sends):
            t.fill_(1000.0 * run + 10.0 * m + comm.rank)

    def arrived():
        return [t[0].item() for t in recvs] + [float(bool((t == t[0]).all())) for t in recvs]

    eager, replayed = [], []
    for run in range(params["replays"]):
        fill(run)
        for req in step():
            req.synchronize()
        eager.append(arrived())

    out: dict[str, Any] = {}
    if params.get("check"):
        os.environ["MEGATRON_P2P_CHECK"] = "1"
        checked = mp.init_communicator(backend="nccl", timeout=20.0)
        assert cuda.cuStreamBeginCapture_v2(stream, 0) == 0
        out["check"] = harness.caught(lambda: checked.exchange(send_next=s[0], recv_prev=r[0]))
        graph = p()
        out["check"]["end_capture"] = cuda.cuStreamEndCapture(stream, ctypes.byref(graph))
        checked.close()
    assert cuda.cuStreamBeginCapture_v2(stream, 0) == 0  # global mode, torch's default
    reqs = step()
    for req in reqs:
        req.wait()  # joins each lane back into the capturing stream
    out["synchronize"] = harness.caught(reqs[0].synchronize)
    out["is_completed"] = harness.caught(reqs[0].is_completed)
    graph, exe = p(), p()
    out["end_capture"] = cuda.cuStreamEndCapture(stream, ctypes.byref(graph))
    assert out["end_capture"] == 0, out
    assert cuda.cuGraphInstantiateWithFlags(ctypes.byref(exe), graph, 0) == 0
    for run in range(params["replays"]):
        fill(run)
        assert cuda.cuGraphLaunch(exe, stream) == 0
        assert cuda.cuStreamSynchronize(stream) == 0
        replayed.append(arrived())
    out.update(eager=eager, replayed=replayed, after=harness.caught(lambda: [q.synchronize() for q in step()]))
    assert cuda.cuGraphExecDestroy(exe) == 0 and cuda.cuGraphDestroy(graph) == 0
    cuda.mpfake_cuda_live_events.restype = ctypes.c_long
    out["captures"] = []
    for run in range(params.get("captures", 0)):
        fill(run)
        assert cuda.cuStreamBeginCapture_v2(stream, 0) == 0
        for req in step():
            req.wait()
        assert cuda.cuStreamEndCapture(stream, ctypes.byref(graph)) == 0
        assert cuda.cuGraphInstantiateWithFlags(ctypes.byref(exe), graph, 0) == 0
        assert cuda.cuGraphLaunch(exe, stream) == 0 and cuda.cuStreamSynchronize(stream) == 0
        assert cuda.cuGraphExecDestroy(exe) == 0 and cuda.cuGraphDestroy(graph) == 0
        out["captures"].append({"arrived": arrived(), "live_events": cuda.mpfake_cuda_live_events()})
    comm.close()
    return out


harness.run(body)
