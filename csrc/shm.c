/* The shm transport's engine. Posted ops belong to the engine: whoever holds `engine` matches,
 * copies and completes them. That is the progress thread, so ops progress while Python
 * computes, or the caller's own thread while it posts or waits, so a waiting rank reacts
 * without a futex wake on its critical path. */
#include "shm.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/uio.h>
#include <unistd.h>

#include "arena.h"
#include "clock.h"
#include "dtype.h"
#include "shm_corrupt.h"
#include "shm_deadlock.h"
#include "shm_segment.h"

#define SPIN_SECONDS 20e-6     /* the progress thread busy-polls this long after activity */
/* A thread waiting on an op polls longer: its peer's reply is usually one Python call away,
 * and a futex sleep and wake cost tens of microseconds on a VM. */
#define DRIVE_SPIN_SECONDS 100e-6
#define DRIVE_YIELD_AFTER 5e-6
#define LIVENESS_PERIOD 0.05   /* how often peers' liveness is checked */
#define CMA_CHUNK (4u << 20)   /* one process_vm_readv call; large single calls are slow */
#define COPY_CHUNK (16u << 20) /* bytes one op copies per pass, so ops on other lanes interleave */
/* A wait blocked this long publishes its pending ops and looks for a wait-for cycle, once per
 * period; a cycle seen in two rounds in a row, with nothing in it moved, is a deadlock. */
#define WATCH_AFTER 20e-3
#define WATCH_PERIOD 20e-3
/* No process's buffer reaches past this address (x86-64's and arm64's user space): a sender's
 * [addr, addr + nbytes) beyond it is garbage, not a message. */
#define USER_SPACE_END (1ull << 48)
#define MAX_THREADS_IN_WAIT (1u << 16) /* a bound on a rank's `driving` and `waiting` counts */
#define EXIT_GRACE 0.2 /* seconds from a process unmapping its memory to its exit, at most */

enum { PH_NEW = 0, PH_ARENA, PH_STREAM, PH_WAIT_DONE, PH_COPY_CMA, PH_COPY_BOUNCE, PH_SKIP };
/* mp_op.offered of a receive: whether it has told its sender where its buffer is. */
enum { OFFER_NONE = 0, OFFER_MADE, OFFER_DECLINED };
#define NO_OFFER UINT64_MAX /* shm_offer.offset of a receive whose buffer is not in the arena */


/* This process's view of a channel: sender fields for (lane, me -> peer), receiver fields for
 * (lane, peer -> me). */
typedef struct {
    uint64_t published;  /* sends whose descriptor is out */
    uint64_t bounced;    /* sends published for the bounce buffer */
    uint64_t streamed;   /* of those, the ones fully written to it */
    uint64_t chunks_out; /* bounce chunks produced */
    uint64_t recv_next;  /* the next receive to serve: receives finish in order */
    uint64_t chunks_in;  /* bounce chunks consumed */
    uint64_t copy_addr;  /* the sender's buffer of the receive being copied (one at a time) */
    /* The peer's counters as last read: they never go back. */
    uint64_t done_seen, consumed_seen, posted_seen, produced_seen, active_seen;
    /* Sender side: the channel's inline slots and bounce chunks are backed by memory (the
     * segment is sparse; see shm_segment_commit). */
    uint8_t inline_committed, bounce_committed;
} chan_local;

typedef struct {
    mp_step *head, *tail;
} step_queue;

typedef struct {
    mp_transport base;
    shm_view v;
    uint64_t eager_threshold;
    int *pidfds;      /* per peer, -1 where pidfd_open is unavailable */
    pid_t *pids;
    chan_local *out;  /* [lane][peer] */
    chan_local *in;   /* [lane][peer] */
    step_queue *lanes;
    uint64_t probe_word;
    mp_arena *arena;          /* this rank's receive arena (a reference), or NULL */
    char **peer_arenas;       /* per peer: its arena as mapped here, or NULL */
    _Atomic uint64_t received[MP_SHM_NPATHS]; /* messages received by each path */
    uint64_t *peer_arena_bytes;

    pthread_t thread;
    int thread_started;
    pthread_mutex_t engine; /* guards lanes, out, in, failed: the engine state */
    pthread_mutex_t lock;   /* guards `incoming` and `stop` */
    step_queue incoming;
    int stop;

    _Atomic uint32_t completions; /* futex word for waiters in this process */
    _Atomic uint32_t waiters;
    _Atomic uint32_t watching; /* threads in a published wait (mirrors my shm_rank.waiting) */
    _Atomic uint32_t driving;  /* threads progressing from a wait (mirrors my shm_rank.driving) */
    _Atomic int corrupt;       /* 0; 1 while corrupt_why is written; 2 once it is final */
    char corrupt_why[MP_DETAIL_LEN]; /* the first impossible value this rank read from the segment */
    int failed; /* abort or own fence seen, everything failed */

    /* Guarded by `lock`. A rank whose ops come from several threads may post more while one
     * of them waits (another may be computing): its waits never count as blocked. */
    pthread_t poster;
    int posters; /* 0, 1, or 2 for several */
} shm_t;

/* Between begin() and end() a posting thread collects the peers its own passes would wake and
 * wakes each once at end(): a futex wake costs microseconds, and one exchange often sends twice
 * to the same peer. Per thread, since several threads may post to one communicator at once. */
static _Thread_local struct {
    const void *in_call; /* the transport between its begin() and end() on this thread */
    int deferring;       /* this thread's engine passes inside that call */
    int n;
    int peers[4];
} deferred_wakes;

static shm_t *as_shm(mp_transport *t) { return (shm_t *)t; }
static shm_rank *my_slot(shm_t *s) { return shm_rank_at(&s->v, s->base.rank); }

static void ring(shm_t *s, int rank)
{
    shm_rank *r = shm_rank_at(&s->v, rank);
    atomic_fetch_add(&r->bell, 1);
    if (atomic_load(&r->sleeping) && !atomic_load(&r->driving))
        mp_futex_wake(&r->bell, 1);
}

/* News for the peer of an op, from the engine. This process's own news is seen by the engine
 * holder, which passes again whenever a pass moved anything. */
static void ring_peer(shm_t *s, const mp_op *op)
{
    if (op->peer == s->base.rank)
        return;
    if (deferred_wakes.deferring) {
        for (int i = 0; i < deferred_wakes.n; i++)
            if (deferred_wakes.peers[i] == op->peer)
                return;
        if (deferred_wakes.n < (int)(sizeof deferred_wakes.peers / sizeof *deferred_wakes.peers)) {
            deferred_wakes.peers[deferred_wakes.n++] = op->peer;
            return;
        }
    }
    ring(s, op->peer);
}

static void shm_abort(mp_transport *t, mp_result cause, int rank, const char *why);

/* A value read from the segment that no valid state holds: another process wrote garbage there.
 * The first one is kept and the communicator aborted, so that the peers fail too. Returns 1: the
 * engine's next pass fails everything pending. */
static int found_corrupt(shm_t *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static int found_corrupt(shm_t *s, const char *fmt, ...)
{
    int none = 0;
    if (atomic_compare_exchange_strong(&s->corrupt, &none, 1)) {
        int n = snprintf(s->corrupt_why, sizeof s->corrupt_why, "corrupt segment: ");
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(s->corrupt_why + n, sizeof s->corrupt_why - (size_t)n, fmt, ap);
        va_end(ap);
        atomic_store_explicit(&s->corrupt, 2, memory_order_release);
        shm_abort(&s->base, MP_ERR_CORRUPT, s->base.rank, s->corrupt_why);
    }
    return 1;
}

/* Reads a counter the peer of `op` advances on their channel: it never goes back, and never
 * passes `limit`, what this rank has made possible (or, with `limit_word`, what the peer has
 * issued, read after it). Returns 0, or -1 once the segment is reported corrupt. */
static int read_counter(shm_t *s, const mp_op *op, _Atomic uint64_t *word, const char *name, uint64_t *seen,
                        _Atomic uint64_t *limit_word, uint64_t limit, uint64_t *out)
{
    uint64_t v = atomic_load_explicit(word, memory_order_acquire);
    if (limit_word)
        limit = atomic_load_explicit(limit_word, memory_order_acquire);
    if (v < *seen || v > limit) {
        found_corrupt(s, "%s = %llu on lane %d %s rank %d, outside [%llu, %llu]", name, (unsigned long long)v,
                      op->lane, op->kind == MP_SEND ? "to" : "from", op->peer_global, (unsigned long long)*seen,
                      (unsigned long long)limit);
        return -1;
    }
    *seen = v;
    *out = v;
    return 0;
}

/* ---- completion ---------------------------------------------------------------------- */

/* An op's own work is over. The host sees a step's ops complete together, as NCCL completes a
 * group's (a receive whose group still sends is not done): a success waits for the step's last
 * op; a failure shows at once. Once DONE a Request may be freed at any moment. */
static void finish(shm_t *s, mp_step *step, mp_op *op, mp_result r)
{
    if (op->offered == OFFER_MADE && r != MP_OK)
        mp_arena_quarantine(s->arena, op->buf); /* its sender may still be writing into it */
    step->ops[op->index] = NULL;
    op->result = r;
    if (--step->remaining > 0 && r == MP_OK) {
        op->next_settled = step->settled;
        step->settled = op;
        return;
    }
    atomic_store_explicit(&op->state, MP_OP_DONE, memory_order_release);
    if (step->remaining == 0)
        for (mp_op *o = step->settled, *next; o; o = next) {
            next = o->next_settled; /* read before DONE: the op may be freed from then on */
            atomic_store_explicit(&o->state, MP_OP_DONE, memory_order_release);
        }
    atomic_fetch_add(&s->completions, 1);
    if (atomic_load(&s->waiters))
        mp_futex_wake(&s->completions, 0);
}

static void fail_step(shm_t *s, mp_step *step, mp_result r, const char *why)
{
    for (int i = 0; i < step->nops; i++) {
        mp_op *op = step->ops[i];
        if (!op)
            continue;
        snprintf(op->detail, sizeof op->detail, "%s", why);
        finish(s, step, op, r);
    }
}

static void describe_cause(shm_t *s, mp_result cause, int rank, char *buf, size_t len)
{
    if (cause == MP_ERR_CORRUPT && rank == s->base.rank && atomic_load(&s->corrupt)) {
        int final = atomic_load_explicit(&s->corrupt, memory_order_acquire) == 2;
        snprintf(buf, len, "%s", final ? s->corrupt_why : "corrupt segment");
        return;
    }
    switch (cause) {
    case MP_ERR_TIMEOUT:
        snprintf(buf, len, "communicator aborted: rank %d timed out waiting for its ops", rank);
        break;
    case MP_ERR_PEER_DEAD:
        snprintf(buf, len, "communicator aborted: rank %d (pid %d) exited", rank,
                 rank >= 0 && rank < s->base.size ? (int)s->pids[rank] : -1);
        break;
    case MP_ERR_CLOSED:
        snprintf(buf, len, "communicator aborted: rank %d closed it with ops pending", rank);
        break;
    case MP_ERR_DEADLOCK:
        snprintf(buf, len, "this rank is in a wait-for cycle that can never resolve (the deadlock report follows)");
        break;
    default: {
        shm_header *h = shm_hdr(&s->v);
        int told = atomic_load_explicit(&h->abort_why_ready, memory_order_acquire);
        /* The reason lands just after the cause, and the segment may hold garbage there: a
         * corrupt segment is named whatever the text says. */
        const char *why = told ? h->abort_why : "";
        const char *named = cause == MP_ERR_CORRUPT && strncmp(why, "corrupt segment", 15) != 0 ? "corrupt segment" : "";
        snprintf(buf, len, "communicator aborted by rank %d (%s)%s%s%s%.*s", rank, mp_result_str(cause),
                 named[0] || why[0] ? ": " : "", named, named[0] && why[0] ? "; " : "", (int)sizeof h->abort_why, why);
        break;
    }
    }
}

static void free_queue(step_queue *q)
{
    mp_step *st = q->head;
    while (st) {
        mp_step *next = st->next;
        free(st);
        st = next;
    }
    q->head = q->tail = NULL;
}

static void fail_queue(shm_t *s, step_queue *q, mp_result r, const char *why)
{
    for (mp_step *st = q->head; st; st = st->next)
        fail_step(s, st, r, why);
    free_queue(q);
}

/* ---- sends ------------------------------------------------------------------------------ */


/* Backs a region of the channel with memory before its first write; a /dev/shm without room is
 * an error of this send (and an abort, so that its receiver fails too), not a SIGBUS. */
static int commit_region(shm_t *s, mp_step *step, mp_op *op, uint8_t *committed, char *addr, uint64_t len,
                         const char *what)
{
    if (*committed)
        return 0;
    int e = shm_segment_commit(addr, len);
    if (!e) {
        *committed = 1;
        return 0;
    }
    snprintf(op->detail, sizeof op->detail, "/dev/shm has %.1f MiB free, too little for the %s of the channel to "
             "rank %d (%.1f MiB; %s); give /dev/shm more space (in a container, --shm-size)", shm_free_mib(), what,
             op->peer_global, (double)len / 1048576.0, e == EFAULT ? "the kernel could not back it" : strerror(e));
    shm_abort(&s->base, MP_ERR_SYSTEM, s->base.rank, op->detail);
    finish(s, step, op, MP_ERR_SYSTEM);
    return -1;
}

/* Fills message op->seq's descriptor and publishes it to the receiver. */
static void post_descriptor(shm_t *s, mp_op *op, uint32_t c, shm_chan *ch, chan_local *cl, uint32_t path)
{
    shm_slot *sl = &ch->slots[op->seq % SHM_NSLOTS];
    sl->nbytes = op->nbytes;
    sl->dtype = op->dtype;
    sl->label = (uint32_t)op->label;
    sl->addr = (uint64_t)(uintptr_t)op->buf;
    sl->result = MP_OK;
    sl->path = path;
    if (path == SHM_PATH_INLINE && op->nbytes)
        memcpy(shm_inline_at(&s->v, c, op->seq), op->buf, op->nbytes);
    atomic_store_explicit(&ch->posted, op->seq + 1, memory_order_release);
    cl->published = op->seq + 1;
    /* A receiver that has not issued this receive yet finds the descriptor when it does (its
     * post passes the engine after raising recv_issued; the fences pair), so it needs no wake:
     * a futex wake costs microseconds, and a peer that is computing has no use for it. */
    atomic_thread_fence(memory_order_seq_cst);
    if (atomic_load_explicit(&ch->recv_issued, memory_order_relaxed) > op->seq)
        ring_peer(s, op);
}

/* For a send too large for its slot, to a peer with an arena: 1 when the receiver offered a
 * buffer for exactly this message (op->remote is set), 0 to take the usual path, -1 to wait for
 * the receive's answer, -2 once the segment is reported corrupt. */
static int take_offer(shm_t *s, mp_op *op, shm_chan *ch, chan_local *cl)
{
    uint64_t active; /* read first: a receive answers before it is made active */
    if (read_counter(s, op, &ch->recv_posted, "recv_posted", &cl->active_seen, &ch->recv_issued, 0, &active) < 0)
        return -2;
    shm_offer *o = &ch->offers[op->seq % SHM_NSLOTS];
    atomic_thread_fence(memory_order_seq_cst); /* after send_issued, before the answer: see answer() */
    if (atomic_load_explicit(&o->seq, memory_order_acquire) != op->seq + 1)
        return active > op->seq || op->nbytes < MP_SHM_OFFER_WAIT_BYTES ? 0 : -1;
    uint64_t offset = o->offset, nbytes = o->nbytes;
    int32_t dtype = o->dtype;
    atomic_thread_fence(memory_order_acquire);
    if (atomic_load_explicit(&o->seq, memory_order_relaxed) != op->seq + 1 || offset == NO_OFFER ||
        nbytes != op->nbytes || dtype != op->dtype)
        return 0; /* rewritten meanwhile, declined, or the receiver expects another message: it says so */
    uint64_t limit = s->peer_arena_bytes[op->peer];
    if (offset > limit || nbytes > limit - offset) {
        found_corrupt(s, "arena offer for message #%llu to rank %d: offset %#llx + nbytes %llu is beyond its arena "
                      "of %llu bytes", (unsigned long long)op->seq, op->peer_global, (unsigned long long)offset,
                      (unsigned long long)nbytes, (unsigned long long)limit);
        return -2;
    }
    op->remote = s->peer_arenas[op->peer] + offset;
    return 1;
}

static int publish_send(shm_t *s, mp_step *step, mp_op *op, uint32_t c, shm_chan *ch, chan_local *cl)
{
    if (cl->published != op->seq)
        return 0; /* an earlier send on this channel goes first */
    uint64_t done;
    if (read_counter(s, op, &ch->done, "done", &cl->done_seen, NULL, cl->published, &done) < 0)
        return 1;
    if (done + SHM_NSLOTS <= op->seq)
        return 0; /* every descriptor slot still holds an unfinished message */
    int large = op->nbytes > s->v.lay.slot_bytes;
    if (large && s->peer_arenas[op->peer]) {
        int offered = take_offer(s, op, ch, cl);
        if (offered == -2)
            return 1;
        if (offered < 0)
            return 0;
        if (offered) {
            atomic_store_explicit(&op->matched, 1, memory_order_relaxed);
            op->phase = PH_ARENA;
            op->progress = 0;
            return 1;
        }
    }
    uint8_t single_copy =
        large ? atomic_load_explicit(shm_cma_at(&s->v, op->peer, s->base.rank), memory_order_relaxed) : 0;
    if (single_copy > 1)
        return found_corrupt(s, "single-copy flag of rank %d for this rank = %u", op->peer_global, single_copy);
    int backed = !large ? !op->nbytes || commit_region(s, step, op, &cl->inline_committed, shm_inline_at(&s->v, c, 0),
                                                       (uint64_t)SHM_NSLOTS * s->v.lay.slot_bytes, "inline slots") == 0
                        : single_copy || commit_region(s, step, op, &cl->bounce_committed, shm_chunk_at(&s->v, c, 0),
                                                       (uint64_t)SHM_NCHUNKS * s->v.lay.chunk_bytes, "bounce buffer") == 0;
    if (!backed)
        return 1;
    uint32_t path = !large ? SHM_PATH_INLINE : single_copy ? SHM_PATH_CMA : SHM_PATH_BOUNCE;
    post_descriptor(s, op, c, ch, cl, path);
    if (path == SHM_PATH_INLINE && op->nbytes <= s->eager_threshold) {
        finish(s, step, op, MP_OK); /* buffered: completes without the receive */
        return 1;
    }
    if (path == SHM_PATH_BOUNCE) {
        op->stream_index = cl->bounced++;
        op->phase = PH_STREAM;
    } else {
        op->phase = PH_WAIT_DONE;
    }
    return 1;
}

/* The one copy of an arena send: straight into the receiver's buffer, a slice per pass so that
 * ops on other lanes interleave; then the descriptor says the bytes are there. */
static int copy_to_arena(shm_t *s, mp_op *op, uint32_t c, shm_chan *ch, chan_local *cl)
{
    uint64_t n = op->nbytes - op->progress < COPY_CHUNK ? op->nbytes - op->progress : COPY_CHUNK;
    memcpy((char *)op->remote + op->progress, (const char *)op->buf + op->progress, n);
    op->progress += n;
    if (op->progress == op->nbytes) {
        post_descriptor(s, op, c, ch, cl, SHM_PATH_ARENA);
        op->phase = PH_WAIT_DONE;
    }
    return 1;
}

static int stream_send(shm_t *s, mp_op *op, uint32_t c, shm_chan *ch, chan_local *cl)
{
    if (cl->streamed != op->stream_index)
        return 0; /* the bounce buffer carries one message at a time, in order */
    uint64_t chunk = s->v.lay.chunk_bytes;
    int moved = 0;
    uint64_t consumed;
    while (op->progress < op->nbytes) {
        if (read_counter(s, op, &ch->consumed, "consumed", &cl->consumed_seen, NULL, cl->chunks_out, &consumed) < 0)
            return 1;
        if (cl->chunks_out - consumed >= SHM_NCHUNKS)
            break;
        uint64_t n = op->nbytes - op->progress < chunk ? op->nbytes - op->progress : chunk;
        memcpy(shm_chunk_at(&s->v, c, cl->chunks_out), (char *)op->buf + op->progress, n);
        op->progress += n;
        cl->chunks_out++;
        atomic_store_explicit(&ch->produced, cl->chunks_out, memory_order_release);
        moved = 1;
    }
    if (moved)
        ring_peer(s, op);
    if (op->progress == op->nbytes) {
        cl->streamed++;
        op->phase = PH_WAIT_DONE;
        moved = 1;
    }
    return moved;
}

static int progress_send(shm_t *s, mp_step *step, mp_op *op)
{
    uint32_t c = shm_chan_index(&s->v, op->lane, s->base.rank, op->peer);
    shm_chan *ch = shm_chan_at(&s->v, c);
    chan_local *cl = &s->out[op->lane * s->base.size + op->peer];
    int moved = 0;
    if (op->phase == PH_NEW) {
        int index = op->index;
        moved = publish_send(s, step, op, c, ch, cl);
        if (!step->ops[index])
            return moved; /* finished as an eager send */
    }
    if (op->phase == PH_ARENA)
        moved |= copy_to_arena(s, op, c, ch, cl);
    if (op->phase == PH_STREAM)
        moved |= stream_send(s, op, c, ch, cl);
    uint64_t done = 0;
    if (op->phase == PH_WAIT_DONE &&
        read_counter(s, op, &ch->done, "done", &cl->done_seen, NULL, cl->published, &done) < 0)
        return 1;
    if (op->phase == PH_WAIT_DONE && done > op->seq) {
        shm_slot *sl = &ch->slots[op->seq % SHM_NSLOTS];
        uint32_t result = sl->result;
        int32_t recv_dtype = sl->recv_dtype;
        uint32_t recv_label = sl->recv_label;
        /* What a receiver writes: its copy's outcome, and on a mismatch what it expected. */
        if (result != MP_OK && result != MP_ERR_MISMATCH && result != MP_ERR_SYSTEM && result != MP_ERR_PEER_DEAD)
            return found_corrupt(s, "result of message #%llu to rank %d = %u", (unsigned long long)op->seq,
                                 op->peer_global, result);
        if (result == MP_ERR_MISMATCH && (recv_dtype < 0 || recv_dtype >= MP_NUM_DTYPES || recv_label >= MP_NUM_LABELS))
            return found_corrupt(s, "receiver's dtype %d / label %u of message #%llu to rank %d", recv_dtype,
                                 recv_label, (unsigned long long)op->seq, op->peer_global);
        /* A receiver that expects exactly what was sent saw another descriptor than this rank wrote. */
        if (result == MP_ERR_MISMATCH && sl->recv_nbytes == op->nbytes && recv_dtype == op->dtype)
            return found_corrupt(s, "descriptor of message #%llu to rank %d: nbytes or dtype changed after this rank "
                                 "wrote %llu bytes of %s (the receiver expects those, and read others)",
                                 (unsigned long long)op->seq, op->peer_global, (unsigned long long)op->nbytes,
                                 mp_dtype_name(op->dtype));
        mp_result r = (mp_result)result;
        if (r == MP_ERR_MISMATCH)
            snprintf(op->detail, sizeof op->detail,
                     "rank %d's %s expects %llu bytes of %s; this rank sent %llu bytes of %s", op->peer_global,
                     mp_label_name((mp_label)recv_label), (unsigned long long)sl->recv_nbytes,
                     mp_dtype_name(recv_dtype), (unsigned long long)op->nbytes, mp_dtype_name(op->dtype));
        else if (r != MP_OK)
            snprintf(op->detail, sizeof op->detail, "%s to rank %d failed at the receiver: %s",
                     mp_label_name(op->label), op->peer_global, mp_result_str(r));
        finish(s, step, op, r);
        moved = 1;
    }
    return moved;
}

/* ---- receives --------------------------------------------------------------------------- */

static void recv_done(shm_t *s, mp_step *step, mp_op *op, shm_chan *ch, chan_local *cl, mp_result r)
{
    shm_slot *sl = &ch->slots[op->seq % SHM_NSLOTS];
    sl->result = (uint32_t)r;
    cl->recv_next++;
    atomic_store_explicit(&ch->done, cl->recv_next, memory_order_release);
    ring_peer(s, op);
    finish(s, step, op, r);
}

static int start_recv(shm_t *s, mp_step *step, mp_op *op, uint32_t c, shm_chan *ch, chan_local *cl)
{
    if (cl->recv_next != op->seq)
        return 0;
    uint64_t posted;
    if (read_counter(s, op, &ch->posted, "posted", &cl->posted_seen, &ch->send_issued, 0, &posted) < 0)
        return 1;
    if (posted <= op->seq)
        return 0;
    shm_slot *sl = &ch->slots[op->seq % SHM_NSLOTS];
    /* Everything in the slot is the peer's word, read once and checked before it sizes a copy. */
    uint64_t nbytes = sl->nbytes, addr = sl->addr;
    int32_t dtype = sl->dtype;
    uint32_t path = sl->path, label = sl->label;
    int offered = op->offered == OFFER_MADE;
    op->offered = OFFER_NONE; /* the sender has chosen: it writes into the buffer no more */
    int copies = path == SHM_PATH_CMA || path == SHM_PATH_BOUNCE;
    const char *bad = path > SHM_PATH_ARENA                                            ? "path"
                    : dtype < 0 || dtype >= MP_NUM_DTYPES                               ? "dtype"
                    : label >= MP_NUM_LABELS                                            ? "label"
                    : (path == SHM_PATH_INLINE) != (nbytes <= s->v.lay.slot_bytes) || nbytes >= USER_SPACE_END
                        ? "nbytes"
                    : path == SHM_PATH_ARENA && (!offered || nbytes != op->nbytes || dtype != op->dtype)
                        ? "path (the arena holds no message of this receive)"
                    : copies && (addr >= USER_SPACE_END || nbytes > USER_SPACE_END - addr) ? "addr"
                                                                                          : NULL;
    if (bad)
        return found_corrupt(s, "descriptor of message #%llu from rank %d: %s (path %u, %llu bytes of dtype %d at "
                             "%#llx, label %u)", (unsigned long long)op->seq, op->peer_global, bad, path,
                             (unsigned long long)nbytes, dtype, (unsigned long long)addr, label);
    if (nbytes != op->nbytes || dtype != op->dtype) {
        sl->recv_nbytes = op->nbytes;
        sl->recv_dtype = op->dtype;
        sl->recv_label = (uint32_t)op->label;
        snprintf(op->detail, sizeof op->detail, "rank %d's %s sent %llu bytes of %s; this rank expects %llu bytes of %s",
                 op->peer_global, mp_label_name((mp_label)label), (unsigned long long)nbytes,
                 mp_dtype_name(dtype), (unsigned long long)op->nbytes, mp_dtype_name(op->dtype));
        if (path == SHM_PATH_BOUNCE) {
            op->phase = PH_SKIP; /* drain the sender's chunks so the channel stays in step */
            op->progress = 0;
            op->skip_total = nbytes;
            return 1;
        }
        recv_done(s, step, op, ch, cl, MP_ERR_MISMATCH);
        return 1;
    }
    atomic_store_explicit(&op->matched, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&s->received[path], 1, memory_order_relaxed);
    if (path == SHM_PATH_INLINE || path == SHM_PATH_ARENA) {
        if (path == SHM_PATH_INLINE && nbytes)
            memcpy(op->buf, shm_inline_at(&s->v, c, op->seq), nbytes);
        recv_done(s, step, op, ch, cl, MP_OK);
        return 1;
    }
    op->phase = path == SHM_PATH_CMA ? PH_COPY_CMA : PH_COPY_BOUNCE;
    op->progress = 0;
    cl->copy_addr = addr;
    return 1;
}

static void shm_abort(mp_transport *t, mp_result cause, int rank, const char *why);

/* Whether peer `r`'s process has exited: its pidfd is readable, or its pid is gone. */
static int peer_exited(shm_t *s, int r)
{
    if (s->pidfds[r] >= 0) {
        struct pollfd p = {s->pidfds[r], POLLIN, 0};
        return poll(&p, 1, 0) > 0;
    }
    return kill(s->pids[r], 0) != 0 && errno == ESRCH;
}

/* A single-copy read that failed: ESRCH (the sender is gone) and EFAULT (its buffer is no longer
 * mapped, as while it exits) are the sender's failure, and the communicator is aborted when
 * it has exited; anything else is this rank's own. */
static mp_result cma_failure(shm_t *s, const mp_op *op, int err, char *detail, size_t len)
{
    if (err != ESRCH && err != EFAULT) {
        snprintf(detail, len, "%s from rank %d: single-copy read failed: %s", mp_label_name(op->label),
                 op->peer_global, err ? strerror(err) : "no bytes");
        return MP_ERR_SYSTEM;
    }
    int exited = err == ESRCH || peer_exited(s, op->peer);
    snprintf(detail, len, "the sender, rank %d (pid %d), %s during the single-copy read (%s)", op->peer_global,
             (int)s->pids[op->peer], exited ? "exited" : "unmapped its buffer, as a process does while it exits",
             strerror(err));
    if (exited)
        shm_abort(&s->base, MP_ERR_PEER_DEAD, op->peer, NULL);
    return MP_ERR_PEER_DEAD;
}

/* Whether peer `r` exits within EXIT_GRACE: a process unmaps its memory just before it is gone,
 * so a read that faults on a live peer's buffer is told from one that raced its exit. */
static int exits_soon(shm_t *s, int r)
{
    for (double until = mp_now() + EXIT_GRACE; !peer_exited(s, r); usleep(1000))
        if (mp_now() > until)
            return 0;
    return 1;
}

static int copy_cma(shm_t *s, mp_step *step, mp_op *op, shm_chan *ch, chan_local *cl)
{
    uint64_t budget = COPY_CHUNK;
    while (op->progress < op->nbytes && budget) {
        uint64_t n = op->nbytes - op->progress;
        if (n > CMA_CHUNK)
            n = CMA_CHUNK;
        struct iovec local = {(char *)op->buf + op->progress, n};
        struct iovec remote = {(void *)(uintptr_t)(cl->copy_addr + op->progress), n};
        ssize_t got = process_vm_readv(s->pids[op->peer], &local, 1, &remote, 1, 0);
        int err = got < 0 ? errno : 0;
        if (err == EFAULT && !exits_soon(s, op->peer))
            return found_corrupt(s, "descriptor of message #%llu from rank %d: addr %#llx (%llu bytes) is not mapped "
                                 "in its process, which lives on", (unsigned long long)op->seq, op->peer_global,
                                 (unsigned long long)cl->copy_addr, (unsigned long long)op->nbytes);
        if (got <= 0) {
            mp_result r = cma_failure(s, op, err, op->detail, sizeof op->detail);
            recv_done(s, step, op, ch, cl, r);
            return 1;
        }
        op->progress += (uint64_t)got;
        budget = budget > (uint64_t)got ? budget - (uint64_t)got : 0;
    }
    if (op->progress == op->nbytes)
        recv_done(s, step, op, ch, cl, MP_OK);
    return 1;
}

static int copy_bounce(shm_t *s, mp_step *step, mp_op *op, uint32_t c, shm_chan *ch, chan_local *cl, int skip)
{
    uint64_t chunk = s->v.lay.chunk_bytes;
    uint64_t total = skip ? op->skip_total : op->nbytes;
    int moved = 0;
    uint64_t produced;
    while (op->progress < total) {
        if (read_counter(s, op, &ch->produced, "produced", &cl->produced_seen, NULL, cl->chunks_in + SHM_NCHUNKS,
                         &produced) < 0)
            return 1;
        if (produced <= cl->chunks_in)
            break;
        uint64_t n = total - op->progress < chunk ? total - op->progress : chunk;
        if (!skip)
            memcpy((char *)op->buf + op->progress, shm_chunk_at(&s->v, c, cl->chunks_in), n);
        op->progress += n;
        cl->chunks_in++;
        atomic_store_explicit(&ch->consumed, cl->chunks_in, memory_order_release);
        moved = 1;
    }
    if (moved)
        ring_peer(s, op);
    if (op->progress == total) {
        recv_done(s, step, op, ch, cl, skip ? MP_ERR_MISMATCH : MP_OK);
        moved = 1;
    }
    return moved;
}

static int progress_recv(shm_t *s, mp_step *step, mp_op *op)
{
    uint32_t c = shm_chan_index(&s->v, op->lane, op->peer, s->base.rank);
    shm_chan *ch = shm_chan_at(&s->v, c);
    chan_local *cl = &s->in[op->lane * s->base.size + op->peer];
    if (op->phase == PH_NEW)
        return start_recv(s, step, op, c, ch, cl);
    if (op->phase == PH_SKIP)
        return copy_bounce(s, step, op, c, ch, cl, 1);
    if (op->phase == PH_COPY_CMA)
        return copy_cma(s, step, op, ch, cl);
    return copy_bounce(s, step, op, c, ch, cl, 0);
}

/* ---- the progress loop ------------------------------------------------------------------ */

/* A large receive on a rank with an arena tells its sender whether its buffer lies there, in
 * the channel's offer slot for its message: when it is posted if the slot is free (the sender
 * has published the message that used it last), else when it becomes active. An activation
 * that races a later receive's answer may overwrite it with its own stale one; the sender of
 * that later message then finds no answer and takes the usual path. */
static void answer(shm_t *s, mp_op *op, shm_chan *ch)
{
    if (!s->arena || op->nbytes <= s->v.lay.slot_bytes)
        return;
    uint64_t offset;
    int in_arena = mp_arena_holds(s->arena, op->buf, op->nbytes, &offset);
    shm_offer *o = &ch->offers[op->seq % SHM_NSLOTS];
    o->offset = in_arena ? offset : NO_OFFER;
    o->nbytes = op->nbytes;
    o->dtype = op->dtype;
    op->offered = in_arena ? OFFER_MADE : OFFER_DECLINED;
    atomic_store_explicit(&o->seq, op->seq + 1, memory_order_release);
    /* Wake the sender only when its send waits for this: it is issued and not published. The
     * fence pairs with take_offer's, so either it sees this answer or this sees its send. */
    atomic_thread_fence(memory_order_seq_cst);
    if (op->nbytes >= MP_SHM_OFFER_WAIT_BYTES && atomic_load_explicit(&ch->send_issued, memory_order_relaxed) > op->seq &&
        atomic_load_explicit(&ch->posted, memory_order_relaxed) <= op->seq)
        ring_peer(s, op);
}

static void activate(shm_t *s, mp_step *step)
{
    for (int i = 0; i < step->nops; i++) {
        mp_op *op = step->ops[i];
        atomic_store_explicit(&op->state, MP_OP_ACTIVE, memory_order_relaxed);
        if (op->kind == MP_RECV) {
            shm_chan *ch = shm_chan_at(&s->v, shm_chan_index(&s->v, op->lane, op->peer, s->base.rank));
            if (op->offered == OFFER_NONE && atomic_load_explicit(&ch->posted, memory_order_acquire) <= op->seq)
                answer(s, op, ch);
            /* Release: a peer that reads it then reads recv_issued, which must not look smaller,
             * and the answer, which must be there. */
            if (atomic_load_explicit(&ch->recv_posted, memory_order_relaxed) < op->seq + 1)
                atomic_store_explicit(&ch->recv_posted, op->seq + 1, memory_order_release);
        }
    }
    step->activated = 1;
}

/* Frees a lane's head step once its ops have all finished: a lane holds only steps with an op
 * still to finish, which is what a closing rank counts as pending. */
static void free_head(step_queue *q)
{
    mp_step *step = q->head;
    q->head = step->next;
    if (!q->head)
        q->tail = NULL;
    free(step);
}

static int progress_lane(shm_t *s, step_queue *q)
{
    int moved = 0;
    while (q->head) {
        mp_step *step = q->head;
        if (!step->activated) {
            activate(s, step);
            moved = 1;
        }
        for (int i = 0; i < step->nops; i++) {
            mp_op *op = step->ops[i];
            if (!op)
                continue;
            moved |= op->kind == MP_SEND ? progress_send(s, step, op) : progress_recv(s, step, op);
        }
        if (step->remaining > 0)
            break;
        free_head(q);
        moved = 1;
    }
    return moved;
}

static void enqueue(step_queue *q, mp_step *step)
{
    step->next = NULL;
    if (q->tail)
        q->tail->next = step;
    else
        q->head = step;
    q->tail = step;
}

/* Whether rank r's fence names a deadlock report that exists (or the overflow value once all
 * are used); reports the segment corrupt when it cannot. */
static int fence_valid(shm_t *s, int r, uint32_t fence)
{
    shm_header *h = shm_hdr(&s->v);
    uint32_t used = __atomic_load_n(&h->reports_used, __ATOMIC_ACQUIRE);
    uint32_t fenced = atomic_load(&h->fenced);
    if (used <= SHM_REPORTS && fenced <= (uint32_t)s->base.size &&
        (fence <= used || (fence == SHM_REPORTS + 1 && used == SHM_REPORTS)))
        return 1;
    found_corrupt(s, "fence of rank %d = %u (%u deadlock report(s) kept, %u rank(s) fenced)", r, fence, used, fenced);
    return 0;
}

static mp_result shm_abort_cause(mp_transport *t, int *rank)
{
    shm_t *s = as_shm(t);
    shm_header *h = shm_hdr(&s->v);
    uint32_t cause = atomic_load(&h->abort_cause);
    /* The winner of the cause writes its rank and reason just after: wait for them (briefly, as
     * it may die in between, or the segment hold garbage). */
    for (double until = 0; cause != MP_OK && !atomic_load_explicit(&h->abort_why_ready, memory_order_acquire);) {
        double now = mp_now();
        if (!until)
            until = now + 0.1;
        else if (now > until)
            break;
        sched_yield();
    }
    int32_t by = atomic_load(&h->abort_rank);
    if (!atomic_load(&s->corrupt) && cause > MP_ERR_INTERRUPTED)
        found_corrupt(s, "abort_cause = %u, not a result code", cause);
    else if (!atomic_load(&s->corrupt) && cause != MP_OK && (by < 0 || by >= t->size))
        found_corrupt(s, "abort_rank = %d with abort_cause %u, in a group of %d", by, cause, t->size);
    if (atomic_load(&s->corrupt)) {
        if (rank)
            *rank = t->rank;
        return MP_ERR_CORRUPT;
    }
    if (rank)
        *rank = by;
    /* A fence is a final verdict: an abort that follows it (a rank closing, a peer dying of its
     * own DeadlockError) does not turn this rank's deadlock into a relayed abort. */
    uint32_t fence = atomic_load(&h->fenced) ? atomic_load(&my_slot(s)->fence) : 0;
    if (fence) {
        if (!fence_valid(s, t->rank, fence))
            return shm_abort_cause(t, rank);
        cause = MP_ERR_DEADLOCK;
        if (rank)
            *rank = t->rank;
    }
    return (mp_result)cause;
}

/* Whether a peer's fence, already seen, is final for this rank: a cycle's ranks are fenced one
 * by one under detect_lock, so while it is held this rank may be in the cycle with its own fence
 * still to come. Read after the peer's fence: the unlock follows every fence of the cycle. */
static int peer_fence_final(shm_t *s)
{
    return !atomic_load(&shm_hdr(&s->v)->detect_lock) && !atomic_load(&my_slot(s)->fence);
}

/* Fails the ops of the active steps that nobody will ever serve, so that the rest of their lane
 * goes on: those whose peer is fenced in a deadlock (with its report), and, when `departed`,
 * those whose peer closed the communicator without posting their partner (a closed rank posts
 * nothing more). The second needs each peer's state, so only blocked waits ask for it. */
static int fail_unserved(shm_t *s, int departed)
{
    if (s->failed || shm_abort_cause(&s->base, NULL) != MP_OK)
        return 0; /* an abort's own cause names what happened better: fail_everything() gives it */
    if (atomic_load(&my_slot(s)->fence))
        return 0; /* this rank is in the cycle itself: fail_everything() gives its ops DeadlockError */
    int failed = 0;
    for (int l = 0; l < s->base.nlanes; l++) {
        mp_step *step = s->lanes[l].head;
        if (!step || !step->activated)
            continue;
        for (int i = 0; i < step->nops; i++) {
            mp_op *op = step->ops[i];
            if (!op || op->peer == s->base.rank)
                continue;
            shm_rank *peer = shm_rank_at(&s->v, op->peer);
            uint32_t fence = atomic_load(&peer->fence);
            if (fence) {
                if (!fence_valid(s, op->peer, fence))
                    return 1;
                if (!peer_fence_final(s))
                    return failed;
                snprintf(op->detail, sizeof op->detail,
                         "rank %d, which this op needs, is in a wait-for cycle that can never resolve (the deadlock "
                         "report follows)", op->peer_global);
                finish(s, step, op, MP_ERR_ABORTED);
                failed = 1;
                continue;
            }
            if (!departed || atomic_load(&peer->state) != SHM_RANK_CLOSED)
                continue;
            shm_chan *ch = op->kind == MP_SEND
                               ? shm_chan_at(&s->v, shm_chan_index(&s->v, op->lane, s->base.rank, op->peer))
                               : shm_chan_at(&s->v, shm_chan_index(&s->v, op->lane, op->peer, s->base.rank));
            if ((op->kind == MP_SEND ? atomic_load(&ch->recv_posted) : atomic_load(&ch->posted)) > op->seq)
                continue;
            snprintf(op->detail, sizeof op->detail, "rank %d closed the communicator without posting the matching %s",
                     op->peer_global, op->kind == MP_SEND ? "receive" : "send");
            finish(s, step, op, MP_ERR_CLOSED);
            failed = 1;
        }
        if (step->remaining == 0)
            free_head(&s->lanes[l]); /* the next step goes on at the next pass */
    }
    return failed;
}

static void shm_abort(mp_transport *t, mp_result cause, int rank, const char *why)
{
    shm_t *s = as_shm(t);
    shm_header *h = shm_hdr(&s->v);
    uint32_t none = MP_OK;
    if (atomic_compare_exchange_strong(&h->abort_cause, &none, (uint32_t)cause)) {
        atomic_store(&h->abort_rank, rank);
        if (why && why[0])
            snprintf(h->abort_why, sizeof h->abort_why, "%s", why);
        atomic_store_explicit(&h->abort_why_ready, 1, memory_order_release); /* the record is final */
    }
    for (int r = 0; r < t->size; r++)
        ring(s, r);
}

/* Fails everything once the communicator is aborted or this rank is fenced as deadlocked; from
 * then on new steps fail on arrival. */
static void fail_everything(shm_t *s)
{
    int rank;
    mp_result cause = shm_abort_cause(&s->base, &rank);
    char why[MP_DETAIL_LEN];
    describe_cause(s, cause, rank, why, sizeof why);
    mp_result r = cause == MP_ERR_TIMEOUT || cause == MP_ERR_PEER_DEAD || cause == MP_ERR_DEADLOCK ? cause
                                                                                              : MP_ERR_ABORTED;
    for (int l = 0; l < s->base.nlanes; l++)
        fail_queue(s, &s->lanes[l], r, why);
    s->failed = 1;
}

/* Every rank's header against what this rank recorded at attach and what its counts can be. */
static int rank_headers_valid(shm_t *s)
{
    for (int r = 0; r < s->base.size; r++) {
        shm_rank *sr = shm_rank_at(&s->v, r);
        int32_t pid = atomic_load(&sr->pid);
        uint32_t state = atomic_load(&sr->state), sleeping = atomic_load(&sr->sleeping);
        uint32_t driving = atomic_load(&sr->driving), waiting = atomic_load(&sr->waiting);
        if (pid != (int32_t)s->pids[r])
            found_corrupt(s, "pid of rank %d = %d; it attached as pid %d", r, pid, (int)s->pids[r]);
        else if (state != SHM_RANK_READY && state != SHM_RANK_CLOSED)
            found_corrupt(s, "state of rank %d = %u", r, state);
        else if (sleeping > 1 || driving > MAX_THREADS_IN_WAIT || waiting > MAX_THREADS_IN_WAIT)
            found_corrupt(s, "rank %d's sleeping = %u, driving = %u, waiting = %u", r, sleeping, driving, waiting);
        else
            continue;
        return 0;
    }
    return 1;
}

static void check_liveness(shm_t *s)
{
    if (!rank_headers_valid(s))
        return;
    for (int r = 0; r < s->base.size; r++) {
        if (r == s->base.rank)
            continue;
        if (atomic_load(&shm_rank_at(&s->v, r)->state) == SHM_RANK_CLOSED)
            continue;
        if (peer_exited(s, r)) {
            shm_abort(&s->base, MP_ERR_PEER_DEAD, r, NULL);
            return;
        }
    }
}

/* Moves newly posted steps onto their lanes and progresses every lane once. Caller holds
 * `engine`. Returns whether anything happened. */
static int engine_pass(shm_t *s)
{
    pthread_mutex_lock(&s->lock);
    mp_step *in = s->incoming.head;
    s->incoming.head = s->incoming.tail = NULL;
    pthread_mutex_unlock(&s->lock);
    int moved = in != NULL;
    while (in) {
        mp_step *next = in->next;
        enqueue(&s->lanes[in->lane], in);
        in = next;
    }
    if (s->failed || shm_abort_cause(&s->base, NULL) != MP_OK) {
        fail_everything(s); /* also fails steps posted while the abort raced in */
        return moved;
    }
    for (int l = 0; l < s->base.nlanes; l++)
        moved |= progress_lane(s, &s->lanes[l]);
    if (atomic_load_explicit(&shm_hdr(&s->v)->fenced, memory_order_relaxed))
        moved |= fail_unserved(s, 0);
    return moved;
}

static void *progress_main(void *arg)
{
    shm_t *s = arg;
    shm_rank *me = my_slot(s);
    double next_liveness = mp_now() + LIVENESS_PERIOD;
    double idle_since = mp_now();
    for (;;) {
        uint32_t seen = atomic_load(&me->bell);
        pthread_mutex_lock(&s->lock);
        int stop = s->stop;
        pthread_mutex_unlock(&s->lock);
        if (stop)
            return NULL;
        pthread_mutex_lock(&s->engine);
        int moved = engine_pass(s);
        int failed = s->failed;
        pthread_mutex_unlock(&s->engine);

        double now = mp_now();
        if (now >= next_liveness) {
            if (!failed)
                check_liveness(s);
            next_liveness = now + LIVENESS_PERIOD;
        }
        if (moved) {
            idle_since = now;
            continue;
        }
        /* A thread waiting in shm_wait drives progress itself; spinning here too would only
         * take its core. */
        if (now - idle_since < SPIN_SECONDS && !atomic_load(&s->driving)) {
            mp_cpu_relax();
            continue;
        }
        atomic_store(&me->sleeping, 1);
        if (atomic_load(&me->bell) == seen)
            mp_futex_wait(&me->bell, seen, next_liveness - now, 1);
        atomic_store(&me->sleeping, 0);
        idle_since = mp_now();
    }
}

/* ---- the interface ---------------------------------------------------------------------- */

static mp_result shm_post(mp_transport *t, mp_step *step)
{
    shm_t *s = as_shm(t);
    if (shm_abort_cause(t, NULL) != MP_OK)
        return MP_ERR_ABORTED;
    step->remaining = step->nops;
    step->activated = 0;
    step->settled = NULL;
    pthread_mutex_lock(&s->lock);
    if (s->posters == 0 || (s->posters == 1 && !pthread_equal(s->poster, pthread_self())))
        s->posters++;
    s->poster = pthread_self();
    deferred_wakes.deferring = deferred_wakes.in_call == s;
    for (int i = 0; i < step->nops; i++) {
        mp_op *op = step->ops[i];
        op->index = i;
        int send = op->kind == MP_SEND;
        shm_chan *ch = shm_chan_at(&s->v, send ? shm_chan_index(&s->v, op->lane, t->rank, op->peer)
                                               : shm_chan_index(&s->v, op->lane, op->peer, t->rank));
        /* What this rank has issued, for peers judging whether it still owes them an op, and
         * bounding the sends it publishes. Only raised: threads may post out of seq order. */
        _Atomic uint64_t *issued = send ? &ch->send_issued : &ch->recv_issued;
        if (atomic_load_explicit(issued, memory_order_relaxed) < op->seq + 1)
            atomic_store_explicit(issued, op->seq + 1, memory_order_relaxed);
        if (!send && (op->seq < SHM_NSLOTS ||
                      atomic_load_explicit(&ch->posted, memory_order_acquire) > op->seq - SHM_NSLOTS))
            answer(s, op, ch);
    }
    deferred_wakes.deferring = 0;
    atomic_thread_fence(memory_order_seq_cst); /* issued before reading what peers posted: see post_descriptor() */
    enqueue(&s->incoming, step);
    pthread_mutex_unlock(&s->lock);
    if (atomic_load_explicit(&s->watching, memory_order_relaxed))
        atomic_fetch_add(&my_slot(s)->wait_epoch, 1); /* another thread posts during a wait: not blocked */
    /* Publish at once when the engine is free; otherwise its holder is running and the bell
     * makes sure it looks again. */
    if (pthread_mutex_trylock(&s->engine) == 0) {
        deferred_wakes.deferring = deferred_wakes.in_call == s;
        while (engine_pass(s))
            ;
        deferred_wakes.deferring = 0;
        pthread_mutex_unlock(&s->engine);
    } else {
        ring(s, t->rank);
    }
    return MP_OK;
}

static mp_result shm_begin(mp_transport *t, void *stream)
{
    (void)stream; /* CPU memory: nothing to order after */
    deferred_wakes.in_call = t;
    deferred_wakes.n = 0;
    return MP_OK;
}

static mp_result shm_end(mp_transport *t)
{
    shm_t *s = as_shm(t);
    if (deferred_wakes.in_call != t)
        return MP_OK;
    for (int i = 0; i < deferred_wakes.n; i++)
        ring(s, deferred_wakes.peers[i]);
    deferred_wakes.n = 0;
    deferred_wakes.in_call = NULL;
    return MP_OK;
}

/* Progresses from the caller's thread while things move, for at most DRIVE_SPIN_SECONDS of calm. */
static void drive(shm_t *s, const mp_op *op, double deadline)
{
    shm_rank *me = my_slot(s);
    atomic_fetch_add(&s->driving, 1);
    atomic_fetch_add(&me->driving, 1);
    uint32_t seen = atomic_load(&me->bell);
    double moved_at = mp_now();
    for (;;) {
        if (mp_op_done(op))
            break;
        double now = mp_now();
        if (now >= deadline || now >= moved_at + DRIVE_SPIN_SECONDS)
            break;
        if (pthread_mutex_trylock(&s->engine) == 0) {
            seen = atomic_load(&me->bell);
            while (engine_pass(s))
                moved_at = now;
            pthread_mutex_unlock(&s->engine);
        } else {
            mp_cpu_relax();
        }
        /* The peer this waits for may share this core (the scheduler moves ranks that wake each
         * other onto one): past a short spin, let it run instead of taking its time slice. */
        if (now >= moved_at + DRIVE_YIELD_AFTER)
            sched_yield();
    }
    atomic_fetch_sub(&me->driving, 1);
    atomic_fetch_sub(&s->driving, 1);
    /* Rings that came after the last pass skipped the wake: hand them to the progress thread. */
    if (atomic_load(&me->bell) != seen && atomic_load(&me->sleeping))
        mp_futex_wake(&me->bell, 1);
}

/* Appends the pending ops of `st` to the published list. */
static void publish_step(shm_watch *w, uint32_t *n, const mp_step *st, const mp_op *waited)
{
    for (int i = 0; i < st->nops && *n < SHM_WATCH_OPS; i++) {
        const mp_op *op = st->ops[i];
        if (!op)
            continue;
        if (op == waited)
            w->wait_index = (int32_t)*n;
        shm_watch_op *o = &w->ops[(*n)++];
        *o = (shm_watch_op){.seq = op->seq, .nbytes = op->nbytes, .step = op->step, .kind = op->kind,
                            .peer = op->peer, .lane = op->lane, .dtype = op->dtype, .label = op->label};
        snprintf(o->call, sizeof o->call, "%s", op->call_name);
    }
}

/* Publishes this rank's pending ops for the cycle search of every rank: each lane's head step
 * first (what the search needs most), then the rest in lane order, then what was posted and
 * not yet moved onto the lanes. */
static void publish_pending(shm_t *s, const mp_op *waited)
{
    shm_watch *w = shm_watch_at(&s->v, s->base.rank);
    pthread_mutex_lock(&s->engine);
    pthread_mutex_lock(&s->lock);
    atomic_fetch_add_explicit(&w->version, 1, memory_order_acq_rel); /* odd: being rewritten */
    atomic_thread_fence(memory_order_release);
    uint32_t n = 0;
    w->wait_index = -1;
    w->wait_lane = waited->lane;
    for (int l = 0; l < s->base.nlanes; l++)
        if (s->lanes[l].head)
            publish_step(w, &n, s->lanes[l].head, waited);
    for (int l = 0; l < s->base.nlanes; l++)
        for (mp_step *st = s->lanes[l].head ? s->lanes[l].head->next : NULL; st; st = st->next)
            publish_step(w, &n, st, waited);
    for (mp_step *st = s->incoming.head; st; st = st->next)
        publish_step(w, &n, st, waited);
    w->nops = n;
    /* Blocked only if no other thread of this rank can post: the waiter is the sole poster. */
    if (atomic_load(&s->watching) > 1 || s->posters > 1 ||
        (s->posters == 1 && !pthread_equal(s->poster, pthread_self())))
        w->wait_index = -2;
    w->epoch = atomic_load(&my_slot(s)->wait_epoch);
    atomic_fetch_add_explicit(&w->version, 1, memory_order_release);
    pthread_mutex_unlock(&s->lock);
    pthread_mutex_unlock(&s->engine);
}

static void watch_enter(shm_t *s)
{
    atomic_fetch_add(&s->watching, 1);
    atomic_fetch_add(&my_slot(s)->waiting, 1);
    atomic_fetch_add(&my_slot(s)->wait_epoch, 1);
}

static void watch_leave(shm_t *s)
{
    atomic_fetch_add(&my_slot(s)->wait_epoch, 1);
    atomic_fetch_sub(&my_slot(s)->waiting, 1);
    atomic_fetch_sub(&s->watching, 1);
}

/* One round of deadlock detection from a blocked wait. `seen`: the cycle of the last round. */
static void watch_round(shm_t *s, const mp_op *op, shm_cycle **seen)
{
    pthread_mutex_lock(&s->engine);
    fail_unserved(s, 1);
    pthread_mutex_unlock(&s->engine);
    if (mp_op_done(op))
        return;
    publish_pending(s, op);
    char corrupt[MP_DETAIL_LEN] = "";
    shm_cycle *cycle = shm_cycle_find(&s->v, s->base.rank, s->eager_threshold, corrupt, sizeof corrupt);
    if (corrupt[0])
        found_corrupt(s, "%s", corrupt);
    shm_header *h = shm_hdr(&s->v);
    uint32_t lock = atomic_load(&h->detect_lock), used = __atomic_load_n(&h->reports_used, __ATOMIC_ACQUIRE);
    if (cycle && (lock > (uint32_t)s->base.size || used > SHM_REPORTS)) {
        found_corrupt(s, "detect_lock = %u, reports_used = %u", lock, used);
        shm_cycle_free(cycle);
        cycle = NULL;
    }
    if (cycle && shm_cycle_same(cycle, *seen) && shm_cycle_fence(&s->v, cycle, s->pids))
        for (int r = 0; r < s->base.size; r++)
            ring(s, r);
    shm_cycle_free(*seen);
    *seen = cycle;
}

static mp_result shm_wait(mp_transport *t, mp_op *op, double deadline, const mp_interrupt *interrupt)
{
    shm_t *s = as_shm(t);
    drive(s, op, deadline);
    double next_round = mp_now() + WATCH_AFTER;
    int watching = 0;
    shm_cycle *seen = NULL;
    mp_result r = MP_OK;
    for (;;) {
        if (mp_op_done(op))
            break;
        double now = mp_now();
        if (now >= deadline) {
            r = MP_ERR_TIMEOUT;
            break;
        }
        if (mp_interrupted(interrupt)) {
            r = MP_ERR_INTERRUPTED;
            break;
        }
        if (now >= next_round) {
            if (!watching)
                watch_enter(s);
            watching = 1;
            watch_round(s, op, &seen);
            next_round = mp_now() + WATCH_PERIOD;
        }
        /* The progress thread takes over; it bumps `completions` when an op finishes. */
        uint32_t c = atomic_load(&s->completions);
        if (mp_op_done(op))
            break;
        double until = deadline < next_round ? deadline : next_round;
        atomic_fetch_add(&s->waiters, 1);
        mp_futex_wait(&s->completions, c, until - now < 0.1 ? until - now : 0.1, 0);
        atomic_fetch_sub(&s->waiters, 1);
    }
    if (watching)
        watch_leave(s);
    shm_cycle_free(seen);
    return r;
}

static void shm_failure_report(mp_transport *t, const mp_op *op, char *buf, size_t len)
{
    shm_t *s = as_shm(t);
    int rank;
    mp_result cause = shm_abort_cause(t, &rank);
    if (cause == MP_ERR_CORRUPT) {
        /* No deadlock report then (a fence may be the garbage); an op's own detail names the
         * bad value already, a failed post does not. */
        if (!op)
            describe_cause(s, MP_ERR_CORRUPT, rank, buf, len);
        else if (len)
            buf[0] = '\0';
        return;
    }
    uint32_t fence = atomic_load(&my_slot(s)->fence);
    if (!fence && op && op->peer >= 0 && op->peer < t->size)
        fence = atomic_load(&shm_rank_at(&s->v, op->peer)->fence);
    if (fence)
        shm_deadlock_report(&s->v, fence, buf, len);
    else if (!op && cause != MP_OK)
        describe_cause(s, cause, rank, buf, len); /* a refused post: why the communicator was aborted */
    else if (len)
        buf[0] = '\0';
}

static void shm_describe_peer(mp_transport *t, const mp_op *op, char *buf, size_t len)
{
    shm_t *s = as_shm(t);
    if (op->peer < 0 || op->peer >= t->size) {
        snprintf(buf, len, "peer out of range");
        return;
    }
    uint32_t st = atomic_load(&shm_rank_at(&s->v, op->peer)->state);
    const char *closed = st == SHM_RANK_CLOSED ? "; it has closed the communicator" : "";
    if (op->kind == MP_SEND) {
        shm_chan *ch = shm_chan_at(&s->v, shm_chan_index(&s->v, op->lane, t->rank, op->peer));
        snprintf(buf, len, "rank %d has posted %llu receive(s) from this rank on lane %d and finished %llu%s",
                 op->peer_global, (unsigned long long)atomic_load(&ch->recv_posted), op->lane,
                 (unsigned long long)atomic_load(&ch->done), closed);
    } else {
        shm_chan *ch = shm_chan_at(&s->v, shm_chan_index(&s->v, op->lane, op->peer, t->rank));
        snprintf(buf, len, "rank %d has posted %llu send(s) to this rank on lane %d%s", op->peer_global,
                 (unsigned long long)atomic_load(&ch->posted), op->lane, closed);
    }
}

static void shm_destroy(mp_transport *t)
{
    shm_t *s = as_shm(t);
    if (s->thread_started) {
        pthread_mutex_lock(&s->lock);
        s->stop = 1;
        pthread_mutex_unlock(&s->lock);
        ring(s, t->rank);
        pthread_join(s->thread, NULL);
    }
    if (s->v.base) {
        pthread_mutex_lock(&s->engine);
        int pending = s->incoming.head != NULL;
        for (int l = 0; l < t->nlanes && !pending; l++)
            pending = s->lanes[l].head != NULL;
        if (pending && shm_abort_cause(t, NULL) == MP_OK)
            shm_abort(t, MP_ERR_CLOSED, t->rank, NULL); /* peers waiting on these ops fail fast */
        char why[MP_DETAIL_LEN];
        snprintf(why, sizeof why, "communicator closed with this op pending");
        fail_queue(s, &s->incoming, MP_ERR_CLOSED, why);
        for (int l = 0; l < t->nlanes; l++)
            fail_queue(s, &s->lanes[l], MP_ERR_CLOSED, why);
        pthread_mutex_unlock(&s->engine);
        /* Threads still in shm_wait see their op finished and leave; then `s` can go. */
        while (atomic_load(&s->driving) || atomic_load(&s->waiters)) /* the segment's copy may be garbage */
            usleep(100);
        atomic_store(&my_slot(s)->state, SHM_RANK_CLOSED);
        shm_segment_unmap(&s->v);
    }
    for (int r = 0; s->peer_arenas && r < t->size; r++)
        mp_arena_unmap_peer(s->peer_arenas[r], s->peer_arena_bytes[r]);
    mp_arena_release(s->arena); /* its blocks that tensors still hold keep it mapped */
    for (int r = 0; s->pidfds && r < t->size; r++)
        if (s->pidfds[r] >= 0)
            close(s->pidfds[r]);
    pthread_mutex_destroy(&s->lock);
    pthread_mutex_destroy(&s->engine);
    free(s->pidfds);
    free(s->pids);
    free(s->peer_arenas);
    free(s->peer_arena_bytes);
    free(s->out);
    free(s->in);
    free(s->lanes);
    free(s);
}

static const mp_transport_ops shm_ops = {
    .name = "shm",
    .post = shm_post,
    .wait = shm_wait,
    .abort = shm_abort,
    .abort_cause = shm_abort_cause,
    .describe_peer = shm_describe_peer,
    .destroy = shm_destroy,
    .begin = shm_begin,
    .end = shm_end,
    .failure_report = shm_failure_report,
};

/* ---- creation --------------------------------------------------------------------------- */

int mp_shm_new_name(char *buf, size_t len)
{
    /* 128 bits from getrandom: unguessable, and made even when every descriptor is in use. */
    unsigned char rnd[16];
    for (size_t have = 0; have < sizeof rnd;) {
        ssize_t got = getrandom(rnd + have, sizeof rnd - have, 0);
        if (got < 0 && errno != EINTR)
            return -1;
        have += got > 0 ? (size_t)got : 0;
    }
    int n = snprintf(buf, len, "/mp2p-%d-", (int)getpid());
    for (size_t i = 0; i < sizeof rnd && n + 2 < (int)len; i++)
        n += snprintf(buf + n, len - (size_t)n, "%02x", rnd[i]);
    return 0;
}

/* Waits until `counter` reaches the group size; names the missing ranks when it does not. */
static mp_result wait_all(shm_t *s, _Atomic uint32_t *counter, uint32_t min_state, double deadline,
                          const mp_shm_config *cfg, const char *what, char *err, size_t errlen)
{
    for (unsigned polls = 0; atomic_load(counter) < (uint32_t)s->base.size; polls++) {
        if (mp_interrupted(cfg->interrupt))
            return MP_ERR_INTERRUPTED;
        for (int r = 0; polls % 64 == 0 && r < s->base.size; r++) {
            pid_t pid = (pid_t)atomic_load(&shm_rank_at(&s->v, r)->pid);
            if (pid <= 0 && cfg->pids)
                pid = cfg->pids[r];
            if (pid > 0 && kill(pid, 0) != 0 && errno == ESRCH) {
                snprintf(err, errlen, "rank %d (pid %d) exited before every rank could %s the shared-memory segment",
                         r, (int)pid, what);
                return MP_ERR_PEER_DEAD;
            }
        }
        if (mp_now() > deadline) {
            int n = snprintf(err, errlen, "timed out waiting for ranks to %s the shared-memory segment; missing:",
                             what);
            for (int r = 0; r < s->base.size && n < (int)errlen; r++)
                if (atomic_load(&shm_rank_at(&s->v, r)->state) < min_state)
                    n += snprintf(err + n, errlen - (size_t)n, " %d", r);
            return MP_ERR_TIMEOUT;
        }
        usleep(200);
    }
    return MP_OK;
}

static void probe_single_copy(shm_t *s, int allow)
{
    for (int r = 0; r < s->base.size; r++) {
        shm_rank *peer = shm_rank_at(&s->v, r);
        uint64_t got = 0;
        struct iovec local = {&got, sizeof got};
        struct iovec remote = {(void *)(uintptr_t)peer->probe_addr, sizeof got};
        int ok = allow && r != s->base.rank &&
                 process_vm_readv(s->pids[r], &local, 1, &remote, 1, 0) == (ssize_t)sizeof got &&
                 got == peer->probe_value;
        atomic_store(shm_cma_at(&s->v, s->base.rank, r), (uint8_t)ok);
    }
}

/* "/mp2p-<owner's pid>-<the segment's random part>-a<rank>": unguessable like the segment's
 * name, and the stale sweep knows the owner. */
static void arena_name(const char *segment, pid_t owner, int rank, char *buf, size_t len)
{
    const char *random = strrchr(segment, '-');
    snprintf(buf, len, "/mp2p-%d%s-a%d", (int)owner, random ? random : "-", rank);
}

/* Maps every peer's receive arena, whose size each published before attaching. */
static mp_result map_peer_arenas(shm_t *s, const char *segment, char *err, size_t errlen)
{
    for (int r = 0; r < s->base.size; r++) {
        uint64_t bytes = shm_rank_at(&s->v, r)->arena_bytes;
        if (r == s->base.rank || !bytes)
            continue;
        char name[MP_SHM_NAME_LEN + 32];
        arena_name(segment, s->pids[r], r, name, sizeof name);
        mp_result res = mp_arena_map_peer(name, bytes, &s->peer_arenas[r], err, errlen);
        if (res != MP_OK)
            return res;
        s->peer_arena_bytes[r] = bytes;
    }
    return MP_OK;
}

/* Once every rank is ready, every arena is mapped by all (or the job failed): each rank removes
 * every name, so that none is left when any rank's creation returns. */
static void unlink_arenas(shm_t *s, const char *segment)
{
    if (s->arena)
        mp_arena_unlink(s->arena);
    for (int r = 0; r < s->base.size; r++) {
        if (r == s->base.rank || !shm_rank_at(&s->v, r)->arena_bytes)
            continue;
        char name[MP_SHM_NAME_LEN + 32];
        arena_name(segment, s->pids[r], r, name, sizeof name);
        shm_unlink(name);
    }
}

static int open_pidfd(pid_t pid)
{
#ifdef SYS_pidfd_open
    return (int)syscall(SYS_pidfd_open, pid, 0);
#else
    (void)pid;
    return -1;
#endif
}

mp_result mp_shm_open(const mp_shm_config *cfg, mp_transport **out, char *err, size_t errlen)
{
    double deadline = mp_now() + cfg->timeout;
    shm_t *s = calloc(1, sizeof *s);
    if (!s) {
        snprintf(err, errlen, "out of memory");
        return MP_ERR_SYSTEM;
    }
    s->base.ops = &shm_ops;
    s->base.rank = cfg->rank;
    s->base.size = cfg->size;
    s->base.nlanes = cfg->nlanes;
    s->eager_threshold = cfg->eager_threshold;
    pthread_mutex_init(&s->lock, NULL);
    pthread_mutex_init(&s->engine, NULL);
    size_t nchan = (size_t)cfg->nlanes * (size_t)cfg->size;
    s->pidfds = malloc(sizeof(int) * (size_t)cfg->size);
    s->pids = calloc((size_t)cfg->size, sizeof(pid_t));
    s->out = calloc(nchan, sizeof(chan_local));
    s->in = calloc(nchan, sizeof(chan_local));
    s->lanes = calloc((size_t)cfg->nlanes, sizeof(step_queue));
    s->peer_arenas = calloc((size_t)cfg->size, sizeof(char *));
    s->peer_arena_bytes = calloc((size_t)cfg->size, sizeof(uint64_t));
    if (!s->pidfds || !s->pids || !s->out || !s->in || !s->lanes || !s->peer_arenas || !s->peer_arena_bytes) {
        free(s->pidfds);
        s->pidfds = NULL;
        shm_destroy(&s->base);
        snprintf(err, errlen, "out of memory");
        return MP_ERR_SYSTEM;
    }
    for (int r = 0; r < cfg->size; r++)
        s->pidfds[r] = -1;

    mp_result res = shm_segment_map(cfg->name, cfg->create, cfg->size, cfg->nlanes, cfg->eager_threshold, deadline,
                                    cfg->interrupt, &s->v, err, errlen);
    if (res != MP_OK) {
        shm_destroy(&s->base);
        return res;
    }
    shm_header *h = shm_hdr(&s->v);
    shm_rank *me = my_slot(s);
    int32_t none = 0;
    if (!atomic_compare_exchange_strong(&me->pid, &none, (int32_t)getpid())) {
        snprintf(err, errlen, "rank %d is already attached to shared-memory segment %s (pid %d): two processes "
                 "claim the same group rank", cfg->rank, cfg->name, (int)none);
        shm_destroy(&s->base);
        return MP_ERR_MISMATCH;
    }
    s->probe_word = ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)s ^ 0x9e3779b97f4a7c15ull;
    me->probe_addr = (uint64_t)(uintptr_t)&s->probe_word;
    me->probe_value = s->probe_word;
    me->global_rank = cfg->global_rank;
    if (cfg->arena_bytes) {
        char name[MP_SHM_NAME_LEN + 32];
        arena_name(cfg->name, getpid(), cfg->rank, name, sizeof name);
        res = mp_arena_create(name, cfg->arena_bytes, &s->arena, err, errlen);
        if (res != MP_OK) {
            shm_destroy(&s->base);
            return res;
        }
        me->arena_bytes = mp_arena_bytes(s->arena);
    }
    atomic_store(&me->state, SHM_RANK_ATTACHED);
    atomic_fetch_add(&h->attached, 1);

    res = wait_all(s, &h->attached, SHM_RANK_ATTACHED, deadline, cfg, "attach to", err, errlen);
    shm_unlink(cfg->name); /* everyone is in (or the job failed): the name is no longer needed */
    if (res != MP_OK) {
        shm_destroy(&s->base);
        return res;
    }
    for (int r = 0; r < cfg->size; r++) {
        s->pids[r] = (pid_t)atomic_load(&shm_rank_at(&s->v, r)->pid);
        if (r != cfg->rank)
            s->pidfds[r] = open_pidfd(s->pids[r]);
    }
    probe_single_copy(s, cfg->allow_cma);
    res = map_peer_arenas(s, cfg->name, err, errlen);
    if (res != MP_OK) {
        shm_destroy(&s->base);
        return res;
    }
    atomic_store(&me->state, SHM_RANK_READY);
    atomic_fetch_add(&h->ready, 1);
    res = wait_all(s, &h->ready, SHM_RANK_READY, deadline, cfg, "finish connecting to", err, errlen);
    unlink_arenas(s, cfg->name);
    if (res != MP_OK) {
        shm_destroy(&s->base);
        return res;
    }
    if (pthread_create(&s->thread, NULL, progress_main, s) != 0) {
        snprintf(err, errlen, "cannot start the progress thread: %s", strerror(errno));
        shm_destroy(&s->base);
        return MP_ERR_SYSTEM;
    }
    s->thread_started = 1;
    *out = &s->base;
    return MP_OK;
}

int mp_shm_received_by_path(mp_transport *t, uint64_t out[MP_SHM_NPATHS])
{
    if (!t || t->ops != &shm_ops)
        return 0;
    for (int p = 0; p < MP_SHM_NPATHS; p++)
        out[p] = atomic_load_explicit(&as_shm(t)->received[p], memory_order_relaxed);
    return 1;
}

mp_arena *mp_shm_arena(mp_transport *t)
{
    return t && t->ops == &shm_ops ? as_shm(t)->arena : NULL;
}

const shm_view *mp_shm_view(mp_transport *t)
{
    return t && t->ops == &shm_ops ? &as_shm(t)->v : NULL;
}

int mp_shm_single_copy(mp_transport *t, int peer)
{
    shm_t *s = as_shm(t);
    if (peer < 0 || peer >= t->size)
        return 0;
    return atomic_load(shm_cma_at(&s->v, t->rank, peer));
}
