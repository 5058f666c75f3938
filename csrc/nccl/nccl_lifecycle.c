/* The NCCL transport's life: error strings, the device context every call enters, creation
 * (communicators, streams, warm-up), abort and destroy, and the vtable that joins the parts. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/clock.h"
#include "core/cycle_report.h"
#include "nccl_internal.h"
#include "nccl_buffering.h"
#include "nccl_param.h"

/* ---- errors and the device's context ------------------------------------------------------ */

const char *nccl_cu_error(nccl_t *n, mp_CUresult r)
{
    const char *s = NULL;
    if (n->cu->GetErrorString(r, &s) != MP_CUDA_SUCCESS || !s)
        s = "unknown CUDA error";
    return s;
}

/* An NCCL result as a report: the result code's own string, then NCCL's last error message only
 * as possibly unrelated. ncclGetLastError ignores its comm and returns one buffer for the whole
 * process, which every warning of any communicator or thread overwrites and nothing clears
 * (NCCL 2.30: src/init.cc ncclGetLastError, src/debug.cc ncclDebugLogV), so it may describe an
 * earlier call or another communicator. Returned by value: `nccl_error(...).text` lives until the
 * end of the caller's full expression (C11 6.2.4), so no buffer outlives the report. */
nccl_why nccl_error(nccl_t *n, mp_ncclComm_t comm, mp_ncclResult_t r)
{
    nccl_why why;
    const char *code = r == MP_NCCL_TIMEOUT       ? "timed out" /* the package's own outcomes */
                     : r == MP_NCCL_ABORTED       ? "the communicator was aborted"
                     : r == MP_NCCL_INTERRUPTED   ? "interrupted"
                                                  : n->nccl->GetErrorString(r);
    if (!code)
        code = "unknown NCCL result";
    const char *last = n->nccl->GetLastError ? n->nccl->GetLastError(comm) : NULL;
    if (last && last[0])
        snprintf(why.text, sizeof why.text, "%s (NCCL's last error message, which may come from another call: %.200s)",
                 code, last);
    else
        snprintf(why.text, sizeof why.text, "%s", code);
    return why;
}

/* The package's failure for an NCCL result: a remote error means a peer failed. */
mp_result nccl_cause_of(mp_ncclResult_t r)
{
    return r == MP_NCCL_TIMEOUT          ? MP_ERR_TIMEOUT
         : r == MP_NCCL_REMOTE_ERROR     ? MP_ERR_PEER_DEAD
         : r == MP_NCCL_INTERRUPTED      ? MP_ERR_INTERRUPTED
                                         : MP_ERR_SYSTEM;
}

/* Makes the device's context current for the calling thread while it works on the device;
 * nccl_leave(n, *saved) restores the thread's own. On a failure nothing may run on the device:
 * the calls would go to no context, or to another device's. */
mp_CUresult nccl_enter(nccl_t *n, mp_CUcontext *saved)
{
    *saved = n->ctx; /* what nccl_leave() leaves alone */
    if (!n->ctx) /* creation failed before the context existed */
        return MP_CUDA_SUCCESS;
    mp_CUcontext cur = NULL;
    mp_CUresult r = n->cu->CtxGetCurrent(&cur);
    if (r == MP_CUDA_SUCCESS && cur != n->ctx && (r = n->cu->CtxSetCurrent(n->ctx)) == MP_CUDA_SUCCESS)
        *saved = cur;
    return r;
}

void nccl_leave(nccl_t *n, mp_CUcontext saved)
{
    if (n->ctx && saved != n->ctx)
        n->cu->CtxSetCurrent(saved);
}

/* Event queries are potentially unsafe calls during a stream capture: in the global mode, which
 * torch.cuda.graph uses, one from any thread invalidates the capture. They run in the relaxed
 * mode, as NCCL runs its own (NCCL 2.30: src/enqueue.cc uploadWork and reclaimPlan,
 * src/include/alloc.h, around cudaThreadExchangeStreamCaptureMode). Captured events are never
 * queried: that is refused in any mode. */
nccl_relaxed nccl_relax(nccl_t *n)
{
    nccl_relaxed saved = {MP_CU_STREAM_CAPTURE_MODE_RELAXED, 0};
    saved.exchanged = n->cu->ThreadExchangeStreamCaptureMode(&saved.mode) == MP_CUDA_SUCCESS;
    return saved;
}

void nccl_unrelax(nccl_t *n, nccl_relaxed saved)
{
    if (saved.exchanged)
        n->cu->ThreadExchangeStreamCaptureMode(&saved.mode);
}

/* ---- abort -------------------------------------------------------------------------------- */

/* Fails every op not yet complete; after this the transport holds no op, and drains their
 * kernels (nccl_drain.c). Lock held. */
static void fail_all(nccl_t *n, mp_result r, const char *detail)
{
    for (int l = 0; l < n->base.nlanes; l++) {
        lane_t *lane = &n->lanes[l];
        lane->unfenced_failed |= lane->open_head && !n->open_capture; /* captured work runs at replay only */
        nccl_finish_steps(lane->open_head, r, detail);
        lane->open_head = lane->open_tail = NULL;
        while (lane->head) {
            fence *f = lane->head;
            lane->head = f->next;
            nccl_finish_steps(f->steps, r, detail);
            f->steps = NULL;
            nccl_drain_fence(n, f);
        }
        lane->tail = NULL;
    }
}

/* Lock held; returns at once. The communicators go to the reaper (nccl_reaper.c), since
 * ncclCommAbort, which never waits for the peers, does wait for the graphs that captured work on
 * them; the ops fail now, and the peers hear of it through the caller's relay. */
bool nccl_abort_locked(nccl_t *n, mp_result cause, int rank, const char *detail)
{
    if (n->cause != MP_OK)
        return false;
    n->cause = cause;
    n->cause_rank = rank;
    snprintf(n->cause_detail, sizeof n->cause_detail, "%s", detail);
    nccl_reap_start(n);
    fail_all(n, cause, n->cause_detail);
    return true;
}

/* A failed CUDA call on the device path: nothing posted after it could complete. Lock held. */
mp_result nccl_fail_cuda(nccl_t *n, const char *what, mp_CUresult r)
{
    char detail[256];
    snprintf(detail, sizeof detail, "%s: %s", what, nccl_cu_error(n, r));
    nccl_abort_locked(n, MP_ERR_SYSTEM, n->base.rank, detail);
    return MP_ERR_SYSTEM;
}

static bool nccl_abort(mp_transport *t, mp_result cause, int rank, const char *why)
{
    nccl_t *n = (nccl_t *)t;
    pthread_mutex_lock(&n->lock);
    char detail[MP_DETAIL_LEN], by[32] = "outside the group";
    if (rank >= 0 && rank < t->size)
        snprintf(by, sizeof by, "rank %d", n->global_ranks[rank]);
    if (cause == MP_ERR_DEADLOCK) /* the cycle's report follows, as on shm */
        snprintf(detail, sizeof detail, "%s", MP_CYCLE_FAILURE);
    else
        snprintf(detail, sizeof detail, "%s (%s)%s%s", mp_result_str(cause), by, why && why[0] ? ": " : "",
                 why ? why : "");
    bool first = nccl_abort_locked(n, cause, rank, detail);
    pthread_mutex_unlock(&n->lock);
    return first;
}

static mp_result nccl_abort_cause(mp_transport *t, int *rank)
{
    nccl_t *n = (nccl_t *)t;
    pthread_mutex_lock(&n->lock);
    mp_result cause = n->cause;
    *rank = n->cause_rank;
    pthread_mutex_unlock(&n->lock);
    return cause;
}

/* Why the communicator was aborted (for op NULL); an op's own failure says the rest. */
static void nccl_failure_report(mp_transport *t, const mp_op *op, char *buf, size_t len)
{
    nccl_t *n = (nccl_t *)t;
    pthread_mutex_lock(&n->lock);
    snprintf(buf, len, "%s", op ? "" : n->cause_detail);
    pthread_mutex_unlock(&n->lock);
}

/* ---- destroy, and the vtable that joins the files ----------------------------------------- */

static void nccl_destroy(mp_transport *t)
{
    nccl_t *n = (nccl_t *)t;
    /* Work already on the streams is let finish, since healthy peers may be about to complete it;
     * a peer's failure (an asynchronous error) ends the drain at once, a silent peer the timeout.
     * Then the communicators are aborted, never destroyed, since ncclCommDestroy can wait on the
     * peers. */
    double deadline = mp_now() + n->timeout;
    for (;;) {
        pthread_mutex_lock(&n->lock);
        nccl_relaxed relaxed = nccl_relax(n);
        if (n->cause == MP_OK)
            nccl_progress_locked(n);
        nccl_check_async_locked(n); /* a peer that died ends the drain at once */
        nccl_unrelax(n, relaxed);
        int pending = 0;
        for (int l = 0; l < t->nlanes; l++)
            pending |= n->lanes[l].head != NULL || n->lanes[l].open_head != NULL;
        if (!pending || n->cause != MP_OK || mp_now() > deadline) {
            nccl_abort_locked(n, MP_ERR_CLOSED, t->rank, "the communicator was closed with the op pending");
            pthread_mutex_unlock(&n->lock);
            break;
        }
        pthread_mutex_unlock(&n->lock);
        usleep(200);
    }
    /* The bindings release the failed ops' buffers once this returns, so it waits for their kernels
     * (nccl_drain.c), which end at the abort flag once they run: only device work queued before
     * them (the caller's, which the lanes wait on) can hold them, and for at most the timeout. */
    for (double until = mp_now() + n->timeout; nccl_failed_ops_running(t) && mp_now() < until;)
        usleep(200);
    nccl_reap_finish(n);
}

/* Releases what the transport holds on the device, and the transport: called once its
 * communicators' abort has returned, by its destroy or by the reaper (nccl_reaper.c). */
void nccl_release(nccl_t *n)
{
    if (n->ctx) {
        mp_CUcontext saved;
        nccl_enter(n, &saved); /* best effort: the process may be ending */
        for (int l = 0; l < n->base.nlanes; l++)
            if (n->lanes[l].stream)
                n->cu->StreamDestroy(n->lanes[l].stream);
        fence *lists[] = {n->spare, n->draining, n->graph_fences};
        for (size_t k = 0; k < sizeof lists / sizeof *lists; k++)
            while (lists[k]) {
                fence *f = lists[k];
                lists[k] = f->next;
                n->cu->EventDestroy(f->event);
                free(f);
            }
        if (n->ready)
            n->cu->EventDestroy(n->ready);
        if (n->check_done)
            n->cu->EventDestroy(n->check_done);
        if (n->check_host)
            n->cu->MemFreeHost(n->check_host);
        if (n->check_dev)
            n->cu->MemFree(n->check_dev);
        if (n->scratch)
            n->cu->MemFree(n->scratch);
        nccl_leave(n, saved);
    }
    if (n->ctx_retained)
        n->cu->DevicePrimaryCtxRelease(n->device);
    pthread_mutex_destroy(&n->lock);
    pthread_mutex_destroy(&n->issue);
    free(n->global_ranks);
    free(n);
}

static const mp_transport_ops nccl_ops = {
    .name = "nccl",
    .post = nccl_post,
    .wait = nccl_wait,
    .abort = nccl_abort,
    .abort_cause = nccl_abort_cause,
    .describe_peer = nccl_describe_peer,
    .destroy = nccl_destroy,
    .caps = MP_CAP_DEVICE_STREAMS | MP_CAP_BEGIN_END_MAY_WAIT, /* `issue` is held across a group's launch */
    .begin = nccl_begin,
    .end = nccl_end,
    .progress = nccl_progress,
    .stream_wait = nccl_stream_wait,
    .watch = nccl_watch,
    .failure_report = nccl_failure_report,
    .failed_ops_running = nccl_failed_ops_running,
};

/* ---- creation ------------------------------------------------------------------------------- */

/* One tiny group per lane to every ring neighbour, so that connection setup happens now, in the
 * same order on every rank, and not inside the first exchange; a neighbour that never comes ends
 * it at the deadline. Lock held. */
static mp_result warm_up(nccl_t *n, double deadline, char *err, size_t errlen)
{
    int rank = n->base.rank, size = n->base.size;
    int next = (rank + 1) % size, prev = (rank + size - 1) % size;
    for (int l = 0; l < n->base.nlanes; l++) {
        lane_t *lane = &n->lanes[l];
        mp_ncclComm_t comm = lane->comm;
        char *base = (char *)(uintptr_t)n->scratch;
        mp_ncclResult_t r = n->nccl->GroupStart();
        if (r == MP_NCCL_SUCCESS) {
            n->nccl->Send(base, 1, MP_NCCL_UINT8, next, comm, lane->stream);
            n->nccl->Recv(base + 1, 1, MP_NCCL_UINT8, prev, comm, lane->stream);
            if (next != prev) {
                n->nccl->Send(base, 1, MP_NCCL_UINT8, prev, comm, lane->stream);
                n->nccl->Recv(base + 2, 1, MP_NCCL_UINT8, next, comm, lane->stream);
            }
            r = n->nccl->GroupEnd();
            if (r == MP_NCCL_IN_PROGRESS)
                r = nccl_settle_locked(n, l, deadline);
        }
        if (r != MP_NCCL_SUCCESS) {
            snprintf(err, errlen, "warming up lane %d failed: %s", l, nccl_error(n, comm, r).text);
            return nccl_cause_of(r);
        }
        mp_CUresult c = n->cu->EventRecord(n->ready, lane->stream);
        /* Polled until it fires: a first NOT_READY is the usual answer right after recording. */
        while (c == MP_CUDA_SUCCESS && (c = n->cu->EventQuery(n->ready)) == MP_CUDA_ERROR_NOT_READY) {
            if (mp_now() > deadline) {
                snprintf(err, errlen, "warming up lane %d: a neighbour (rank %d or %d) did not take part in time", l,
                         n->global_ranks[prev], n->global_ranks[next]);
                return MP_ERR_TIMEOUT;
            }
            if (mp_interrupted(n->interrupt))
                return MP_ERR_INTERRUPTED;
            usleep(100);
            c = MP_CUDA_SUCCESS;
        }
        if (c != MP_CUDA_SUCCESS) {
            snprintf(err, errlen, "warming up lane %d: %s", l, nccl_cu_error(n, c));
            return MP_ERR_SYSTEM;
        }
    }
    return MP_OK;
}

static mp_result open_device(nccl_t *n, const mp_nccl_config *cfg, char *err, size_t errlen)
{
    const mp_cuda_lib *cu = n->cu;
    mp_CUdevice dev;
    mp_CUresult r = cu->Init(0);
    if (r == MP_CUDA_SUCCESS)
        r = cu->DeviceGet(&dev, cfg->device);
    if (r == MP_CUDA_SUCCESS && (r = cu->DevicePrimaryCtxRetain(&n->ctx, dev)) == MP_CUDA_SUCCESS)
        n->ctx_retained = 1;
    if (r != MP_CUDA_SUCCESS) {
        snprintf(err, errlen, "CUDA device %d is not usable: %s", cfg->device, nccl_cu_error(n, r));
        return MP_ERR_SYSTEM;
    }
    int least = 0, greatest = 0;
    mp_CUcontext saved;
    r = nccl_enter(n, &saved);
    if (r == MP_CUDA_SUCCESS)
        r = cu->CtxGetStreamPriorityRange(&least, &greatest);
    for (int l = 0; r == MP_CUDA_SUCCESS && l < cfg->nlanes; l++)
        r = cu->StreamCreateWithPriority(&n->lanes[l].stream, MP_CU_STREAM_NON_BLOCKING,
                                         cfg->high_priority ? greatest : least);
    if (r == MP_CUDA_SUCCESS)
        r = cu->EventCreate(&n->ready, MP_CU_EVENT_DISABLE_TIMING);
    if (r == MP_CUDA_SUCCESS && cfg->check)
        r = cu->EventCreate(&n->check_done, MP_CU_EVENT_DISABLE_TIMING);
    if (r == MP_CUDA_SUCCESS)
        r = cu->MemAlloc(&n->scratch, 16);
    nccl_leave(n, saved);
    if (r != MP_CUDA_SUCCESS) {
        snprintf(err, errlen, "creating streams on CUDA device %d failed: %s", cfg->device, nccl_cu_error(n, r));
        return MP_ERR_SYSTEM;
    }
    return MP_OK;
}

static mp_result open_comms(nccl_t *n, const mp_nccl_config *cfg, double deadline, char *err, size_t errlen)
{
    /* `size` covers only the fields set (NCCL copies `size` bytes: src/init.cc parseCommConfig),
     * so that no byte of padding is read as a later release's field. */
    mp_ncclConfigPrefix config = {
        .size = MP_NCCL_CONFIG_PREFIX_SIZE,
        .magic = MP_NCCL_CONFIG_MAGIC,
        .version = MP_NCCL_MIN_VERSION,
        .blocking = 0,
    };
    for (int l = 0; l < cfg->nlanes; l++) {
        mp_ncclResult_t r = n->nccl->CommInitRankConfig(&n->lanes[l].comm, cfg->size, cfg->ids[l], cfg->rank, &config);
        if (r != MP_NCCL_SUCCESS && r != MP_NCCL_IN_PROGRESS) {
            snprintf(err, errlen, "ncclCommInitRankConfig for lane %d failed: %s", l,
                     nccl_error(n, n->lanes[l].comm, r).text);
            return MP_ERR_SYSTEM;
        }
    }
    for (int l = 0; l < cfg->nlanes; l++) {
        mp_ncclResult_t r = nccl_settle_locked(n, l, deadline);
        if (r != MP_NCCL_SUCCESS) {
            snprintf(err, errlen, r == MP_NCCL_TIMEOUT ? "lane %d: not every rank joined the NCCL communicator in "
                                                         "time: %s"
                                                       : "lane %d: NCCL initialisation failed: %s",
                     l, nccl_error(n, n->lanes[l].comm, r).text);
            return nccl_cause_of(r);
        }
    }
    return MP_OK;
}

mp_result mp_nccl_open(const mp_nccl_config *cfg, const mp_nccl_lib *nccl, const mp_cuda_lib *cuda,
                       mp_transport **out, char *err, size_t errlen)
{
    /* A blocking communicator's init and group ends block inside NCCL, where no timeout, peer's
     * failure or Ctrl-C can reach them: refused, rather than silently unabortable.
     * NCCL_COMM_BLOCKING overrides the config (src/init.cc envConfigOverride). Read as NCCL will
     * read it, its conf files included (nccl_param.c): rank 0's NCCL has loaded them into the
     * environment at ncclGetUniqueId, the other ranks' not yet. NCCL reads it once per process, at
     * its first communicator, and keeps it (src/include/param.h NCCL_PARAM); this reads it at each
     * creation, which agrees unless it has changed since. */
    mp_nccl_param blocking;
    mp_nccl_param_read(&blocking, "NCCL_COMM_BLOCKING", -1, nccl->version, MP_NCCL_SYSTEM_CONF);
    if (blocking.value == 1) {
        int in_file = blocking.from == MP_NCCL_PARAM_FILE;
        snprintf(err, errlen, "NCCL_COMM_BLOCKING=1 %s%s makes NCCL's communicators blocking (it overrides the "
                 "nonblocking config this backend asks for), and a blocking call could then not be ended by a "
                 "timeout, a peer's failure or Ctrl-C: %s, before the process makes its first NCCL communicator "
                 "(NCCL reads it once per process)",
                 in_file ? "in NCCL's conf file " : "in the environment", blocking.file,
                 in_file ? "remove it from that file, or set NCCL_COMM_BLOCKING=0 in the environment, which no conf "
                           "file overrides"
                         : "unset it, or set it to 0");
        return MP_ERR_SYSTEM;
    }
    nccl_t *n = calloc(1, sizeof *n);
    int *global_ranks = malloc((size_t)cfg->size * sizeof *global_ranks);
    if (!n || !global_ranks) {
        free(n);
        free(global_ranks);
        snprintf(err, errlen, "out of memory");
        return MP_ERR_SYSTEM;
    }
    memcpy(global_ranks, cfg->global_ranks, (size_t)cfg->size * sizeof *global_ranks);
    n->global_ranks = global_ranks;
    n->base.ops = &nccl_ops;
    n->base.rank = cfg->rank;
    n->base.size = cfg->size;
    n->base.nlanes = cfg->nlanes;
    n->base.buffered_at_most = mp_nccl_buffered_at_most(nccl->version, MP_NCCL_SYSTEM_CONF);
    n->nccl = nccl;
    n->cu = cuda;
    n->device = cfg->device;
    n->timeout = cfg->timeout;
    n->check = cfg->check;
    pthread_mutex_init(&n->issue, NULL);
    pthread_mutex_init(&n->lock, NULL);
    double deadline = mp_now() + cfg->timeout;
    n->interrupt = cfg->interrupt;
    mp_result res = open_device(n, cfg, err, errlen);
    if (res == MP_OK) {
        mp_CUcontext saved;
        mp_CUresult entered = nccl_enter(n, &saved);
        if (entered != MP_CUDA_SUCCESS) {
            snprintf(err, errlen, "%s: %s", ENTER_FAILED, nccl_cu_error(n, entered));
            res = MP_ERR_SYSTEM;
        } else {
            pthread_mutex_lock(&n->lock); /* every NCCL call on the lanes is made under it */
            res = open_comms(n, cfg, deadline, err, errlen);
            if (res == MP_OK)
                res = warm_up(n, deadline, err, errlen);
            pthread_mutex_unlock(&n->lock);
        }
        nccl_leave(n, saved);
    }
    n->interrupt = NULL; /* the caller's, valid during this call only */
    if (res != MP_OK) {
        nccl_destroy(&n->base); /* aborts whatever communicators exist */
        return res;
    }
    *out = &n->base;
    return MP_OK;
}
