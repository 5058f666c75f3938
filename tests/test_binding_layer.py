"""The binding layer alone, on the benchmark-only "null" transport (megatron_p2p._testing): every op it is given is done
when posting returns, with no copy and no peer, so one process can be rank 0 of a group of 2.
The layer itself (argument checks, tensor reads, the plan, Requests) runs as it does for shm.
Tensors of exactly torch.Tensor or torch.nn.Parameter are read through torch's own descriptors;
a subclass is read through attribute lookup, so its overrides are honoured."""
from __future__ import annotations

import pytest
import torch

import megatron_p2p
from megatron_p2p import _testing
from megatron_p2p.communicator import BACKENDS

SLOTS = ("send_next", "recv_prev", "send_prev", "recv_next")


@pytest.fixture
def comm():
    c = _testing.null_communicator("binding-layer-test", 0, [0, 1], timeout=10.0)
    yield c
    c.close()


def tensors() -> dict[str, torch.Tensor]:
    return {name: torch.full((8,), float(i)) for i, name in enumerate(SLOTS)}


@pytest.mark.parametrize("mode", ["parity", "batched"])
def test_an_exchange_on_the_null_transport_is_complete_when_posted_and_moves_no_bytes(comm, mode):
    given = tensors()
    reqs = comm.exchange(mode=mode, **given)
    assert sorted(reqs) == sorted(SLOTS)
    assert all(r.is_completed() and r.wait() for r in reqs.values())
    assert all(torch.equal(t, tensors()[name]) for name, t in given.items())
    assert comm.stats()["sends"] == 2 and comm.stats()["recvs"] == 2


def test_isend_irecv_and_batch_on_the_null_transport_are_complete_when_posted(comm):
    t = torch.ones(4)
    assert comm.isend(t, 1).is_completed() and comm.irecv(t, 1).wait()
    reqs = comm.batch([(True, t, 1), (False, torch.empty(4), 1)])
    assert [r.is_send for r in reqs] == [True, False] and all(r.is_completed() for r in reqs)
    assert [(op["kind"], op["state"]) for op in comm.recent_ops()][-2:] == [("send", "completed"), ("recv", "completed")]


def test_a_non_contiguous_tensor_is_refused_and_its_contiguous_copy_is_not(comm):
    strided = torch.ones(4, 4).t()
    with pytest.raises(ValueError, match="recv_prev is not contiguous"):
        comm.exchange(recv_prev=strided)
    assert comm.exchange(recv_prev=strided.contiguous())["recv_prev"].wait()


def test_a_non_tensor_is_refused_and_a_parameter_is_carried(comm):
    with pytest.raises(TypeError, match="tensor must be a torch.Tensor, not list"):
        comm.isend([1.0], 1)
    assert comm.isend(torch.nn.Parameter(torch.ones(3)), 1).wait()
    with pytest.raises(ValueError, match="not contiguous"):
        comm.isend(torch.nn.Parameter(torch.ones(3, 3).t()), 1)


class NeverContiguous(torch.Tensor):
    def is_contiguous(self, *args, **kwargs) -> bool:
        return False


def test_a_subclass_is_read_through_its_own_overrides(comm):
    with pytest.raises(ValueError, match="not contiguous"):
        comm.isend(torch.ones(3).as_subclass(NeverContiguous), 1)
    assert comm.isend(torch.ones(3).as_subclass(torch.Tensor), 1).wait()


def test_a_complex_conjugate_view_is_refused_and_its_resolved_copy_is_not(comm):
    z = torch.ones(3, dtype=torch.complex64)
    with pytest.raises(ValueError, match="conjugate bit"):
        comm.isend(z.conj(), 1)
    assert comm.isend(z.conj().resolve_conj(), 1).wait()


def test_a_negative_view_is_refused_and_its_resolved_copy_is_not(comm):
    neg = torch.ones(3, dtype=torch.complex64).conj().imag
    assert neg.is_neg()
    with pytest.raises(ValueError, match="negative bit"):
        comm.isend(neg, 1)
    assert comm.isend(neg.resolve_neg(), 1).wait()


def test_the_sizes_and_pointer_read_are_the_tensors_own(comm):
    t = torch.arange(12, dtype=torch.float64)[2:]
    assert comm.isend(t, 1).nbytes == 80
    assert comm.check_tensor(t) is None


def test_an_aborted_null_communicator_refuses_posts_and_a_live_one_does_not(comm):
    assert comm.isend(torch.ones(1), 1).wait()
    comm.abort(reason="test")
    with pytest.raises(megatron_p2p.P2PError, match="aborted"):
        comm.isend(torch.ones(1), 1)


def test_the_null_transport_is_not_a_backend_of_init_communicator():
    assert "null" not in BACKENDS and "shm" in BACKENDS
    with pytest.raises(ValueError, match="backend must be one of"):
        megatron_p2p.init_communicator(backend="null")


def test_an_abort_for_a_cause_outside_the_group_names_no_rank_and_one_for_a_peer_names_its_global_rank():
    """Group ranks 0 and 1 are global ranks 4 and 6: a report names the global one, as every report does."""
    for rank, named in ((-1, r"caused outside the group\)"), (6, r"caused by rank 6\)")):
        c = _testing.null_communicator(f"binding-layer-outside-{rank}", 0, [4, 6], timeout=10.0)
        try:
            c.abort(rank=rank, reason="the store's host is gone", peer_failed=True)
            with pytest.raises(megatron_p2p.PeerFailureError, match=named) as exc:
                c.isend(torch.ones(1), 6)
            assert "group rank" not in str(exc.value) and "rank 1" not in str(exc.value), exc.value
        finally:
            c.close()


def test_an_abort_naming_a_rank_past_any_int_is_a_value_error_and_a_group_rank_is_taken(comm):
    with pytest.raises(ValueError, match="is not a rank of this communicator"):
        comm.abort(rank=2**70, reason="why", peer_failed=True)
    assert comm.isend(torch.ones(1), 1).wait()  # refused up front: nothing was aborted
    comm.abort(rank=1, reason="why", peer_failed=True)
    with pytest.raises(megatron_p2p.PeerFailureError, match="caused by rank 1"):
        comm.isend(torch.ones(1), 1)


def test_an_unknown_backend_given_by_keyword_is_named_and_a_known_one_is_taken():
    with pytest.raises(ValueError, match="backend must be 'shm' or 'nccl', got 'bogus'"):
        megatron_p2p._C.Communicator(backend="bogus", unique_id="x", group_rank=0, ranks=[0, 1])
    _testing.null_communicator("binding-layer-backend", 0, [0, 1], timeout=5.0).close()


def test_a_cause_outside_the_group_must_be_a_peer_failure(comm):
    with pytest.raises(ValueError, match="rank=-1 .* needs peer_failed=True"):
        comm.abort(rank=-1, reason="why")
    assert comm.isend(torch.ones(1), 1).wait()  # refused up front: nothing was aborted
