#include "null_transport.h"

#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

typedef struct {
    mp_transport base;
    _Atomic uint64_t aborted; /* 0, or the first abort: its cause (high half) and rank (low half) */
} null_t;

static null_t *as_null(mp_transport *t) { return (null_t *)t; }

static mp_result null_post(mp_transport *t, mp_step *step)
{
    if (atomic_load_explicit(&as_null(t)->aborted, memory_order_relaxed))
        return MP_ERR_ABORTED;
    for (int i = 0; i < step->nops; i++) {
        mp_op *op = step->ops[i];
        op->result = MP_OK;
        atomic_store_explicit(&op->matched, 1, memory_order_relaxed);
        atomic_store_explicit(&op->state, MP_OP_DONE, memory_order_release);
    }
    free(step);
    return MP_OK;
}

static mp_result null_wait(mp_transport *t, mp_op *op, double deadline, const mp_interrupt *interrupt)
{
    (void)t, (void)op, (void)deadline, (void)interrupt; /* every op is done once posted */
    return MP_OK;
}

static bool null_abort(mp_transport *t, mp_result cause, int rank, const char *why)
{
    (void)why; /* no op is ever pending, so no failure quotes it */
    uint64_t none = 0;
    return atomic_compare_exchange_strong(&as_null(t)->aborted, &none, (uint64_t)cause << 32 | (uint32_t)rank);
}

static mp_result null_abort_cause(mp_transport *t, int *rank)
{
    uint64_t aborted = atomic_load_explicit(&as_null(t)->aborted, memory_order_relaxed);
    if (rank)
        *rank = aborted ? (int)(uint32_t)aborted : -1;
    return (mp_result)(aborted >> 32);
}

static void null_describe_peer(mp_transport *t, const mp_op *op, char *buf, size_t len)
{
    (void)t, (void)op;
    snprintf(buf, len, "the null transport has no peers");
}

static void null_destroy(mp_transport *t) { free(t); }

static const mp_transport_ops null_ops = {
    .name = "null",
    .post = null_post,
    .wait = null_wait,
    .abort = null_abort,
    .abort_cause = null_abort_cause,
    .describe_peer = null_describe_peer,
    .destroy = null_destroy,
};

mp_result mp_null_open(int rank, int size, int nlanes, mp_transport **out)
{
    null_t *n = calloc(1, sizeof *n);
    if (!n)
        return MP_ERR_SYSTEM;
    n->base = (mp_transport){.ops = &null_ops, .rank = rank, .size = size, .nlanes = nlanes};
    *out = (mp_transport *)n; /* base is the first member */
    return MP_OK;
}
