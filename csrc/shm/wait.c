/* Waiting on an shm op: the waiting thread drives the engine itself for a while, then sleeps on
 * completions; a wait blocked long enough publishes its pending ops and runs the rounds of the
 * deadlock search. */
#include "engine.h"

#include <sched.h>
#include <stdio.h>
#include <string.h>

#include "core/clock.h"
#include "deadlock.h"

/* A thread waiting on an op polls longer than the progress thread: its peer's reply is usually
 * one Python call away, and a futex sleep and wake cost tens of microseconds on a VM. */
#define DRIVE_SPIN_SECONDS 100e-6
#define DRIVE_YIELD_AFTER 5e-6
/* A wait blocked this long publishes its pending ops and looks for a wait-for cycle, once per
 * period; a cycle seen in two rounds in a row, with nothing in it moved, is a deadlock. */
#define WATCH_AFTER 20e-3
#define WATCH_PERIOD 20e-3

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
        int engine = pthread_mutex_trylock(&s->engine) == 0;
        if (!engine && now >= moved_at + DRIVE_YIELD_AFTER) {
            /* Its holder has work in hand, often a copy the progress thread began before this
             * wait: spinning would take the core from it (at nice 19 it gets almost none), so
             * sleep on the lock. */
            pthread_mutex_lock(&s->engine);
            engine = 1;
            now = mp_now();
        }
        if (engine) {
            seen = atomic_load(&me->bell);
            while (shm_engine_pass(s))
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
    /* Rings that came after the last pass skipped the wake, and later ones wake by themselves.
     * Pass for the skipped ones here: waking the progress thread would cost a futex wake on the
     * way back to Python, and its pass would then take this core from its rank. Only when
     * another thread holds the engine does the progress thread get them. */
    while (atomic_load(&me->bell) != seen) {
        if (pthread_mutex_trylock(&s->engine) != 0) {
            if (atomic_load(&me->sleeping))
                mp_futex_wake(&me->bell, 1);
            break;
        }
        seen = atomic_load(&me->bell);
        while (shm_engine_pass(s))
            ;
        pthread_mutex_unlock(&s->engine);
    }
}

/* Whether `op` is the next op of run `o`: the same channel, shape and call, the following seq. */
static int continues(const shm_watch_op *o, const mp_op *op)
{
    return o->seq + o->count == op->seq && o->kind == (int32_t)op->kind && o->peer == op->peer &&
           o->lane == op->lane && o->nbytes == op->nbytes && o->dtype == op->dtype && o->label == (int32_t)op->label &&
           strncmp(o->call, op->call_name, sizeof o->call - 1) == 0;
}

/* Appends the pending ops of `st` to the published list, as runs: each op joins a run of this
 * step that it continues, or starts one while there is room. */
static void publish_step(shm_watch *w, uint32_t *n, const mp_step *st, const mp_op *waited)
{
    uint32_t first = *n; /* this step's runs */
    for (int i = 0; i < st->nops; i++) {
        const mp_op *op = st->ops[i];
        if (!op)
            continue;
        uint32_t run = first;
        while (run < *n && !continues(&w->ops[run], op))
            run++;
        if (run == *n) {
            if (*n == SHM_WATCH_OPS)
                continue; /* left out; it may still continue a run that has room */
            shm_watch_op *o = &w->ops[(*n)++];
            *o = (shm_watch_op){.seq = op->seq, .nbytes = op->nbytes, .step = op->step, .kind = op->kind,
                                .peer = op->peer, .lane = op->lane, .dtype = op->dtype, .label = op->label};
            snprintf(o->call, sizeof o->call, "%s", op->call_name);
        }
        if (op == waited)
            w->wait_index = (int32_t)run;
        w->ops[run].count++;
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
    shm_fail_unserved(s, 1);
    pthread_mutex_unlock(&s->engine);
    if (mp_op_done(op))
        return;
    publish_pending(s, op);
    char corrupt[MP_DETAIL_LEN] = "";
    shm_cycle *cycle = shm_cycle_find(&s->v, s->base.rank, s->eager_threshold, corrupt, sizeof corrupt);
    if (corrupt[0])
        shm_found_corrupt(s, "%s", corrupt);
    shm_header *h = shm_hdr(&s->v);
    uint32_t lock = atomic_load(&h->detect_lock), used = atomic_load_explicit(&h->reports_used, memory_order_acquire);
    if (cycle && (lock > (uint32_t)s->base.size || used > SHM_REPORTS)) {
        shm_found_corrupt(s, "detect_lock = %u, reports_used = %u", lock, used);
        shm_cycle_free(cycle);
        cycle = NULL;
    }
    if (cycle && shm_cycle_same(cycle, *seen) && shm_cycle_fence(&s->v, cycle, s->pids))
        for (int r = 0; r < s->base.size; r++)
            shm_ring(s, r);
    shm_cycle_free(*seen);
    *seen = cycle;
}

mp_result shm_wait(mp_transport *t, mp_op *op, double deadline, const mp_interrupt *interrupt)
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
