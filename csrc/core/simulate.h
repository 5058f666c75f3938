/* The offline simulator of the transport semantics (docs/program-format.md): what a
 * program of calls does under strict rendezvous, shm's descriptor slots and its eager threshold.
 * Pure C, no Python, no I/O; event-driven in synchronous rounds, O(ops).
 *
 * Packed program: one int64 stream per rank, a sequence of call records
 *   header:        tag (0 steps, 1 exchange), flags (bit 0: wait; bit 1: batched mode), nawaits,
 *                  then nawaits pairs (call, op): an earlier call of the rank, and -1 to await all of
 *                  it or the position of one of its ops in record order
 *   steps body:    nsteps, then per step: lane, nops, then per op: kind (0 send, 1 recv), peer, bytes, dtype
 *   exchange body: prev, next, mask (bit i: slot i of mp_slot posted), then per posted slot in slot
 *                  order: bytes, dtype. Expanded into steps by mp_plan_exchange, as the runtime does.
 * Each op has a label index: its position among the rank's ops in record order (an exchange's
 * ops counted in slot order), so the caller can keep the labels. */
#ifndef MP_SIMULATE_H
#define MP_SIMULATE_H

#include <stddef.h>
#include <stdint.h>

#define MP_SIM_SLOTS 8 /* descriptor slots per channel, as SHM_NSLOTS */

typedef struct {
    int size;
    int nlanes;
    uint64_t eager_threshold;
    const int64_t *const *streams; /* [size] */
    const size_t *lengths;         /* [size]: int64 values in each stream */
    /* 0: each (rank, lane) runs its steps in issue order, lanes side by side. 1: each rank runs
     * all its steps, of every lane, one after another in issue order: the worst case NCCL allows
     * when its communicators share a device (one execution order per device). Matching stays per
     * lane either way: a lane is its own communicator. */
    int serialize_lanes;
    /* 1: keep each op's posted and completed rounds (mp_sim_op_info; mp_sim_each_op). */
    int timeline;
} mp_sim_program;

typedef enum { MP_SIM_OK = 0, MP_SIM_DEADLOCK = 1, MP_SIM_MISMATCH = 2 } mp_sim_verdict;

/* Where an op sits in the program, and what it is. */
typedef struct {
    int32_t rank, call, step, index; /* step and index within the call's expanded steps */
    int32_t seq;                     /* k-th op of its kind on its channel (src, dst, lane) */
    int32_t kind;                    /* 0 send, 1 recv */
    int32_t peer, lane, dtype;
    int32_t slot;                    /* exchange slot (mp_slot), -1 for an op of a steps call */
    int32_t label;                   /* label index (see above) */
    int32_t partner_state;           /* in a deadlock: MP_SIM_PARTNER_* of the op it must meet */
    int64_t bytes;
    int64_t partner_posted;          /* ops of the partner's kind the peer has issued on the channel */
    int64_t posted_round;            /* the round its rank posted it, -1 if never or not kept */
    int64_t done_round;              /* the round it completed, -1 if never or not kept */
} mp_sim_op_info;

enum { MP_SIM_PARTNER_MISSING = 0, MP_SIM_PARTNER_QUEUED = 1, MP_SIM_PARTNER_ACTIVE = 2 };

/* One edge of the wait-for cycle: `op` of `rank` needs rank `waits_for`. */
typedef struct {
    mp_sim_op_info op;
    int32_t waits_for;
} mp_sim_edge;

typedef struct mp_sim mp_sim;

/* Parses and expands a program. Returns NULL with a message in err on a malformed program or
 * when memory runs out (*oom set then). The result is owned by the caller: mp_sim_free. */
mp_sim *mp_sim_new(const mp_sim_program *prog, char *err, size_t errlen, int *oom);
void mp_sim_free(mp_sim *sim);

/* Runs to quiescence. Returns 0, or -1 when memory runs out. */
int mp_sim_run(mp_sim *sim);

mp_sim_verdict mp_sim_result(const mp_sim *sim);
/* Rounds until everything completed (ok), or until the last op completed. */
int64_t mp_sim_rounds(const mp_sim *sim);
/* Mismatch: the first disagreeing pair in simulated time. */
void mp_sim_mismatch(const mp_sim *sim, mp_sim_op_info *send, mp_sim_op_info *recv);
/* Deadlock: the cycle (closed: 1) or, when none exists, the chain of waits that ends at a rank
 * that has finished (closed: 0). Valid until mp_sim_free. */
const mp_sim_edge *mp_sim_cycle(const mp_sim *sim, size_t *n, int *closed);
/* Deadlock: ops left pending, in op order. */
int64_t mp_sim_num_pending(const mp_sim *sim);
/* Calls `fn` for each pending op; stops early when it returns non-zero (and returns that). */
int mp_sim_each_pending(const mp_sim *sim, int (*fn)(void *ctx, const mp_sim_op_info *op), void *ctx);
/* The same for every op, in op order (a timeline of the run: posted_round, done_round). */
int mp_sim_each_op(const mp_sim *sim, int (*fn)(void *ctx, const mp_sim_op_info *op), void *ctx);

#endif
