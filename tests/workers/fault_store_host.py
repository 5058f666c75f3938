"""Ending the job during creation: the ranks bootstrap through a TCPStore that rank 0 hosts
itself (not torchrun's agent store), and rank 0 exits (os._exit(0), so torchrun waits for the
others) while rank 1 waits in init_communicator for the unique id. Rank 1 reports what its
call raised, and how long after rank 0's exit (torchrun's store, which outlives rank 0, carries
the moment of the exit).

params: timeout (rank 1's communicator timeout, long: the report must come from the store
vanishing), delay (how long rank 0 lets rank 1 wait before it exits)."""
import os
import signal
import time

import harness


def body(params):
    import megatron_p2p as mp
    from megatron_p2p.communicator import _env_rendezvous

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    agent_store, me, world = _env_rendezvous()
    _store = harness.store_of_rank0(agent_store, me, world)  # held: the communicator's store
    if me == 0:
        time.sleep(params["delay"])
        agent_store.set("exited_at", repr(time.time()))
        os._exit(0)
    made = []
    start = time.time()
    record = harness.caught(lambda: made.append(mp.init_communicator(timeout=params["timeout"])))
    reported_at = start + record["elapsed"]
    for comm in made:
        comm.close()
    exited_at = float(agent_store.get("exited_at")) if agent_store.check(["exited_at"]) else None
    return {"call": record, "after_exit": None if exited_at is None else reported_at - exited_at}


harness.run(body)
