/* The simulator's shared state: its tables (ops, steps, calls, ranks, channels) and the calls
 * between its files: simulate_build.c fills the tables, simulate.c runs them, and
 * simulate_report.c analyses where they stopped. Only csrc/core/simulate*.c include it. */
#ifndef MP_SIMULATE_INTERNAL_H
#define MP_SIMULATE_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "plan.h"
#include "simulate.h"

enum { KIND_SEND = 0, KIND_RECV = 1 };
enum { RANK_RUNNING, RANK_WAIT_AWAIT, RANK_WAIT_CALL, RANK_FINAL, RANK_DONE };

typedef struct {
    int64_t bytes;
    int32_t rank, call, step, index, chan, seq, peer, dtype, label;
    int8_t kind, lane, slot;
    uint8_t active, done, waited;
} sim_op;

typedef struct {
    int32_t rank, lane, call, first_op, nops, remaining, queue_pos;
    uint8_t issued;
} sim_step;

typedef struct {
    int32_t first_step, nsteps, first_op, nops, remaining, awaits_off, nawaits, first_label;
    uint8_t wait, waited, exchange;
} sim_call;

typedef struct {
    int32_t first_call, ncalls, next_call, waiting, state;
    int64_t remaining;
} sim_rank;

typedef struct {
    int32_t send_off, nsend, recv_off, nrecv; /* into chan_ops: sends then receives, in seq order */
    int32_t published, recv_done, issued[MP_MAX_LANES];
    uint8_t scheduled;
} sim_chan;

typedef struct {
    int32_t *v;
    size_t n, cap;
} int_list;

struct mp_sim {
    int size, nlanes;
    int nqueues; /* step queues per rank: nlanes, or 1 when lanes are serialized (mp_sim_program) */
    uint64_t eager;
    int32_t nops, nsteps, ncalls, nawaits, nchans;
    sim_op *ops;
    sim_step *steps;
    sim_call *calls;
    int32_t *awaits; /* pairs: (call, op), op -1 for the whole call */
    sim_rank *ranks;
    sim_chan *chans;
    int32_t *chan_ops;
    int32_t *posted_round, *done_round; /* per op, only with mp_sim_program.timeline (else NULL) */
    /* A FIFO of step ids per (rank, queue), run in issue order: a step activates at its queue's
     * head. The queue is the step's lane, or the rank's one queue when lanes are serialized;
     * channels (matching) are per lane whatever the queues. */
    int32_t *queue_off, *queue_count, *queue_head, *queue_steps;
    int_list cur, next;  /* events: >= 0 a channel's next pair, < 0 an eager send (-1 - op) */
    int oom;
    /* results */
    mp_sim_verdict verdict;
    int64_t rounds, now;
    int64_t mismatch_time;
    int32_t mismatch_send, mismatch_recv;
    mp_sim_edge *cycle;
    size_t cycle_len;
    int cycle_closed;
    int64_t npending;
};

/* Which of its rank's queues runs the steps of `lane`: the lane's own, or the rank's one. */
static inline int32_t sim_lane_queue(const mp_sim *sim, int32_t lane)
{
    return sim->nqueues == 1 ? 0 : lane;
}

/* That queue among all ranks' (the index into queue_off, queue_count and queue_head). */
static inline int32_t sim_queue(const mp_sim *sim, int32_t rank, int32_t lane)
{
    return rank * sim->nqueues + sim_lane_queue(sim, lane);
}

/* A growing array of `elem`-byte elements with room for one more: `v` itself, or its larger
 * copy; NULL when memory runs out (`v` is then left as it was). */
void *sim_reserve(void *v, size_t n, size_t *cap, size_t elem);

/* After a deadlock: the wait-for cycle, or the chain of waits (simulate_report.c). */
void sim_find_cycle(mp_sim *sim);

#endif
