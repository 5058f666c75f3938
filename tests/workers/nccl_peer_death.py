"""A peer's death on the NCCL backend over the fake libraries, 2 ranks, communicator timeout
params["timeout"] (long: a report well within it comes from the watchdog seeing the death).
Rank `victim` is the one that dies or is slow; the other, the waiter, posts a receive from it and
blocks in synchronize(). params["case"]:
  killed       the victim (rank 1) is SIGKILLed once the waiter blocks
  slow         the victim (rank 1) sleeps params["delay"] s, then posts the send
  store_killed the victim (rank 0) hosts the TCPStore the communicator uses, and is SIGKILLed
  idle_killed  the victim (rank 1) is SIGKILLed while the waiter has nothing pending; the waiter
               notices nothing for params["idle"] s, then posts a receive from it
  normal_end   rank 0 hosts the store; one exchange completes, rank 0 closes and exits; rank 1
               stays idle with its communicator open params["idle"] s after rank 0 is gone, then
               closes
The waiter reports its calls (harness.caught) and, for the deaths, after_death: seconds from the
moment the victim died to the end of the failing call (torchrun's store carries the moment).
Every rank ignores torchrun's SIGTERM, so that the waiter can report after the victim's death."""
import os
import signal
import time
from pathlib import Path
from typing import Any

import harness
import nccl_model_cuda


def die(agent_store) -> None:
    agent_store.set("died_at", repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def body(params):
    nccl_model_cuda.install()
    import torch

    import megatron_p2p as mp
    from megatron_p2p.communicator import _env_rendezvous

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    on = nccl_model_cuda.on_device
    case = params["case"]
    agent_store, me, world = _env_rendezvous()
    if case in ("store_killed", "normal_end"):
        harness.store_of_rank0(agent_store, me, world)
    comm = mp.init_communicator(backend="nccl", timeout=params["timeout"])
    victim = 0 if case == "store_killed" else 1
    peer = comm.ranks[1 - comm.rank]
    t = torch.arange(256, dtype=torch.float32)
    got = torch.zeros(256, dtype=torch.float32)
    out: dict[str, Any] = {}

    if case == "normal_end":
        agent_store.set(f"pid{me}", str(os.getpid()))
        reqs = comm.exchange(send_next=on(t + me), recv_prev=on(got))
        out["exchange"] = harness.caught(lambda: [r.synchronize() for r in reqs.values()])
        if me == 0:
            out["close"] = harness.caught(comm.close)
            return out  # the process exits, and the store with it
        gone = Path(f"/proc/{int(agent_store.get('pid0'))}")
        while gone.exists():  # exited and reaped
            time.sleep(0.01)
        time.sleep(params["idle"])
        out["close"] = harness.caught(comm.close)
        return out

    if me == victim:
        if case == "idle_killed":
            die(agent_store)
        agent_store.wait(["posted"])
        time.sleep(0.3)  # the waiter is blocked in synchronize()
        if case == "slow":
            time.sleep(params["delay"])
            comm.isend(on(t), peer).synchronize()
            comm.close()
            return out
        die(agent_store)

    if case == "idle_killed":
        agent_store.wait(["died_at"])
        time.sleep(params["idle"])
    req = comm.irecv(on(got), peer)
    agent_store.set("posted", "1")
    start = time.time()
    out["wait"] = harness.caught(req.synchronize)
    if case == "slow":
        out["exact"] = bool(torch.equal(got, t))
    else:
        out["after_death"] = start + out["wait"]["elapsed"] - float(agent_store.get("died_at"))
        out["next_call"] = harness.caught(lambda: comm.exchange(send_next=on(t), recv_prev=on(got)))
    out["close"] = harness.caught(comm.close)
    return out


harness.run(body)
