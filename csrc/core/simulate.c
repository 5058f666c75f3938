/* The offline simulator (simulate.h): a program's calls run in synchronous rounds under the
 * transport's semantics. Every state change is an event; an op is touched a constant number of
 * times, so a run costs O(ops + calls + awaits).
 * The tables are built in simulate_build.c; a stuck state's analysis and the results the
 * caller reads are simulate_report.c. */
#include "simulate.h"

#include <stdlib.h>

#include "simulate_internal.h"

void *sim_reserve(void *v, size_t n, size_t *cap, size_t elem)
{
    if (n < *cap)
        return v;
    size_t grown = *cap ? *cap * 2 : 64;
    void *p = realloc(v, grown * elem);
    if (p)
        *cap = grown;
    return p;
}

static int push(int_list *l, int32_t x)
{
    int32_t *v = sim_reserve(l->v, l->n, &l->cap, sizeof *v);
    if (!v)
        return -1;
    l->v = v;
    l->v[l->n++] = x;
    return 0;
}

/* ---- the run -------------------------------------------------------------------------------- */

static int is_eager(const mp_sim *sim, const sim_op *o)
{
    return (uint64_t)o->bytes <= sim->eager;
}

static void schedule(mp_sim *sim, int32_t event)
{
    if (push(&sim->next, event) != 0)
        sim->oom = 1;
}

/* The channel's next receive meets its send once both are there and earlier receives are done. */
static void try_match(mp_sim *sim, int32_t c)
{
    sim_chan *ch = &sim->chans[c];
    if (ch->scheduled || ch->recv_done >= ch->nrecv || ch->published <= ch->recv_done)
        return;
    if (!sim->ops[sim->chan_ops[ch->recv_off + ch->recv_done]].active)
        return;
    ch->scheduled = 1;
    schedule(sim, c);
}

/* Sends are published in order, each once active and given a free descriptor slot. */
static void try_publish(mp_sim *sim, int32_t c)
{
    sim_chan *ch = &sim->chans[c];
    while (ch->published < ch->nsend && ch->published < ch->recv_done + MP_SIM_SLOTS) {
        int32_t id = sim->chan_ops[ch->send_off + ch->published];
        if (!sim->ops[id].active)
            break;
        ch->published++;
        if (is_eager(sim, &sim->ops[id]))
            schedule(sim, -1 - id);
    }
    try_match(sim, c);
}

static void activate(mp_sim *sim, sim_step *st)
{
    for (int32_t i = 0; i < st->nops; i++)
        sim->ops[st->first_op + i].active = 1;
    for (int32_t i = 0; i < st->nops; i++) {
        const sim_op *o = &sim->ops[st->first_op + i];
        if (o->kind == KIND_SEND)
            try_publish(sim, o->chan);
        else
            try_match(sim, o->chan);
    }
}

static void issue(mp_sim *sim, sim_call *c)
{
    for (int32_t s = c->first_step; s < c->first_step + c->nsteps; s++) {
        sim_step *st = &sim->steps[s];
        st->issued = 1;
        for (int32_t i = 0; i < st->nops; i++) {
            const sim_op *o = &sim->ops[st->first_op + i];
            if (sim->posted_round)
                sim->posted_round[st->first_op + i] = (int32_t)sim->now;
            sim->chans[o->chan].issued[o->kind]++;
        }
        if (sim->queue_head[sim_queue(sim, st->rank, st->lane)] == st->queue_pos)
            activate(sim, st);
    }
}

/* Issues the rank's calls until it has to wait. */
static void advance(mp_sim *sim, int32_t r)
{
    sim_rank *rk = &sim->ranks[r];
    while (rk->waiting == 0 && rk->state != RANK_DONE) {
        if (rk->next_call == rk->ncalls) {
            rk->state = rk->remaining ? RANK_FINAL : RANK_DONE;
            return;
        }
        sim_call *c = &sim->calls[rk->first_call + rk->next_call];
        for (int32_t a = c->awaits_off; a < c->awaits_off + c->nawaits; a++) {
            sim_call *w = &sim->calls[sim->awaits[2 * a]];
            int32_t op = sim->awaits[2 * a + 1];
            if (op < 0 && w->remaining && !w->waited) {
                w->waited = 1;
                rk->waiting++;
            } else if (op >= 0 && sim->steps[sim->ops[op].step].remaining && !sim->ops[op].waited) {
                sim->ops[op].waited = 1;
                rk->waiting++;
            }
        }
        if (rk->waiting) {
            rk->state = RANK_WAIT_AWAIT;
            return;
        }
        issue(sim, c);
        rk->next_call++;
        rk->state = RANK_RUNNING;
        if (c->wait && c->remaining) {
            c->waited = 1;
            rk->waiting = 1;
            rk->state = RANK_WAIT_CALL;
        }
    }
}

/* An op is matched here; the host sees it complete only with its whole step, as NCCL completes
 * a group's ops together. */
static void complete(mp_sim *sim, int32_t id)
{
    sim_op *o = &sim->ops[id];
    o->done = 1;
    if (sim->done_round)
        sim->done_round[id] = (int32_t)sim->now;
    sim_step *st = &sim->steps[o->step];
    sim_call *c = &sim->calls[o->call];
    sim_rank *rk = &sim->ranks[o->rank];
    rk->remaining--;
    c->remaining--;
    int wake = 0;
    if (--st->remaining == 0) {
        int32_t q = sim_queue(sim, o->rank, o->lane);
        int32_t head = ++sim->queue_head[q];
        if (head < sim->queue_count[q]) {
            sim_step *next = &sim->steps[sim->queue_steps[sim->queue_off[q] + head]];
            if (next->issued)
                activate(sim, next);
        }
        for (int32_t i = st->first_op; i < st->first_op + st->nops; i++)
            if (sim->ops[i].waited) {
                sim->ops[i].waited = 0;
                wake |= --rk->waiting == 0;
            }
    }
    if (c->remaining == 0 && c->waited) {
        c->waited = 0;
        wake |= --rk->waiting == 0;
    }
    if (wake)
        advance(sim, o->rank);
    if (rk->state == RANK_FINAL && rk->remaining == 0)
        rk->state = RANK_DONE;
}

static void pair_done(mp_sim *sim, int32_t c)
{
    sim_chan *ch = &sim->chans[c];
    int32_t q = ch->recv_done;
    int32_t recv = sim->chan_ops[ch->recv_off + q], send = sim->chan_ops[ch->send_off + q];
    ch->recv_done++;
    ch->scheduled = 0;
    const sim_op *s = &sim->ops[send], *r = &sim->ops[recv];
    if (s->bytes != r->bytes || s->dtype != r->dtype) {
        int32_t first = send < recv ? send : recv;
        int32_t best = sim->mismatch_send < sim->mismatch_recv ? sim->mismatch_send : sim->mismatch_recv;
        if (sim->mismatch_send < 0 || sim->now < sim->mismatch_time || (sim->now == sim->mismatch_time && first < best)) {
            sim->mismatch_time = sim->now;
            sim->mismatch_send = send;
            sim->mismatch_recv = recv;
        }
    }
    int eager = is_eager(sim, s);
    complete(sim, recv);
    if (!eager)
        complete(sim, send);
    try_publish(sim, c);
}

int mp_sim_run(mp_sim *sim)
{
    sim->mismatch_send = sim->mismatch_recv = -1;
    sim->now = 0;
    for (int32_t r = 0; r < sim->size; r++)
        advance(sim, r);
    while (sim->next.n && !sim->oom) {
        int_list t = sim->cur;
        sim->cur = sim->next;
        sim->next = t;
        sim->next.n = 0;
        sim->now++;
        for (size_t i = 0; i < sim->cur.n; i++) {
            int32_t e = sim->cur.v[i];
            if (e >= 0)
                pair_done(sim, e);
            else
                complete(sim, -1 - e);
        }
        sim->cur.n = 0;
        sim->rounds = sim->now;
    }
    if (sim->oom)
        return -1;
    sim->npending = 0;
    for (int32_t i = 0; i < sim->nops; i++)
        sim->npending += !sim->ops[i].done;
    if (sim->mismatch_send >= 0)
        sim->verdict = MP_SIM_MISMATCH;
    else if (sim->npending)
        sim->verdict = MP_SIM_DEADLOCK;
    else
        sim->verdict = MP_SIM_OK;
    if (sim->verdict == MP_SIM_DEADLOCK)
        sim_find_cycle(sim);
    return sim->oom ? -1 : 0;
}
