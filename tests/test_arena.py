"""Receive buffers from the rank's shared arena (`comm.empty`): a send into one is written by the
sender straight into the receiver's memory (path "arena" in received_by_path); buffers users
allocate themselves still go by single copy or the bounce buffer. Arena buffers are ordinary
tensors that outlive their communicator; a full arena falls back to plain memory, saying so
once; a block whose receive failed while its sender could still write is never handed out again.

One torchrun job (workers/arena_cases.py) observes everything; where a buffer lives is read from
the rank's memory map. Rank 0 sends, rank 1 receives, unless a test says otherwise."""
import pytest
from conftest import run_job

MIB = 1 << 20
ARENA_WAIT_BYTES = 2 * MIB  # megatron_p2p._C.ARENA_WAIT_BYTES: the workers use messages of this size
TIMEOUT = 60.0  # of every communicator: a loaded 2-core machine


@pytest.fixture(scope="module")
def ranks():
    job = run_job("arena_cases.py", 2, params={"timeout": TIMEOUT}, timeout=300)
    return [r["value"] for r in job.ok()]


@pytest.fixture(scope="module")
def receiver(ranks):
    return ranks[1]


# ---- the path a message takes -------------------------------------------------------------------


def test_a_send_into_an_arena_buffer_arrives_exactly_by_the_arena_path(receiver):
    d = receiver["delivery"]
    assert d["arena_buf_in_arena"]
    assert d["into_arena"] == {"exact": True, "paths": ["arena"]}


def test_a_send_into_a_plain_buffer_arrives_exactly_by_single_copy(receiver):
    d = receiver["delivery"]
    assert not d["plain_buf_in_arena"]
    assert d["into_plain"] == {"exact": True, "paths": ["single_copy"]}


def test_with_single_copy_off_plain_buffers_take_the_bounce_path_and_arena_buffers_the_arena(receiver):
    d = receiver["delivery"]["no_single_copy"]
    assert d["into_plain"] == {"exact": True, "paths": ["bounce"]}
    assert d["into_arena"] == {"exact": True, "paths": ["arena"]}


def test_a_send_posted_before_its_arena_receive_waits_for_the_offer(receiver):
    """A send of ARENA_WAIT_BYTES or more to a rank with an arena waits for the receive's
    answer, then writes into the buffer it offers; a smaller one does not wait (the wake-up
    would cost more than the faster copy saves) and is read by the receiver."""
    d = receiver["delivery"]
    assert d["into_arena_send_first"] == {"exact": True, "paths": ["arena"]}
    assert d["into_arena_send_first_small"] == {"exact": True, "paths": ["single_copy"]}


def test_a_message_larger_than_one_copy_pass_arrives_exactly(receiver):
    assert receiver["delivery"]["into_arena_40mib"] == {"exact": True, "paths": ["arena"]}


def test_a_view_inside_an_arena_block_receives_at_its_offset_and_nowhere_else(receiver):
    d = receiver["delivery"]
    assert d["into_view"] == {"exact": True, "paths": ["arena"]}
    assert d["view_neighbours_untouched"]


def test_more_arena_receives_in_flight_than_offer_slots_all_arrive_exactly(receiver):
    burst = receiver["delivery"]["burst"]
    assert burst["exact"] == [True] * 12
    assert burst["paths"] == {"arena": 12}


def test_receives_outstanding_past_the_offer_slots_while_more_are_posted_all_arrive_exactly(receiver):
    """Groups of 10 arena receives, then a window of 12 posted while earlier ones complete
    (workers/arena_cases.py offers_in_flight): two receives answer into one offer slot, from the
    posting thread and the engine's, and no message lands in another receive's buffer. An offer
    a later receive replaced before its sender read it sends that message by single copy."""
    d = receiver["delivery"]["offers_in_flight"]
    assert d["in_arena"] == d["exact"] == 120, d
    assert sum(d["paths"].values()) == 120 and set(d["paths"]) <= {"arena", "single_copy"}, d
    # Which path each takes is timing (the sanitizers' run sends more by single copy); what matters
    # is that offers were taken while others were answered, and that nothing went astray.
    assert d["paths"].get("arena", 0) > 0, d


def test_each_rank_offers_its_own_arena_whatever_its_peer_has(ranks):
    """Rank 0 has no arena, rank 1 has one: rank 1's buffer is written by rank 0 into its
    arena; rank 0's comm.empty is plain memory, received by single copy."""
    no_arena, with_arena = ranks[0]["mixed"], ranks[1]["mixed"]
    assert (no_arena["arena_bytes"], with_arena["arena_bytes"]) == (0, 16 * MIB)
    assert not no_arena["in_arena"] and with_arena["in_arena"]
    assert no_arena["peer_arenas_mapped"] == 1 and with_arena["peer_arenas_mapped"] == 0
    assert with_arena["to_rank_1"] == {"exact": True, "paths": ["arena"]}
    assert no_arena["to_rank_0"] == {"exact": True, "paths": ["single_copy"]}


def test_megatron_cores_drop_in_receives_into_the_arena(ranks):
    """P2PCommunicator's receive buffers (send_forward / recv_forward, then backward) come from
    the arena and arrive by the arena path, requiring grad like megatron-core's."""
    for rank, v in enumerate(ranks):
        d = v["dropin"]
        assert d["exact"] and d["requires_grad"] and d["in_arena"], (rank, d)
        assert (d["arena_delta"], d["other_paths_delta"]) == (1, 0), (rank, d)


# ---- the tensors -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "complex64", "int64", "uint8", "bool"])
def test_empty_gives_an_ordinary_writable_tensor_of_the_shape_and_dtype(receiver, dtype):
    t = receiver["tensors"][dtype]
    assert t["shape"] == [65, 1024] and t["dtype"] == f"torch.{dtype}", t
    assert t["contiguous"] and t["device"] == "cpu" and t["in_arena"] and t["written"], t
    if dtype not in ("int64", "uint8", "bool"):
        assert t["grad"], t  # requires_grad_() and backward() work


def test_empty_takes_a_torch_size(receiver):
    assert receiver["tensors"]["torch_size_shape"] == [8, 4096]


def test_buffers_that_travel_inline_are_plain_memory(receiver):
    """Up to the descriptor slot (4 KiB), or the eager threshold when larger, a message is
    copied through the segment: such buffers are not taken from the arena; one byte more is."""
    t = receiver["tensors"]
    assert not t["at_slot_size_in_arena"] and t["above_slot_size_in_arena"]
    assert not t["at_eager_threshold_in_arena"] and t["above_eager_threshold_in_arena"]
    assert t["scalar"] == {"shape": [], "in_arena": False}
    assert t["zero_elements"] == {"shape": [0, 5], "in_arena": False}


# ---- size, exhaustion and reuse ---------------------------------------------------------------


def test_a_full_arena_falls_back_to_plain_memory_and_says_so_once(receiver):
    e = receiver["exhaustion"]
    assert e["arena_bytes"] == 8 * MIB
    assert e["first_in_arena"] and e["warnings_before_full"] == []
    assert e["spill_raised"] == [None] * 3
    assert e["spilled_in_arena"] == [False] * 3
    assert len(e["warnings_when_full"]) == 1, e["warnings_when_full"]
    assert "receive arena (8 MiB)" in e["warnings_when_full"][0]
    assert e["into_spilled"] == {"exact": True, "paths": ["single_copy"]}


def test_a_freed_block_is_handed_out_again(receiver):
    e = receiver["exhaustion"]
    assert e["after_free_in_arena"]
    assert e["into_reused"] == {"exact": True, "paths": ["arena"]}
    assert e["warnings_after_reuse"] == e["warnings_when_full"]  # no new warning


def test_arena_bytes_zero_gives_plain_buffers_and_single_copy(receiver):
    d = receiver["disabled"]["arg_zero"]
    assert d["arena_bytes"] == 0 and d["own_arenas"] == 0 and not d["in_arena"], d
    assert d["transfer"] == {"exact": True, "paths": ["single_copy"]}


def test_the_environment_sizes_the_arena_and_zero_disables_it(receiver):
    d = receiver["disabled"]
    assert d["env_zero"] == {"arena_bytes": 0, "own_arenas": 0}
    assert d["env_16mib"] == {"arena_bytes": 16 * MIB, "in_arena": True,
                              "transfer": {"exact": True, "paths": ["arena"]}}


def test_the_default_arena_is_1_gib_and_the_largest_64_gib_works(receiver):
    assert receiver["delivery"]["arena_bytes"] == 1 << 30
    assert receiver["disabled"]["arg_max"] == {"arena_bytes": 64 << 30, "in_arena": True,
                                              "transfer": {"exact": True, "paths": ["arena"]}}


@pytest.mark.parametrize("value", ["-1", "True", "1.5", str((64 << 30) + 1), "'1048576'"])
def test_an_invalid_arena_bytes_argument_raises_value_error_naming_it(receiver, value):
    raised = receiver["invalid"]["arg"][value]
    assert raised["type"] == "ValueError", raised
    assert "arena_bytes" in raised["msg"] and value in raised["msg"], raised


@pytest.mark.parametrize("value", ["'lots'", "'-1'", repr(str((64 << 30) + 1)), "'1.5'", "''"])
def test_an_invalid_arena_size_in_the_environment_raises_value_error_naming_it(receiver, value):
    raised = receiver["invalid"]["env"][value]
    assert raised["type"] == "ValueError", raised
    assert "$MEGATRON_P2P_SHM_ARENA_BYTES" in raised["msg"] and value.strip("'") in raised["msg"], raised


# ---- lifetime ----------------------------------------------------------------------------------


def test_an_arena_buffer_outlives_its_communicator(ranks):
    """After close() the received bytes are still there and the buffer is writable; the peer's
    arena is unmapped; empty() on the closed communicator gives plain memory."""
    for rank, v in enumerate(ranks):
        life = v["lifetime"]
        assert life["in_arena_after_close"] and life["writable_after_close"], (rank, life)
        assert life["peer_arena_mapped_while_open"] == 1 and life["peer_arena_mapped_after_close"] == 0, (rank, life)
        assert not life["empty_after_close_in_arena"] and life["empty_after_close_shape"] == [ARENA_WAIT_BYTES // 4]
    assert ranks[1]["lifetime"]["transfer"] == {"exact": True, "paths": ["arena"]}
    assert ranks[1]["lifetime"]["readable_after_close"]


def test_the_arena_is_gone_with_its_last_buffer_and_leaves_no_dev_shm_entry(ranks):
    for rank, v in enumerate(ranks):
        assert v["lifetime"]["own_arena_mapped_after_del"] == 0, rank
        assert v["lifetime"]["dev_shm_after"] == [], rank


# ---- blocks a sender may still write into -----------------------------------------------------


def quarantine(receiver, how):
    return receiver["quarantine"][how]


def test_a_completed_receives_block_is_handed_out_again(receiver):
    q = quarantine(receiver, "completed")
    assert q["in_arena"] and q["transfer"] == {"exact": True, "paths": ["arena"]}
    assert q["again_in_arena"]


@pytest.mark.parametrize("how,error", [("timeout", "P2PTimeoutError"), ("peer_abort", "P2PError")])
def test_a_block_whose_receive_failed_before_its_sender_wrote_is_never_handed_out_again(receiver, how, error):
    """The sender may still write into it: freed, it stays out of the free list, so the whole
    arena cannot be handed out again; its memory goes with the arena."""
    q = quarantine(receiver, how)
    assert q["in_arena"] and q["wait"]["type"] == error, q
    assert not q["again_in_arena"], q
    assert q["own_arenas_left"] == 0, q


@pytest.mark.parametrize("how", ["mismatch", "timeout_plain"])
def test_a_block_no_sender_can_write_into_is_handed_out_again_after_a_failure(receiver, how):
    """A mismatch is found once the sender has chosen another path; a receive into plain memory
    never offered the arena's block: either way, the block returns to the free list."""
    q = quarantine(receiver, how)
    assert q["wait"]["type"] == ("MismatchError" if how == "mismatch" else "P2PTimeoutError"), q
    assert q["again_in_arena"], q
    assert q["own_arenas_left"] == 0, q


# ---- an offer rewritten by a hostile peer ------------------------------------------------------


def forged(ranks, forge):
    return ranks[0]["forged_offers"][forge]["send"], ranks[1]["forged_offers"][forge]


def test_an_untouched_offer_is_written_where_it_points(ranks):
    send, recv = forged(ranks, "untouched")
    assert send["type"] is None and recv["recv"]["type"] is None, (send, recv)
    assert recv["buffer_exact"] and recv["landed_where_pointed"], recv


def test_an_offer_ending_at_the_arenas_end_is_in_bounds_and_written_there(ranks):
    """The receiver's word is trusted as far as bounds go: the last bytes of its own arena."""
    send, recv = forged(ranks, "at_the_end")
    assert send["type"] is None and recv["recv"]["type"] is None, (send, recv)
    assert recv["landed_where_pointed"] and not recv["buffer_exact"], recv


@pytest.mark.parametrize("forge", ["one_past_the_end", "huge"])
def test_an_offer_beyond_the_arena_is_reported_as_a_corrupt_segment_and_never_written(ranks, forge):
    """One byte past the end, or an offset whose sum with the size wraps around: the sender
    reports the offer (offset and nbytes) without writing, and the receiver gets the report."""
    send, recv = forged(ranks, forge)
    offset = f"offset {recv['forged_offset']:#x} + nbytes {3 * MIB + 4096}"
    for raised in (send, recv["recv"]):
        assert raised["type"] == "P2PError", raised
        assert "corrupt segment: arena offer for message #0 to rank 1" in raised["msg"], raised
        assert offset in raised["msg"], raised
    assert not recv["buffer_exact"]
