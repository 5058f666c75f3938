/* ncclCommAbort on a thread of its own. NCCL's abort blocks until every CUDA graph that captured
 * work on the communicator is destroyed (NCCL 2.30: src/init.cc ncclCommAbort -> commReclaim ->
 * commDestroySync, which polls until comm->localPersistentRefs is 0; src/enqueue.cc takes a
 * reference per captured plan and reclaimPlan drops it), so no caller may wait for it holding the
 * GIL or the transport's lock, and none may wait for it without a bound. The aborted transport
 * hands its communicators to a reaper thread; its destroy waits NCCL_ABORT_BOUND for the reaper,
 * and past that hands it the rest of the transport (streams, events, memory, the context's
 * retain), which the reaper releases once NCCL lets go. One release path either way: nccl_release. */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <time.h>

#include "core/clock.h"
#include "nccl_internal.h"

struct nccl_reaper {
    const mp_nccl_lib *nccl;
    const mp_cuda_lib *cu;
    mp_CUcontext ctx;         /* made current on the reaper's thread; retained by the transport */
    mp_ncclComm_t comms[2];
    int ncomms;
    pthread_mutex_t lock;
    pthread_cond_t finished;
    int done;                 /* every ncclCommAbort has returned */
    nccl_t *owner;            /* the transport, once its destroy has handed it over */
    int refs;                 /* the thread's and the transport's */
};

static void reaper_put(struct nccl_reaper *r)
{
    pthread_mutex_lock(&r->lock);
    int last = --r->refs == 0;
    pthread_mutex_unlock(&r->lock);
    if (!last)
        return;
    pthread_cond_destroy(&r->finished);
    pthread_mutex_destroy(&r->lock);
    free(r);
}

/* No other thread can be inside a call on these communicators: the transport made every call under
 * its lock and took them from its lanes under it, which NCCL's abort needs (user guide,
 * usage/communicators.rst "Fault Tolerance"). NCCL's own group thread may be: the abort joins it
 * (src/init.cc ncclCommEnsureReady -> src/group.cc ncclGroupJobAbort). */
static void abort_lanes(const struct nccl_reaper *r)
{
    if (r->ctx)
        r->cu->CtxSetCurrent(r->ctx); /* this thread's own: nothing to restore */
    for (int i = 0; i < r->ncomms; i++)
        r->nccl->CommAbort(r->comms[i]);
}

static void abort_comms(struct nccl_reaper *r)
{
    abort_lanes(r);
    pthread_mutex_lock(&r->lock);
    r->done = 1;
    nccl_t *owner = r->owner;
    pthread_cond_broadcast(&r->finished);
    pthread_mutex_unlock(&r->lock);
    if (owner)
        nccl_release(owner);
}

static void *reaper_main(void *arg)
{
    struct nccl_reaper *r = arg;
    pthread_setname_np(pthread_self(), "mp2p-ncclabort"); /* what a stack dump or `top -H` shows */
    abort_comms(r);
    reaper_put(r);
    return NULL;
}

/* Takes the lanes' communicators (the transport never calls NCCL on them again) and starts their
 * abort. Lock held; returns at once. Without memory or a thread, it aborts here, unbounded. */
void nccl_reap_start(nccl_t *n)
{
    struct nccl_reaper local = {.nccl = n->nccl, .cu = n->cu, .ctx = n->ctx};
    for (int l = 0; l < n->base.nlanes; l++) {
        if (n->lanes[l].comm)
            local.comms[local.ncomms++] = n->lanes[l].comm;
        n->lanes[l].comm = NULL;
    }
    struct nccl_reaper *r = calloc(1, sizeof *r);
    if (!r) {
        abort_lanes(&local);
        return;
    }
    *r = local;
    r->refs = 2;
    pthread_mutex_init(&r->lock, NULL);
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC); /* mp_now's clock */
    pthread_cond_init(&r->finished, &attr);
    pthread_condattr_destroy(&attr);
    n->reaper = r;
    pthread_t thread;
    pthread_attr_t detached;
    pthread_attr_init(&detached);
    pthread_attr_setdetachstate(&detached, PTHREAD_CREATE_DETACHED);
    int started = pthread_create(&thread, &detached, reaper_main, r) == 0;
    pthread_attr_destroy(&detached);
    if (!started) {
        abort_comms(r);
        r->refs = 1;
    }
}

int nccl_reap_done(nccl_t *n)
{
    struct nccl_reaper *r = n->reaper;
    if (!r)
        return 1; /* aborted inline, or never */
    pthread_mutex_lock(&r->lock);
    int done = r->done;
    pthread_mutex_unlock(&r->lock);
    return done;
}

/* The end of a destroy, lock not held: releases the transport once its abort has returned, or
 * within NCCL_ABORT_BOUND hands it to the reaper, which releases it when NCCL returns. */
void nccl_reap_finish(nccl_t *n)
{
    struct nccl_reaper *r = n->reaper;
    if (!r) {
        nccl_release(n);
        return;
    }
    double deadline = mp_now() + NCCL_ABORT_BOUND;
    struct timespec until = {(time_t)deadline, (long)((deadline - (double)(time_t)deadline) * 1e9)};
    pthread_mutex_lock(&r->lock);
    while (!r->done && pthread_cond_timedwait(&r->finished, &r->lock, &until) != ETIMEDOUT)
        ;
    int handed = !r->done;
    if (handed)
        r->owner = n;
    pthread_mutex_unlock(&r->lock);
    reaper_put(r);
    if (!handed)
        nccl_release(n);
}
