"""What differs for a worker body between the shm backend and the NCCL backend over the fake
libraries, so that one body runs on both (workers that take a "backend" param).

shm carries CPU tensors, and Request.wait() blocks the host. NCCL carries CUDA tensors (here CPU
memory that reports cuda:0, see nccl_model_cuda.py), and wait() only makes the current stream
wait. On a GPU the compute that reads a received tensor runs on that stream, after the data; on
the model that compute is the host, so it must also synchronize() before reading."""
from __future__ import annotations

from typing import Any

BACKENDS = ("shm", "nccl")


class Backend:
    """One of BACKENDS; making the "nccl" one points the package at the fakes and patches torch.cuda."""

    def __init__(self, name: str):
        if name not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
        self.name = name
        self.nccl = name == "nccl"
        if self.nccl:
            import nccl_model_cuda

            nccl_model_cuda.install()

    def tensor(self, t: Any) -> Any:
        """`t` as the backend takes it: for NCCL, the same memory reporting cuda:0. A
        non-contiguous tensor stays so (and is refused), never silently copied."""
        if not self.nccl or t is None:
            return t
        import nccl_model_cuda

        return t.as_subclass(nccl_model_cuda.FakeCudaTensor)

    def settle(self, request: Any, timeout: float | None = None) -> None:
        """Waits as a pipeline does, then until the request's bytes are where the host reads them."""
        request.wait(timeout)
        if self.nccl:
            request.synchronize(timeout)

    def comm(self, comm: Any) -> Any:
        """`comm` for code that hands it CPU tensors and reads what arrives after wait(), as
        P2PCommunicator does: on NCCL, tensors are passed on as CUDA ones and wait() settles."""
        return ModelComm(comm, self) if self.nccl else comm


class SettlingRequest:
    """A request whose wait() also makes the bytes visible to the host (Backend.settle)."""

    def __init__(self, request: Any, backend: Backend):
        self._request = request
        self._backend = backend

    def wait(self, timeout: float | None = None) -> None:
        self._backend.settle(self._request, timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._request, name)


class ModelComm:
    """A communicator that takes CPU tensors in exchange() and batch(), for callers written for
    CUDA ones (P2PCommunicator posts through these two only)."""

    def __init__(self, comm: Any, backend: Backend):
        self._comm = comm
        self._backend = backend

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm, name)

    def check_tensor(self, tensor: Any, name: str = "tensor") -> None:
        self._comm.check_tensor(self._backend.tensor(tensor), name)

    def exchange(self, **kw: Any) -> dict[str, SettlingRequest]:
        ops = {k: (self._backend.tensor(v) if k.startswith(("send_", "recv_")) else v) for k, v in kw.items()}
        return {k: SettlingRequest(r, self._backend) for k, r in self._comm.exchange(**ops).items()}

    def batch(self, ops: Any, **kw: Any) -> list[SettlingRequest]:
        ops = [(is_send, self._backend.tensor(t), peer) for is_send, t, peer in ops]
        return [SettlingRequest(r, self._backend) for r in self._comm.batch(ops, **kw)]
