/* Posting on the NCCL transport: each step becomes one NCCL group on its lane's stream, between
 * begin(), which orders the lanes after the caller's stream, and end(), which fences what was
 * posted with one event per lane; debug matching checks a step's descriptors before its data. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

#include "core/clock.h"
#include "core/dtype.h"
#include "nccl_internal.h"

/* ---- issuing: one step, one NCCL group ---------------------------------------------------- */

mp_ncclDataType_t mp_nccl_datatype(int dtype, uint64_t nbytes, int nccl_version, size_t *count)
{
    mp_ncclDataType_t type = MP_NCCL_UINT8;
    size_t size = 1;
    int fp8 = nccl_version >= MP_NCCL_FLOAT8_VERSION;
    switch ((mp_dtype)dtype) {
    case MP_DT_FLOAT64: type = MP_NCCL_FLOAT64; size = 8; break;
    case MP_DT_FLOAT32: type = MP_NCCL_FLOAT32; size = 4; break;
    case MP_DT_FLOAT16: type = MP_NCCL_FLOAT16; size = 2; break;
    case MP_DT_BFLOAT16: type = MP_NCCL_BFLOAT16; size = 2; break;
    case MP_DT_FLOAT8_E4M3FN: type = fp8 ? MP_NCCL_FLOAT8E4M3 : MP_NCCL_UINT8; break;
    case MP_DT_FLOAT8_E5M2: type = fp8 ? MP_NCCL_FLOAT8E5M2 : MP_NCCL_UINT8; break;
    case MP_DT_INT8: type = MP_NCCL_INT8; break;
    case MP_DT_INT32: type = MP_NCCL_INT32; size = 4; break;
    case MP_DT_INT64: type = MP_NCCL_INT64; size = 8; break;
    case MP_DT_UINT32: type = MP_NCCL_UINT32; size = 4; break;
    case MP_DT_UINT64: type = MP_NCCL_UINT64; size = 8; break;
    default: break; /* no NCCL type of its own (bool, int16, fnuz float8, complex, ...): bytes */
    }
    if (nbytes % size) { /* cannot happen for a whole tensor; keep the bytes exact regardless */
        type = MP_NCCL_UINT8;
        size = 1;
    }
    *count = (size_t)(nbytes / size);
    return type;
}

mp_ncclResult_t mp_nccl_issue(const mp_nccl_calls *calls, void *ctx, const mp_step *step, int nccl_version)
{
    mp_ncclResult_t first = calls->group_start(ctx);
    if (first != MP_NCCL_SUCCESS)
        return first;
    for (int i = 0; i < step->nops; i++) {
        const mp_op *op = step->ops[i];
        size_t count;
        mp_ncclDataType_t type = mp_nccl_datatype(op->dtype, op->nbytes, nccl_version, &count);
        mp_ncclResult_t r = op->kind == MP_SEND ? calls->send(ctx, op, count, type)
                                                : calls->recv(ctx, op, count, type);
        if (r != MP_NCCL_SUCCESS && first == MP_NCCL_SUCCESS)
            first = r;
    }
    mp_ncclResult_t end = calls->group_end(ctx, step->lane); /* always: a group must be closed */
    return first != MP_NCCL_SUCCESS ? first : end;
}

/* ---- CUDA graph capture ------------------------------------------------------------------- */

/* The id of the capture `stream` is in now, 0 when none (an invalidated capture counts as one:
 * work on its stream still goes to it, and fails there). Asked at every call, of the caller's
 * stream: whether to capture, query or wait is that stream's state, never a previous call's. */
static unsigned long long capture_of(nccl_t *n, mp_CUstream stream)
{
    int status = 0;
    unsigned long long id = 0;
    if (n->cu->StreamGetCaptureInfo(stream, &status, &id, NULL, NULL, NULL) != MP_CUDA_SUCCESS)
        return 0;
    return status == MP_CU_STREAM_CAPTURE_STATUS_NONE ? 0 : id ? id : 1;
}

/* A fence for the capture under way: only streams of that capture may wait on its event, and only
 * while it lasts (a later wait is refused by the op's capture id, never read from the fence). */
static fence *graph_fence(nccl_t *n, unsigned long long capture, mp_CUresult *r)
{
    fence *f = nccl_fence_take(n, r);
    if (!f)
        return NULL;
    f->capture = capture;
    f->next = n->graph_fences;
    n->graph_fences = f;
    return f;
}

/* An event recorded on a capturing stream adds only an ordering to the graph: no node refers to it
 * and no replay records it (only cuEventRecordWithFlags with CU_EVENT_RECORD_EXTERNAL makes an
 * event node), so a capture's fences are free once it has ended. Every capture the transport
 * takes part in includes lane 0 (begin() joins every lane), so those not lane 0's current one have
 * ended. Lock held, context current. */
static void recycle_graph_fences(nccl_t *n)
{
    if (!n->graph_fences)
        return;
    unsigned long long live = capture_of(n, n->lanes[0].stream);
    for (fence **p = &n->graph_fences; *p;) {
        fence *f = *p;
        if (f->capture == live) {
            p = &f->next;
            continue;
        }
        *p = f->next;
        f->capture = 0;
        f->next = n->spare;
        n->spare = f;
    }
}

/* ---- the real NCCL calls, on one lane's communicator ------------------------------------- */

typedef struct {
    nccl_t *n;
    mp_ncclComm_t comm;
    mp_CUstream stream;
} issuing;

static mp_ncclResult_t real_group_start(void *ctx) { return ((issuing *)ctx)->n->nccl->GroupStart(); }

static mp_ncclResult_t real_group_end(void *ctx, int lane)
{
    (void)lane;
    return ((issuing *)ctx)->n->nccl->GroupEnd();
}

static mp_ncclResult_t real_send(void *ctx, const mp_op *op, size_t count, mp_ncclDataType_t type)
{
    issuing *i = ctx;
    return i->n->nccl->Send(op->buf, count, type, op->peer, i->comm, i->stream);
}

static mp_ncclResult_t real_recv(void *ctx, const mp_op *op, size_t count, mp_ncclDataType_t type)
{
    issuing *i = ctx;
    return i->n->nccl->Recv(op->buf, count, type, op->peer, i->comm, i->stream);
}

static const mp_nccl_calls real_calls = {real_group_start, real_group_end, real_send, real_recv};

static mp_ncclResult_t issue_step(issuing *i, const void *step)
{
    return mp_nccl_issue(&real_calls, i, step, i->n->nccl->version);
}

/* Runs `group` (one NCCL group on lane `l`) and settles it. The NCCL calls run under the lock, as
 * every call on a lane's communicator does, and none of them waits: the communicator is
 * nonblocking, so ncclGroupEnd hands the launch to NCCL's own thread and answers ncclInProgress.
 * The settle then polls with the lock released between polls, watched by the watchdog like device
 * work, and ends at the timeout itself too. The issue lock, held, keeps every other poster out.
 * Lock and issue lock held, and held again on return; MP_NCCL_ABORTED if an abort came meanwhile,
 * MP_NCCL_TIMEOUT with `detail` past the timeout. */
static mp_ncclResult_t launch_locked(nccl_t *n, int l, mp_ncclResult_t (*group)(issuing *, const void *),
                                     const void *arg, char *detail, size_t len)
{
    issuing i = {n, n->lanes[l].comm, n->lanes[l].stream};
    mp_ncclResult_t r = group(&i, arg);
    if (r == MP_NCCL_IN_PROGRESS) { /* NCCL's thread launches it */
        n->launching = 1;
        n->launch_lane = l;
        n->launch_began = mp_now();
        r = nccl_settle_locked(n, l, n->launch_began + n->timeout);
        if (r == MP_NCCL_TIMEOUT)
            nccl_launch_overdue(n, mp_now(), n->timeout, detail, len);
        n->launching = 0;
    }
    return n->cause != MP_OK ? MP_NCCL_ABORTED : r;
}

/* ---- debug matching: a step's descriptors, exchanged and compared before its data ---------- */

static mp_CUresult reserve_check(nccl_t *n, int nops)
{
    if (nops <= n->check_slots)
        return MP_CUDA_SUCCESS;
    int slots = nops > 16 ? nops : 16;
    if (n->check_host)
        n->cu->MemFreeHost(n->check_host);
    if (n->check_dev)
        n->cu->MemFree(n->check_dev);
    n->check_host = NULL;
    n->check_dev = 0;
    n->check_slots = 0;
    void *host = NULL;
    size_t bytes = 2 * (size_t)slots * sizeof(mp_check_desc);
    mp_CUresult c = n->cu->MemAllocHost(&host, bytes);
    if (c == MP_CUDA_SUCCESS && (c = n->cu->MemAlloc(&n->check_dev, bytes)) != MP_CUDA_SUCCESS)
        n->cu->MemFreeHost(host);
    if (c == MP_CUDA_SUCCESS) {
        n->check_host = host;
        n->check_slots = slots;
    }
    return c;
}

typedef struct {
    const mp_step *step;
    mp_CUdeviceptr out, in;
} descriptors;

/* One group: every send's descriptor out, every receive's in, in the step's order. */
static mp_ncclResult_t issue_descriptors(issuing *i, const void *arg)
{
    const descriptors *d = arg;
    const size_t size = sizeof(mp_check_desc);
    mp_ncclResult_t r = i->n->nccl->GroupStart();
    for (int k = 0; r == MP_NCCL_SUCCESS && k < d->step->nops; k++) {
        const mp_op *op = d->step->ops[k];
        void *at = (void *)(uintptr_t)((op->kind == MP_SEND ? d->out : d->in) + (mp_CUdeviceptr)k * size);
        r = op->kind == MP_SEND ? i->n->nccl->Send(at, size, MP_NCCL_UINT8, op->peer, i->comm, i->stream)
                                : i->n->nccl->Recv(at, size, MP_NCCL_UINT8, op->peer, i->comm, i->stream);
    }
    mp_ncclResult_t end = i->n->nccl->GroupEnd(); /* always: a group must be closed */
    return r != MP_NCCL_SUCCESS ? r : end;
}

/* Every send of the step sends its descriptor and every receive takes one, as one group on the
 * step's lane; the host waits for them and compares. Only then may the data's group be issued:
 * NCCL has no way to stop data already launched. Lock and issue lock held. */
static mp_result check_step(nccl_t *n, const mp_step *step, char *detail, size_t len)
{
    lane_t *lane = &n->lanes[step->lane];
    const size_t size = sizeof(mp_check_desc);
    mp_CUresult c = reserve_check(n, step->nops);
    if (c != MP_CUDA_SUCCESS) {
        snprintf(detail, len, "debug matching could not allocate its descriptors: %s", nccl_cu_error(n, c));
        return MP_ERR_SYSTEM;
    }
    mp_check_desc *out = n->check_host, *in = n->check_host + n->check_slots;
    mp_CUdeviceptr dev_out = n->check_dev, dev_in = n->check_dev + (mp_CUdeviceptr)n->check_slots * size;
    for (int i = 0; i < step->nops; i++)
        if (step->ops[i]->kind == MP_SEND)
            mp_check_describe(step->ops[i], &out[i]);
    c = n->cu->MemcpyHtoDAsync(dev_out, out, (size_t)step->nops * size, lane->stream);
    if (c != MP_CUDA_SUCCESS) {
        snprintf(detail, len, "debug matching could not copy its descriptors: %s", nccl_cu_error(n, c));
        return MP_ERR_SYSTEM;
    }
    descriptors d = {step, dev_out, dev_in};
    mp_ncclResult_t r = launch_locked(n, step->lane, issue_descriptors, &d, detail, len);
    if (r == MP_NCCL_ABORTED)
        return n->cause;
    if (r == MP_NCCL_TIMEOUT)
        return MP_ERR_TIMEOUT;
    if (r != MP_NCCL_SUCCESS) {
        snprintf(detail, len, "debug matching: NCCL failed to issue the descriptors on lane %d: %.180s", step->lane,
                 nccl_error(n, lane->comm, r).text);
        return nccl_cause_of(r);
    }
    c = n->cu->MemcpyDtoHAsync(in, dev_in, (size_t)step->nops * size, lane->stream);
    if (c == MP_CUDA_SUCCESS)
        c = n->cu->EventRecord(n->check_done, lane->stream);
    if (c != MP_CUDA_SUCCESS) {
        snprintf(detail, len, "debug matching could not fetch its descriptors: %s", nccl_cu_error(n, c));
        return MP_ERR_SYSTEM;
    }
    nccl_relaxed relaxed = nccl_relax(n); /* another thread may be capturing */
    mp_result waited = nccl_await_event_locked(n, n->check_done, mp_now() + n->timeout, detail, len);
    nccl_unrelax(n, relaxed);
    if (waited == MP_ERR_TIMEOUT)
        snprintf(detail, len, "debug matching: rank %d waited %.1f s on lane %d for the descriptors of step #%llu: a "
                 "peer has not posted the matching ops", n->global_ranks[n->base.rank], n->timeout, step->lane,
                 (unsigned long long)step->ops[0]->step);
    if (waited != MP_OK)
        return waited;
    for (int i = 0; i < step->nops; i++) {
        const mp_op *op = step->ops[i];
        if (op->kind == MP_RECV && mp_check_compare(&in[i], op->peer_global, op, n->global_ranks[n->base.rank], detail, len) < 0)
            return MP_ERR_MISMATCH;
    }
    return MP_OK;
}

/* ---- vtable -------------------------------------------------------------------------------- */

mp_result nccl_begin(mp_transport *t, void *stream)
{
    nccl_t *n = (nccl_t *)t;
    pthread_mutex_lock(&n->issue);
    pthread_mutex_lock(&n->lock);
    mp_result res = n->cause != MP_OK ? n->cause : MP_OK;
    mp_CUcontext saved;
    mp_CUresult entered = nccl_enter(n, &saved);
    if (res == MP_OK && entered != MP_CUDA_SUCCESS)
        res = nccl_fail_cuda(n, ENTER_FAILED, entered);
    n->open_capture = res == MP_OK ? capture_of(n, (mp_CUstream)stream) : 0;
    if (res == MP_OK)
        recycle_graph_fences(n);
    if (n->open_capture && n->check) /* debug matching waits on the host before every step */
        res = MP_ERR_CAPTURE;
    if (res == MP_OK) {
        /* During capture the lanes join the capture through this event, which the graph keeps. */
        mp_CUresult r = MP_CUDA_SUCCESS;
        fence *g = n->open_capture ? graph_fence(n, n->open_capture, &r) : NULL;
        mp_CUevent ready = g ? g->event : n->ready;
        if (r == MP_CUDA_SUCCESS)
            r = n->cu->EventRecord(ready, (mp_CUstream)stream);
        for (int l = 0; r == MP_CUDA_SUCCESS && l < t->nlanes; l++)
            r = n->cu->StreamWaitEvent(n->lanes[l].stream, ready, 0);
        if (r != MP_CUDA_SUCCESS)
            res = nccl_fail_cuda(n, "ordering the lanes after the caller's stream failed", r);
    }
    nccl_leave(n, saved);
    pthread_mutex_unlock(&n->lock);
    pthread_mutex_unlock(&n->issue);
    return res;
}

mp_result nccl_post(mp_transport *t, mp_step *step)
{
    nccl_t *n = (nccl_t *)t;
    pthread_mutex_lock(&n->issue);
    pthread_mutex_lock(&n->lock);
    if (n->cause != MP_OK) {
        mp_result cause = n->cause;
        pthread_mutex_unlock(&n->lock);
        pthread_mutex_unlock(&n->issue);
        return cause;
    }
    int l = step->lane;
    lane_t *lane = &n->lanes[l];
    for (int i = 0; i < step->nops; i++) {
        step->ops[i]->index = i;
        atomic_store_explicit(&step->ops[i]->state, MP_OP_ACTIVE, memory_order_release);
    }
    step->next = NULL;
    if (lane->open_tail)
        lane->open_tail->next = step;
    else
        lane->open_head = step;
    lane->open_tail = step; /* owned from here on: an abort (even while the launch settles) frees it, since
                             * NCCL has taken what it needs of the ops by the time ncclGroupEnd returns */
    mp_CUcontext saved;
    mp_CUresult entered = nccl_enter(n, &saved);
    if (entered != MP_CUDA_SUCCESS) {
        nccl_fail_cuda(n, ENTER_FAILED, entered);
        pthread_mutex_unlock(&n->lock);
        pthread_mutex_unlock(&n->issue);
        return MP_OK; /* its ops report the failure */
    }
    if (n->check && step->nops) {
        char detail[MP_DETAIL_LEN];
        mp_result checked = check_step(n, step, detail, sizeof detail);
        if (checked != MP_OK) {
            nccl_abort_locked(n, checked, t->rank, detail); /* nothing if an abort came first */
            nccl_leave(n, saved);
            pthread_mutex_unlock(&n->lock);
            pthread_mutex_unlock(&n->issue);
            return MP_OK;
        }
    }
    char detail[MP_DETAIL_LEN];
    mp_ncclResult_t r = launch_locked(n, l, issue_step, step, detail, sizeof detail);
    nccl_leave(n, saved);
    if (r != MP_NCCL_SUCCESS && r != MP_NCCL_ABORTED) {
        if (r != MP_NCCL_TIMEOUT)
            snprintf(detail, sizeof detail, "NCCL failed to issue a group on lane %d: %.200s", l,
                     nccl_error(n, lane->comm, r).text);
        nccl_abort_locked(n, nccl_cause_of(r), t->rank, detail);
    }
    pthread_mutex_unlock(&n->lock);
    pthread_mutex_unlock(&n->issue);
    return MP_OK; /* the step is ours either way; a failure is reported through its ops */
}

fence *nccl_fence_take(nccl_t *n, mp_CUresult *r)
{
    fence *f = n->spare;
    *r = MP_CUDA_SUCCESS;
    if (f) {
        n->spare = f->next;
        return f;
    }
    if (!(f = calloc(1, sizeof *f))) {
        *r = MP_CUDA_ERROR_OUT_OF_MEMORY;
        return NULL;
    }
    if ((*r = n->cu->EventCreate(&f->event, MP_CU_EVENT_DISABLE_TIMING)) != MP_CUDA_SUCCESS) {
        free(f);
        return NULL;
    }
    return f;
}

mp_result nccl_end(mp_transport *t)
{
    nccl_t *n = (nccl_t *)t;
    pthread_mutex_lock(&n->issue);
    pthread_mutex_lock(&n->lock);
    mp_result res = MP_OK;
    mp_CUcontext saved;
    mp_CUresult entered = nccl_enter(n, &saved);
    if (entered != MP_CUDA_SUCCESS && n->cause == MP_OK)
        res = nccl_fail_cuda(n, ENTER_FAILED, entered);
    for (int l = 0; l < t->nlanes && n->cause == MP_OK; l++) {
        lane_t *lane = &n->lanes[l];
        if (!lane->open_head)
            continue;
        fence *f;
        mp_CUresult r = MP_CUDA_SUCCESS;
        if (n->open_capture) {
            /* Captured work runs at each replay: its ops are stream-ordered only, and done here. */
            if ((f = graph_fence(n, n->open_capture, &r)))
                r = n->cu->EventRecord(f->event, lane->stream);
            if (r != MP_CUDA_SUCCESS) {
                res = nccl_fail_cuda(n, "recording a lane's event during capture failed", r);
                break;
            }
            for (mp_step *s = lane->open_head; s; s = s->next)
                for (int i = 0; i < s->nops; i++) {
                    s->ops[i]->fence = f;
                    s->ops[i]->captured = n->open_capture;
                }
            nccl_finish_steps(lane->open_head, MP_OK, "");
            lane->open_head = lane->open_tail = NULL;
            continue;
        }
        if ((f = nccl_fence_take(n, &r)))
            r = n->cu->EventRecord(f->event, lane->stream);
        if (!f || r != MP_CUDA_SUCCESS) {
            if (f) {
                f->next = n->spare;
                n->spare = f;
            }
            res = nccl_fail_cuda(n, "recording a lane's completion event failed", r != MP_CUDA_SUCCESS ? r : MP_CUDA_ERROR_OUT_OF_MEMORY);
            break;
        }
        f->steps = lane->open_head;
        f->recorded = mp_now();
        f->next = NULL;
        for (mp_step *s = f->steps; s; s = s->next)
            for (int i = 0; i < s->nops; i++)
                s->ops[i]->fence = f;
        lane->open_head = lane->open_tail = NULL;
        if (lane->tail)
            lane->tail->next = f;
        else
            lane->head = f;
        lane->tail = f;
    }
    nccl_leave(n, saved);
    pthread_mutex_unlock(&n->lock);
    pthread_mutex_unlock(&n->issue);
    return res;
}

/* Orders `stream` after the op. Refused (MP_ERR_CAPTURE, the communicator untouched) where CUDA
 * would fail the wait and invalidate a capture: a captured op's event belongs to its graph, so only
 * a stream in that capture may wait on it; a capturing stream may not wait on an eager op's event
 * (CUDA_ERROR_STREAM_CAPTURE_ISOLATION), so an eager op still pending then cannot be waited. */
mp_result nccl_stream_wait(mp_transport *t, mp_op *op, void *stream)
{
    nccl_t *n = (nccl_t *)t;
    mp_result res = MP_OK;
    pthread_mutex_lock(&n->lock);
    mp_CUcontext saved;
    mp_CUresult entered = nccl_enter(n, &saved);
    if (entered != MP_CUDA_SUCCESS) {
        res = nccl_fail_cuda(n, ENTER_FAILED, entered);
        pthread_mutex_unlock(&n->lock);
        return res;
    }
    unsigned long long capture = capture_of(n, (mp_CUstream)stream);
    const fence *f = op->fence;
    if (op->captured) {
        if (!f || op->captured != capture) /* its capture has ended, or is another: its fence may be reused */
            res = MP_ERR_CAPTURE;
    } else if (!mp_op_done(op) && n->cause == MP_OK) {
        nccl_relaxed relaxed = nccl_relax(n);
        nccl_progress_locked(n);
        nccl_unrelax(n, relaxed);
        if (!mp_op_done(op) && capture)
            res = MP_ERR_CAPTURE;
    }
    if (res == MP_OK && (op->captured || !mp_op_done(op)) && f) {
        mp_CUresult r = n->cu->StreamWaitEvent((mp_CUstream)stream, f->event, 0);
        if (r != MP_CUDA_SUCCESS)
            res = nccl_fail_cuda(n, "making the caller's stream wait failed", r);
    }
    nccl_leave(n, saved);
    pthread_mutex_unlock(&n->lock);
    return res;
}
