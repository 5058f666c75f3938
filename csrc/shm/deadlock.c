#include "deadlock.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/cycle_report.h"
#include "core/dtype.h"
#include "core/op.h"
#include "core/waitfor.h"

/* Graph nodes: per rank, the head step of each lane, and the rank's wait (which must return
 * before the rank posts anything new). A published run leads to at most two nodes of its peer:
 * its first blocked op's, and that of its first op the peer has not issued a partner for. */
#define NODE_KINDS 3
#define NODE_WAIT 2
#define MAX_EDGES (2 * SHM_WATCH_OPS)

typedef struct {
    int state; /* 0: not read yet, 1: blocked with a consistent snapshot, 2: not usable */
    shm_watch snap;
} rank_view;

/* One way a node waits on another: op `seq` of run `via` of the node's rank needs `to` to move. */
typedef struct {
    int to;
    int via;
    uint64_t seq;
    int partner_issued;
    uint64_t partner_count; /* the partner kind's ops the peer has issued on the channel */
} edge;

typedef struct {
    int rank;
    int node_kind;     /* lane, or NODE_WAIT */
    int next;          /* the rank it waits for */
    uint32_t epoch;
    shm_watch_op op;   /* the op that needs `next` (a run of one) */
    int partner_issued;
    uint64_t partner_count; /* the partner kind's ops `next` has issued on the channel */
} cycle_edge;

struct shm_cycle {
    int n;
    cycle_edge edges[];
};

typedef struct {
    const shm_view *v;
    uint64_t eager;
    rank_view *views;
    int *nedges;       /* -1: not computed */
    edge *edges;       /* [node][MAX_EDGES] */
    char *corrupt;     /* the first impossible value read, for the caller to report */
    size_t corrupt_len;
} graph;

static void found_corrupt(graph *g, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void found_corrupt(graph *g, const char *fmt, ...)
{
    if (!g->corrupt_len || g->corrupt[0])
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g->corrupt, g->corrupt_len, fmt, ap);
    va_end(ap);
}

static shm_chan *chan(const shm_view *v, int lane, int src, int dst)
{
    return shm_chan_at(v, shm_chan_index(v, lane, src, dst));
}

static int is_eager(const graph *g, const shm_watch_op *o) { return o->kind == MP_SEND && o->nbytes <= g->eager; }

/* Seqlock read of a blocked rank's snapshot, checked like any other value from shared memory. */
static rank_view *view_of(graph *g, int r)
{
    rank_view *rv = &g->views[r];
    if (rv->state)
        return rv;
    rv->state = 2;
    shm_rank *sr = shm_rank_at(g->v, r);
    uint32_t epoch = atomic_load(&sr->wait_epoch);
    if (!atomic_load(&sr->waiting) || atomic_load(&sr->fence))
        return rv;
    shm_watch *w = shm_watch_at(g->v, r);
    uint32_t before = atomic_load_explicit(&w->version, memory_order_acquire);
    /* Odd: being rewritten. 0: never published; the segment's zeros (epoch 0, as the rank's own
     * wait_epoch before its first watched wait, nops 0, wait_index 0) describe no wait, and a
     * garbage `waiting` must not have them read as an impossible one. */
    if ((before & 1) || before == 0)
        return rv;
    memcpy(&rv->snap, (const char *)w, sizeof rv->snap);
    atomic_thread_fence(memory_order_acquire);
    if (atomic_load_explicit(&w->version, memory_order_relaxed) != before || rv->snap.epoch != epoch ||
        atomic_load(&sr->wait_epoch) != epoch)
        return rv;
    /* A consistent snapshot: what it holds is what rank r wrote, or garbage. */
    shm_watch *s = &rv->snap;
    if (s->nops > SHM_WATCH_OPS || s->wait_index < -2 || s->wait_index >= (int32_t)s->nops || s->wait_lane < 0 ||
        s->wait_lane >= g->v->nlanes) {
        found_corrupt(g, "rank %d's published wait: nops = %u, wait_index = %d, wait_lane = %d", r, s->nops,
                      s->wait_index, s->wait_lane);
        return rv;
    }
    for (uint32_t i = 0; i < s->nops; i++) {
        const shm_watch_op *o = &s->ops[i];
        int valid = (o->kind == MP_SEND || o->kind == MP_RECV) && o->peer >= 0 && o->peer < g->v->size &&
                    o->lane >= 0 && o->lane < g->v->nlanes && o->dtype >= 0 && o->dtype < MP_NUM_DTYPES &&
                    o->label >= 0 && o->label < MP_NUM_LABELS;
        /* Every published op was issued: the run ends within what rank r has issued on its channel. */
        uint64_t issued = !valid              ? 0
                        : o->kind == MP_SEND ? atomic_load(&chan(g->v, o->lane, r, o->peer)->send_issued)
                                             : atomic_load(&chan(g->v, o->lane, o->peer, r)->recv_issued);
        if (!valid || o->count == 0 || o->seq > issued || o->count > issued - o->seq) {
            found_corrupt(g, "rank %d's published op #%u: kind %d, peer %d, lane %d, dtype %d, label %d, seq %llu, "
                          "count %u (%llu issued)", r, i, o->kind, o->peer, o->lane, o->dtype, o->label,
                          (unsigned long long)o->seq, o->count, (unsigned long long)issued);
            return rv;
        }
        s->ops[i].call[sizeof s->ops[i].call - 1] = '\0';
    }
    rv->state = 1;
    return rv;
}

/* A channel's counters, read in the order they are written: finished <= made active (or
 * published) <= issued. Returns 0 and reports when they are not. */
static int counters_valid(graph *g, const char *what, int lane, int src, int dst, _Atomic uint64_t *done,
                          _Atomic uint64_t *active, _Atomic uint64_t *issued, uint64_t out[3])
{
    uint64_t d = atomic_load(done), a = atomic_load(active), i = atomic_load(issued);
    out[0] = d, out[1] = a, out[2] = i;
    if (d <= a && a <= i)
        return 1;
    found_corrupt(g, "channel (lane %d, %d->%d): %llu done, %llu %s, %llu issued", lane, src, dst,
                  (unsigned long long)d, (unsigned long long)a, what, (unsigned long long)i);
    return 0;
}

static uint64_t add_sat(uint64_t a, uint64_t b) { return a > UINT64_MAX - b ? UINT64_MAX : a + b; }
static uint64_t max_u64(uint64_t a, uint64_t b) { return a > b ? a : b; }
static uint64_t run_last(const shm_watch_op *o) { return o->seq + o->count - 1; } /* checked in view_of */

/* The seq below which rank r's messages on the channel of run `o` are complete, live. */
static uint64_t completed_below(const graph *g, int r, const shm_watch_op *o)
{
    if (o->kind == MP_SEND) {
        shm_chan *ch = chan(g->v, o->lane, r, o->peer);
        uint64_t done = atomic_load(&ch->done);
        return is_eager(g, o) ? max_u64(atomic_load(&ch->posted), done) : done;
    }
    return atomic_load(&chan(g->v, o->lane, o->peer, r)->done);
}

/* The edges of ops first..last of rank r's run `via` (all incomplete): the peer's node that its
 * first op without a posted partner waits on, and its wait node if a later op's partner is not
 * even issued. None when every op's partner is posted (they progress), or nothing is known of
 * the peer. Per channel, each of these turns at one seq; `out` gets 0, 1 or 2 edges. */
static int run_edges(graph *g, int r, int via, uint64_t first, uint64_t last, edge *out)
{
    const shm_watch_op *o = &g->views[r].snap.ops[via];
    int p = o->peer;
    if (p == r)
        return 0; /* self pairs share a group and complete together */
    uint64_t c[3]; /* done, active or published, issued */
    uint64_t active, issued, count; /* below `active` an op's partner is posted; below `issued`, issued */
    if (o->kind == MP_SEND) {
        shm_chan *ch = chan(g->v, o->lane, r, p);
        if (!counters_valid(g, "receive(s) active", o->lane, r, p, &ch->done, &ch->recv_posted, &ch->recv_issued, c))
            return 0;
        count = c[2];
        /* A buffered send waits only for a free descriptor slot: receive seq - SHM_NSLOTS done. */
        active = is_eager(g, o) ? add_sat(c[0], SHM_NSLOTS) : c[1];
        issued = is_eager(g, o) ? add_sat(c[2], SHM_NSLOTS) : c[2];
    } else {
        shm_chan *ch = chan(g->v, o->lane, p, r);
        if (!counters_valid(g, "published", o->lane, p, r, &ch->done, &ch->posted, &ch->send_issued, c))
            return 0;
        count = c[2];
        active = c[1];
        issued = c[2];
    }
    uint64_t blocked = max_u64(first, active);
    if (blocked > last || view_of(g, p)->state != 1)
        return 0; /* progressing; or the peer is computing, or moving: it may still post */
    int n = 0;
    if (blocked < issued)
        out[n++] = (edge){p * NODE_KINDS + o->lane, via, blocked, 1, count};
    if (last >= issued)
        out[n++] = (edge){p * NODE_KINDS + NODE_WAIT, via, max_u64(blocked, issued), 0, count};
    return n;
}

/* The runs of rank r's head step on `lane` with an op still incomplete, as indices into its
 * snapshot. */
static int head_ops(graph *g, int r, int lane, int *out)
{
    const shm_watch *s = &g->views[r].snap;
    int n = 0;
    int64_t head = -1;
    for (uint32_t i = 0; i < s->nops; i++) {
        const shm_watch_op *o = &s->ops[i];
        if (o->lane != lane || (head >= 0 && (int64_t)o->step != head) || completed_below(g, r, o) > run_last(o))
            continue;
        head = (int64_t)o->step;
        out[n++] = (int)i;
    }
    return n;
}

static void compute_edges(graph *g, int node)
{
    int r = node / NODE_KINDS, kind = node % NODE_KINDS;
    edge *out = &g->edges[(size_t)node * MAX_EDGES];
    g->nedges[node] = 0;
    rank_view *rv = view_of(g, r);
    if (rv->state != 1)
        return;
    const shm_watch *s = &rv->snap;
    int deps[SHM_WATCH_OPS], ndeps;
    if (kind == NODE_WAIT) {
        if (s->wait_index == -2)
            return; /* several threads wait: any of them may return and post */
        ndeps = head_ops(g, r, s->wait_lane, deps);
        /* The wait returns once the waited op's group completes, all its ops together: it needs
         * every op of the lane's head step, unless that step lies past the waited op's (whose
         * group is then complete). */
        if (s->wait_index >= 0 && ndeps > 0 && s->ops[deps[0]].step > s->ops[s->wait_index].step)
            return;
    } else {
        ndeps = head_ops(g, r, kind, deps);
    }
    for (int i = 0; i < ndeps; i++) {
        const shm_watch_op *o = &s->ops[deps[i]];
        uint64_t first = max_u64(o->seq, completed_below(g, r, o));
        if (first <= run_last(o))
            g->nedges[node] += run_edges(g, r, deps[i], first, run_last(o), &out[g->nedges[node]]);
    }
}

/* The search's view of the graph (core/waitfor.h): an edge's reason is its place in g->edges. */
static int node_edges(void *ctx, int32_t node, mp_waitfor_sink *sink)
{
    graph *g = ctx;
    if (g->nedges[node] < 0)
        compute_edges(g, node);
    if (g->corrupt_len && g->corrupt[0])
        return 1; /* the segment holds garbage: nothing found in it is reported */
    for (int k = 0; k < g->nedges[node]; k++) {
        int32_t via = node * MAX_EDGES + k;
        if (mp_waitfor_add(sink, g->edges[via].to, via) != 0)
            return 1;
    }
    return 0;
}

shm_cycle *shm_cycle_find(const shm_view *v, int me, uint64_t eager_threshold, char *corrupt, size_t corrupt_len)
{
    size_t nodes = (size_t)v->size * NODE_KINDS;
    graph g = {.v = v, .eager = eager_threshold, .corrupt = corrupt, .corrupt_len = corrupt_len};
    if (corrupt_len)
        corrupt[0] = '\0';
    g.views = calloc((size_t)v->size, sizeof *g.views);
    g.nedges = malloc(nodes * sizeof(int));
    g.edges = malloc(nodes * MAX_EDGES * sizeof(edge));
    shm_cycle *found = NULL;
    mp_waitfor_path path = {0};
    if (!g.views || !g.nedges || !g.edges)
        goto done;
    for (size_t i = 0; i < nodes; i++)
        g.nedges[i] = -1;
    int32_t start = me * NODE_KINDS + NODE_WAIT;
    mp_waitfor_graph wf = {(int32_t)nodes, node_edges, &g};
    if (mp_waitfor_cycle(&wf, &start, 1, &path) != 1 || !(found = malloc(sizeof *found + sizeof(cycle_edge) * path.n)))
        goto done;
    found->n = (int)path.n;
    for (size_t i = 0; i < path.n; i++) {
        int node = path.nodes[i];
        const edge *e = &g.edges[path.via[i]];
        cycle_edge *ce = &found->edges[i];
        ce->rank = node / NODE_KINDS;
        ce->node_kind = node % NODE_KINDS;
        ce->epoch = g.views[ce->rank].snap.epoch;
        ce->op = g.views[ce->rank].snap.ops[e->via];
        ce->op.seq = e->seq;
        ce->op.count = 1;
        ce->next = e->to / NODE_KINDS;
        ce->partner_issued = e->partner_issued;
        ce->partner_count = e->partner_count;
    }
done:
    mp_waitfor_path_free(&path);
    free(g.views);
    free(g.nedges);
    free(g.edges);
    return found;
}

int shm_cycle_same(const shm_cycle *a, const shm_cycle *b)
{
    if (!a || !b || a->n != b->n)
        return 0;
    for (int i = 0; i < a->n; i++) {
        const cycle_edge *x = &a->edges[i], *y = &b->edges[i];
        if (x->rank != y->rank || x->node_kind != y->node_kind || x->next != y->next || x->epoch != y->epoch ||
            x->op.kind != y->op.kind || x->op.peer != y->op.peer || x->op.lane != y->op.lane ||
            x->op.seq != y->op.seq)
            return 0;
    }
    return 1;
}

void shm_cycle_free(shm_cycle *c) { free(c); }

/* The cycle in the one report grammar (core/cycle_report.h), with global ranks and pids. */
static void format_report(const shm_view *v, const shm_cycle *c, const pid_t *pids, char *buf, size_t len)
{
    mp_cycle_rank *ranks = calloc((size_t)c->n, sizeof *ranks);
    if (!ranks) {
        snprintf(buf, len, "deadlock: a wait-for cycle of %d ranks (no memory left to describe it)", c->n);
        return;
    }
    for (int i = 0; i < c->n; i++) {
        const cycle_edge *e = &c->edges[i];
        const shm_watch_op *o = &e->op;
        ranks[i] = (mp_cycle_rank){
            .rank = shm_global_rank(v, e->rank),
            .peer = shm_global_rank(v, o->peer),
            .pid = (long)pids[e->rank],
            .kind = (mp_kind)o->kind,
            .what = mp_label_name((mp_label)(o->label % MP_NUM_LABELS)),
            .nbytes = o->nbytes,
            .dtype = mp_dtype_name(o->dtype),
            .lane = o->lane,
            .message = o->seq,
            .call = o->call,
            .label = "",
            .partner_posted = e->partner_issued,
            .partner_count = e->partner_count,
        };
    }
    mp_cycle_report(ranks, c->n, buf, len);
    free(ranks);
}

int shm_cycle_fence(const shm_view *v, const shm_cycle *c, const pid_t *pids)
{
    shm_header *h = shm_hdr(v);
    uint32_t free_lock = 0;
    if (!atomic_compare_exchange_strong(&h->detect_lock, &free_lock, (uint32_t)c->edges[0].rank + 1))
        return 0;
    int fenced = 0;
    for (int i = 0; i < c->n; i++)
        if (atomic_load(&shm_rank_at(v, c->edges[i].rank)->fence))
            goto unlock; /* reported already; its fence fails the rest */
    uint32_t value = SHM_REPORTS + 1; /* every report area used: the ranks fail without one */
    uint32_t used = atomic_load_explicit(&h->reports_used, memory_order_relaxed); /* only the lock holder writes it */
    if (used < SHM_REPORTS) {
        format_report(v, c, pids, shm_report_at(v, used), SHM_REPORT_BYTES);
        value = used + 1;
        /* Release: a rank that reads the count, or a fence naming the report, then reads the text. */
        atomic_store_explicit(&h->reports_used, value, memory_order_release);
    }
    uint32_t count = 0;
    for (int i = 0; i < c->n; i++) {
        uint32_t none = 0;
        if (atomic_compare_exchange_strong(&shm_rank_at(v, c->edges[i].rank)->fence, &none, value))
            count++;
    }
    atomic_fetch_add(&h->fenced, count);
    fenced = 1;
unlock:
    atomic_store(&h->detect_lock, 0);
    return fenced;
}

void shm_deadlock_report(const shm_view *v, uint32_t fence, char *buf, size_t len)
{
    if (!len)
        return;
    if (fence == 0 || fence > SHM_REPORTS) {
        snprintf(buf, len, "deadlock: a wait-for cycle was found, but its report was not kept (more than %u "
                 "cycles in this communicator)", SHM_REPORTS);
        return;
    }
    size_t n = len - 1 < SHM_REPORT_BYTES - 1 ? len - 1 : SHM_REPORT_BYTES - 1;
    memcpy(buf, shm_report_at(v, fence - 1), n); /* a peer's text: bounded and terminated here */
    buf[n] = '\0';
}
