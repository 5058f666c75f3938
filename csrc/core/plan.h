/* The schedule of one pipeline exchange: which ops, in which order, on which lane, grouped how.
 * Pure functions, no I/O: the one place where Megatron's parity rule lives. */
#ifndef MP_PLAN_H
#define MP_PLAN_H

/* The four ops of an exchange, named as megatron-core names them (mp_slot_name; exported to
 * Python as _C.SLOT_NAMES, in this order). They are also the first four op labels (op.h). */
typedef enum { MP_SEND_NEXT = 0, MP_RECV_PREV = 1, MP_SEND_PREV = 2, MP_RECV_NEXT = 3, MP_NUM_SLOTS = 4 } mp_slot;

/* Lanes a communicator may have: 1 (one ordered queue) or 2 (lane 0 forward, lane 1 backward).
 * Exported to Python as _C.MAX_LANES. */
#define MP_MAX_LANES 2

typedef enum {
    MP_MODE_PARITY = 0,  /* megatron's _p2p_ops: one op per step, order by the parity of the rank */
    MP_MODE_BATCHED = 1, /* megatron's _batched_p2p_ops: the ops of a lane in one group */
    MP_NUM_MODES = 2,
} mp_mode;

typedef struct {
    int lane;
    int nops;
    mp_slot ops[MP_NUM_SLOTS]; /* in issue order */
} mp_plan_step;

typedef struct {
    int nsteps;
    mp_plan_step steps[MP_NUM_SLOTS];
} mp_plan;

typedef struct {
    mp_mode mode;
    int nlanes;          /* 1: everything on lane 0 (megatron's one stream); 2: lane 0 forward, lane 1 backward */
    int rank;            /* group rank: its parity picks the order */
    unsigned present;    /* bit i set: op i is posted */
    int prev_is_self;    /* one-rank ring: prev == next == self */
    int next_is_self;
} mp_plan_input;

const char *mp_slot_name(mp_slot s);
/* "parity" or "batched" (exported to Python as _C.MODE_NAMES, in mp_mode order); "?" past the end. */
const char *mp_mode_name(mp_mode m);
int mp_slot_is_send(mp_slot s);
/* Lane of an op: forward (activations: send_next / recv_prev) or backward (gradients). */
int mp_slot_lane(mp_slot s, int nlanes);
/* The steps of one exchange, in issue order: every step of lane 0 before any of lane 1, in every
 * mode and on every rank (plan.c says why). */
void mp_plan_exchange(const mp_plan_input *in, mp_plan *out);

#endif
