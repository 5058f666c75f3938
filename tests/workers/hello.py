"""Smallest job: every rank exchanges one tensor around the ring."""
import harness


def body(params):
    import torch

    import megatron_p2p as mp

    with mp.init_communicator(timeout=10.0) as comm:
        send = torch.full((4,), comm.rank, dtype=torch.int32)
        recv = torch.empty(4, dtype=torch.int32)
        for r in comm.exchange(send_next=send, recv_prev=recv).values():
            r.wait()
        return {"got": recv.tolist(), "prev": comm.prev_rank}


harness.run(body)
