"""A fork child of a rank with an NCCL communicator (one rank exchanging with itself over the
fakes): the child calls the inherited communicator and exits through sys.exit; the parent then
exchanges. Returns what the child's call raised (through a pipe), the child's exit status and
stderr, and whether the parent's exchanges after it are exact."""
import json
import os
import sys
import tempfile

import harness
import nccl_model_cuda


def body(params):
    nccl_model_cuda.install()
    import torch

    import megatron_p2p as mp

    comm = mp.init_communicator(backend="nccl", timeout=20.0)
    send, recv = torch.arange(64, dtype=torch.float32), torch.zeros(64)
    s, r = nccl_model_cuda.on_device(send), nccl_model_cuda.on_device(recv)
    for q in comm.exchange(send_next=s, recv_prev=r, mode="batched").values():
        q.synchronize()
    read, write = os.pipe()
    err = tempfile.TemporaryFile()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        os.dup2(err.fileno(), 2)
        send.fill_(-7.0)
        caught = harness.caught(lambda: comm.exchange(send_next=s, recv_prev=r, mode="batched"))
        os.write(write, json.dumps(caught).encode())
        os.close(write)
        comm.close()
        sys.exit(0)  # through the interpreter's shutdown: the exit hooks and the GC run
    os.close(write)
    with os.fdopen(read) as f:
        child_call = json.loads(f.read() or "null")
    _, status = os.waitpid(pid, 0)
    err.seek(0)
    exact = []
    for run in range(3):
        send.copy_(torch.arange(64, dtype=torch.float32) + 100.0 * run)
        for q in comm.exchange(send_next=s, recv_prev=r, mode="batched").values():
            q.synchronize()
        exact.append(recv.tolist() == send.tolist())
    comm.close()
    return {"child_call": child_call, "child_status": status, "child_stderr": err.read().decode(errors="replace"),
            "parent": os.getpid(), "exact_after": exact}


harness.run(body)
