"""Deadlocks at run time, one section each on communicators of their own, on 4 ranks:

  partial      ranks 0 and 1 both send first to each other (a 2-rank cycle) while ranks 2 and 3
               exchange with each other; the timeout is 60 s
  three        ranks 0, 1, 2 each send to the next before receiving (a 3-rank cycle)
  staggered    a 2-rank cycle whose rank 1 enters its wait 25 ms after rank 0, out of step with
               its watch rounds
  lane_order   two ranks, each waiting on a send queued on its lane behind a receive whose sender
               is queued the same way (a cycle through lane order)
  waiter       ranks 0 and 1 in a cycle; rank 2 waits on a receive from rank 0
  compute      rank 1 computes for 3 s before posting the receive rank 0 waits on
  busy_chain   rank 0 waits on rank 1, which waits on rank 2, which computes for 2 s
  behind_batch rank 0 waits on one 40-op group: 20 receives from rank 2, which computes for 2 s,
               then 20 sends to rank 1, which posts its receives behind a send to rank 0 (a
               2-rank cycle behind 20 ops that wait on a computing rank)
  batch_waits  the same 40-op group, with rank 1 posting its receives behind a receive from
               rank 2, which computes for 1 s and then sends to both: no cycle

Each rank records what it raised, how long after the cycle formed, and its message."""
import time

import harness
from harness import caught

TIMEOUT = 60.0
STAGGER = 0.025  # between the two 20 ms watch rounds that confirm a cycle, and not a multiple of them


def wait_all(reqs):
    for r in reqs:
        r.wait()


def send_first(torch, comm, peer_send, peer_recv, numel=1024, call="send_first"):
    """isend to one peer, then irecv from another, one by one on lane 0: under strict
    rendezvous the receive is queued behind a send that needs it."""
    out = torch.full((numel,), float(comm.global_rank))
    buf = torch.zeros(numel)
    wait_all([comm.isend(out, peer_send, call=call), comm.irecv(buf, peer_recv, call=call)])


def partial(torch, comm, me):
    if me in (0, 1):
        return caught(lambda: send_first(torch, comm, 1 - me, 1 - me, call="send_forward_recv_forward"))
    # Ranks 2 and 3 exchange with each other meanwhile, and must not be disturbed.
    peer = 5 - me

    def exchanges():
        for i in range(200):
            a, b = torch.full((256,), float(i)), torch.zeros(256)
            wait_all(comm.batch([(True, a, peer), (False, b, peer)], call="pair_exchange"))
            assert bool((b == i).all())
    return caught(exchanges)


def three(torch, comm, me):
    return caught(lambda: send_first(torch, comm, comm.next_rank, comm.prev_rank))


def staggered(torch, comm, me):
    def body():
        if me == 1:
            time.sleep(STAGGER)
        send_first(torch, comm, 1 - me, 1 - me)
    return caught(body)


def lane_order(torch, comm, me):
    peer = 1 - me

    def body():
        buf, out = torch.zeros(64), torch.ones(64)
        comm.batch([(False, buf, peer)], lane=1, call="recv_backward")  # queued first on lane 1
        comm.batch([(True, out, peer)], lane=1, call="send_backward")[0].wait()
    return caught(body)


def waiter(torch, comm, me):
    if me in (0, 1):
        return caught(lambda: send_first(torch, comm, 1 - me, 1 - me))
    return caught(lambda: comm.irecv(torch.zeros(16), 0, call="recv_forward").wait())


def compute(torch, comm, me):
    if me == 0:
        return caught(lambda: comm.isend(torch.ones(1024), 1, call="send_forward").wait())
    time.sleep(3.0)
    buf = torch.zeros(1024)
    res = caught(lambda: comm.irecv(buf, 0, call="recv_forward").wait())
    res["exact"] = bool((buf == 1).all())
    return res


def busy_chain(torch, comm, me):
    if me == 0:
        return caught(lambda: comm.irecv(torch.zeros(8), 1).wait())
    if me == 1:
        def relay():
            buf = torch.zeros(8)
            comm.irecv(buf, 2).wait()
            comm.isend(buf, 0).wait()
        return caught(relay)
    time.sleep(2.0)
    return caught(lambda: comm.isend(torch.ones(8), 1).wait())


BATCH_HALF = 20  # ops of each kind in the 40-op group: more than the 16 runs a rank publishes


def batch_behind(torch, comm, me, rank1_first, compute):
    """Rank 0 waits on a 40-op group: BATCH_HALF receives from rank 2 first, then BATCH_HALF
    sends to rank 1. Rank 1 posts `rank1_first` (a send to rank 0, or a receive from rank 2), then
    the BATCH_HALF receives from rank 0. Rank 2 computes for `compute` s, then sends what rank 0
    and (after a receive) rank 1 expect. Records whether what the rank received is exact."""
    ins = [torch.zeros(1024) for _ in range(BATCH_HALF)]

    def body():
        if me == 0:
            wait_all(comm.batch([(False, b, 2) for b in ins] + [(True, torch.full((1024,), float(i)), 1)
                                                               for i in range(BATCH_HALF)], call="forward_batch"))
        elif me == 1:
            first = comm.batch([(rank1_first == "send", torch.zeros(1024), 0 if rank1_first == "send" else 2)],
                               call=f"{rank1_first}_first")
            wait_all(first + comm.batch([(False, b, 0) for b in ins], call="recv_batch"))
        else:
            time.sleep(compute)
            late = [(True, torch.full((1024,), 2.0), 0) for _ in range(BATCH_HALF)]
            wait_all(comm.batch(late + ([(True, torch.zeros(1024), 1)] if rank1_first == "recv" else []), call="late"))
    res = caught(body)
    expected = [2.0] * BATCH_HALF if me == 0 else list(range(BATCH_HALF)) if me == 1 else []
    res["exact"] = all(bool((b == v).all()) for b, v in zip(ins, expected))
    return res


def behind_batch(torch, comm, me):
    return batch_behind(torch, comm, me, "send", 2.0)


def batch_waits(torch, comm, me):
    return batch_behind(torch, comm, me, "recv", 1.0)


# name: (the global ranks of its communicator, the section)
SECTIONS = {"partial": ((0, 1, 2, 3), partial), "three": ((0, 1, 2), three),
            "staggered": ((0, 1), staggered), "lane_order": ((0, 1), lane_order),
            "waiter": ((0, 1, 2), waiter), "compute": ((0, 1), compute), "busy_chain": ((0, 1, 2), busy_chain),
            "behind_batch": ((0, 1, 2), behind_batch), "batch_waits": ((0, 1, 2), batch_waits)}


def body(params):
    import torch
    import torch.distributed as dist

    import megatron_p2p as mp

    dist.init_process_group("gloo")
    me = dist.get_rank()
    results = {}
    for name in params.get("sections", list(SECTIONS)):
        ranks, section = SECTIONS[name]
        group = dist.new_group(list(ranks))  # collective over every rank
        if me in ranks:
            with mp.init_communicator(group, timeout=TIMEOUT) as comm:
                dist.barrier(group)
                results[name] = section(torch, comm, me)
        dist.barrier()
    return results


harness.run(body)
