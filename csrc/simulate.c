/* The offline simulator (simulate.h): a program's calls run in synchronous rounds under the
 * transport's semantics. Every state change is an event; an op is touched a constant number of
 * times, so a run costs O(ops + calls + awaits). */
#include "simulate.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "plan.h"

enum { TAG_STEPS = 0, TAG_EXCHANGE = 1 };
enum { FLAG_WAIT = 1, FLAG_BATCHED = 2 };
enum { KIND_SEND = 0, KIND_RECV = 1 };
enum { RANK_RUNNING, RANK_WAIT_AWAIT, RANK_WAIT_CALL, RANK_FINAL, RANK_DONE };

#define MAX_ITEMS (INT32_MAX / 4)

typedef struct {
    int64_t bytes;
    int32_t rank, call, step, index, chan, seq, peer, dtype, label;
    int8_t kind, lane, slot;
    uint8_t active, done, waited;
} sim_op;

typedef struct {
    int32_t rank, lane, call, first_op, nops, remaining, lane_pos;
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
    int32_t published, recv_done, issued[2];
    uint8_t scheduled;
} sim_chan;

typedef struct {
    int32_t *v;
    size_t n, cap;
} int_list;

struct mp_sim {
    int size, nlanes;
    uint64_t eager;
    int32_t nops, nsteps, ncalls, nawaits, nchans;
    sim_op *ops;
    sim_step *steps;
    sim_call *calls;
    int32_t *awaits; /* pairs: (call, op), op -1 for the whole call */
    sim_rank *ranks;
    sim_chan *chans;
    int32_t *chan_ops;
    int32_t *lane_off, *lane_count, *lane_head, *lane_steps; /* per (rank, lane) FIFO of step ids */
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

/* A growing array of `elem`-byte elements with room for one more: `v` itself, or its larger
 * copy; NULL when memory runs out (`v` is then left as it was). */
static void *reserve(void *v, size_t n, size_t *cap, size_t elem)
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
    int32_t *v = reserve(l->v, l->n, &l->cap, sizeof *v);
    if (!v)
        return -1;
    l->v = v;
    l->v[l->n++] = x;
    return 0;
}

/* ---- parsing ------------------------------------------------------------------------------ */

typedef struct {
    const mp_sim_program *prog;
    char *err;
    size_t errlen;
} parser;

static int parse_error(parser *p, int rank, size_t pos, const char *fmt, ...)
{
    char what[160];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    snprintf(p->err, p->errlen, "packed program: rank %d, value %zu: %s", rank, pos, what);
    return -1;
}

/* Reads one value, bounds-checked. */
static int take(parser *p, int rank, size_t *pos, int64_t lo, int64_t hi, const char *what, int64_t *out)
{
    if (*pos >= p->prog->lengths[rank])
        return parse_error(p, rank, *pos, "the stream ends inside a call (expected %s)", what);
    int64_t v = p->prog->streams[rank][*pos];
    if (v < lo || v > hi)
        return parse_error(p, rank, *pos, "%s %lld is outside [%lld, %lld]", what, (long long)v, (long long)lo,
                           (long long)hi);
    (*pos)++;
    *out = v;
    return 0;
}

static void plan_of(const mp_sim *sim, int rank, int64_t flags, int64_t prev, int64_t next, int64_t mask, mp_plan *out)
{
    mp_plan_input in = {
        .mode = (flags & FLAG_BATCHED) ? MP_MODE_BATCHED : MP_MODE_PARITY,
        .nlanes = sim->nlanes,
        .rank = rank,
        .present = (unsigned)mask,
        .prev_is_self = prev == rank,
        .next_is_self = next == rank,
    };
    mp_plan_exchange(&in, out);
}

static int grow_check(parser *p, int rank, size_t pos, int64_t total)
{
    if (total > MAX_ITEMS)
        return parse_error(p, rank, pos, "the program is too large to simulate");
    return 0;
}

/* The op of an earlier call that an await names by its position in record order, or -1. */
static int32_t awaited_op(const mp_sim *sim, int32_t call, int64_t k)
{
    const sim_call *c = &sim->calls[call];
    if (k >= c->nops)
        return -1;
    if (!c->exchange)
        return c->first_op + (int32_t)k;
    for (int32_t i = c->first_op; i < c->first_op + c->nops; i++)
        if (sim->ops[i].label == c->first_label + k)
            return i;
    return -1;
}

/* One pass over every stream: counts (fill == 0) or fills the tables (fill == 1). */
static int parse(mp_sim *sim, parser *p, int fill)
{
    const mp_sim_program *prog = p->prog;
    int64_t nops = 0, nsteps = 0, ncalls = 0, nawaits = 0;
    for (int r = 0; r < prog->size; r++) {
        size_t pos = 0;
        int32_t call_index = 0, label = 0;
        if (fill) {
            sim->ranks[r].first_call = (int32_t)ncalls;
            sim->ranks[r].state = RANK_RUNNING;
        }
        while (pos < prog->lengths[r]) {
            size_t at = pos;
            int64_t tag, flags, na, v;
            if (take(p, r, &pos, TAG_STEPS, TAG_EXCHANGE, "tag", &tag) ||
                take(p, r, &pos, 0, FLAG_WAIT | FLAG_BATCHED, "flags", &flags) ||
                take(p, r, &pos, 0, MAX_ITEMS, "await count", &na))
                return -1;
            sim_call *c = fill ? &sim->calls[ncalls] : NULL;
            if (c) {
                c->awaits_off = (int32_t)nawaits;
                c->nawaits = (int32_t)na;
                c->wait = (flags & FLAG_WAIT) != 0;
                c->first_step = (int32_t)nsteps;
                c->first_op = (int32_t)nops;
                c->first_label = label;
                c->exchange = tag == TAG_EXCHANGE;
            }
            for (int64_t i = 0; i < na; i++) {
                int64_t k;
                if (call_index == 0)
                    return parse_error(p, r, pos, "call 0 awaits an earlier call");
                if (take(p, r, &pos, 0, call_index - 1, "awaited call", &v) ||
                    take(p, r, &pos, -1, MAX_ITEMS, "awaited op", &k))
                    return -1;
                if (fill) {
                    int32_t target = sim->ranks[r].first_call + (int32_t)v;
                    int32_t op = k < 0 ? -1 : awaited_op(sim, target, k);
                    if (k >= 0 && op < 0)
                        return parse_error(p, r, pos, "call %d awaits op %lld of call %lld, which has %d ops", call_index,
                                           (long long)k, (long long)v, sim->calls[target].nops);
                    sim->awaits[2 * nawaits] = target;
                    sim->awaits[2 * nawaits + 1] = op;
                }
                nawaits++;
            }
            if (tag == TAG_EXCHANGE) {
                int64_t prev, next, mask, bytes[MP_NUM_SLOTS] = {0}, dtype[MP_NUM_SLOTS] = {0};
                int32_t slot_label[MP_NUM_SLOTS] = {0};
                if (take(p, r, &pos, 0, prog->size - 1, "prev", &prev) ||
                    take(p, r, &pos, 0, prog->size - 1, "next", &next) ||
                    take(p, r, &pos, 0, (1 << MP_NUM_SLOTS) - 1, "slot mask", &mask))
                    return -1;
                for (int s = 0; s < MP_NUM_SLOTS; s++)
                    if (mask >> s & 1) {
                        if (take(p, r, &pos, 0, INT64_MAX, "bytes", &bytes[s]) ||
                            take(p, r, &pos, 0, INT32_MAX, "dtype", &dtype[s]))
                            return -1;
                        slot_label[s] = label++;
                    }
                mp_plan plan;
                plan_of(sim, r, flags, prev, next, mask, &plan);
                for (int s = 0; s < plan.nsteps; s++) {
                    const mp_plan_step *ps = &plan.steps[s];
                    int balance = 0;
                    for (int i = 0; i < ps->nops; i++) {
                        mp_slot slot = ps->ops[i];
                        int64_t peer = (slot == MP_SEND_NEXT || slot == MP_RECV_NEXT) ? next : prev;
                        if (peer == r)
                            balance += mp_slot_is_send(slot) ? 1 : -1;
                        if (fill) {
                            sim_op *o = &sim->ops[nops];
                            o->bytes = bytes[slot];
                            o->rank = r;
                            o->call = (int32_t)ncalls;
                            o->step = (int32_t)nsteps;
                            o->index = i;
                            o->peer = (int32_t)peer;
                            o->dtype = (int32_t)dtype[slot];
                            o->label = slot_label[slot];
                            o->kind = mp_slot_is_send(slot) ? KIND_SEND : KIND_RECV;
                            o->lane = (int8_t)ps->lane;
                            o->slot = (int8_t)slot;
                        }
                        nops++;
                    }
                    if (balance)
                        return parse_error(p, r, at, "call %d: a self send without its receive in the same step",
                                           call_index);
                    if (fill)
                        sim->steps[nsteps] = (sim_step){.rank = r, .lane = ps->lane, .call = (int32_t)ncalls,
                                                        .first_op = (int32_t)(nops - ps->nops), .nops = ps->nops};
                    nsteps++;
                }
            } else {
                int64_t ns;
                if (take(p, r, &pos, 0, MAX_ITEMS, "step count", &ns))
                    return -1;
                for (int64_t s = 0; s < ns; s++) {
                    int64_t lane, n, kind, peer, bytes, dtype;
                    int balance = 0;
                    if (take(p, r, &pos, 0, sim->nlanes - 1, "lane", &lane) ||
                        take(p, r, &pos, 1, MAX_ITEMS, "op count", &n))
                        return -1;
                    for (int64_t i = 0; i < n; i++) {
                        if (take(p, r, &pos, KIND_SEND, KIND_RECV, "kind", &kind) ||
                            take(p, r, &pos, 0, prog->size - 1, "peer", &peer) ||
                            take(p, r, &pos, 0, INT64_MAX, "bytes", &bytes) ||
                            take(p, r, &pos, 0, INT32_MAX, "dtype", &dtype))
                            return -1;
                        if (peer == r)
                            balance += kind == KIND_SEND ? 1 : -1;
                        if (fill)
                            sim->ops[nops] = (sim_op){.bytes = bytes, .rank = r, .call = (int32_t)ncalls,
                                                      .step = (int32_t)nsteps, .index = (int32_t)i, .peer = (int32_t)peer,
                                                      .dtype = (int32_t)dtype, .label = label, .kind = (int8_t)kind,
                                                      .lane = (int8_t)lane, .slot = -1};
                        label++;
                        nops++;
                        if (grow_check(p, r, pos, nops))
                            return -1;
                    }
                    if (balance)
                        return parse_error(p, r, at, "call %d, step %lld: a self send without its receive in the same step",
                                           call_index, (long long)s);
                    if (fill)
                        sim->steps[nsteps] = (sim_step){.rank = r, .lane = (int32_t)lane, .call = (int32_t)ncalls,
                                                        .first_op = (int32_t)(nops - n), .nops = (int32_t)n};
                    nsteps++;
                }
            }
            if (c) {
                c->nsteps = (int32_t)nsteps - c->first_step;
                c->nops = (int32_t)nops - c->first_op;
            }
            ncalls++;
            call_index++;
            if (grow_check(p, r, pos, nops) || grow_check(p, r, pos, nsteps) || grow_check(p, r, pos, ncalls) ||
                grow_check(p, r, pos, nawaits))
                return -1;
        }
        if (fill)
            sim->ranks[r].ncalls = call_index;
    }
    sim->nops = (int32_t)nops;
    sim->nsteps = (int32_t)nsteps;
    sim->ncalls = (int32_t)ncalls;
    sim->nawaits = (int32_t)nawaits;
    return 0;
}

/* ---- channels and lanes --------------------------------------------------------------------- */

static uint64_t hash_key(uint64_t k)
{
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    return k;
}

/* Numbers the channels (src, dst, lane) and lists each one's sends and receives in seq order. */
static int build_channels(mp_sim *sim)
{
    size_t cap = 16;
    while (cap < 2 * (size_t)sim->nops)
        cap *= 2;
    uint64_t *keys = calloc(cap, sizeof *keys);
    int32_t *ids = malloc(cap * sizeof *ids);
    int rc = -1;
    if (!keys || !ids)
        goto out;
    int32_t nchans = 0;
    for (int32_t i = 0; i < sim->nops; i++) {
        sim_op *o = &sim->ops[i];
        uint64_t src = (uint64_t)(o->kind == KIND_SEND ? o->rank : o->peer);
        uint64_t dst = (uint64_t)(o->kind == KIND_SEND ? o->peer : o->rank);
        uint64_t key = ((src * (uint64_t)sim->size + dst) * (uint64_t)sim->nlanes + (uint64_t)o->lane) + 1;
        size_t h = (size_t)hash_key(key) & (cap - 1);
        while (keys[h] && keys[h] != key)
            h = (h + 1) & (cap - 1);
        if (!keys[h]) {
            keys[h] = key;
            ids[h] = nchans++;
        }
        o->chan = ids[h];
    }
    sim->nchans = nchans;
    sim->chans = calloc(nchans ? (size_t)nchans : 1, sizeof *sim->chans);
    sim->chan_ops = malloc((sim->nops ? (size_t)sim->nops : 1) * sizeof *sim->chan_ops);
    if (!sim->chans || !sim->chan_ops)
        goto out;
    for (int32_t i = 0; i < sim->nops; i++) {
        sim_chan *ch = &sim->chans[sim->ops[i].chan];
        if (sim->ops[i].kind == KIND_SEND)
            ch->nsend++;
        else
            ch->nrecv++;
    }
    int32_t off = 0;
    for (int32_t c = 0; c < nchans; c++) {
        sim->chans[c].send_off = off;
        sim->chans[c].recv_off = off + sim->chans[c].nsend;
        off += sim->chans[c].nsend + sim->chans[c].nrecv;
        sim->chans[c].nsend = sim->chans[c].nrecv = 0;
    }
    for (int32_t i = 0; i < sim->nops; i++) {
        sim_op *o = &sim->ops[i];
        sim_chan *ch = &sim->chans[o->chan];
        if (o->kind == KIND_SEND) {
            o->seq = ch->nsend++;
            sim->chan_ops[ch->send_off + o->seq] = i;
        } else {
            o->seq = ch->nrecv++;
            sim->chan_ops[ch->recv_off + o->seq] = i;
        }
    }
    rc = 0;
out:
    free(keys);
    free(ids);
    return rc;
}

static int build_lanes(mp_sim *sim)
{
    size_t nq = (size_t)sim->size * (size_t)sim->nlanes;
    sim->lane_off = calloc(nq, sizeof *sim->lane_off);
    sim->lane_count = calloc(nq, sizeof *sim->lane_count);
    sim->lane_head = calloc(nq, sizeof *sim->lane_head);
    sim->lane_steps = malloc((sim->nsteps ? (size_t)sim->nsteps : 1) * sizeof *sim->lane_steps);
    if (!sim->lane_off || !sim->lane_count || !sim->lane_head || !sim->lane_steps)
        return -1;
    for (int32_t s = 0; s < sim->nsteps; s++)
        sim->lane_count[sim->steps[s].rank * sim->nlanes + sim->steps[s].lane]++;
    int32_t off = 0;
    for (size_t q = 0; q < nq; q++) {
        sim->lane_off[q] = off;
        off += sim->lane_count[q];
        sim->lane_count[q] = 0;
    }
    for (int32_t s = 0; s < sim->nsteps; s++) {
        size_t q = (size_t)sim->steps[s].rank * (size_t)sim->nlanes + (size_t)sim->steps[s].lane;
        sim->steps[s].lane_pos = sim->lane_count[q]++;
        sim->lane_steps[sim->lane_off[q] + sim->steps[s].lane_pos] = s;
    }
    return 0;
}

void mp_sim_free(mp_sim *sim)
{
    if (!sim)
        return;
    free(sim->ops);
    free(sim->steps);
    free(sim->calls);
    free(sim->awaits);
    free(sim->ranks);
    free(sim->chans);
    free(sim->chan_ops);
    free(sim->lane_off);
    free(sim->lane_count);
    free(sim->lane_head);
    free(sim->lane_steps);
    free(sim->cur.v);
    free(sim->next.v);
    free(sim->cycle);
    free(sim);
}

mp_sim *mp_sim_new(const mp_sim_program *prog, char *err, size_t errlen, int *oom)
{
    *oom = 0;
    if (errlen)
        err[0] = '\0';
    if (prog->size < 1 || prog->nlanes < 1 || prog->nlanes > 2) {
        snprintf(err, errlen, "packed program: size %d and lanes %d must be >= 1 and 1 or 2", prog->size, prog->nlanes);
        return NULL;
    }
    mp_sim *sim = calloc(1, sizeof *sim);
    if (!sim) {
        *oom = 1;
        return NULL;
    }
    sim->size = prog->size;
    sim->nlanes = prog->nlanes;
    sim->eager = prog->eager_threshold;
    parser p = {prog, err, errlen};
    if (parse(sim, &p, 0) != 0) {
        mp_sim_free(sim);
        return NULL;
    }
    sim->ops = calloc(sim->nops ? (size_t)sim->nops : 1, sizeof *sim->ops);
    sim->steps = calloc(sim->nsteps ? (size_t)sim->nsteps : 1, sizeof *sim->steps);
    sim->calls = calloc(sim->ncalls ? (size_t)sim->ncalls : 1, sizeof *sim->calls);
    sim->awaits = calloc(sim->nawaits ? 2 * (size_t)sim->nawaits : 1, sizeof *sim->awaits);
    sim->ranks = calloc((size_t)sim->size, sizeof *sim->ranks);
    if (!sim->ops || !sim->steps || !sim->calls || !sim->awaits || !sim->ranks || parse(sim, &p, 1) != 0 ||
        build_channels(sim) != 0 || build_lanes(sim) != 0) {
        if (!err[0])
            *oom = 1;
        mp_sim_free(sim);
        return NULL;
    }
    for (int32_t c = 0; c < sim->ncalls; c++)
        sim->calls[c].remaining = sim->calls[c].nops;
    for (int32_t s = 0; s < sim->nsteps; s++)
        sim->steps[s].remaining = sim->steps[s].nops;
    for (int32_t i = 0; i < sim->nops; i++)
        sim->ranks[sim->ops[i].rank].remaining++;
    return sim;
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
            sim->chans[o->chan].issued[o->kind]++;
        }
        if (sim->lane_head[st->rank * sim->nlanes + st->lane] == st->lane_pos)
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
    sim_step *st = &sim->steps[o->step];
    sim_call *c = &sim->calls[o->call];
    sim_rank *rk = &sim->ranks[o->rank];
    rk->remaining--;
    c->remaining--;
    int wake = 0;
    if (--st->remaining == 0) {
        int32_t q = o->rank * sim->nlanes + o->lane;
        int32_t head = ++sim->lane_head[q];
        if (head < sim->lane_count[q]) {
            sim_step *next = &sim->steps[sim->lane_steps[sim->lane_off[q] + head]];
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

static void find_cycle(mp_sim *sim);

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
        find_cycle(sim);
    return sim->oom ? -1 : 0;
}

/* ---- the stuck state: the wait-for graph -------------------------------------------------------
 * Nodes: (rank, lane) for a lane's head step and (rank, wait) for the rank's host wait,
 * numbered rank * (nlanes + 1) + lane, the wait being lane nlanes. */

typedef struct {
    int32_t target, op;
} sim_edge;

typedef struct {
    sim_edge *v;
    size_t n, cap;
} edge_list;

static int push_edge(edge_list *l, int32_t target, int32_t op)
{
    sim_edge *v = reserve(l->v, l->n, &l->cap, sizeof *v);
    if (!v)
        return -1;
    l->v = v;
    l->v[l->n++] = (sim_edge){target, op};
    return 0;
}

static int32_t node_of(const mp_sim *sim, int32_t rank, int32_t lane) { return rank * (sim->nlanes + 1) + lane; }

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

/* Where a pending op of an active step points: the peer's wait, the peer's lane, or nowhere
 * (its partner is active too and it only waits for an earlier op of its group). */
static int32_t op_target(const mp_sim *sim, int32_t id)
{
    const sim_op *o = &sim->ops[id];
    switch (partner_state(sim, id)) {
    case MP_SIM_PARTNER_MISSING:
        return node_of(sim, o->peer, sim->nlanes);
    case MP_SIM_PARTNER_QUEUED:
        return node_of(sim, o->peer, o->lane);
    default:
        return -1;
    }
}

static int head_edges(const mp_sim *sim, int32_t r, int32_t lane, edge_list *out)
{
    int32_t q = r * sim->nlanes + lane;
    if (sim->lane_head[q] >= sim->lane_count[q])
        return 0;
    const sim_step *st = &sim->steps[sim->lane_steps[sim->lane_off[q] + sim->lane_head[q]]];
    if (!st->issued)
        return 0;
    for (int32_t i = st->first_op; i < st->first_op + st->nops; i++) {
        int32_t t = sim->ops[i].done ? -1 : op_target(sim, i);
        if (t >= 0 && push_edge(out, t, i) != 0)
            return -1;
    }
    return 0;
}

/* Edges of a wait on ops [first, end): each pending op points where it needs, or to its lane
 * head when it is queued behind it (or only waits for an op of its own group). */
static int wait_ops_edges(const mp_sim *sim, int32_t first, int32_t end, edge_list *out)
{
    int32_t behind_head_seen[2] = {0, 0};
    for (int32_t i = first; i < end; i++) {
        const sim_op *o = &sim->ops[i];
        if (o->done && sim->steps[o->step].remaining == 0)
            continue;
        int32_t t = o->active && !o->done ? op_target(sim, i) : -1; /* done: waits for its group */
        if (t < 0) {
            if (behind_head_seen[o->lane]++)
                continue;
            t = node_of(sim, o->rank, o->lane); /* its lane head holds it back */
        }
        if (push_edge(out, t, i) != 0)
            return -1;
    }
    return 0;
}

static int wait_edges(const mp_sim *sim, int32_t r, edge_list *out)
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
        for (int32_t lane = 0; lane < sim->nlanes; lane++) {
            int32_t q = r * sim->nlanes + lane;
            if (sim->lane_head[q] >= sim->lane_count[q])
                continue;
            const sim_step *st = &sim->steps[sim->lane_steps[sim->lane_off[q] + sim->lane_head[q]]];
            for (int32_t i = st->first_op; i < st->first_op + st->nops; i++)
                if (!sim->ops[i].done) {
                    if (push_edge(out, node_of(sim, r, lane), i) != 0)
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
    };
}

/* Keeps the edges of `path` that leave a rank: each is an op of that rank needing the next. */
static int record_path(mp_sim *sim, const int32_t *nodes, const int32_t *ops, size_t n, int closed)
{
    sim->cycle = calloc(n ? n : 1, sizeof *sim->cycle);
    if (!sim->cycle)
        return -1;
    int32_t per = sim->nlanes + 1;
    for (size_t i = 0; i < n; i++) {
        int32_t from = nodes[i] / per, to = nodes[i + 1] / per;
        if (from == to)
            continue;
        op_info(sim, ops[i], &sim->cycle[sim->cycle_len].op);
        sim->cycle[sim->cycle_len++].waits_for = to;
    }
    sim->cycle_closed = closed;
    return 0;
}

/* Depth-first search from every rank's wait, then every lane; the first cycle found is kept.
 * Without a cycle, the chain of first edges from the first stuck rank is kept instead. */
static void find_cycle(mp_sim *sim)
{
    int32_t per = sim->nlanes + 1, nnodes = sim->size * per;
    size_t *first = malloc(((size_t)nnodes + 1) * sizeof *first);
    uint8_t *color = calloc((size_t)nnodes, 1);
    int32_t *stack = malloc((size_t)nnodes * sizeof *stack), *path_nodes = malloc(((size_t)nnodes + 1) * sizeof *path_nodes);
    int32_t *path_ops = malloc(((size_t)nnodes + 1) * sizeof *path_ops);
    size_t *cursor = malloc((size_t)nnodes * sizeof *cursor);
    edge_list edges = {0};
    if (!first || !color || !stack || !path_nodes || !path_ops || !cursor)
        goto oom;
    for (int32_t v = 0; v < nnodes; v++) {
        first[v] = edges.n;
        int32_t r = v / per, lane = v % per;
        if ((lane == sim->nlanes ? wait_edges(sim, r, &edges) : head_edges(sim, r, lane, &edges)) != 0)
            goto oom;
    }
    first[nnodes] = edges.n;
    for (int32_t pass = 0; pass < 2; pass++)
        for (int32_t r = 0; r < sim->size; r++)
            for (int32_t lane = pass ? 0 : sim->nlanes; lane < (pass ? sim->nlanes : sim->nlanes + 1); lane++) {
                int32_t start = node_of(sim, r, lane);
                if (color[start])
                    continue;
                size_t depth = 0;
                stack[depth] = start;
                cursor[depth++] = first[start];
                color[start] = 1;
                while (depth) {
                    int32_t v = stack[depth - 1];
                    if (cursor[depth - 1] == first[v + 1]) {
                        color[v] = 2;
                        depth--;
                        continue;
                    }
                    const sim_edge *e = &edges.v[cursor[depth - 1]++];
                    if (color[e->target] == 1) { /* back edge: the cycle is on the stack */
                        size_t from = 0;
                        while (stack[from] != e->target)
                            from++;
                        size_t n = 0;
                        for (size_t i = from; i < depth; i++) {
                            path_nodes[n] = stack[i];
                            path_ops[n++] = i + 1 < depth ? edges.v[cursor[i] - 1].op : e->op;
                        }
                        path_nodes[n] = e->target;
                        if (record_path(sim, path_nodes, path_ops, n, 1) != 0)
                            goto oom;
                        goto done;
                    }
                    if (color[e->target] == 0) {
                        color[e->target] = 1;
                        stack[depth] = e->target;
                        cursor[depth++] = first[e->target];
                    }
                }
            }
    /* No cycle: follow first edges from the first stuck rank until a rank with nothing to wait for. */
    for (int32_t r = 0; r < sim->size; r++) {
        if (sim->ranks[r].state == RANK_DONE)
            continue;
        int32_t v = node_of(sim, r, sim->nlanes);
        size_t n = 0;
        memset(color, 0, (size_t)nnodes);
        while (first[v] < first[v + 1] && !color[v] && n < (size_t)nnodes) {
            color[v] = 1;
            path_nodes[n] = v;
            path_ops[n++] = edges.v[first[v]].op;
            v = edges.v[first[v]].target;
        }
        path_nodes[n] = v;
        if (record_path(sim, path_nodes, path_ops, n, 0) != 0)
            goto oom;
        break;
    }
    goto done;
oom:
    sim->oom = 1;
done:
    free(first);
    free(color);
    free(stack);
    free(path_nodes);
    free(path_ops);
    free(cursor);
    free(edges.v);
}

/* ---- results -------------------------------------------------------------------------------- */

mp_sim_verdict mp_sim_result(const mp_sim *sim) { return sim->verdict; }
int64_t mp_sim_rounds(const mp_sim *sim) { return sim->rounds; }
int64_t mp_sim_num_ops(const mp_sim *sim) { return sim->nops; }
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

int mp_sim_each_pending(const mp_sim *sim, int (*fn)(void *ctx, const mp_sim_op_info *op), void *ctx)
{
    for (int32_t i = 0; i < sim->nops; i++) {
        if (sim->ops[i].done)
            continue;
        mp_sim_op_info info;
        op_info(sim, i, &info);
        int rc = fn(ctx, &info);
        if (rc)
            return rc;
    }
    return 0;
}
