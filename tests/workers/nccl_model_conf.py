"""Creating an NCCL communicator over the fakes while NCCL's conf files (NCCL_CONF_FILE,
$HOME/.nccl.conf) may set NCCL's parameters (tests/test_nccl_params.py). Reports what creation
raised, NCCL_COMM_BLOCKING as the process's C environment holds it afterwards (NCCL, and the model,
copy the conf files there; os.environ is Python's copy from the start), and, when creation
succeeded, digests of what one exchange sent and received."""
import ctypes
import hashlib
from typing import Any

import harness
import nccl_model_cuda


def digest(t) -> str:
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


def c_getenv(name: str):
    libc = ctypes.CDLL(None)
    libc.getenv.restype, libc.getenv.argtypes = ctypes.c_char_p, [ctypes.c_char_p]
    value = libc.getenv(name.encode())
    return None if value is None else value.decode()


def body(params):
    nccl_model_cuda.install()
    import torch

    import megatron_p2p as mp

    made = []
    out: dict[str, Any] = {"create": harness.caught(lambda: made.append(
        mp.init_communicator(backend="nccl", lanes=1, timeout=params.get("timeout", 10.0))))}
    out["environ"] = c_getenv("NCCL_COMM_BLOCKING")
    if made:
        on = nccl_model_cuda.on_device
        with made[0] as comm:
            sent = torch.randint(-2**31, 2**31 - 1, (1000,), dtype=torch.int32,
                                 generator=torch.Generator().manual_seed(comm.rank))
            got = torch.zeros_like(sent)
            for r in comm.exchange(send_next=on(sent), recv_prev=on(got)).values():
                r.synchronize(timeout=20.0)
            out.update(rank=comm.rank, prev=comm.prev_rank, sent=digest(sent), got=digest(got))
    return out


harness.run(body)
