/* After the run: the stuck state's wait-for graph and the cycle (or chain of waits) found in
 * it for a deadlock's report, and the results the caller reads (verdict, mismatch, pending ops). */
#include <stdlib.h>
#include <string.h>

#include "simulate_internal.h"
#include "waitfor.h"

/* ---- the stuck state: the wait-for graph -------------------------------------------------------
 * Nodes: (rank, queue) for a step queue's head step (simulate_internal.h: a lane's, or the rank's
 * one queue when lanes are serialized) and (rank, wait) for the rank's host wait, numbered
 * rank * (nqueues + 1) + queue, the wait being queue nqueues. */

static int32_t node_of(const mp_sim *sim, int32_t rank, int32_t queue) { return rank * (sim->nqueues + 1) + queue; }

/* The op that `id` must meet, or -1 when its peer never posts it. */
static int32_t partner_of(const mp_sim *sim, int32_t id)
{
    const sim_op *o = &sim->ops[id];
    const sim_chan *ch = &sim->chans[o->chan];
    if (o->kind == KIND_SEND)
        return o->seq < ch->nrecv ? sim->chan_ops[ch->recv_off + o->seq] : -1;
    return o->seq < ch->nsend ? sim->chan_ops[ch->send_off + o->seq] : -1;
}

static int partner_state(const mp_sim *sim, int32_t id)
{
    int32_t p = partner_of(sim, id);
    if (p < 0 || !sim->steps[sim->ops[p].step].issued)
        return MP_SIM_PARTNER_MISSING;
    return sim->ops[p].active ? MP_SIM_PARTNER_ACTIVE : MP_SIM_PARTNER_QUEUED;
}

/* Where a pending op of an active step points: the peer's wait, the peer's queue, or nowhere
 * (its partner is active too and it only waits for an earlier op of its group). */
static int32_t op_target(const mp_sim *sim, int32_t id)
{
    const sim_op *o = &sim->ops[id];
    switch (partner_state(sim, id)) {
    case MP_SIM_PARTNER_MISSING:
        return node_of(sim, o->peer, sim->nqueues);
    case MP_SIM_PARTNER_QUEUED:
        return node_of(sim, o->peer, sim_lane_queue(sim, o->lane));
    default:
        return -1;
    }
}

static int head_edges(const mp_sim *sim, int32_t r, int32_t queue, mp_waitfor_sink *out)
{
    int32_t q = r * sim->nqueues + queue;
    if (sim->queue_head[q] >= sim->queue_count[q])
        return 0;
    const sim_step *st = &sim->steps[sim->queue_steps[sim->queue_off[q] + sim->queue_head[q]]];
    if (!st->issued)
        return 0;
    for (int32_t i = st->first_op; i < st->first_op + st->nops; i++) {
        int32_t t = sim->ops[i].done ? -1 : op_target(sim, i);
        if (t >= 0 && mp_waitfor_add(out, t, i) != 0)
            return -1;
    }
    return 0;
}

/* Edges of a wait on ops [first, end): each pending op points where it needs, or to its queue's
 * head when it is queued behind it (or only waits for an op of its own group). */
static int wait_ops_edges(const mp_sim *sim, int32_t first, int32_t end, mp_waitfor_sink *out)
{
    int32_t behind_head_seen[2] = {0, 0}; /* per queue of the rank */
    for (int32_t i = first; i < end; i++) {
        const sim_op *o = &sim->ops[i];
        if (o->done && sim->steps[o->step].remaining == 0)
            continue;
        int32_t t = o->active && !o->done ? op_target(sim, i) : -1; /* done: waits for its group */
        if (t < 0) {
            int32_t queue = sim_lane_queue(sim, o->lane);
            if (behind_head_seen[queue]++)
                continue;
            t = node_of(sim, o->rank, queue); /* its queue's head holds it back */
        }
        if (mp_waitfor_add(out, t, i) != 0)
            return -1;
    }
    return 0;
}

static int wait_edges(const mp_sim *sim, int32_t r, mp_waitfor_sink *out)
{
    const sim_rank *rk = &sim->ranks[r];
    switch (rk->state) {
    case RANK_WAIT_CALL:
    {
        const sim_call *c = &sim->calls[rk->first_call + rk->next_call - 1];
        return wait_ops_edges(sim, c->first_op, c->first_op + c->nops, out);
    }
    case RANK_WAIT_AWAIT: {
        const sim_call *c = &sim->calls[rk->first_call + rk->next_call];
        for (int32_t a = c->awaits_off; a < c->awaits_off + c->nawaits; a++) {
            const sim_call *w = &sim->calls[sim->awaits[2 * a]];
            int32_t op = sim->awaits[2 * a + 1];
            if (wait_ops_edges(sim, op < 0 ? w->first_op : op, op < 0 ? w->first_op + w->nops : op + 1, out) != 0)
                return -1;
        }
        return 0;
    }
    case RANK_FINAL:
        for (int32_t queue = 0; queue < sim->nqueues; queue++) {
            int32_t q = r * sim->nqueues + queue;
            if (sim->queue_head[q] >= sim->queue_count[q])
                continue;
            const sim_step *st = &sim->steps[sim->queue_steps[sim->queue_off[q] + sim->queue_head[q]]];
            for (int32_t i = st->first_op; i < st->first_op + st->nops; i++)
                if (!sim->ops[i].done) {
                    if (mp_waitfor_add(out, node_of(sim, r, queue), i) != 0)
                        return -1;
                    break;
                }
        }
        return 0;
    default:
        return 0;
    }
}

static void op_info(const mp_sim *sim, int32_t id, mp_sim_op_info *out)
{
    const sim_op *o = &sim->ops[id];
    const sim_call *c = &sim->calls[o->call];
    const sim_chan *ch = &sim->chans[o->chan];
    *out = (mp_sim_op_info){
        .rank = o->rank,
        .call = o->call - sim->ranks[o->rank].first_call,
        .step = o->step - c->first_step,
        .index = o->index,
        .seq = o->seq,
        .kind = o->kind,
        .peer = o->peer,
        .lane = o->lane,
        .dtype = o->dtype,
        .slot = o->slot,
        .label = o->label,
        .partner_state = partner_state(sim, id),
        .bytes = o->bytes,
        .partner_posted = ch->issued[o->kind == KIND_SEND ? KIND_RECV : KIND_SEND],
        .posted_round = sim->posted_round && sim->steps[o->step].issued ? sim->posted_round[id] : -1,
        .done_round = sim->done_round && o->done ? sim->done_round[id] : -1,
    };
}

/* Keeps the edges of `path` that leave a rank: each is an op of that rank needing the next. */
static int record_path(mp_sim *sim, const mp_waitfor_path *path)
{
    sim->cycle = calloc(path->n ? path->n : 1, sizeof *sim->cycle);
    if (!sim->cycle)
        return -1;
    int32_t per = sim->nqueues + 1;
    size_t edges = path->closed ? path->n : path->n - 1; /* an open chain's last node waits on nothing */
    for (size_t i = 0; i < edges; i++) {
        int32_t from = path->nodes[i] / per, to = path->nodes[(i + 1) % path->n] / per;
        if (from == to)
            continue;
        op_info(sim, path->via[i], &sim->cycle[sim->cycle_len].op);
        sim->cycle[sim->cycle_len++].waits_for = to;
    }
    sim->cycle_closed = path->closed;
    return 0;
}

/* The search's view of the stuck state (core/waitfor.h): an edge's reason is its op. */
static int node_edges(void *ctx, int32_t v, mp_waitfor_sink *sink)
{
    const mp_sim *sim = ctx;
    int32_t per = sim->nqueues + 1, r = v / per, queue = v % per;
    return queue == sim->nqueues ? wait_edges(sim, r, sink) : head_edges(sim, r, queue, sink);
}

/* Depth-first search from every rank's wait, then every queue; the first cycle found is kept.
 * Without a cycle, the chain of first edges from the first stuck rank is kept instead. */
void sim_find_cycle(mp_sim *sim)
{
    int32_t per = sim->nqueues + 1, nnodes = sim->size * per;
    mp_waitfor_graph g = {nnodes, node_edges, sim};
    mp_waitfor_path path = {0};
    int32_t *starts = malloc((size_t)(nnodes ? nnodes : 1) * sizeof *starts);
    int rc = -1;
    if (starts) {
        int32_t n = 0;
        for (int32_t r = 0; r < sim->size; r++)
            starts[n++] = node_of(sim, r, sim->nqueues);
        for (int32_t r = 0; r < sim->size; r++)
            for (int32_t queue = 0; queue < sim->nqueues; queue++)
                starts[n++] = node_of(sim, r, queue);
        rc = mp_waitfor_cycle(&g, starts, (size_t)n, &path);
    }
    for (int32_t r = 0; rc == 0 && r < sim->size; r++)
        if (sim->ranks[r].state != RANK_DONE)
            rc = mp_waitfor_chain(&g, node_of(sim, r, sim->nqueues), &path) == 0 ? 1 : -1;
    if (rc < 0 || (rc == 1 && record_path(sim, &path) != 0))
        sim->oom = 1;
    mp_waitfor_path_free(&path);
    free(starts);
}

/* ---- results -------------------------------------------------------------------------------- */

mp_sim_verdict mp_sim_result(const mp_sim *sim) { return sim->verdict; }
int64_t mp_sim_rounds(const mp_sim *sim) { return sim->rounds; }
int64_t mp_sim_num_pending(const mp_sim *sim) { return sim->npending; }

void mp_sim_mismatch(const mp_sim *sim, mp_sim_op_info *send, mp_sim_op_info *recv)
{
    op_info(sim, sim->mismatch_send, send);
    op_info(sim, sim->mismatch_recv, recv);
}

const mp_sim_edge *mp_sim_cycle(const mp_sim *sim, size_t *n, int *closed)
{
    *n = sim->cycle_len;
    *closed = sim->cycle_closed;
    return sim->cycle;
}

static int each_op(const mp_sim *sim, int pending_only, int (*fn)(void *ctx, const mp_sim_op_info *op), void *ctx)
{
    for (int32_t i = 0; i < sim->nops; i++) {
        if (pending_only && sim->ops[i].done)
            continue;
        mp_sim_op_info info;
        op_info(sim, i, &info);
        int rc = fn(ctx, &info);
        if (rc)
            return rc;
    }
    return 0;
}

int mp_sim_each_pending(const mp_sim *sim, int (*fn)(void *ctx, const mp_sim_op_info *op), void *ctx)
{
    return each_op(sim, 1, fn, ctx);
}

int mp_sim_each_op(const mp_sim *sim, int (*fn)(void *ctx, const mp_sim_op_info *op), void *ctx)
{
    return each_op(sim, 0, fn, ctx);
}
