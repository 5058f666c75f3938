/* Who runs the shm engine: the progress thread, and the posting thread's own passes (post, begin,
 * end). Wakes of peers live here too, since a posting thread defers them until end() in
 * thread-local state that only these functions touch. */
#include "engine.h"

#include <sys/resource.h>
#include <unistd.h>

#include "core/clock.h"

#define SPIN_SECONDS 20e-6     /* the progress thread busy-polls this long after activity */
#define LIVENESS_PERIOD 0.05   /* how often peers' liveness is checked */
#define PROGRESS_NICE 19       /* the progress thread yields the core to every rank's own thread */

/* Between begin() and end() a posting thread collects the peers its own passes would wake and
 * wakes each once at end(): a futex wake costs microseconds, and one exchange often sends twice
 * to the same peer. Per thread, since several threads may post to one communicator at once. */
static _Thread_local struct {
    const void *in_call; /* the transport between its begin() and end() on this thread */
    int deferring;       /* this thread's engine passes inside that call */
    int n;
    int peers[4];
} deferred_wakes;

/* Bumps `rank`'s bell and wakes its progress thread when it sleeps and no thread of the rank
 * drives. News about a message (`message`) wakes it only when the rank has a step posted and
 * not retired: only such a step can use the news, and the rank's next post passes its engine
 * itself, after raising `unfinished` (shm_post's fence pairs with this one). A rank between two
 * ops, in Python, is not woken for nothing: that wake ran its progress thread on the core of a
 * rank that was working (benchmarks/PROFILE.md). */
static void ring(shm_t *s, int rank, int message)
{
    shm_rank *r = shm_rank_at(&s->v, rank);
    atomic_fetch_add(&r->bell, 1);
    atomic_thread_fence(memory_order_seq_cst);
    if ((!message || atomic_load(&r->unfinished)) && atomic_load(&r->sleeping) && !atomic_load(&r->driving))
        mp_futex_wake(&r->bell, 1);
}

void shm_ring(shm_t *s, int rank) { ring(s, rank, 0); }

/* News for the peer of an op, from the engine. This process's own news is seen by the engine
 * holder, which passes again whenever a pass moved anything. */
void shm_ring_peer(shm_t *s, const mp_op *op)
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
    ring(s, op->peer, 1);
}

void shm_send_deferred_wakes(shm_t *s)
{
    for (int i = 0; i < deferred_wakes.n; i++)
        ring(s, deferred_wakes.peers[i], 1);
    deferred_wakes.n = 0;
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

/* Moves newly posted steps onto their lanes and progresses every lane once. Caller holds
 * `engine`. Returns whether anything happened. */
int shm_engine_pass(shm_t *s)
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
        if (!s->failed)
            shm_settle_answered_sends(s);
        shm_fail_everything(s); /* also fails steps posted while the abort raced in */
        return moved;
    }
    for (int l = 0; l < s->base.nlanes; l++)
        moved |= shm_progress_lane(s, &s->lanes[l]);
    if (atomic_load_explicit(&shm_hdr(&s->v)->fenced, memory_order_relaxed))
        moved |= shm_fail_unserved(s, 0);
    return moved;
}

void *shm_progress_main(void *arg)
{
    shm_t *s = arg;
    shm_rank *me = my_slot(s);
    /* A thread that wakes is favoured by the scheduler: at the rank's own priority, a peer's ring
     * made this one preempt a rank's running thread for 4-25 us, the slow mode of a ping-pong
     * (benchmarks/PROFILE.md). At nice 19 it runs when its core is otherwise idle, which is
     * when its work is needed: a thread that waits drives progress itself. Best effort: a
     * thread whose nice cannot be raised keeps its priority and its role. */
    (void)setpriority(PRIO_PROCESS, (id_t)gettid(), PROGRESS_NICE);
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
        int moved = shm_engine_pass(s);
        int failed = s->failed;
        pthread_mutex_unlock(&s->engine);

        double now = mp_now();
        if (now >= next_liveness) {
            if (!failed)
                shm_check_liveness(s);
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

/* Publishes what was posted at once when the engine is free, so that it progresses while Python
 * computes; otherwise the engine's holder is running and the bell makes it look again. */
static void pass_after_post(shm_t *s)
{
    if (pthread_mutex_trylock(&s->engine) == 0) {
        deferred_wakes.deferring = deferred_wakes.in_call == s;
        while (shm_engine_pass(s))
            ;
        deferred_wakes.deferring = 0;
        pthread_mutex_unlock(&s->engine);
    } else {
        shm_ring(s, s->base.rank);
    }
}

mp_result shm_post(mp_transport *t, mp_step *step)
{
    shm_t *s = as_shm(t);
    if (shm_abort_cause(t, NULL) != MP_OK)
        return MP_ERR_ABORTED;
    step->remaining = step->nops;
    step->activated = 0;
    step->settled = NULL;
    int pass_now = !step->more_follow; /* read now: once enqueued, the engine may free the step */
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
            shm_answer(s, op, ch);
    }
    deferred_wakes.deferring = 0;
    atomic_fetch_add(&my_slot(s)->unfinished, 1);
    /* Issued and unfinished before reading what peers posted: see shm_post_descriptor() and
     * ring(). */
    atomic_thread_fence(memory_order_seq_cst);
    enqueue(&s->incoming, step);
    pthread_mutex_unlock(&s->lock);
    if (atomic_load_explicit(&s->watching, memory_order_relaxed))
        atomic_fetch_add(&my_slot(s)->wait_epoch, 1); /* another thread posts during a wait: not blocked */
    /* One pass once the call's last step is posted: a pass after an earlier step could copy a
     * large send before the later steps made their offers, and the peer's copy would wait for
     * this one (an exchange's two copies ran one after the other). */
    if (pass_now)
        pass_after_post(s);
    return MP_OK;
}

mp_result shm_begin(mp_transport *t, void *stream)
{
    (void)stream; /* CPU memory: nothing to order after */
    deferred_wakes.in_call = t;
    deferred_wakes.n = 0;
    return MP_OK;
}

mp_result shm_end(mp_transport *t)
{
    shm_t *s = as_shm(t);
    if (deferred_wakes.in_call != t)
        return MP_OK;
    shm_send_deferred_wakes(s);
    deferred_wakes.in_call = NULL;
    return MP_OK;
}
