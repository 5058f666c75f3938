/* Building a simulator: the packed program parsed (exchanges expanded into steps by the plan,
 * as the runtime does), its channels numbered and its step queues (one per lane, or one per
 * rank when lanes are serialized) laid out; then mp_sim_new and mp_sim_free. The run itself is
 * simulate.c. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "numbering.h"
#include "plan.h"
#include "simulate_internal.h"

enum { TAG_STEPS = 0, TAG_EXCHANGE = 1 };
enum { FLAG_WAIT = 1, FLAG_BATCHED = 2 };

#define MAX_ITEMS (INT32_MAX / 4)

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

/* ---- channels and queues -------------------------------------------------------------------- */

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
    }
    /* Numbered as the runtime numbers them (core/numbering.h), in each rank's issue order. */
    mp_channel_numbers *numbers = calloc(nchans ? (size_t)nchans : 1, sizeof *numbers);
    if (!numbers)
        goto out;
    for (int32_t i = 0; i < sim->nops; i++) {
        sim_op *o = &sim->ops[i];
        sim_chan *ch = &sim->chans[o->chan];
        o->seq = (int32_t)mp_number_message(&numbers[o->chan], o->kind == KIND_SEND ? MP_SEND : MP_RECV);
        sim->chan_ops[(o->kind == KIND_SEND ? ch->send_off : ch->recv_off) + o->seq] = i;
    }
    free(numbers);
    rc = 0;
out:
    free(keys);
    free(ids);
    return rc;
}

/* Lays out each (rank, queue)'s FIFO of steps in issue order (simulate_internal.h). */
static int build_queues(mp_sim *sim)
{
    size_t nq = (size_t)sim->size * (size_t)sim->nqueues;
    sim->queue_off = calloc(nq, sizeof *sim->queue_off);
    sim->queue_count = calloc(nq, sizeof *sim->queue_count);
    sim->queue_head = calloc(nq, sizeof *sim->queue_head);
    sim->queue_steps = malloc((sim->nsteps ? (size_t)sim->nsteps : 1) * sizeof *sim->queue_steps);
    if (!sim->queue_off || !sim->queue_count || !sim->queue_head || !sim->queue_steps)
        return -1;
    for (int32_t s = 0; s < sim->nsteps; s++)
        sim->queue_count[sim_queue(sim, sim->steps[s].rank, sim->steps[s].lane)]++;
    int32_t off = 0;
    for (size_t q = 0; q < nq; q++) {
        sim->queue_off[q] = off;
        off += sim->queue_count[q];
        sim->queue_count[q] = 0;
    }
    for (int32_t s = 0; s < sim->nsteps; s++) {
        int32_t q = sim_queue(sim, sim->steps[s].rank, sim->steps[s].lane);
        sim->steps[s].queue_pos = sim->queue_count[q]++;
        sim->queue_steps[sim->queue_off[q] + sim->steps[s].queue_pos] = s;
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
    free(sim->posted_round);
    free(sim->done_round);
    free(sim->queue_off);
    free(sim->queue_count);
    free(sim->queue_head);
    free(sim->queue_steps);
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
    sim->nqueues = prog->serialize_lanes ? 1 : prog->nlanes;
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
        build_channels(sim) != 0 || build_queues(sim) != 0) {
        if (!err[0])
            *oom = 1;
        mp_sim_free(sim);
        return NULL;
    }
    if (prog->timeline) {
        sim->posted_round = malloc((sim->nops ? (size_t)sim->nops : 1) * sizeof *sim->posted_round);
        sim->done_round = malloc((sim->nops ? (size_t)sim->nops : 1) * sizeof *sim->done_round);
        if (!sim->posted_round || !sim->done_round) {
            *oom = 1;
            mp_sim_free(sim);
            return NULL;
        }
    }
    for (int32_t c = 0; c < sim->ncalls; c++)
        sim->calls[c].remaining = sim->calls[c].nops;
    for (int32_t s = 0; s < sim->nsteps; s++)
        sim->steps[s].remaining = sim->steps[s].nops;
    for (int32_t i = 0; i < sim->nops; i++)
        sim->ranks[sim->ops[i].rank].remaining++;
    return sim;
}
