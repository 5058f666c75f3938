/* The NCCL transport. Ops complete through CUDA events: end() records one event per lane
 * after the steps posted since begin(), and progress() finishes the ops of every event that has
 * fired, in order. Host waits poll those events and ncclCommGetAsyncError against a deadline,
 * because NCCL itself never times out. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "dtype.h"
#include "match_check.h"
#include "nccl.h"

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

/* ---- the transport ------------------------------------------------------------------------ */

typedef struct fence {
    mp_CUevent event;
    double recorded;         /* mp_now() at end(): the watchdog's clock for its steps */
    mp_step *steps;          /* the steps this event completes, in issue order */
    struct fence *next;
} fence;

typedef struct {
    mp_ncclComm_t comm;      /* NULL once aborted */
    mp_CUstream stream;
    mp_step *open_head, *open_tail; /* issued since begin(), not yet fenced */
    fence *head, *tail;      /* fenced, oldest first: events on one stream fire in order */
} lane_t;

typedef struct {
    mp_transport base;
    const mp_nccl_lib *nccl;
    const mp_cuda_lib *cu;
    int device;
    mp_CUcontext ctx;        /* the device's primary context, which torch uses too */
    int ctx_retained;
    mp_CUevent ready;        /* recorded on the caller's stream by begin() */
    mp_CUdeviceptr scratch;  /* warm-up buffers */
    double timeout;
    const mp_interrupt *interrupt; /* the caller's, while creation waits for the group */
    lane_t lanes[2];
    fence *spare;            /* recycled fences, each with its event */
    /* Fences recorded during a CUDA graph capture: their events belong to the graph, which
     * re-records them at every replay, so they are never recycled nor queried. */
    fence *graph_fences;
    int capturing;           /* the last call's stream was capturing: no host queries */
    /* `issue` orders the posting calls of threads sharing the communicator; `lock` guards the
     * state and every call on a lane communicator, and is dropped while a launch settles, so
     * that an abort from the relay or the watchdog reaches a group stuck in ncclInProgress. */
    pthread_mutex_t issue;
    pthread_mutex_t lock;
    mp_result cause;
    int cause_rank;
    char cause_detail[MP_DETAIL_LEN];
    /* Debug matching: descriptors out (the first `check_slots`) and in (the next), in pinned
     * host memory and on the device, and the event a step's descriptors are waited on with. */
    int check;
    int global_rank;
    mp_check_desc *check_host;
    mp_CUdeviceptr check_dev;
    int check_slots;
    mp_CUevent check_done;
} nccl_t;

static const char *cu_error(nccl_t *n, mp_CUresult r)
{
    const char *s = NULL;
    if (n->cu->GetErrorString(r, &s) != MP_CUDA_SUCCESS || !s)
        s = "unknown CUDA error";
    return s;
}

static const char *nccl_error(nccl_t *n, mp_ncclComm_t comm, mp_ncclResult_t r)
{
    const char *last = n->nccl->GetLastError && comm ? n->nccl->GetLastError(comm) : NULL;
    return last && last[0] ? last : n->nccl->GetErrorString(r);
}

/* Makes the device's context current for the calling thread while it works on the device;
 * leave(n, *saved) restores the thread's own. On a failure nothing may run on the device: the
 * calls would go to no context, or to another device's. */
static mp_CUresult enter(nccl_t *n, mp_CUcontext *saved)
{
    *saved = n->ctx; /* what leave() leaves alone */
    if (!n->ctx) /* creation failed before the context existed */
        return MP_CUDA_SUCCESS;
    mp_CUcontext cur = NULL;
    mp_CUresult r = n->cu->CtxGetCurrent(&cur);
    if (r == MP_CUDA_SUCCESS && cur != n->ctx && (r = n->cu->CtxSetCurrent(n->ctx)) == MP_CUDA_SUCCESS)
        *saved = cur;
    return r;
}

#define ENTER_FAILED "making the CUDA device's primary context current failed"

static void leave(nccl_t *n, mp_CUcontext saved)
{
    if (n->ctx && saved != n->ctx)
        n->cu->CtxSetCurrent(saved);
}

/* Whether `stream` is capturing a CUDA graph, when nothing may query or wait on the host. */
static int is_capturing(nccl_t *n, mp_CUstream stream)
{
    int status = 0;
    return n->cu->StreamIsCapturing(stream, &status) == MP_CUDA_SUCCESS && status == MP_CU_STREAM_CAPTURE_STATUS_ACTIVE;
}

/* A fence with a fresh event, owned by the graph being captured until the transport is destroyed. */
static fence *graph_fence(nccl_t *n, mp_CUresult *r)
{
    fence *f = calloc(1, sizeof *f);
    *r = f ? n->cu->EventCreate(&f->event, MP_CU_EVENT_DISABLE_TIMING) : MP_CUDA_ERROR_OUT_OF_MEMORY;
    if (*r != MP_CUDA_SUCCESS) {
        free(f);
        return NULL;
    }
    f->next = n->graph_fences;
    n->graph_fences = f;
    return f;
}

static void finish_op(mp_op *op, mp_result r, const char *detail)
{
    op->result = r;
    snprintf(op->detail, sizeof op->detail, "%s", detail);
    atomic_store_explicit(&op->state, MP_OP_DONE, memory_order_release);
}

static void finish_steps(mp_step *s, mp_result r, const char *detail)
{
    while (s) {
        mp_step *next = s->next;
        for (int i = 0; i < s->nops; i++)
            if (s->ops[i])
                finish_op(s->ops[i], r, detail);
        free(s);
        s = next;
    }
}

/* Fails every op not yet complete; after this the transport holds no op. Lock held. */
static void fail_all(nccl_t *n, mp_result r, const char *detail)
{
    for (int l = 0; l < n->base.nlanes; l++) {
        lane_t *lane = &n->lanes[l];
        finish_steps(lane->open_head, r, detail);
        lane->open_head = lane->open_tail = NULL;
        while (lane->head) {
            fence *f = lane->head;
            lane->head = f->next;
            finish_steps(f->steps, r, detail);
            f->steps = NULL;
            f->next = n->spare;
            n->spare = f;
        }
        lane->tail = NULL;
    }
}

/* The package's failure for an NCCL result: a remote error means a peer failed. */
static mp_result cause_of(mp_ncclResult_t r)
{
    return r == MP_NCCL_TIMEOUT          ? MP_ERR_TIMEOUT
         : r == MP_NCCL_REMOTE_ERROR     ? MP_ERR_PEER_DEAD
         : r == MP_NCCL_INTERRUPTED      ? MP_ERR_INTERRUPTED
                                         : MP_ERR_SYSTEM;
}

/* Lock held. ncclCommAbort does not wait for the peers, so it is safe at any point. */
static void abort_locked(nccl_t *n, mp_result cause, int rank, const char *detail)
{
    if (n->cause != MP_OK)
        return;
    n->cause = cause;
    n->cause_rank = rank;
    snprintf(n->cause_detail, sizeof n->cause_detail, "%s", detail);
    mp_CUcontext saved;
    enter(n, &saved); /* ncclCommAbort must run regardless */
    for (int l = 0; l < n->base.nlanes; l++)
        if (n->lanes[l].comm) {
            n->nccl->CommAbort(n->lanes[l].comm);
            n->lanes[l].comm = NULL;
        }
    leave(n, saved);
    fail_all(n, cause, n->cause_detail);
}

/* A failed CUDA call on the device path: nothing posted after it could complete. Lock held. */
static mp_result fail_cuda(nccl_t *n, const char *what, mp_CUresult r)
{
    char detail[256];
    snprintf(detail, sizeof detail, "%s: %s", what, cu_error(n, r));
    abort_locked(n, MP_ERR_SYSTEM, n->base.rank, detail);
    return MP_ERR_SYSTEM;
}

static void pause_polling(unsigned polls)
{
    if (polls > 64) /* a short spin catches fast completions; then poll gently */
        usleep(polls > 4096 ? 1000 : 20);
}

/* Waits for ncclGroupEnd / init on a nonblocking communicator to leave ncclInProgress. With
 * `locked`, the caller holds n->lock: it is released between polls, and an abort meanwhile
 * (which frees `comm`) ends the wait with MP_NCCL_ABORTED. */
static mp_ncclResult_t settle(nccl_t *n, mp_ncclComm_t comm, double deadline, int locked)
{
    mp_ncclResult_t state = MP_NCCL_IN_PROGRESS;
    for (unsigned polls = 0;; polls++) {
        if (n->nccl->CommGetAsyncError(comm, &state) != MP_NCCL_SUCCESS)
            return MP_NCCL_INTERNAL_ERROR;
        if (state != MP_NCCL_IN_PROGRESS)
            return state;
        if (mp_now() > deadline)
            return MP_NCCL_TIMEOUT;
        if (mp_interrupted(n->interrupt))
            return MP_NCCL_INTERRUPTED;
        if (locked)
            pthread_mutex_unlock(&n->lock);
        pause_polling(polls);
        if (locked) {
            pthread_mutex_lock(&n->lock);
            if (n->cause != MP_OK)
                return MP_NCCL_ABORTED;
        }
    }
}

/* Finishes the ops of every fence whose event has fired. Lock held. */
static void progress_locked(nccl_t *n)
{
    for (int l = 0; l < n->base.nlanes; l++) {
        lane_t *lane = &n->lanes[l];
        while (lane->head) {
            fence *f = lane->head;
            mp_CUresult r = n->cu->EventQuery(f->event);
            if (r == MP_CUDA_ERROR_NOT_READY)
                break;
            if (r != MP_CUDA_SUCCESS) {
                fail_cuda(n, "CUDA reported an error on a lane's stream", r);
                return;
            }
            lane->head = f->next;
            if (!lane->head)
                lane->tail = NULL;
            finish_steps(f->steps, MP_OK, "");
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
        mp_ncclResult_t state = MP_NCCL_SUCCESS;
        if (!n->lanes[l].comm || n->nccl->CommGetAsyncError(n->lanes[l].comm, &state) != MP_NCCL_SUCCESS)
            continue;
        if (state != MP_NCCL_SUCCESS && state != MP_NCCL_IN_PROGRESS) {
            snprintf(detail, len, "NCCL reported an asynchronous error on lane %d: %s", l,
                     nccl_error(n, n->lanes[l].comm, state));
            return cause_of(state);
        }
    }
    return MP_OK;
}

/* Such an error aborts everything. Lock held. */
static void check_async_locked(nccl_t *n)
{
    char detail[256];
    mp_result cause = n->cause == MP_OK ? async_error_locked(n, detail, sizeof detail) : MP_OK;
    if (cause != MP_OK)
        abort_locked(n, cause, n->base.rank, detail);
}

/* Polls `event` until it fires, releasing the lock between polls: MP_OK, MP_ERR_TIMEOUT past
 * `deadline`, or the cause of an abort or asynchronous error meanwhile. Lock held. */
static mp_result await_event_locked(nccl_t *n, mp_CUevent event, double deadline, char *detail, size_t len)
{
    for (unsigned polls = 0;; polls++) {
        mp_CUresult c = n->cu->EventQuery(event);
        if (c == MP_CUDA_SUCCESS)
            return MP_OK;
        if (c != MP_CUDA_ERROR_NOT_READY) {
            snprintf(detail, len, "CUDA reported an error on a lane's stream: %s", cu_error(n, c));
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

/* ---- the real NCCL calls ------------------------------------------------------------------ */

static mp_ncclResult_t real_group_start(void *ctx) { return ((nccl_t *)ctx)->nccl->GroupStart(); }

static mp_ncclResult_t real_group_end(void *ctx, int lane)
{
    nccl_t *n = ctx;
    mp_ncclResult_t r = n->nccl->GroupEnd();
    /* The launch may finish asynchronously; the lane's event must be recorded after it. */
    return r == MP_NCCL_IN_PROGRESS ? settle(n, n->lanes[lane].comm, mp_now() + n->timeout, 1) : r;
}

static mp_ncclResult_t real_send(void *ctx, const mp_op *op, size_t count, mp_ncclDataType_t type)
{
    nccl_t *n = ctx;
    lane_t *lane = &n->lanes[op->lane];
    return n->nccl->Send(op->buf, count, type, op->peer, lane->comm, lane->stream);
}

static mp_ncclResult_t real_recv(void *ctx, const mp_op *op, size_t count, mp_ncclDataType_t type)
{
    nccl_t *n = ctx;
    lane_t *lane = &n->lanes[op->lane];
    return n->nccl->Recv(op->buf, count, type, op->peer, lane->comm, lane->stream);
}

static const mp_nccl_calls real_calls = {real_group_start, real_group_end, real_send, real_recv};

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

/* Every send of the step sends its descriptor and every receive takes one, as one group on the
 * step's lane; the host waits for them and compares. Only then may the data's group be issued:
 * NCCL has no way to stop data already launched. Lock and issue lock held. */
static mp_result check_step(nccl_t *n, const mp_step *step, char *detail, size_t len)
{
    lane_t *lane = &n->lanes[step->lane];
    const size_t size = sizeof(mp_check_desc);
    mp_CUresult c = reserve_check(n, step->nops);
    if (c != MP_CUDA_SUCCESS) {
        snprintf(detail, len, "debug matching could not allocate its descriptors: %s", cu_error(n, c));
        return MP_ERR_SYSTEM;
    }
    mp_check_desc *out = n->check_host, *in = n->check_host + n->check_slots;
    mp_CUdeviceptr dev_out = n->check_dev, dev_in = n->check_dev + (mp_CUdeviceptr)n->check_slots * size;
    for (int i = 0; i < step->nops; i++)
        if (step->ops[i]->kind == MP_SEND)
            mp_check_describe(step->ops[i], &out[i]);
    c = n->cu->MemcpyHtoDAsync(dev_out, out, (size_t)step->nops * size, lane->stream);
    if (c != MP_CUDA_SUCCESS) {
        snprintf(detail, len, "debug matching could not copy its descriptors: %s", cu_error(n, c));
        return MP_ERR_SYSTEM;
    }
    mp_ncclResult_t r = n->nccl->GroupStart();
    for (int i = 0; r == MP_NCCL_SUCCESS && i < step->nops; i++) {
        const mp_op *op = step->ops[i];
        mp_CUdeviceptr at = (op->kind == MP_SEND ? dev_out : dev_in) + (mp_CUdeviceptr)i * size;
        r = op->kind == MP_SEND ? n->nccl->Send((void *)(uintptr_t)at, size, MP_NCCL_UINT8, op->peer, lane->comm,
                                                lane->stream)
                                : n->nccl->Recv((void *)(uintptr_t)at, size, MP_NCCL_UINT8, op->peer, lane->comm,
                                                lane->stream);
    }
    mp_ncclResult_t end = real_group_end(n, step->lane);
    if (end == MP_NCCL_ABORTED)
        return n->cause;
    if (r == MP_NCCL_SUCCESS)
        r = end;
    if (r != MP_NCCL_SUCCESS) {
        snprintf(detail, len, "debug matching: NCCL failed to issue the descriptors on lane %d: %s", step->lane,
                 nccl_error(n, lane->comm, r));
        return cause_of(r);
    }
    c = n->cu->MemcpyDtoHAsync(in, dev_in, (size_t)step->nops * size, lane->stream);
    if (c == MP_CUDA_SUCCESS)
        c = n->cu->EventRecord(n->check_done, lane->stream);
    if (c != MP_CUDA_SUCCESS) {
        snprintf(detail, len, "debug matching could not fetch its descriptors: %s", cu_error(n, c));
        return MP_ERR_SYSTEM;
    }
    mp_result waited = await_event_locked(n, n->check_done, mp_now() + n->timeout, detail, len);
    if (waited == MP_ERR_TIMEOUT)
        snprintf(detail, len, "debug matching: rank %d waited %.1f s on lane %d for the descriptors of step #%llu: a "
                 "peer has not posted the matching ops", n->global_rank, n->timeout, step->lane,
                 (unsigned long long)step->ops[0]->step);
    if (waited != MP_OK)
        return waited;
    for (int i = 0; i < step->nops; i++) {
        const mp_op *op = step->ops[i];
        if (op->kind == MP_RECV && mp_check_compare(&in[i], op->peer_global, op, n->global_rank, detail, len) < 0)
            return MP_ERR_MISMATCH;
    }
    return MP_OK;
}

/* ---- vtable -------------------------------------------------------------------------------- */

static mp_result nccl_begin(mp_transport *t, void *stream)
{
    nccl_t *n = (nccl_t *)t;
    pthread_mutex_lock(&n->issue);
    pthread_mutex_lock(&n->lock);
    mp_result res = n->cause != MP_OK ? n->cause : MP_OK;
    mp_CUcontext saved;
    mp_CUresult entered = enter(n, &saved);
    if (res == MP_OK && entered != MP_CUDA_SUCCESS)
        res = fail_cuda(n, ENTER_FAILED, entered);
    n->capturing = res == MP_OK && is_capturing(n, (mp_CUstream)stream);
    if (n->capturing && n->check) /* debug matching waits on the host before every step */
        res = MP_ERR_CAPTURE;
    if (res == MP_OK) {
        /* During capture the lanes join the capture through this event, which the graph keeps. */
        mp_CUresult r = MP_CUDA_SUCCESS;
        fence *g = n->capturing ? graph_fence(n, &r) : NULL;
        mp_CUevent ready = g ? g->event : n->ready;
        if (r == MP_CUDA_SUCCESS)
            r = n->cu->EventRecord(ready, (mp_CUstream)stream);
        for (int l = 0; r == MP_CUDA_SUCCESS && l < t->nlanes; l++)
            r = n->cu->StreamWaitEvent(n->lanes[l].stream, ready, 0);
        if (r != MP_CUDA_SUCCESS)
            res = fail_cuda(n, "ordering the lanes after the caller's stream failed", r);
    }
    leave(n, saved);
    pthread_mutex_unlock(&n->lock);
    pthread_mutex_unlock(&n->issue);
    return res;
}

static mp_result nccl_post(mp_transport *t, mp_step *step)
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
    lane->open_tail = step; /* owned from here on: an abort (even while the launch settles) frees it */
    mp_CUcontext saved;
    mp_CUresult entered = enter(n, &saved);
    if (entered != MP_CUDA_SUCCESS) {
        fail_cuda(n, ENTER_FAILED, entered);
        pthread_mutex_unlock(&n->lock);
        pthread_mutex_unlock(&n->issue);
        return MP_OK; /* its ops report the failure */
    }
    if (n->check && step->nops) {
        char detail[MP_DETAIL_LEN];
        mp_result checked = check_step(n, step, detail, sizeof detail);
        if (checked != MP_OK) {
            abort_locked(n, checked, t->rank, detail); /* nothing if an abort came first */
            leave(n, saved);
            pthread_mutex_unlock(&n->lock);
            pthread_mutex_unlock(&n->issue);
            return MP_OK;
        }
    }
    mp_ncclResult_t r = mp_nccl_issue(&real_calls, n, step, n->nccl->version);
    leave(n, saved);
    if (r != MP_NCCL_SUCCESS && r != MP_NCCL_ABORTED) {
        char detail[256];
        snprintf(detail, sizeof detail, "NCCL failed to issue a group on lane %d: %s", l, nccl_error(n, lane->comm, r));
        abort_locked(n, cause_of(r), t->rank, detail);
    }
    pthread_mutex_unlock(&n->lock);
    pthread_mutex_unlock(&n->issue);
    return MP_OK; /* the step is ours either way; a failure is reported through its ops */
}

static mp_result nccl_end(mp_transport *t)
{
    nccl_t *n = (nccl_t *)t;
    pthread_mutex_lock(&n->issue);
    pthread_mutex_lock(&n->lock);
    mp_result res = MP_OK;
    mp_CUcontext saved;
    mp_CUresult entered = enter(n, &saved);
    if (entered != MP_CUDA_SUCCESS && n->cause == MP_OK)
        res = fail_cuda(n, ENTER_FAILED, entered);
    for (int l = 0; l < t->nlanes && n->cause == MP_OK; l++) {
        lane_t *lane = &n->lanes[l];
        if (!lane->open_head)
            continue;
        fence *f = n->spare;
        mp_CUresult r = MP_CUDA_SUCCESS;
        if (n->capturing) {
            /* Captured work runs at each replay: its ops are stream-ordered only, and done here. */
            if ((f = graph_fence(n, &r)))
                r = n->cu->EventRecord(f->event, lane->stream);
            if (r != MP_CUDA_SUCCESS) {
                res = fail_cuda(n, "recording a lane's event during capture failed", r);
                break;
            }
            for (mp_step *s = lane->open_head; s; s = s->next)
                for (int i = 0; i < s->nops; i++) {
                    s->ops[i]->fence = f;
                    s->ops[i]->captured = 1;
                }
            finish_steps(lane->open_head, MP_OK, "");
            lane->open_head = lane->open_tail = NULL;
            continue;
        }
        if (f) {
            n->spare = f->next;
        } else if ((f = calloc(1, sizeof *f))) {
            r = n->cu->EventCreate(&f->event, MP_CU_EVENT_DISABLE_TIMING);
            if (r != MP_CUDA_SUCCESS) {
                free(f);
                f = NULL;
            }
        }
        if (f && r == MP_CUDA_SUCCESS)
            r = n->cu->EventRecord(f->event, lane->stream);
        if (!f || r != MP_CUDA_SUCCESS) {
            if (f) {
                f->next = n->spare;
                n->spare = f;
            }
            res = fail_cuda(n, "recording a lane's completion event failed", r != MP_CUDA_SUCCESS ? r : MP_CUDA_ERROR_OUT_OF_MEMORY);
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
    leave(n, saved);
    pthread_mutex_unlock(&n->lock);
    pthread_mutex_unlock(&n->issue);
    return res;
}

static void nccl_progress(mp_transport *t)
{
    nccl_t *n = (nccl_t *)t;
    pthread_mutex_lock(&n->lock);
    if (n->cause == MP_OK && !n->capturing)
        progress_locked(n);
    pthread_mutex_unlock(&n->lock);
}

static mp_result nccl_wait(mp_transport *t, mp_op *op, double deadline, const mp_interrupt *interrupt)
{
    nccl_t *n = (nccl_t *)t;
    for (unsigned polls = 0;; polls++) {
        pthread_mutex_lock(&n->lock);
        n->capturing = 0; /* a host wait: the caller is not capturing */
        if (n->cause == MP_OK) {
            progress_locked(n);
            if (!mp_op_done(op))
                check_async_locked(n);
        }
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

static mp_result nccl_stream_wait(mp_transport *t, mp_op *op, void *stream)
{
    nccl_t *n = (nccl_t *)t;
    mp_result res = MP_OK;
    pthread_mutex_lock(&n->lock);
    mp_CUcontext saved;
    mp_CUresult entered = enter(n, &saved);
    if (entered != MP_CUDA_SUCCESS) {
        res = fail_cuda(n, ENTER_FAILED, entered);
        pthread_mutex_unlock(&n->lock);
        return res;
    }
    n->capturing = is_capturing(n, (mp_CUstream)stream);
    if (n->cause == MP_OK && !n->capturing)
        progress_locked(n);
    /* A captured op is done for the host, but its replays still order the waiting stream. */
    if ((op->captured || !mp_op_done(op)) && op->fence) {
        mp_CUresult r = n->cu->StreamWaitEvent((mp_CUstream)stream, ((fence *)op->fence)->event, 0);
        if (r != MP_CUDA_SUCCESS)
            res = fail_cuda(n, "making the caller's stream wait failed", r);
    }
    leave(n, saved);
    pthread_mutex_unlock(&n->lock);
    return res;
}

static mp_result nccl_watch(mp_transport *t, double timeout, char *detail, size_t len)
{
    nccl_t *n = (nccl_t *)t;
    mp_result cause = MP_OK;
    /* Thread-local capture mode: these queries, from a thread that captures nothing, must not
     * invalidate a capture another thread runs in the global mode. */
    int mode = MP_CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
    int exchanged = n->cu->ThreadExchangeStreamCaptureMode(&mode) == MP_CUDA_SUCCESS;
    pthread_mutex_lock(&n->lock);
    if (n->cause == MP_OK) {
        progress_locked(n);
        cause = async_error_locked(n, detail, len);
        double now = mp_now();
        for (int l = 0; cause == MP_OK && l < t->nlanes; l++) {
            const fence *f = n->lanes[l].head;
            if (f && now - f->recorded > timeout) {
                snprintf(detail, len, "lane %d: device work fenced %.1f s ago has not completed (timeout %.1f s)", l,
                         now - f->recorded, timeout);
                cause = MP_ERR_TIMEOUT;
            }
        }
    }
    pthread_mutex_unlock(&n->lock);
    if (exchanged)
        n->cu->ThreadExchangeStreamCaptureMode(&mode);
    return cause;
}

static void nccl_abort(mp_transport *t, mp_result cause, int rank, const char *why)
{
    nccl_t *n = (nccl_t *)t;
    pthread_mutex_lock(&n->lock);
    char detail[MP_DETAIL_LEN];
    snprintf(detail, sizeof detail, "%s (group rank %d)%s%s", mp_result_str(cause), rank, why && why[0] ? ": " : "",
             why ? why : "");
    abort_locked(n, cause, rank, detail);
    pthread_mutex_unlock(&n->lock);
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

static void nccl_describe_peer(mp_transport *t, const mp_op *op, char *buf, size_t len)
{
    (void)t;
    snprintf(buf, len, "%s", op->fence ? "its lane's completion event has not fired"
                                       : "not yet fenced");
}

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
        n->capturing = 0;
        if (n->cause == MP_OK)
            progress_locked(n);
        check_async_locked(n); /* a peer that died ends the drain at once */
        int pending = 0;
        for (int l = 0; l < t->nlanes; l++)
            pending |= n->lanes[l].head != NULL || n->lanes[l].open_head != NULL;
        if (!pending || n->cause != MP_OK || mp_now() > deadline) {
            abort_locked(n, MP_ERR_CLOSED, t->rank, "the communicator was closed with the op pending");
            pthread_mutex_unlock(&n->lock);
            break;
        }
        pthread_mutex_unlock(&n->lock);
        usleep(200);
    }
    if (n->ctx) {
        mp_CUcontext saved;
        enter(n, &saved); /* best effort: the process may be ending */
        for (int l = 0; l < t->nlanes; l++)
            if (n->lanes[l].stream)
                n->cu->StreamDestroy(n->lanes[l].stream);
        fence *lists[] = {n->spare, n->graph_fences};
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
        leave(n, saved);
    }
    if (n->ctx_retained)
        n->cu->DevicePrimaryCtxRelease(n->device);
    pthread_mutex_destroy(&n->lock);
    pthread_mutex_destroy(&n->issue);
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
    .begin = nccl_begin,
    .end = nccl_end,
    .progress = nccl_progress,
    .stream_wait = nccl_stream_wait,
    .watch = nccl_watch,
    .failure_report = nccl_failure_report,
};

/* ---- creation ------------------------------------------------------------------------------- */

/* One tiny group per lane to every ring neighbour, so that connection setup happens now, in the
 * same order on every rank, and not inside the first exchange. */
static mp_result warm_up(nccl_t *n, double deadline, char *err, size_t errlen)
{
    int rank = n->base.rank, size = n->base.size;
    int next = (rank + 1) % size, prev = (rank + size - 1) % size;
    for (int l = 0; l < n->base.nlanes; l++) {
        lane_t *lane = &n->lanes[l];
        char *base = (char *)(uintptr_t)n->scratch;
        mp_ncclResult_t r = n->nccl->GroupStart();
        if (r == MP_NCCL_SUCCESS) {
            n->nccl->Send(base, 1, MP_NCCL_UINT8, next, lane->comm, lane->stream);
            n->nccl->Recv(base + 1, 1, MP_NCCL_UINT8, prev, lane->comm, lane->stream);
            if (next != prev) {
                n->nccl->Send(base, 1, MP_NCCL_UINT8, prev, lane->comm, lane->stream);
                n->nccl->Recv(base + 2, 1, MP_NCCL_UINT8, next, lane->comm, lane->stream);
            }
            r = n->nccl->GroupEnd();
            if (r == MP_NCCL_IN_PROGRESS)
                r = settle(n, lane->comm, deadline, 0);
        }
        if (r != MP_NCCL_SUCCESS) {
            snprintf(err, errlen, "warming up lane %d failed: %s", l, nccl_error(n, lane->comm, r));
            return cause_of(r);
        }
        mp_CUresult c = n->cu->EventRecord(n->ready, lane->stream);
        /* Polled until it fires: a first NOT_READY is the usual answer right after recording. */
        while (c == MP_CUDA_SUCCESS && (c = n->cu->EventQuery(n->ready)) == MP_CUDA_ERROR_NOT_READY) {
            if (mp_now() > deadline) {
                snprintf(err, errlen, "warming up lane %d: a neighbour (group rank %d or %d) did not take part "
                         "in time", l, prev, next);
                return MP_ERR_TIMEOUT;
            }
            if (mp_interrupted(n->interrupt))
                return MP_ERR_INTERRUPTED;
            usleep(100);
            c = MP_CUDA_SUCCESS;
        }
        if (c != MP_CUDA_SUCCESS) {
            snprintf(err, errlen, "warming up lane %d: %s", l, cu_error(n, c));
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
        snprintf(err, errlen, "CUDA device %d is not usable: %s", cfg->device, cu_error(n, r));
        return MP_ERR_SYSTEM;
    }
    int least = 0, greatest = 0;
    mp_CUcontext saved;
    r = enter(n, &saved);
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
    leave(n, saved);
    if (r != MP_CUDA_SUCCESS) {
        snprintf(err, errlen, "creating streams on CUDA device %d failed: %s", cfg->device, cu_error(n, r));
        return MP_ERR_SYSTEM;
    }
    return MP_OK;
}

static mp_result open_comms(nccl_t *n, const mp_nccl_config *cfg, double deadline, char *err, size_t errlen)
{
    mp_ncclConfigPrefix config = {
        .size = sizeof config,
        .magic = MP_NCCL_CONFIG_MAGIC,
        .version = MP_NCCL_MIN_VERSION,
        .blocking = 0,
    };
    for (int l = 0; l < cfg->nlanes; l++) {
        mp_ncclResult_t r = n->nccl->CommInitRankConfig(&n->lanes[l].comm, cfg->size, cfg->ids[l], cfg->rank, &config);
        if (r != MP_NCCL_SUCCESS && r != MP_NCCL_IN_PROGRESS) {
            snprintf(err, errlen, "ncclCommInitRankConfig for lane %d failed: %s", l,
                     nccl_error(n, n->lanes[l].comm, r));
            return MP_ERR_SYSTEM;
        }
    }
    for (int l = 0; l < cfg->nlanes; l++) {
        mp_ncclResult_t r = settle(n, n->lanes[l].comm, deadline, 0);
        if (r != MP_NCCL_SUCCESS) {
            snprintf(err, errlen, r == MP_NCCL_TIMEOUT ? "lane %d: not every rank joined the NCCL communicator in "
                                                         "time (%s)"
                                                       : "lane %d: NCCL initialisation failed: %s",
                     l, nccl_error(n, n->lanes[l].comm, r));
            return cause_of(r);
        }
    }
    return MP_OK;
}

mp_result mp_nccl_open(const mp_nccl_config *cfg, const mp_nccl_lib *nccl, const mp_cuda_lib *cuda,
                       mp_transport **out, char *err, size_t errlen)
{
    nccl_t *n = calloc(1, sizeof *n);
    if (!n) {
        snprintf(err, errlen, "out of memory");
        return MP_ERR_SYSTEM;
    }
    n->base.ops = &nccl_ops;
    n->base.rank = cfg->rank;
    n->base.size = cfg->size;
    n->base.nlanes = cfg->nlanes;
    n->nccl = nccl;
    n->cu = cuda;
    n->device = cfg->device;
    n->timeout = cfg->timeout;
    n->check = cfg->check;
    n->global_rank = cfg->global_rank;
    pthread_mutex_init(&n->issue, NULL);
    pthread_mutex_init(&n->lock, NULL);
    double deadline = mp_now() + cfg->timeout;
    n->interrupt = cfg->interrupt;
    mp_result res = open_device(n, cfg, err, errlen);
    if (res == MP_OK) {
        mp_CUcontext saved;
        mp_CUresult entered = enter(n, &saved);
        if (entered != MP_CUDA_SUCCESS) {
            snprintf(err, errlen, "%s: %s", ENTER_FAILED, cu_error(n, entered));
            res = MP_ERR_SYSTEM;
        } else
            res = open_comms(n, cfg, deadline, err, errlen);
        if (res == MP_OK)
            res = warm_up(n, deadline, err, errlen);
        leave(n, saved);
    }
    n->interrupt = NULL; /* the caller's, valid during this call only */
    if (res != MP_OK) {
        nccl_destroy(&n->base); /* aborts whatever communicators exist */
        return res;
    }
    *out = &n->base;
    return MP_OK;
}
