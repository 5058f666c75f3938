/* How the shm engine fails: corrupt values read from the segment, aborts and their causes,
 * deadlock fences, peers' liveness, and failing what is pending with the reason. Kept apart from
 * the fast paths, which only call in here when something has gone wrong. */
#include "engine.h"

#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/clock.h"
#include "core/cycle_report.h"
#include "deadlock.h"

#define MAX_THREADS_IN_WAIT (1u << 16) /* a bound on a rank's `driving` and `waiting` counts */

/* A value read from the segment that no valid state holds: another process wrote garbage there.
 * The first one is kept and the communicator aborted, so that the peers fail too. Returns 1: the
 * engine's next pass fails everything pending. */
int shm_found_corrupt(shm_t *s, const char *fmt, ...)
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

static void fail_step(shm_t *s, mp_step *step, mp_result r, const char *why)
{
    for (int i = 0; i < step->nops; i++) {
        mp_op *op = step->ops[i];
        if (!op)
            continue;
        snprintf(op->detail, sizeof op->detail, "%s", why);
        shm_finish(s, step, op, r);
    }
}

static void describe_cause(shm_t *s, mp_result cause, int rank, char *buf, size_t len)
{
    int who = rank >= 0 && rank < s->base.size ? shm_global_rank(&s->v, rank) : rank; /* as every report names it */
    if (cause == MP_ERR_CORRUPT && rank == s->base.rank && atomic_load(&s->corrupt)) {
        int final = atomic_load_explicit(&s->corrupt, memory_order_acquire) == 2;
        snprintf(buf, len, "%s", final ? s->corrupt_why : "corrupt segment");
        return;
    }
    switch (cause) {
    case MP_ERR_TIMEOUT:
        snprintf(buf, len, "communicator aborted: rank %d timed out waiting for its ops", who);
        break;
    case MP_ERR_PEER_DEAD:
        if (rank == MP_RANK_OUTSIDE)
            snprintf(buf, len, "communicator aborted: a process outside the group is gone");
        else
            snprintf(buf, len, "communicator aborted: rank %d (pid %d) exited", who,
                     rank >= 0 && rank < s->base.size ? (int)s->pids[rank] : -1);
        break;
    case MP_ERR_CLOSED:
        snprintf(buf, len, "communicator aborted: rank %d closed it with ops pending", who);
        break;
    case MP_ERR_DEADLOCK:
        snprintf(buf, len, "%s", MP_CYCLE_FAILURE);
        break;
    default: {
        shm_header *h = shm_hdr(&s->v);
        int told = atomic_load_explicit(&h->abort_why_ready, memory_order_acquire);
        /* The reason lands just after the cause, and the segment may hold garbage there: a
         * corrupt segment is named whatever the text says. */
        const char *why = told ? h->abort_why : "";
        const char *named = cause == MP_ERR_CORRUPT && strncmp(why, "corrupt segment", 15) != 0 ? "corrupt segment" : "";
        snprintf(buf, len, "communicator aborted by rank %d (%s)%s%s%s%.*s", who, mp_result_str(cause),
                 named[0] || why[0] ? ": " : "", named, named[0] && why[0] ? "; " : "", (int)sizeof h->abort_why, why);
        break;
    }
    }
}

void shm_fail_queue(shm_t *s, step_queue *q, mp_result r, const char *why)
{
    for (mp_step *st = q->head; st; st = st->next)
        fail_step(s, st, r, why);
    while (q->head)
        shm_free_head(s, q);
}

/* Whether peer `r`'s process has exited: its pidfd is readable, or its pid is gone. */
int shm_peer_exited(shm_t *s, int r)
{
    if (s->pidfds[r] >= 0) {
        struct pollfd p = {s->pidfds[r], POLLIN, 0};
        return poll(&p, 1, 0) > 0;
    }
    return kill(s->pids[r], 0) != 0 && errno == ESRCH;
}

/* Whether rank r's fence names a deadlock report that exists (or the overflow value once all
 * are used); reports the segment corrupt when it cannot. */
static int fence_valid(shm_t *s, int r, uint32_t fence)
{
    shm_header *h = shm_hdr(&s->v);
    uint32_t used = atomic_load_explicit(&h->reports_used, memory_order_acquire);
    uint32_t fenced = atomic_load(&h->fenced);
    if (used <= SHM_REPORTS && fenced <= (uint32_t)s->base.size &&
        (fence <= used || (fence == SHM_REPORTS + 1 && used == SHM_REPORTS)))
        return 1;
    shm_found_corrupt(s, "fence of rank %d = %u (%u deadlock report(s) kept, %u rank(s) fenced)", r, fence, used,
                      fenced);
    return 0;
}

mp_result shm_abort_cause(mp_transport *t, int *rank)
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
        shm_found_corrupt(s, "abort_cause = %u, not a result code", cause);
    else if (!atomic_load(&s->corrupt) && cause != MP_OK && (by < 0 || by >= t->size) &&
             !(by == MP_RANK_OUTSIDE && cause == MP_ERR_PEER_DEAD))
        shm_found_corrupt(s, "abort_rank = %d with abort_cause %u, in a group of %d", by, cause, t->size);
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
int shm_fail_unserved(shm_t *s, int departed)
{
    if (s->failed || shm_abort_cause(&s->base, NULL) != MP_OK)
        return 0; /* an abort's own cause names what happened better: shm_fail_everything() gives it */
    if (atomic_load(&my_slot(s)->fence))
        return 0; /* this rank is in the cycle itself: shm_fail_everything() gives its ops DeadlockError */
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
                shm_finish(s, step, op, MP_ERR_ABORTED);
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
            shm_finish(s, step, op, MP_ERR_CLOSED);
            failed = 1;
        }
        if (step->remaining == 0)
            shm_free_head(s, &s->lanes[l]); /* the next step goes on at the next pass */
    }
    return failed;
}

bool shm_abort(mp_transport *t, mp_result cause, int rank, const char *why)
{
    shm_t *s = as_shm(t);
    shm_header *h = shm_hdr(&s->v);
    uint32_t none = MP_OK;
    bool first = atomic_compare_exchange_strong(&h->abort_cause, &none, (uint32_t)cause);
    if (first) {
        atomic_store(&h->abort_rank, rank);
        if (why && why[0])
            snprintf(h->abort_why, sizeof h->abort_why, "%s", why);
        atomic_store_explicit(&h->abort_why_ready, 1, memory_order_release); /* the record is final */
    }
    for (int r = 0; r < t->size; r++)
        shm_ring(s, r);
    return first;
}

/* Fails everything once the communicator is aborted or this rank is fenced as deadlocked; from
 * then on new steps fail on arrival. */
void shm_fail_everything(shm_t *s)
{
    int rank;
    mp_result cause = shm_abort_cause(&s->base, &rank);
    char why[MP_DETAIL_LEN];
    describe_cause(s, cause, rank, why, sizeof why);
    mp_result r = cause == MP_ERR_TIMEOUT || cause == MP_ERR_PEER_DEAD || cause == MP_ERR_DEADLOCK ? cause
                                                                                              : MP_ERR_ABORTED;
    for (int l = 0; l < s->base.nlanes; l++)
        shm_fail_queue(s, &s->lanes[l], r, why);
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
            shm_found_corrupt(s, "pid of rank %d = %d; it attached as pid %d", r, pid, (int)s->pids[r]);
        else if (state != SHM_RANK_READY && state != SHM_RANK_CLOSED)
            shm_found_corrupt(s, "state of rank %d = %u", r, state);
        else if (sleeping > 1 || driving > MAX_THREADS_IN_WAIT || waiting > MAX_THREADS_IN_WAIT)
            shm_found_corrupt(s, "rank %d's sleeping = %u, driving = %u, waiting = %u", r, sleeping, driving, waiting);
        else
            continue;
        return 0;
    }
    return 1;
}

void shm_check_liveness(shm_t *s)
{
    if (!rank_headers_valid(s))
        return;
    for (int r = 0; r < s->base.size; r++) {
        if (r == s->base.rank)
            continue;
        if (atomic_load(&shm_rank_at(&s->v, r)->state) == SHM_RANK_CLOSED)
            continue;
        if (shm_peer_exited(s, r)) {
            shm_abort(&s->base, MP_ERR_PEER_DEAD, r, NULL);
            return;
        }
    }
}

void shm_failure_report(mp_transport *t, const mp_op *op, char *buf, size_t len)
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

void shm_describe_peer(mp_transport *t, const mp_op *op, char *buf, size_t len)
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
