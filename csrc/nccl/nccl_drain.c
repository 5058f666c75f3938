/* The device work of ops an abort failed. An abort fails the ops at once (the caller must not wait
 * on a peer that may be dead), but their kernels end only at their next read of NCCL's abort flag,
 * which they make only while they wait: one running at the abort, or starting after it, still moves
 * whatever data is ready, into the failed receive's buffer too (src/device/common.h ncclKernelMain;
 * src/device/primitives.h checkAbort; src/device/prims_simple.h waitPeer). ncclCommAbort does not
 * wait for them: it synchronizes NCCL's own streams, not the lane streams (src/init.cc
 * commDestroySync). So the bindings keep a failed op's buffers until nccl_failed_ops_running says
 * its kernels are over:
 *  - fenced steps: their lane's event, already recorded after them, fires;
 *  - steps issued since begin(), not yet fenced (a launch that may still be on NCCL's group thread):
 *    once ncclCommAbort has returned, which joins that thread (src/init.cc ncclCommEnsureReady ->
 *    src/group.cc ncclGroupJobAbort), an event recorded on the lane then fires. */
#include "nccl_internal.h"

/* Moves the steps' fence to the drained list; lock held. */
void nccl_drain_fence(nccl_t *n, fence *f)
{
    f->next = n->draining;
    n->draining = f;
}

/* Records, on each lane whose unfenced steps failed, an event after whatever NCCL enqueued there.
 * Lock held; called once ncclCommAbort has returned. A lane whose event cannot be recorded has no
 * working stream, on which nothing runs. */
static void fence_unfenced(nccl_t *n)
{
    mp_CUcontext saved;
    if (nccl_enter(n, &saved) != MP_CUDA_SUCCESS)
        return;
    for (int l = 0; l < n->base.nlanes; l++) {
        if (!n->lanes[l].unfenced_failed)
            continue;
        n->lanes[l].unfenced_failed = 0;
        mp_CUresult r;
        fence *f = nccl_fence_take(n, &r);
        if (f && n->cu->EventRecord(f->event, n->lanes[l].stream) == MP_CUDA_SUCCESS) {
            nccl_drain_fence(n, f);
        } else if (f) {
            f->next = n->spare;
            n->spare = f;
        }
    }
    nccl_leave(n, saved);
}

static int unfenced_pending(const nccl_t *n)
{
    for (int l = 0; l < n->base.nlanes; l++)
        if (n->lanes[l].unfenced_failed)
            return 1;
    return 0;
}

/* Lock held. An event that reports an error stands for a context on which nothing runs. */
static int draining_locked(nccl_t *n)
{
    if (unfenced_pending(n)) {
        if (!nccl_reap_done(n))
            return 1;
        fence_unfenced(n);
    }
    nccl_relaxed relaxed = nccl_relax(n);
    for (fence **p = &n->draining; *p;) {
        fence *f = *p;
        if (n->cu->EventQuery(f->event) == MP_CUDA_ERROR_NOT_READY) {
            p = &f->next;
            continue;
        }
        *p = f->next;
        f->next = n->spare;
        n->spare = f;
    }
    nccl_unrelax(n, relaxed);
    return n->draining != NULL;
}

int nccl_failed_ops_running(mp_transport *t)
{
    nccl_t *n = (nccl_t *)t;
    pthread_mutex_lock(&n->lock);
    int running = draining_locked(n);
    pthread_mutex_unlock(&n->lock);
    return running;
}
