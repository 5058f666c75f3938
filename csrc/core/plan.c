#include "plan.h"

#include "op.h"

/* The one name table of the ops: the slots (an exchange's ops), then the other labels (op.h). */
static const char *const label_names[MP_NUM_LABELS] = {
    [MP_SEND_NEXT] = "send_next", [MP_RECV_PREV] = "recv_prev", [MP_SEND_PREV] = "send_prev",
    [MP_RECV_NEXT] = "recv_next", [MP_LABEL_ISEND] = "isend",    [MP_LABEL_IRECV] = "irecv",
};
static const char *const mode_names[MP_NUM_MODES] = {[MP_MODE_PARITY] = "parity", [MP_MODE_BATCHED] = "batched"};

/* Megatron's _p2p_ops order. Even ranks send first, odd ranks receive first, so a strict
 * rendezvous pairs neighbours on every chain and ring. */
static const mp_slot parity_even[MP_NUM_SLOTS] = {MP_SEND_NEXT, MP_RECV_PREV, MP_SEND_PREV, MP_RECV_NEXT};
static const mp_slot parity_odd[MP_NUM_SLOTS] = {MP_RECV_PREV, MP_SEND_NEXT, MP_RECV_NEXT, MP_SEND_PREV};

/* Batched order. Megatron issues send_prev, recv_prev, send_next, recv_next; with two ranks
 * (prev == next) the first send to the peer is then a gradient while the peer's first receive
 * expects an activation. Here sends go next-then-prev and receives prev-then-next, which pairs
 * the k-th send with the k-th receive of the same direction for every size.
 * Lanes are issued in one fixed order, lane 0's group before lane 1's, on every rank and for
 * every subset of ops (so does parity mode: both of its orders list the forward pair first).
 * Each lane is its own NCCL communicator, and NCCL requires the operations of one device's
 * communicators to follow one order consistent across ranks (NCCL's user guide,
 * docs/userguide/source/usage/communicators.rst, "Using multiple NCCL communicators
 * concurrently"; from 2.26 NCCL_LAUNCH_ORDER_IMPLICIT takes that order from the host issue
 * order, src/enqueue.cc). Creating a lane's step where its first op appears, with sends first,
 * put lane 1 first for send_prev + recv_prev but lane 0 first for its partner's send_next +
 * recv_next: 1F1B's two sides issued their lanes in opposite orders, which deadlocks once NCCL
 * serializes them. The forward pair first keeps both: lane order, and the relative order of the
 * sends and of the receives (so with one lane the single group pairs directions as before). */
static const mp_slot batched_order[MP_NUM_SLOTS] = {MP_SEND_NEXT, MP_RECV_PREV, MP_SEND_PREV, MP_RECV_NEXT};

const char *mp_slot_name(mp_slot s)
{
    return (unsigned)s < MP_NUM_SLOTS ? label_names[s] : "?";
}

const char *mp_mode_name(mp_mode m)
{
    return (unsigned)m < MP_NUM_MODES ? mode_names[m] : "?";
}

int mp_slot_is_send(mp_slot s)
{
    return s == MP_SEND_NEXT || s == MP_SEND_PREV;
}

int mp_slot_lane(mp_slot s, int nlanes)
{
    if (nlanes < 2)
        return 0;
    return (s == MP_SEND_NEXT || s == MP_RECV_PREV) ? 0 : 1;
}

static int targets_self(const mp_plan_input *in, mp_slot s)
{
    return (s == MP_SEND_NEXT || s == MP_RECV_NEXT) ? in->next_is_self : in->prev_is_self;
}

void mp_plan_exchange(const mp_plan_input *in, mp_plan *out)
{
    const mp_slot *order = in->mode == MP_MODE_BATCHED ? batched_order
                         : (in->rank % 2 == 0)         ? parity_even
                                                       : parity_odd;
    int lanes = in->nlanes < 2 ? 1 : 2;
    /* A self send and its receive must share a group (NCCL's rule; under strict rendezvous
     * anything else deadlocks), so a lane holding one is issued as one group. */
    int grouped[2] = {in->mode == MP_MODE_BATCHED, in->mode == MP_MODE_BATCHED};
    for (int i = 0; i < MP_NUM_SLOTS; i++)
        if ((in->present >> order[i] & 1u) && targets_self(in, order[i]))
            grouped[mp_slot_lane(order[i], lanes)] = 1;

    int lane_step[2] = {-1, -1};
    out->nsteps = 0;
    for (int i = 0; i < MP_NUM_SLOTS; i++) {
        mp_slot s = order[i];
        if (!(in->present >> s & 1u))
            continue;
        int lane = mp_slot_lane(s, lanes);
        mp_plan_step *step;
        if (grouped[lane] && lane_step[lane] >= 0) {
            step = &out->steps[lane_step[lane]];
        } else {
            step = &out->steps[out->nsteps];
            lane_step[lane] = out->nsteps++;
            step->lane = lane;
            step->nops = 0;
        }
        step->ops[step->nops++] = s;
    }
}

const char *mp_label_name(mp_label l)
{
    return (unsigned)l < MP_NUM_LABELS ? label_names[l] : "op";
}
