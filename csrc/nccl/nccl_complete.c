/* Completion on the NCCL transport: an op finishes when its lane's event fires. Progress, host
 * waits and the watchdog poll those events and NCCL's asynchronous errors: NCCL never times out. */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

#include "core/clock.h"
#include "nccl_internal.h"

/* ---- finishing ops ------------------------------------------------------------------------ */

static void finish_op(mp_op *op, mp_result r, const char *detail)
{
    op->result = r;
    snprintf(op->detail, sizeof op->detail, "%s", detail);
    atomic_store_explicit(&op->state, MP_OP_DONE, memory_order_release);
}

void nccl_finish_steps(mp_step *s, mp_result r, const char *detail)
{
    nccl_finish_ops(s, r, detail);
    nccl_free_steps(s);
}

void nccl_finish_ops(mp_step *s, mp_result r, const char *detail)
{
    for (; s; s = s->next)
        for (int i = 0; i < s->nops; i++)
            if (s->ops[i])
                finish_op(s->ops[i], r, detail);
}

void nccl_free_steps(mp_step *s)
{
    while (s) {
        mp_step *next = s->next;
        free(s);
        s = next;
    }
}

/* ---- polling the device ------------------------------------------------------------------- */

static void pause_polling(unsigned polls)
{
    if (polls > 64) /* a short spin catches fast completions; then poll gently */
        usleep(polls > 4096 ? 1000 : 20);
}

/* How long a settle yields before it sleeps. For a nonblocking communicator NCCL starts a thread
 * per group end, which must run before the group is launched (NCCL 2.30: src/group.cc
 * ncclGroupEndInternal); creating and joining a thread took 52-102 us on the 2-core test machine,
 * and a usleep(20) about 95 us, so a sleep would double the wait: yielding lets that thread have
 * the core, and only a launch slower than this sleeps. */
#define SETTLE_YIELD_SECONDS 0.0005

/* Waits for lane `l`'s communicator (its init, or a group's launch) to leave ncclInProgress.
 * Every poll is a call into NCCL, so each is made under the lock, which is released between polls:
 * NCCL completes a finished group job inside ncclCommGetAsyncError with no lock of its own
 * (src/init.cc ncclCommGetAsyncError -> src/group.cc ncclGroupJobComplete), so two threads polling
 * one communicator at once could free it twice. An abort meanwhile (which takes the communicator)
 * ends the wait with MP_NCCL_ABORTED; `deadline` with MP_NCCL_TIMEOUT; the interrupt of a creation
 * with MP_NCCL_INTERRUPTED. Lock held, and held again on return. */
mp_ncclResult_t nccl_settle_locked(nccl_t *n, int l, double deadline)
{
    mp_ncclResult_t state = MP_NCCL_IN_PROGRESS;
    double yield_until = mp_now() + SETTLE_YIELD_SECONDS;
    for (unsigned polls = 0;; polls++) {
        mp_ncclComm_t comm = n->lanes[l].comm;
        if (n->cause != MP_OK || !comm)
            return MP_NCCL_ABORTED;
        if (n->nccl->CommGetAsyncError(comm, &state) != MP_NCCL_SUCCESS)
            return MP_NCCL_INTERNAL_ERROR;
        if (state != MP_NCCL_IN_PROGRESS)
            return state;
        if (mp_now() > deadline)
            return MP_NCCL_TIMEOUT;
        if (mp_interrupted(n->interrupt))
            return MP_NCCL_INTERRUPTED;
        pthread_mutex_unlock(&n->lock);
        if (mp_now() < yield_until)
            sched_yield(); /* the launch thread may need this core */
        else
            pause_polling(polls);
        pthread_mutex_lock(&n->lock);
    }
}

/* Why a group's launch that began at n->launch_began is overdue: for the watchdog and for the
 * posting thread's own deadline, which report it alike. */
void nccl_launch_overdue(const nccl_t *n, double now, double timeout, char *detail, size_t len)
{
    snprintf(detail, len, "lane %d: a group's launch has not completed after %.1f s (timeout %.1f s): NCCL is "
             "connecting to a peer that has not posted its side", n->launch_lane, now - n->launch_began, timeout);
}

/* Finishes the ops of every fence whose event has fired. Lock held. */
void nccl_progress_locked(nccl_t *n)
{
    for (int l = 0; l < n->base.nlanes; l++) {
        lane_t *lane = &n->lanes[l];
        while (lane->head) {
            fence *f = lane->head;
            mp_CUresult r = n->cu->EventQuery(f->event);
            if (r == MP_CUDA_ERROR_NOT_READY)
                break;
            if (r != MP_CUDA_SUCCESS) {
                nccl_fail_cuda(n, "CUDA reported an error on a lane's stream", r);
                return;
            }
            lane->head = f->next;
            if (!lane->head)
                lane->tail = NULL;
            nccl_finish_steps(f->steps, MP_OK, "");
            f->steps = NULL;
            f->next = n->spare;
            n->spare = f;
        }
    }
}

/* An asynchronous NCCL error (a remote failure, a dead connection) on any lane: its cause, or
 * MP_OK. Lock held. */
static mp_result async_error_locked(nccl_t *n, char *detail, size_t len)
{
    for (int l = 0; l < n->base.nlanes; l++) {
        mp_ncclComm_t comm = n->lanes[l].comm;
        mp_ncclResult_t state = MP_NCCL_SUCCESS;
        if (!comm || n->nccl->CommGetAsyncError(comm, &state) != MP_NCCL_SUCCESS)
            continue;
        if (state != MP_NCCL_SUCCESS && state != MP_NCCL_IN_PROGRESS) {
            snprintf(detail, len, "NCCL reported an asynchronous error on lane %d: %s", l,
                     nccl_error(n, comm, state).text);
            return nccl_cause_of(state);
        }
    }
    return MP_OK;
}

/* Such an error aborts everything. Lock held. */
void nccl_check_async_locked(nccl_t *n)
{
    char detail[256];
    mp_result cause = n->cause == MP_OK ? async_error_locked(n, detail, sizeof detail) : MP_OK;
    if (cause != MP_OK)
        nccl_abort_locked(n, cause, n->base.rank, detail);
}

/* Polls `event` until it fires, releasing the lock between polls: MP_OK, MP_ERR_TIMEOUT past
 * `deadline`, or the cause of an abort or asynchronous error meanwhile. Lock held. */
mp_result nccl_await_event_locked(nccl_t *n, mp_CUevent event, double deadline, char *detail, size_t len)
{
    for (unsigned polls = 0;; polls++) {
        mp_CUresult c = n->cu->EventQuery(event);
        if (c == MP_CUDA_SUCCESS)
            return MP_OK;
        if (c != MP_CUDA_ERROR_NOT_READY) {
            snprintf(detail, len, "CUDA reported an error on a lane's stream: %s", nccl_cu_error(n, c));
            return MP_ERR_SYSTEM;
        }
        mp_result failed = async_error_locked(n, detail, len);
        if (failed != MP_OK)
            return failed;
        if (mp_now() > deadline)
            return MP_ERR_TIMEOUT;
        pthread_mutex_unlock(&n->lock);
        pause_polling(polls);
        pthread_mutex_lock(&n->lock);
        if (n->cause != MP_OK)
            return n->cause;
    }
}

/* ---- vtable ------------------------------------------------------------------------------- */

void nccl_progress(mp_transport *t)
{
    nccl_t *n = (nccl_t *)t;
    pthread_mutex_lock(&n->lock);
    nccl_relaxed relaxed = nccl_relax(n);
    if (n->cause == MP_OK)
        nccl_progress_locked(n);
    nccl_unrelax(n, relaxed);
    pthread_mutex_unlock(&n->lock);
}

mp_result nccl_wait(mp_transport *t, mp_op *op, double deadline, const mp_interrupt *interrupt)
{
    nccl_t *n = (nccl_t *)t;
    for (unsigned polls = 0;; polls++) {
        pthread_mutex_lock(&n->lock);
        nccl_relaxed relaxed = nccl_relax(n);
        if (n->cause == MP_OK) {
            nccl_progress_locked(n);
            if (!mp_op_done(op))
                nccl_check_async_locked(n);
        }
        nccl_unrelax(n, relaxed);
        pthread_mutex_unlock(&n->lock);
        if (mp_op_done(op))
            return MP_OK;
        if (mp_now() > deadline)
            return MP_ERR_TIMEOUT;
        if (mp_interrupted(interrupt))
            return MP_ERR_INTERRUPTED;
        pause_polling(polls);
    }
}

mp_result nccl_watch(mp_transport *t, double timeout, char *detail, size_t len)
{
    nccl_t *n = (nccl_t *)t;
    mp_result cause = MP_OK;
    pthread_mutex_lock(&n->lock);
    nccl_relaxed relaxed = nccl_relax(n); /* a capture on another thread must survive the queries */
    if (n->cause == MP_OK) {
        nccl_progress_locked(n);
        cause = async_error_locked(n, detail, len);
        double now = mp_now();
        if (cause == MP_OK && n->launching && now - n->launch_began > timeout) {
            nccl_launch_overdue(n, now, timeout, detail, len);
            cause = MP_ERR_TIMEOUT;
        }
        for (int l = 0; cause == MP_OK && l < t->nlanes; l++) {
            const fence *f = n->lanes[l].head;
            if (f && now - f->recorded > timeout) {
                snprintf(detail, len, "lane %d: device work fenced %.1f s ago has not completed (timeout %.1f s)", l,
                         now - f->recorded, timeout);
                cause = MP_ERR_TIMEOUT;
            }
        }
    }
    nccl_unrelax(n, relaxed);
    pthread_mutex_unlock(&n->lock);
    return cause;
}

void nccl_describe_peer(mp_transport *t, const mp_op *op, char *buf, size_t len)
{
    (void)t;
    snprintf(buf, len, "%s", op->fence ? "its lane's completion event has not fired"
                                       : "not yet fenced");
}
