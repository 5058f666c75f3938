"""One rank drops its communicator after an exchange with itself (params["backend"]: "shm", or
"nccl" over the fake libraries) and reports whether the garbage collector freed it
(params["case"]):
  dropped  every Request and the communicator are dropped: it must be freed, and closed on the way
  held    a Request is still held: the communicator must stay alive, and that Request still
          completes exactly
The communicator's on_error hook is a bound method of an object that holds the communicator, as
a user's dump hook may be: a second cycle besides the in-flight Requests."""
import gc
import time
import weakref

import harness


class Hook:
    def __init__(self, comm):
        self.comm = comm

    def dump(self, exc):
        pass


def body(params):
    import torch

    on = lambda t: t  # noqa: E731
    if params["backend"] == "nccl":
        import nccl_model_cuda

        nccl_model_cuda.install()
        on = nccl_model_cuda.on_device
    import megatron_p2p as mp

    comm = mp.init_communicator(backend=params["backend"], timeout=30.0)
    comm.on_error = Hook(comm).dump
    sent = torch.arange(256, dtype=torch.float32)
    got = torch.zeros(256, dtype=torch.float32)
    reqs = comm.exchange(send_next=on(sent), recv_prev=on(got), mode="batched")
    held = reqs["recv_prev"] if params["case"] == "held" else None
    if held is None:
        [r.synchronize() for r in reqs.values()]  # a loop variable would keep the last Request
    ref = weakref.ref(comm)
    del comm, reqs
    gc.collect()
    if held is None:
        # The watchdog thread holds a strong reference while it checks the communicator (every
        # 0.1 s, for microseconds, but it can lose the GIL meanwhile): a collection that runs in
        # that window frees it at the next one instead. Freed within a few checks is the promise.
        deadline = time.monotonic() + 5.0
        while ref() is not None and time.monotonic() < deadline:
            time.sleep(0.01)
            gc.collect()
    out = {"freed": ref() is None}
    if held is not None:
        held.synchronize()
        out["exact"] = torch.equal(got, sent)
        kept = ref()
        assert kept is not None  # `held` keeps it
        out["closed"] = kept.closed
        kept.close()
    return out


harness.run(body)
