/* Drives the shm engine without Python, the way the bindings do, from several processes (one per
 * rank, forked) and several threads per rank (one per lane), so that ThreadSanitizer can watch the
 * engine's threads meet: posting threads, waiting threads that progress the engine themselves,
 * and the progress thread.
 *
 * Every rank derives the same plan from the seed: per lane and round, one of a ring shift, an
 * all-to-all step, a self exchange, a pairwise exchange in two steps, or a burst (a ring shift of
 * BURST messages per peer in one step, between 4 KiB and 2 MiB, received into the arena where the
 * receiver has one: more receives outstanding on a channel than it has offer slots, so that two
 * receives answer into one slot); sizes cross the inline
 * (eager and rendezvous), single-copy and bounce-buffer paths; now and then a receive expects a
 * different size (both sides must report the mismatch) or a rank dawdles (its peers block long
 * enough to run the deadlock detector, which must find nothing). Rank 1 refuses single-copy, so
 * what is sent to it goes through the bounce buffer. Every byte received is checked.
 *
 * Exit status: 0 when every op ended as planned, 1 when one did not, 2 on bad arguments, 3 when
 * the job ran past its time limit; a rank that dies passes on its status (ThreadSanitizer's
 * exitcode when it reported). */
#include <errno.h>
#include <getopt.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/clock.h"
#include "core/dtype.h"
#include "core/numbering.h"
#include "shm/shm_transport.h"
#include "shm/segment.h"

#define NLANES 2
#define MAX_RANKS 8
#define BURST ((int)SHM_NSLOTS + 2) /* messages per peer in a burst round's step */
#define MAX_STEP_OPS (2 * BURST > 2 * MAX_RANKS ? 2 * BURST : 2 * MAX_RANKS)
#define MAX_INFLIGHT 8

typedef struct {
    int ranks;
    int rounds;          /* per lane, at most */
    double seconds;      /* no round starts after this long (0: no limit) */
    double start;        /* mp_now() when the job began (the clock is shared by the ranks) */
    uint64_t seed;
    uint64_t eager_threshold;
    int window;          /* steps a lane keeps posted before it waits for the oldest */
    double timeout;      /* for one wait, and for creating the communicator */
    double time_limit;   /* for the whole job */
    int corrupt;         /* flip one received byte on rank 0, to show the check reports it */
    uint64_t slot_bytes; /* what travels inline, as the layout sizes it */
} config;

typedef struct {
    uint64_t messages, inlined, single_copy, bounce, arena, burst_arena, self, mismatched, bytes, dawdles, failures;
} stats;

static void add_stats(stats *to, const stats *s)
{
    to->messages += s->messages;
    to->inlined += s->inlined;
    to->single_copy += s->single_copy;
    to->arena += s->arena;
    to->burst_arena += s->burst_arena;
    to->bounce += s->bounce;
    to->self += s->self;
    to->mismatched += s->mismatched;
    to->bytes += s->bytes;
    to->dawdles += s->dawdles;
    to->failures += s->failures;
}

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(1);
    }
    return p;
}

/* ---- the plan every rank derives ------------------------------------------------------- */

static uint64_t mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static uint64_t hash4(uint64_t a, uint64_t b, uint64_t c, uint64_t d)
{
    return mix(mix(mix(mix(a) ^ b) ^ c) ^ d);
}

enum { ROUND_SHIFT = 0, ROUND_ALL_TO_ALL, ROUND_SELF, ROUND_PAIRS, ROUND_BURST };

static int round_kind(const config *cfg, int lane, int round)
{
    uint64_t h = hash4(cfg->seed, 1, (uint64_t)lane, (uint64_t)round) % 100;
    if (h < 5)
        return ROUND_BURST;
    if (h < 50)
        return ROUND_SHIFT;
    if (h < 70)
        return ROUND_ALL_TO_ALL;
    if (h < 80)
        return ROUND_SELF;
    return cfg->ranks % 2 == 0 ? ROUND_PAIRS : ROUND_SHIFT;
}

static int round_shift(const config *cfg, int lane, int round)
{
    return 1 + (int)(hash4(cfg->seed, 2, (uint64_t)lane, (uint64_t)round) % (uint64_t)(cfg->ranks - 1));
}

/* Sizes across every path: inline (eager or not), single-copy or bounce, and several copy chunks. */
static uint64_t message_bytes(const config *cfg, uint64_t h)
{
    uint64_t tier = h % 100, r = h >> 8;
    if (tier < 40)
        return r % (cfg->slot_bytes + 1);
    if (tier < 70)
        return cfg->slot_bytes + 1 + r % (64u << 10);
    if (tier < 90)
        return (64u << 10) + r % (448u << 10);
    if (tier < 98)
        return (512u << 10) + r % (1536u << 10);
    return (2u << 20) + r % (4u << 20);
}

/* A burst's sizes: past the inline slot and under ARENA_WAIT_BYTES (whose senders wait for the
 * receive's answer), spread evenly over the powers of two from 4 KiB to 1 MiB. */
static uint64_t burst_bytes(const config *cfg, uint64_t h)
{
    uint64_t base = (uint64_t)4096 << (h % 9), n = base + (h >> 8) % base;
    return n > cfg->slot_bytes ? n : cfg->slot_bytes + 1;
}

typedef struct {
    uint64_t nbytes;
    int dtype;
    uint64_t key;        /* seeds the message's bytes */
    int mismatched;      /* the receive expects one byte more */
    int burst;           /* of a burst round: received into the arena where there is one */
} message;

/* Message `index` of a round from src to dst (a burst's has several). */
static message plan_message(const config *cfg, int lane, int round, int index, int src, int dst)
{
    uint64_t h = hash4(cfg->seed ^ 0x5bd1e995u, (uint64_t)lane, (uint64_t)round, (uint64_t)(src * MAX_RANKS + dst));
    /* A burst's messages differ in their bytes only: an offer read half-rewritten would pass the
     * sender's size and dtype check, and the bytes land in another receive's buffer. */
    message m = {.dtype = (int)(mix(h) % MP_NUM_DTYPES), .key = mix(h ^ 7 ^ ((uint64_t)index << 32))};
    m.burst = round_kind(cfg, lane, round) == ROUND_BURST;
    m.nbytes = m.burst ? burst_bytes(cfg, h) : message_bytes(cfg, h);
    m.mismatched = !m.burst && src != dst && mix(h ^ 11) % 64 == 0;
    return m;
}

static int dawdles(const config *cfg, int lane, int round, int rank)
{
    return hash4(cfg->seed, 3, (uint64_t)(lane * MAX_RANKS + rank), (uint64_t)round) % 100 == 0;
}

typedef struct {
    mp_kind kind;
    int peer;
    message m;
} plan_op;

typedef struct {
    int nops;
    plan_op ops[MAX_STEP_OPS];
} plan_step;

static void add_message(const config *cfg, plan_step *st, mp_kind kind, int me, int peer, int lane, int round,
                        int index)
{
    int src = kind == MP_SEND ? me : peer, dst = kind == MP_SEND ? peer : me;
    st->ops[st->nops++] = (plan_op){kind, peer, plan_message(cfg, lane, round, index, src, dst)};
}

static void add_op(const config *cfg, plan_step *st, mp_kind kind, int me, int peer, int lane, int round)
{
    add_message(cfg, st, kind, me, peer, lane, round, 0);
}

/* This rank's steps of one round (1 or 2); every rank's k-th step on a lane only needs its peers'
 * k-th steps, so no order of posting deadlocks. */
static int plan_round(const config *cfg, int lane, int round, int me, plan_step steps[2])
{
    memset(steps, 0, 2 * sizeof *steps);
    int n = cfg->ranks;
    switch (round_kind(cfg, lane, round)) {
    case ROUND_SHIFT: {
        int d = round_shift(cfg, lane, round);
        add_op(cfg, &steps[0], MP_RECV, me, (me + n - d) % n, lane, round);
        add_op(cfg, &steps[0], MP_SEND, me, (me + d) % n, lane, round);
        return 1;
    }
    case ROUND_ALL_TO_ALL: {
        /* In an order of this rank's own: a group's ops progress together whatever their order. */
        uint64_t h = hash4(cfg->seed, 4, (uint64_t)(lane * MAX_RANKS + me), (uint64_t)round);
        for (int i = 0; i < n; i++) {
            int peer = (int)(((uint64_t)i + h) % (uint64_t)n);
            if (peer == me)
                continue;
            if ((h >> i) & 1) {
                add_op(cfg, &steps[0], MP_SEND, me, peer, lane, round);
                add_op(cfg, &steps[0], MP_RECV, me, peer, lane, round);
            } else {
                add_op(cfg, &steps[0], MP_RECV, me, peer, lane, round);
                add_op(cfg, &steps[0], MP_SEND, me, peer, lane, round);
            }
        }
        return 1;
    }
    case ROUND_BURST: {
        int d = round_shift(cfg, lane, round);
        for (int i = 0; i < BURST; i++) {
            add_message(cfg, &steps[0], MP_RECV, me, (me + n - d) % n, lane, round, i);
            add_message(cfg, &steps[0], MP_SEND, me, (me + d) % n, lane, round, i);
        }
        return 1;
    }
    case ROUND_SELF:
        add_op(cfg, &steps[0], MP_SEND, me, me, lane, round);
        add_op(cfg, &steps[0], MP_RECV, me, me, lane, round);
        return 1;
    default: {
        /* The lower rank of each pair sends first, the upper receives first: two steps each. */
        int peer = (me + n / 2) % n;
        int lower = me < peer;
        add_op(cfg, &steps[lower ? 0 : 1], MP_SEND, me, peer, lane, round);
        add_op(cfg, &steps[lower ? 1 : 0], MP_RECV, me, peer, lane, round);
        return 2;
    }
    }
}

/* ---- when to stop ---------------------------------------------------------------------- */

/* Per lane, in memory the ranks share: 1 + the highest round any rank has started, and a bit
 * set once time is up. From then on no rank starts a round beyond that highest one, so every
 * rank runs the same rounds however far ahead or behind it was. */
#define TIME_UP (1ull << 63)

static int may_start(_Atomic uint64_t *started, uint64_t round)
{
    uint64_t cur = atomic_load(started);
    for (;;) {
        uint64_t highest = cur & ~TIME_UP;
        if (round + 1 <= highest)
            return 1;
        if (cur & TIME_UP)
            return 0;
        if (atomic_compare_exchange_weak(started, &cur, round + 1))
            return 1;
    }
}

/* ---- message bytes ---------------------------------------------------------------------- */

static uint64_t pattern_word(uint64_t key, uint64_t i) { return mix(key + i); }

static void fill(unsigned char *buf, uint64_t nbytes, uint64_t key)
{
    uint64_t words = nbytes / 8;
    for (uint64_t i = 0; i < words; i++) {
        uint64_t w = pattern_word(key, i);
        memcpy(buf + i * 8, &w, 8);
    }
    uint64_t tail = pattern_word(key, words);
    memcpy(buf + words * 8, &tail, nbytes % 8);
}

/* The index of the first wrong byte, or nbytes when all are right. */
static uint64_t first_wrong(const unsigned char *buf, uint64_t nbytes, uint64_t key)
{
    unsigned char expect[8];
    for (uint64_t i = 0; i < nbytes; i += 8) {
        uint64_t w = pattern_word(key, i / 8);
        memcpy(expect, &w, 8);
        uint64_t n = nbytes - i < 8 ? nbytes - i : 8;
        for (uint64_t j = 0; j < n; j++)
            if (buf[i + j] != expect[j])
                return i + j;
    }
    return nbytes;
}

/* ---- one rank --------------------------------------------------------------------------- */

typedef struct {
    plan_step plan;
    mp_op ops[MAX_STEP_OPS];
    int round;
    int refused; /* post() failed: the transport never took the ops */
} posted_step;

typedef struct {
    const config *cfg;
    mp_transport *t;
    _Atomic uint64_t *started; /* this lane's, shared by the ranks */
    pthread_mutex_t *gil; /* what the bindings hold around begin() and end(), as Python's GIL */
    _Atomic int *reported; /* failures this rank has printed */
    int lane;
    int rank;
    mp_channel_numbers numbers[MAX_RANKS]; /* per peer, on this lane */
    uint64_t steps;
    posted_step *inflight[MAX_INFLIGHT];
    int head, count;
    int corrupted;
    stats st;
} lane_ctx;

/* The first failure of a rank, in full; the peers hear of it through an abort and stop too,
 * so that the job ends soon with the cause on top. */
static void report(lane_ctx *c, const posted_step *p, const mp_op *op, const char *what)
{
    c->st.failures++;
    if (atomic_fetch_add(c->reported, 1))
        return;
    char line[MP_DETAIL_LEN + 256];
    snprintf(line, sizeof line, "rank %d lane %d round %d: the %s rank %d (%llu bytes) %s%s%s", c->rank, c->lane,
             p->round, op->kind == MP_SEND ? "send to" : "receive from", op->peer, (unsigned long long)op->nbytes,
             what, op->detail[0] ? ": " : "", op->detail);
    fprintf(stderr, "%s\n", line);
    char why[SHM_REPORT_BYTES] = "";
    mp_transport_failure_report(c->t, op, why, sizeof why);
    if (why[0])
        fprintf(stderr, "%s\n", why);
    c->t->ops->abort(c->t, MP_ERR_ABORTED, c->rank, line);
}

static void post_step(lane_ctx *c, const plan_step *plan, int round)
{
    posted_step *p = xmalloc(sizeof *p);
    memset(p, 0, sizeof *p);
    mp_step *step = xmalloc(sizeof(mp_step) + sizeof(mp_op *) * (size_t)plan->nops);
    step->more_follow = 0;
    p->plan = *plan;
    p->round = round;
    for (int i = 0; i < plan->nops; i++) {
        const plan_op *po = &plan->ops[i];
        mp_op *op = &p->ops[i];
        uint64_t nbytes = po->m.nbytes + (po->kind == MP_RECV && po->m.mismatched);
        op->kind = po->kind;
        op->label = po->kind == MP_SEND ? MP_LABEL_ISEND : MP_LABEL_IRECV;
        op->peer = op->peer_global = po->peer;
        op->lane = c->lane;
        op->nbytes = nbytes;
        op->dtype = po->m.dtype;
        op->ndim = -1;
        /* Half the large receives of ranks with an arena land in it (a burst's all): their senders
         * copy straight in. */
        mp_arena *arena = mp_shm_arena(c->t);
        char why[160];
        op->buf = po->kind == MP_RECV && arena && nbytes > c->cfg->slot_bytes && (po->m.key % 2 || po->m.burst)
                      ? mp_arena_alloc(arena, nbytes, why, sizeof why)
                      : NULL;
        if (!op->buf)
            op->buf = xmalloc(nbytes);
        if (po->kind == MP_SEND)
            fill(op->buf, nbytes, po->m.key);
        else
            memset(op->buf, 0xa5, nbytes);
        snprintf(op->call_name, sizeof op->call_name, "stress_round_%d", round);
        step->ops[i] = op;
    }
    step->lane = c->lane;
    step->nops = plan->nops;

    pthread_mutex_lock(c->gil);
    mp_transport_begin(c->t, NULL);
    for (int i = 0; i < plan->nops; i++) {
        mp_op *op = &p->ops[i];
        op->seq = mp_number_message(&c->numbers[op->peer], op->kind);
        op->step = c->steps;
    }
    c->steps++;
    pthread_mutex_unlock(c->gil);
    mp_result r = c->t->ops->post(c->t, step);
    pthread_mutex_lock(c->gil);
    mp_transport_end(c->t);
    pthread_mutex_unlock(c->gil);
    if (r != MP_OK) {
        if (!atomic_fetch_add(c->reported, 1))
            fprintf(stderr, "rank %d lane %d round %d: posting failed: %s\n", c->rank, c->lane, round,
                    mp_result_str(r));
        free(step);
        p->refused = 1;
        c->st.failures++;
    }
    c->inflight[(c->head + c->count++) % MAX_INFLIGHT] = p;
}

static mp_result expected_result(const config *cfg, const plan_op *po)
{
    if (!po->m.mismatched)
        return MP_OK;
    /* A buffered send completes before its receive looks at it. */
    int eager = po->m.nbytes <= cfg->slot_bytes && po->m.nbytes <= cfg->eager_threshold;
    return po->kind == MP_SEND && eager ? MP_OK : MP_ERR_MISMATCH;
}

static void complete_oldest(lane_ctx *c)
{
    posted_step *p = c->inflight[c->head];
    c->head = (c->head + 1) % MAX_INFLIGHT;
    c->count--;
    for (int i = 0; i < p->plan.nops && !p->refused; i++) {
        const plan_op *po = &p->plan.ops[i];
        mp_op *op = &p->ops[i];
        if (c->t->ops->wait(c->t, op, mp_now() + c->cfg->timeout, NULL) != MP_OK) {
            report(c, p, op, "is still pending at the timeout");
            c->t->ops->wait(c->t, op, mp_now() + c->cfg->timeout, NULL); /* the abort finishes it */
            continue;
        }
        mp_result expect = expected_result(c->cfg, po);
        if (op->result != expect) {
            char what[96];
            snprintf(what, sizeof what, "ended with '%s', expected '%s'", mp_result_str(op->result),
                     mp_result_str(expect));
            report(c, p, op, what);
            continue;
        }
        if (op->kind == MP_SEND)
            continue;
        c->st.messages++;
        if (po->m.mismatched) {
            c->st.mismatched++;
            continue;
        }
        c->st.bytes += op->nbytes;
        if (op->peer == c->rank)
            c->st.self++;
        else if (op->nbytes <= c->cfg->slot_bytes)
            c->st.inlined++;
        else if (mp_shm_arena(c->t) && mp_arena_holds(mp_shm_arena(c->t), op->buf, op->nbytes, &(uint64_t){0})) {
            c->st.arena++;
            c->st.burst_arena += (uint64_t)po->m.burst;
        }
        else if (mp_transport_single_copy(c->t, op->peer))
            c->st.single_copy++;
        else
            c->st.bounce++;
        if (c->cfg->corrupt && c->rank == 0 && c->lane == 0 && op->nbytes && !c->corrupted) {
            ((unsigned char *)op->buf)[op->nbytes / 2] ^= 1;
            c->corrupted = 1;
        }
        uint64_t wrong = first_wrong(op->buf, op->nbytes, po->m.key);
        if (wrong < op->nbytes) {
            char what[96];
            snprintf(what, sizeof what, "has a wrong byte at offset %llu", (unsigned long long)wrong);
            report(c, p, op, what);
        }
    }
    mp_arena *arena = mp_shm_arena(c->t);
    for (int i = 0; i < p->plan.nops; i++) {
        uint64_t off;
        if (arena && mp_arena_holds(arena, p->ops[i].buf, p->ops[i].nbytes, &off))
            mp_arena_free(arena, p->ops[i].buf);
        else
            free(p->ops[i].buf);
    }
    free(p);
}

static void *lane_main(void *arg)
{
    lane_ctx *c = arg;
    for (int round = 0; round < c->cfg->rounds && !c->st.failures; round++) {
        if (c->cfg->seconds > 0 && mp_now() - c->cfg->start > c->cfg->seconds)
            atomic_fetch_or(c->started, TIME_UP);
        if (!may_start(c->started, (uint64_t)round))
            break;
        plan_step steps[2];
        int nsteps = plan_round(c->cfg, c->lane, round, c->rank, steps);
        if (dawdles(c->cfg, c->lane, round, c->rank)) {
            usleep(25000); /* longer than the detector's first look */
            c->st.dawdles++;
        }
        for (int s = 0; s < nsteps; s++) {
            if (c->count == c->cfg->window)
                complete_oldest(c);
            post_step(c, &steps[s], round);
        }
    }
    while (c->count)
        complete_oldest(c);
    return NULL;
}

static int run_rank(const config *cfg, const char *name, int rank, _Atomic uint64_t *started, int stats_fd)
{
    mp_shm_config sc = {.name = name, .rank = rank, .size = cfg->ranks, .nlanes = NLANES, .create = rank == 0,
                        .eager_threshold = cfg->eager_threshold, .timeout = cfg->timeout, .allow_cma = rank != 1,
                        .global_rank = rank, .arena_bytes = rank % 2 == 0 ? 64u << 20 : 0};
    mp_transport *t = NULL;
    char err[512] = "";
    mp_result r = mp_shm_open(&sc, &t, err, sizeof err);
    if (r != MP_OK) {
        fprintf(stderr, "rank %d: mp_shm_open: %s: %s\n", rank, mp_result_str(r), err);
        return 1;
    }
    pthread_mutex_t gil = PTHREAD_MUTEX_INITIALIZER;
    _Atomic int reported = 0;
    lane_ctx lanes[NLANES];
    pthread_t threads[NLANES];
    for (int l = 0; l < NLANES; l++) {
        lanes[l] = (lane_ctx){.cfg = cfg, .t = t, .started = &started[l], .gil = &gil,
                              .reported = &reported, .lane = l, .rank = rank};
        if (pthread_create(&threads[l], NULL, lane_main, &lanes[l]) != 0) {
            fprintf(stderr, "rank %d: cannot start a thread\n", rank);
            return 1;
        }
    }
    stats total = {0};
    for (int l = 0; l < NLANES; l++) {
        pthread_join(threads[l], NULL);
        add_stats(&total, &lanes[l].st);
    }
    t->ops->destroy(t);
    if (write(stats_fd, &total, sizeof total) != (ssize_t)sizeof total)
        return 1;
    return total.failures ? 1 : 0;
}

/* ---- the job ---------------------------------------------------------------------------- */

static void usage(const char *argv0)
{
    fprintf(stderr,
            "usage: %s [-r ranks 2-%d] [-n most rounds per lane] [-d seconds to start rounds for] [-s seed]\n"
            "          [-e eager threshold] [-w window 1-%d] [-t wait timeout s] [-l job time limit s]\n"
            "          [-c (corrupt one received byte on rank 0)]\n",
            argv0, MAX_RANKS, MAX_INFLIGHT);
}

static int parse_args(int argc, char **argv, config *cfg)
{
    *cfg = (config){.ranks = 4, .rounds = 1000, .seed = 1, .eager_threshold = 2048, .window = 3, .timeout = 120,
                    .time_limit = 300};
    int c;
    while ((c = getopt(argc, argv, "r:n:d:s:e:w:t:l:c")) != -1) {
        switch (c) {
        case 'r': cfg->ranks = atoi(optarg); break;
        case 'n': cfg->rounds = atoi(optarg); break;
        case 'd': cfg->seconds = atof(optarg); break;
        case 's': cfg->seed = strtoull(optarg, NULL, 0); break;
        case 'e': cfg->eager_threshold = strtoull(optarg, NULL, 0); break;
        case 'w': cfg->window = atoi(optarg); break;
        case 't': cfg->timeout = atof(optarg); break;
        case 'l': cfg->time_limit = atof(optarg); break;
        case 'c': cfg->corrupt = 1; break;
        default: return -1;
        }
    }
    if (optind != argc || cfg->ranks < 2 || cfg->ranks > MAX_RANKS || cfg->rounds < 1 || cfg->window < 1 ||
        cfg->window > MAX_INFLIGHT || cfg->eager_threshold > MP_SHM_MAX_EAGER || cfg->timeout <= 0 ||
        cfg->time_limit <= 0 || cfg->seconds < 0)
        return -1;
    shm_layout lay;
    shm_layout_compute(cfg->ranks, NLANES, cfg->eager_threshold, &lay);
    cfg->slot_bytes = lay.slot_bytes;
    return 0;
}

static volatile sig_atomic_t out_of_time;
static void on_alarm(int sig) { (void)sig; out_of_time = 1; }

int main(int argc, char **argv)
{
    config cfg;
    if (parse_args(argc, argv, &cfg) < 0) {
        usage(argv[0]);
        return 2;
    }
    char name[MP_SHM_NAME_LEN];
    int pipefd[2];
    _Atomic uint64_t *started = mmap(NULL, NLANES * sizeof *started, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                                     -1, 0);
    if (mp_shm_new_name(name, sizeof name) != 0 || pipe(pipefd) != 0 || started == MAP_FAILED) {
        perror("setup");
        return 1;
    }
    cfg.start = mp_now();
    pid_t pids[MAX_RANKS];
    for (int r = 0; r < cfg.ranks; r++) {
        pids[r] = fork();
        if (pids[r] < 0) {
            perror("fork");
            return 1;
        }
        if (pids[r] == 0) {
            close(pipefd[0]);
            exit(run_rank(&cfg, name, r, started, pipefd[1]));
        }
    }
    close(pipefd[1]);
    struct sigaction sa = {.sa_handler = on_alarm}; /* no SA_RESTART: waitpid returns at the limit */
    sigaction(SIGALRM, &sa, NULL);
    alarm((unsigned)cfg.time_limit + 1);

    int status = 0, left = cfg.ranks;
    while (left > 0) {
        int ws;
        pid_t pid = waitpid(-1, &ws, 0);
        if (pid < 0 && errno == EINTR && out_of_time) {
            fprintf(stderr, "the job ran past its limit of %.0f s; killing the ranks\n", cfg.time_limit);
            for (int r = 0; r < cfg.ranks; r++)
                kill(pids[r], SIGKILL);
            while (waitpid(-1, NULL, 0) > 0)
                ;
            shm_unlink(name);
            return 3;
        }
        if (pid < 0)
            break;
        left--;
        int code = WIFEXITED(ws) ? WEXITSTATUS(ws) : 128 + WTERMSIG(ws);
        if (code && status <= 1)
            status = code; /* a sanitizer's code or a signal says more than a peer's plain failure */
    }
    stats total = {0}, s;
    while (read(pipefd[0], &s, sizeof s) == (ssize_t)sizeof s)
        add_stats(&total, &s);
    uint64_t rounds = 0;
    for (int l = 0; l < NLANES; l++)
        rounds += atomic_load(&started[l]) & ~TIME_UP;
    printf("seed=%llu ranks=%d lanes=%d rounds=%llu messages=%llu inline=%llu single_copy=%llu bounce=%llu arena=%llu "
           "burst_arena=%llu self=%llu mismatched=%llu dawdles=%llu mib=%.1f failures=%llu seconds=%.1f\n",
           (unsigned long long)cfg.seed, cfg.ranks, NLANES, (unsigned long long)rounds,
           (unsigned long long)total.messages, (unsigned long long)total.inlined, (unsigned long long)total.single_copy,
           (unsigned long long)total.bounce, (unsigned long long)total.arena,
           (unsigned long long)total.burst_arena, (unsigned long long)total.self, (unsigned long long)total.mismatched,
           (unsigned long long)total.dawdles, (double)total.bytes / (1 << 20), (unsigned long long)total.failures,
           mp_now() - cfg.start);
    return status;
}
