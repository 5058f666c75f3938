/* A model of the CUDA driver (libcuda.so.1) for running the NCCL backend on a machine without a
 * GPU. It keeps the driver's promises, not the package's assumptions:
 *   - cuInit first, else CUDA_ERROR_NOT_INITIALIZED;
 *   - one primary context per device, reference counted, and one current context per thread:
 *     every call whose documentation lists CUDA_ERROR_INVALID_CONTEXT fails with it when the
 *     thread has no current context (all but cuEventQuery, cuGetErrorString and the context
 *     calls themselves), and a stream or event of another context is CUDA_ERROR_INVALID_HANDLE;
 *   - a stream is an ordered queue run by a worker thread of its own; the null stream (handle
 *     0, and the per-thread handle 2) is the context's default stream;
 *   - an event completes when the work recorded before it has run (cuEventQuery says
 *     CUDA_ERROR_NOT_READY until then); cuStreamWaitEvent orders work across streams;
 *   - device memory is host memory;
 *   - stream capture and graphs, as the last section describes.
 * The fake libnccl enqueues its kernels through the mpfake_ functions.
 *
 * Environment (read by cuInit):
 *   MPFAKE_CUDA_DEVICES              number of devices (default 1)
 *   MPFAKE_CUDA_DRIVER_VERSION=N     what cuDriverGetVersion reports (default 13000)
 *   MPFAKE_CUDA_FAIL_SET_CURRENT_AFTER=N
 *                                    after N successful cuCtxSetCurrent calls in the process,
 *                                    every later one fails with CUDA_ERROR_INVALID_CONTEXT
 *   MPFAKE_CUDA_CAPTURE_LOG=PATH     appends one line per call refused by the stream-capture
 *                                    rules: "NAME ERROR", e.g. "cuEventQuery 907" */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "mpfake.h"

#define MAX_DEVICES 8

typedef struct item {
    enum { RUN, RECORD, WAIT } kind;
    void (*fn)(void *);
    void *arg;
    void (*release)(void *); /* called with release_arg once a RUN item has run */
    void *release_arg;
    struct mp_fake_event *event;
    uint64_t generation;
    struct item *next;
} item;

/* A set of graph nodes (indices): what the next captured work on a stream depends on. */
typedef struct {
    int *v;
    int n, cap;
} deps_t;

struct capture;

typedef struct mp_fake_stream {
    struct mp_fake_ctx *ctx;
    int blocking; /* synchronizes with the legacy stream (no CU_STREAM_NON_BLOCKING) */
    pthread_mutex_t lock;
    pthread_cond_t changed;
    item *head, *tail;
    uint64_t enqueued, done; /* items, for cuStreamSynchronize */
    int destroyed;
    pthread_t worker;
    struct capture *capture; /* while it captures (driver_lock) */
    int lane;                /* its index among the capture's streams */
    deps_t deps;
} stream_t;

typedef struct mp_fake_event {
    struct mp_fake_ctx *ctx;
    uint64_t recorded; /* generation of the last cuEventRecord */
    uint64_t fired;    /* generation that has run on its stream */
    struct capture *capture; /* last recorded in this capture (driver_lock) */
    deps_t deps;             /* the captured work it stands for */
} event_t;

typedef struct mp_fake_ctx {
    int device;
    int refs;
    stream_t *null_stream;
} ctx_t;

/* The driver's own process-wide state: devices and their primary contexts. */
static pthread_mutex_t driver_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t event_fired = PTHREAD_COND_INITIALIZER; /* any event fired: waits recheck */
static int initialized;
static int ndevices = 1;
static long set_current_budget = -1; /* -1: unlimited */
static ctx_t primary[MAX_DEVICES];
static _Thread_local ctx_t *current;

/* The stream-capture rules, in the last section; the calls above consult them. */
static int capture_takes(stream_t *s, CUstream handle, item *it, CUresult *r);
static CUresult capture_allows_stream_sync(const char *call, stream_t *s, CUstream handle);
static CUresult capture_allows_event_sync(const char *call, event_t *e);
static CUresult capture_allows_unsafe(const char *call);

static const struct {
    CUresult code;
    const char *text;
} errors[] = {
    {CUDA_SUCCESS, "no error"},
    {CUDA_ERROR_INVALID_VALUE, "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "initialization error"},
    {CUDA_ERROR_INVALID_DEVICE, "invalid device ordinal"},
    {CUDA_ERROR_INVALID_CONTEXT, "invalid device context"},
    {CUDA_ERROR_INVALID_HANDLE, "invalid resource handle"},
    {CUDA_ERROR_ILLEGAL_STATE, "the resource is not in a state for this call"},
    {CUDA_ERROR_NOT_READY, "device not ready"},
    {CUDA_ERROR_CONTEXT_IS_DESTROYED, "context is destroyed"},
    {CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "operation not permitted while a stream is capturing"},
    {CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, "the stream capture was invalidated by an earlier error"},
    {CUDA_ERROR_STREAM_CAPTURE_MERGE, "the operation would merge two independent stream captures"},
    {CUDA_ERROR_STREAM_CAPTURE_UNMATCHED, "the capture was not begun on this stream"},
    {CUDA_ERROR_STREAM_CAPTURE_UNJOINED, "a stream forked into the capture was not joined back into its origin"},
    {CUDA_ERROR_STREAM_CAPTURE_ISOLATION, "a dependency would cross the boundary of the stream capture"},
    {CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, "the legacy stream would depend implicitly on a capturing stream"},
    {CUDA_ERROR_CAPTURED_EVENT, "operation not permitted on an event last recorded in a capturing stream"},
    {CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD, "the capture must be ended on the thread that began it"},
};

CUresult cuGetErrorString(CUresult error, const char **text)
{
    for (size_t i = 0; i < sizeof errors / sizeof *errors; i++)
        if (errors[i].code == error) {
            *text = errors[i].text;
            return CUDA_SUCCESS;
        }
    *text = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

/* Works before cuInit, as the driver's does (documented under cuDriverGetVersion). NCCL reads it
 * for cuMem's auto-detection (src/misc/cudawrap.cc: ncclIsCuMemSupported, 12.0 or later) and
 * before every one-sided call (src/enqueue.cc: rmaTaskAppend, 12.5 or later). */
CUresult cuDriverGetVersion(int *version)
{
    if (!version)
        return CUDA_ERROR_INVALID_VALUE;
    const char *v = getenv("MPFAKE_CUDA_DRIVER_VERSION");
    *version = v && v[0] ? atoi(v) : 13000;
    return CUDA_SUCCESS;
}

CUresult cuInit(unsigned int flags)
{
    if (flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&driver_lock);
    if (!initialized) {
        const char *n = getenv("MPFAKE_CUDA_DEVICES");
        const char *budget = getenv("MPFAKE_CUDA_FAIL_SET_CURRENT_AFTER");
        if (n && atoi(n) >= 0 && atoi(n) <= MAX_DEVICES)
            ndevices = atoi(n);
        if (budget && budget[0])
            set_current_budget = atol(budget);
        for (int d = 0; d < MAX_DEVICES; d++)
            primary[d].device = d;
        initialized = 1;
    }
    pthread_mutex_unlock(&driver_lock);
    return CUDA_SUCCESS;
}

static CUresult ready(void)
{
    return __atomic_load_n(&initialized, __ATOMIC_ACQUIRE) ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED;
}

/* The current context, or why there is none. */
static CUresult need_context(ctx_t **out)
{
    CUresult r = ready();
    if (r != CUDA_SUCCESS)
        return r;
    if (!current)
        return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&driver_lock);
    int alive = current->refs > 0;
    pthread_mutex_unlock(&driver_lock);
    if (!alive)
        return CUDA_ERROR_CONTEXT_IS_DESTROYED;
    *out = current;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice *dev, int ordinal)
{
    CUresult r = ready();
    if (r != CUDA_SUCCESS)
        return r;
    if (ordinal < 0 || ordinal >= ndevices)
        return CUDA_ERROR_INVALID_DEVICE;
    *dev = ordinal;
    return CUDA_SUCCESS;
}

static void *worker_main(void *arg);

static stream_t *stream_new(ctx_t *ctx, int blocking)
{
    stream_t *s = calloc(1, sizeof *s);
    if (!s)
        return NULL;
    s->ctx = ctx;
    s->blocking = blocking;
    pthread_mutex_init(&s->lock, NULL);
    pthread_cond_init(&s->changed, NULL);
    if (pthread_create(&s->worker, NULL, worker_main, s) != 0) {
        free(s);
        return NULL;
    }
    pthread_detach(s->worker);
    return s;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev)
{
    CUresult r = ready();
    if (r != CUDA_SUCCESS)
        return r;
    if (dev < 0 || dev >= ndevices)
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&driver_lock);
    ctx_t *c = &primary[dev];
    if (!c->null_stream)
        c->null_stream = stream_new(c, 1);
    c->refs++;
    pthread_mutex_unlock(&driver_lock);
    *ctx = (CUcontext)c;
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    CUresult r = ready();
    if (r != CUDA_SUCCESS)
        return r;
    if (dev < 0 || dev >= ndevices)
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&driver_lock);
    r = primary[dev].refs > 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
    if (r == CUDA_SUCCESS)
        primary[dev].refs--;
    pthread_mutex_unlock(&driver_lock);
    return r;
}

static int is_context(CUcontext ctx)
{
    for (int d = 0; d < MAX_DEVICES; d++)
        if ((ctx_t *)ctx == &primary[d])
            return 1;
    return 0;
}

CUresult cuCtxGetCurrent(CUcontext *ctx)
{
    CUresult r = ready();
    if (r != CUDA_SUCCESS)
        return r;
    *ctx = (CUcontext)current;
    return CUDA_SUCCESS;
}

CUresult cuCtxSetCurrent(CUcontext ctx)
{
    CUresult r = ready();
    if (r != CUDA_SUCCESS)
        return r;
    if (ctx && !is_context(ctx))
        return CUDA_ERROR_INVALID_CONTEXT;
    pthread_mutex_lock(&driver_lock);
    if (set_current_budget == 0)
        r = CUDA_ERROR_INVALID_CONTEXT;
    else if (set_current_budget > 0)
        set_current_budget--;
    pthread_mutex_unlock(&driver_lock);
    if (r == CUDA_SUCCESS)
        current = (ctx_t *)ctx;
    return r;
}

CUresult cuCtxGetStreamPriorityRange(int *least, int *greatest)
{
    ctx_t *c;
    CUresult r = need_context(&c);
    if (r != CUDA_SUCCESS)
        return r;
    *least = 0;
    *greatest = -5;
    return CUDA_SUCCESS;
}

/* ---- streams ------------------------------------------------------------------------------ */

static void *worker_main(void *arg)
{
    stream_t *s = arg;
    pthread_mutex_lock(&s->lock);
    for (;;) {
        while (!s->head && !s->destroyed)
            pthread_cond_wait(&s->changed, &s->lock);
        if (!s->head)
            break; /* destroyed and drained */
        item *it = s->head;
        pthread_mutex_unlock(&s->lock);
        if (it->kind == RUN) {
            it->fn(it->arg);
            if (it->release)
                it->release(it->release_arg);
        } else if (it->kind == RECORD) {
            pthread_mutex_lock(&driver_lock);
            if (it->event->fired < it->generation)
                it->event->fired = it->generation;
            pthread_cond_broadcast(&event_fired);
            pthread_mutex_unlock(&driver_lock);
        } else {
            pthread_mutex_lock(&driver_lock);
            while (it->event->fired < it->generation)
                pthread_cond_wait(&event_fired, &driver_lock);
            pthread_mutex_unlock(&driver_lock);
        }
        pthread_mutex_lock(&s->lock);
        s->head = it->next;
        if (!s->head)
            s->tail = NULL;
        s->done++;
        pthread_cond_broadcast(&s->changed);
        free(it);
    }
    pthread_mutex_unlock(&s->lock);
    return NULL; /* the struct is kept: a later use of the handle is reported, not undefined */
}

/* The stream a handle names in context `c`: the null and per-thread handles are its default. */
static CUresult resolve_stream(ctx_t *c, CUstream handle, stream_t **out)
{
    uintptr_t h = (uintptr_t)handle;
    stream_t *s = h == 0 || h == 2 ? c->null_stream : (stream_t *)handle;
    if (!s || s->ctx != c || __atomic_load_n(&s->destroyed, __ATOMIC_ACQUIRE))
        return CUDA_ERROR_INVALID_HANDLE;
    *out = s;
    return CUDA_SUCCESS;
}

/* The calling thread's context and `handle` resolved in it: the prologue of every stream call. */
static CUresult current_stream(CUstream handle, ctx_t **c, stream_t **s)
{
    CUresult r = need_context(c);
    return r == CUDA_SUCCESS ? resolve_stream(*c, handle, s) : r;
}

static CUresult enqueue(stream_t *s, item *it)
{
    it->next = NULL;
    pthread_mutex_lock(&s->lock);
    if (s->destroyed) {
        pthread_mutex_unlock(&s->lock);
        free(it);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    if (s->tail)
        s->tail->next = it;
    else
        s->head = it;
    s->tail = it;
    s->enqueued++;
    pthread_cond_broadcast(&s->changed);
    pthread_mutex_unlock(&s->lock);
    return CUDA_SUCCESS;
}

/* Queues an item: a record or wait takes its event's generation now, as the driver snapshots the
 * event at the call. */
static CUresult enqueue_stamped(stream_t *s, item *it)
{
    if (it->kind != RUN) {
        pthread_mutex_lock(&driver_lock);
        /* a wait on an event never recorded (generation 0) waits for nothing */
        it->generation = it->kind == RECORD ? ++it->event->recorded : it->event->recorded;
        pthread_mutex_unlock(&driver_lock);
    }
    return enqueue(s, it);
}

/* Work for a stream: into its queue, or into its capture's graph while it captures. */
static CUresult submit(stream_t *s, CUstream handle, item *it)
{
    CUresult r;
    if (capture_takes(s, handle, it, &r)) {
        free(it);
        return r;
    }
    return enqueue_stamped(s, it);
}

static item *new_item(int kind, event_t *e)
{
    item *it = calloc(1, sizeof *it);
    if (it) {
        it->kind = kind;
        it->event = e;
    }
    return it;
}

CUresult cuStreamCreateWithPriority(CUstream *stream, unsigned int flags, int priority)
{
    ctx_t *c;
    CUresult r = need_context(&c);
    if (r != CUDA_SUCCESS)
        return r;
    if (flags > 1 || priority > 0 || priority < -5)
        return CUDA_ERROR_INVALID_VALUE;
    stream_t *s = stream_new(c, !(flags & 1));
    if (!s)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *stream = (CUstream)s;
    return CUDA_SUCCESS;
}

/* Like the driver: returns at once; the stream's pending work still runs, then it is freed. */
CUresult cuStreamDestroy_v2(CUstream stream)
{
    ctx_t *c;
    stream_t *s;
    CUresult r = current_stream(stream, &c, &s);
    if (r == CUDA_SUCCESS && s == c->null_stream)
        r = CUDA_ERROR_INVALID_HANDLE;
    if (r != CUDA_SUCCESS)
        return r;
    pthread_mutex_lock(&s->lock);
    __atomic_store_n(&s->destroyed, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&s->changed);
    pthread_mutex_unlock(&s->lock);
    return CUDA_SUCCESS;
}

CUresult cuStreamSynchronize(CUstream stream)
{
    ctx_t *c;
    stream_t *s;
    CUresult r = current_stream(stream, &c, &s);
    if (r == CUDA_SUCCESS)
        r = capture_allows_stream_sync("cuStreamSynchronize", s, stream);
    if (r != CUDA_SUCCESS)
        return r;
    pthread_mutex_lock(&s->lock);
    uint64_t target = s->enqueued;
    while (s->done < target)
        pthread_cond_wait(&s->changed, &s->lock);
    pthread_mutex_unlock(&s->lock);
    return CUDA_SUCCESS;
}

CUresult cuStreamQuery(CUstream stream)
{
    ctx_t *c;
    stream_t *s;
    CUresult r = current_stream(stream, &c, &s);
    if (r == CUDA_SUCCESS)
        r = capture_allows_stream_sync("cuStreamQuery", s, stream);
    if (r != CUDA_SUCCESS)
        return r;
    pthread_mutex_lock(&s->lock);
    r = s->done < s->enqueued ? CUDA_ERROR_NOT_READY : CUDA_SUCCESS;
    pthread_mutex_unlock(&s->lock);
    return r;
}

/* ---- events ------------------------------------------------------------------------------- */

static CUresult resolve_event(ctx_t *c, CUevent event, event_t **out)
{
    event_t *e = (event_t *)event;
    if (!e || e->ctx != c)
        return CUDA_ERROR_INVALID_HANDLE;
    *out = e;
    return CUDA_SUCCESS;
}

/* For tests: events created and not yet destroyed, to show what a caller lets accumulate. */
static _Atomic long live_events;
long mpfake_cuda_live_events(void) { return atomic_load(&live_events); }

CUresult cuEventCreate(CUevent *event, unsigned int flags)
{
    ctx_t *c;
    CUresult r = need_context(&c);
    if (r != CUDA_SUCCESS)
        return r;
    if (flags & ~0x7u)
        return CUDA_ERROR_INVALID_VALUE;
    event_t *e = calloc(1, sizeof *e);
    if (!e)
        return CUDA_ERROR_OUT_OF_MEMORY;
    e->ctx = c;
    *event = (CUevent)e;
    atomic_fetch_add(&live_events, 1);
    return CUDA_SUCCESS;
}

/* Freed only once nothing can still refer to it: streams may hold it in a pending item. A
 * model may keep the few bytes; it never reuses the handle. */
CUresult cuEventDestroy_v2(CUevent event)
{
    ctx_t *c;
    event_t *e;
    CUresult r = need_context(&c);
    if (r == CUDA_SUCCESS)
        r = resolve_event(c, event, &e);
    if (r != CUDA_SUCCESS)
        return r;
    pthread_mutex_lock(&driver_lock);
    e->ctx = NULL; /* later use is an invalid handle */
    pthread_mutex_unlock(&driver_lock);
    atomic_fetch_sub(&live_events, 1);
    return CUDA_SUCCESS;
}

CUresult cuEventRecord(CUevent event, CUstream stream)
{
    ctx_t *c;
    event_t *e;
    stream_t *s;
    CUresult r = need_context(&c);
    if (r == CUDA_SUCCESS)
        r = resolve_event(c, event, &e);
    if (r == CUDA_SUCCESS)
        r = resolve_stream(c, stream, &s);
    if (r != CUDA_SUCCESS)
        return r;
    item *it = new_item(RECORD, e);
    return it ? submit(s, stream, it) : CUDA_ERROR_OUT_OF_MEMORY;
}

/* The one call here that the driver documents without CUDA_ERROR_INVALID_CONTEXT: the event
 * names its context, so any thread may poll it. */
CUresult cuEventQuery(CUevent event)
{
    event_t *e = (event_t *)event;
    CUresult r = ready();
    if (r != CUDA_SUCCESS)
        return r;
    if (!e || !e->ctx)
        return CUDA_ERROR_INVALID_HANDLE;
    if ((r = capture_allows_event_sync("cuEventQuery", e)) != CUDA_SUCCESS)
        return r;
    pthread_mutex_lock(&driver_lock);
    r = e->fired < e->recorded ? CUDA_ERROR_NOT_READY : CUDA_SUCCESS;
    pthread_mutex_unlock(&driver_lock);
    return r;
}

CUresult cuEventSynchronize(CUevent event)
{
    ctx_t *c;
    event_t *e;
    CUresult r = need_context(&c);
    if (r == CUDA_SUCCESS)
        r = resolve_event(c, event, &e);
    if (r == CUDA_SUCCESS)
        r = capture_allows_event_sync("cuEventSynchronize", e);
    if (r != CUDA_SUCCESS)
        return r;
    pthread_mutex_lock(&driver_lock);
    uint64_t target = e->recorded;
    while (e->fired < target)
        pthread_cond_wait(&event_fired, &driver_lock);
    pthread_mutex_unlock(&driver_lock);
    return CUDA_SUCCESS;
}

CUresult cuStreamWaitEvent(CUstream stream, CUevent event, unsigned int flags)
{
    ctx_t *c;
    event_t *e;
    stream_t *s;
    CUresult r = need_context(&c);
    if (r == CUDA_SUCCESS)
        r = resolve_event(c, event, &e);
    if (r == CUDA_SUCCESS)
        r = resolve_stream(c, stream, &s);
    if (r == CUDA_SUCCESS && flags != 0)
        r = CUDA_ERROR_INVALID_VALUE;
    if (r != CUDA_SUCCESS)
        return r;
    item *it = new_item(WAIT, e);
    return it ? submit(s, stream, it) : CUDA_ERROR_OUT_OF_MEMORY;
}

/* ---- memory --------------------------------------------------------------------------------- */

CUresult cuMemAlloc_v2(CUdeviceptr *ptr, size_t bytes)
{
    ctx_t *c;
    CUresult r = need_context(&c);
    if (r == CUDA_SUCCESS)
        r = capture_allows_unsafe("cuMemAlloc_v2");
    if (r != CUDA_SUCCESS)
        return r;
    if (bytes == 0)
        return CUDA_ERROR_INVALID_VALUE;
    void *p = aligned_alloc(256, (bytes + 255) / 256 * 256);
    if (!p)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *ptr = (CUdeviceptr)(uintptr_t)p;
    return CUDA_SUCCESS;
}

CUresult cuMemFree_v2(CUdeviceptr ptr)
{
    ctx_t *c;
    CUresult r = need_context(&c);
    if (r == CUDA_SUCCESS)
        r = capture_allows_unsafe("cuMemFree_v2");
    if (r != CUDA_SUCCESS)
        return r;
    free((void *)(uintptr_t)ptr);
    return CUDA_SUCCESS;
}

/* Pinned host memory is plain host memory here; an async copy is a RUN item on its stream, so it
 * is ordered like a kernel and captured like one. */
CUresult cuMemAllocHost_v2(void **ptr, size_t bytes)
{
    ctx_t *c;
    CUresult r = need_context(&c);
    if (r == CUDA_SUCCESS)
        r = capture_allows_unsafe("cuMemAllocHost_v2");
    if (r != CUDA_SUCCESS)
        return r;
    if (bytes == 0)
        return CUDA_ERROR_INVALID_VALUE;
    return (*ptr = malloc(bytes)) ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

CUresult cuMemFreeHost(void *ptr)
{
    ctx_t *c;
    CUresult r = need_context(&c);
    if (r == CUDA_SUCCESS)
        r = capture_allows_unsafe("cuMemFreeHost");
    if (r != CUDA_SUCCESS)
        return r;
    free(ptr);
    return CUDA_SUCCESS;
}

typedef struct {
    void *dst;
    const void *src;
    size_t bytes;
} copy_t;

static void run_copy(void *arg)
{
    copy_t *cp = arg;
    memcpy(cp->dst, cp->src, cp->bytes);
}

static CUresult enqueue_copy(void *dst, const void *src, size_t bytes, CUstream stream)
{
    ctx_t *c;
    CUresult r = need_context(&c);
    if (r != CUDA_SUCCESS)
        return r;
    copy_t *cp = malloc(sizeof *cp);
    if (!cp)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *cp = (copy_t){dst, src, bytes};
    r = mpfake_stream_enqueue_owned((CUcontext)c, stream, run_copy, cp, free);
    if (r != CUDA_SUCCESS)
        free(cp);
    return r;
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t bytes, CUstream stream)
{
    return enqueue_copy((void *)(uintptr_t)dst, src, bytes, stream);
}

CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t bytes, CUstream stream)
{
    return enqueue_copy(dst, (const void *)(uintptr_t)src, bytes, stream);
}

/* ---- for tests ------------------------------------------------------------------------------ */

/* MPFAKE_CUDA_FAIL_SET_CURRENT_AFTER, set while the process runs: after `n` more successful
 * cuCtxSetCurrent calls every later one fails (n < 0: never). */
void mpfake_fail_set_current_after(long n)
{
    pthread_mutex_lock(&driver_lock);
    set_current_budget = n;
    pthread_mutex_unlock(&driver_lock);
}

/* ---- for the fake libnccl -------------------------------------------------------------------- */

CUcontext mpfake_current_context(void) { return (CUcontext)current; }

CUresult mpfake_stream_context(CUstream stream, CUcontext *ctx)
{
    ctx_t *c;
    stream_t *s;
    CUresult r = current_stream(stream, &c, &s);
    if (r == CUDA_SUCCESS)
        *ctx = (CUcontext)s->ctx;
    return r;
}

CUresult mpfake_stream_enqueue_owned(CUcontext ctx, CUstream stream, void (*fn)(void *), void *arg,
                                     void (*release)(void *))
{
    stream_t *s;
    CUresult r = is_context(ctx) ? resolve_stream((ctx_t *)ctx, stream, &s) : CUDA_ERROR_INVALID_CONTEXT;
    if (r != CUDA_SUCCESS)
        return r;
    item *it = new_item(RUN, NULL);
    if (!it)
        return CUDA_ERROR_OUT_OF_MEMORY;
    it->fn = fn;
    it->arg = arg;
    it->release = release;
    it->release_arg = arg;
    return submit(s, stream, it);
}

CUresult mpfake_stream_enqueue(CUcontext ctx, CUstream stream, void (*fn)(void *), void *arg)
{
    return mpfake_stream_enqueue_owned(ctx, stream, fn, arg, NULL);
}

/* A kernel that holds `stream` for `ms` and does nothing else, as torch.cuda._sleep's spinning
 * kernel does: device work without NCCL, run in stream order like any kernel (doc:
 * cuLaunchKernel). The device checks' dry run stalls a stream with it. */
static void hold_ms(void *arg)
{
    unsigned long ms = (unsigned long)(uintptr_t)arg;
    struct timespec t = {.tv_sec = (time_t)(ms / 1000), .tv_nsec = (long)(ms % 1000) * 1000000L};
    while (nanosleep(&t, &t) != 0)
        ;
}

CUresult mpfake_cuda_sleep(CUstream stream, unsigned int ms)
{
    ctx_t *c;
    CUresult r = need_context(&c);
    if (r != CUDA_SUCCESS)
        return r;
    return mpfake_stream_enqueue((CUcontext)c, stream, hold_ms, (void *)(uintptr_t)ms);
}

/* ---- stream capture and graphs ---------------------------------------------------------------
 * While a stream captures (cuStreamBeginCapture_v2 .. cuStreamEndCapture), work submitted to it
 * is appended to its capture's graph instead of running. As the driver promises:
 *   - the graph is a DAG: a captured node depends on what its stream had last, its own previous
 *     node and the captured events it has waited on since;
 *   - a record on a capturing stream makes the event a captured event; a stream that waits on
 *     one joins its capture; cuStreamEndCapture must be called on the origin stream (else
 *     _UNMATCHED) and, unless the capture is RELAXED, from the thread that began it (else
 *     _WRONG_THREAD); it fails with _UNJOINED unless every joined stream's last work is joined
 *     back into the origin, and with _INVALIDATED once the capture was invalidated;
 *   - refused, and invalidating the captures concerned: querying or synchronizing a captured
 *     event (CUDA_ERROR_CAPTURED_EVENT) or a capturing stream (_UNSUPPORTED); a capturing stream
 *     waiting on an event recorded outside capture (_ISOLATION) or in another capture (_MERGE);
 *     the legacy stream used while a blocking stream of its context captures (_IMPLICIT); and
 *     the potentially unsafe calls (cuEventQuery, cuEventSynchronize, cuStreamSynchronize,
 *     cuStreamQuery, cuMemAlloc_v2, cuMemFree_v2) from a thread that the modes forbid: a thread
 *     in GLOBAL mode (the default) while it has a capture not begun RELAXED or another thread
 *     has a GLOBAL one; a thread in THREAD_LOCAL mode while it has one not begun RELAXED; never a
 *     thread in RELAXED mode (cuThreadExchangeStreamCaptureMode). Work for the streams of an
 *     invalidated capture fails with _INVALIDATED until it ends;
 *   - cuGraphLaunch runs every node again, each after its dependencies, after the launch
 *     stream's earlier work and the instance's previous launch, and before the stream's later work.
 * Not modelled, and refused with _UNSUPPORTED: capturing the null stream, launching a graph into a
 * capturing stream. Every capture error (900-908) is appended to MPFAKE_CUDA_CAPTURE_LOG. */

typedef struct {
    int lane; /* the capture stream it was captured on */
    void (*fn)(void *);
    void *arg;
    void (*release)(void *);
    deps_t deps;
} node_t;

typedef struct capture {
    unsigned long long id;
    CUstreamCaptureMode mode;
    pthread_t thread; /* that began it */
    ctx_t *ctx;
    int invalid, ended;
    stream_t **lanes; /* the streams in it; [0] is the origin */
    int nlanes;
    node_t *nodes;
    int nnodes, cap;
    struct capture *next; /* among the active captures */
} capture_t;

/* A graph's nodes, shared by the graph, its instances and their queued work. */
typedef struct {
    _Atomic int refs;
    ctx_t *ctx;
    int nlanes, nnodes;
    node_t *nodes;
} body_t;

typedef struct mp_fake_graph {
    body_t *body; /* NULL once destroyed */
} graph_t;

typedef struct mp_fake_graph_exec {
    body_t *body; /* NULL once destroyed */
    pthread_mutex_t lock;
    stream_t **lanes;    /* where lane k runs; [0] is the launch stream */
    int *lane_last;      /* its last node, or -1 */
    event_t **node_done; /* for the nodes another lane depends on, or that end a lane */
    event_t *start, *finished;
} exec_t;

static capture_t *active; /* driver_lock */
static unsigned long long last_capture_id;
static _Thread_local CUstreamCaptureMode thread_mode = CU_STREAM_CAPTURE_MODE_GLOBAL;

static CUresult refuse(const char *call, CUresult error)
{
    const char *path = getenv("MPFAKE_CUDA_CAPTURE_LOG");
    if (!path || !path[0])
        return error;
    int fd = open(path, O_WRONLY | O_CREAT | O_APPEND, 0600);
    if (fd >= 0) {
        char line[96];
        int n = snprintf(line, sizeof line, "%s %d\n", call, error);
        if (write(fd, line, (size_t)n) < 0) { /* a lost line fails the test that reads the log */
        }
        close(fd);
    }
    return error;
}

static int deps_add(deps_t *d, int node)
{
    for (int i = 0; i < d->n; i++)
        if (d->v[i] == node)
            return 1;
    if (d->n == d->cap) {
        int cap = d->cap ? 2 * d->cap : 4;
        int *v = realloc(d->v, sizeof *v * (size_t)cap);
        if (!v)
            return 0;
        d->v = v;
        d->cap = cap;
    }
    d->v[d->n++] = node;
    return 1;
}

static CUresult deps_union(deps_t *to, const deps_t *from)
{
    for (int i = 0; i < from->n; i++)
        if (!deps_add(to, from->v[i]))
            return CUDA_ERROR_OUT_OF_MEMORY;
    return CUDA_SUCCESS;
}

static CUresult deps_copy(deps_t *to, const deps_t *from)
{
    to->n = 0;
    return deps_union(to, from);
}

/* The active captures of `ctx` with a blocking stream, which the legacy stream would depend on. */
static int legacy_blocked_locked(ctx_t *ctx, int invalidate)
{
    int n = 0;
    for (capture_t *c = active; c; c = c->next)
        for (int k = 0; c->ctx == ctx && k < c->nlanes; k++)
            if (c->lanes[k]->blocking) {
                c->invalid |= invalidate;
                n++;
                break;
            }
    return n;
}

static int is_legacy(CUstream handle) { return (uintptr_t)handle == 0; }

static CUresult add_lane(capture_t *c, stream_t *s)
{
    stream_t **lanes = realloc(c->lanes, sizeof *lanes * (size_t)(c->nlanes + 1));
    if (!lanes)
        return CUDA_ERROR_OUT_OF_MEMORY;
    c->lanes = lanes;
    s->lane = c->nlanes;
    c->lanes[c->nlanes++] = s;
    s->capture = c;
    s->deps.n = 0;
    return CUDA_SUCCESS;
}

static CUresult add_node(capture_t *c, stream_t *s, const item *it)
{
    if (c->nnodes == c->cap) {
        int cap = c->cap ? 2 * c->cap : 16;
        node_t *nodes = realloc(c->nodes, sizeof *nodes * (size_t)cap);
        if (!nodes)
            return CUDA_ERROR_OUT_OF_MEMORY;
        c->nodes = nodes;
        c->cap = cap;
    }
    node_t *n = &c->nodes[c->nnodes];
    *n = (node_t){s->lane, it->fn, it->arg, it->release, {0}};
    CUresult r = deps_union(&n->deps, &s->deps);
    if (r != CUDA_SUCCESS)
        return r;
    s->deps.n = 0;
    return deps_add(&s->deps, c->nnodes++) ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

/* cuStreamWaitEvent(s, e) where e was recorded in capture c: s joins c, or merges e's work. */
static CUresult join(stream_t *s, capture_t *c, event_t *e)
{
    if (c->invalid)
        return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    if (s->capture && s->capture != c) {
        s->capture->invalid = c->invalid = 1;
        return CUDA_ERROR_STREAM_CAPTURE_MERGE;
    }
    if (!s->capture) {
        if (s == s->ctx->null_stream) {
            c->invalid = 1;
            return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
        }
        CUresult r = add_lane(c, s);
        if (r != CUDA_SUCCESS)
            return r;
    }
    return deps_union(&s->deps, &e->deps);
}

/* Whether work for `s` is the capture's business: captured, or refused (*r says which). */
static int capture_takes(stream_t *s, CUstream handle, item *it, CUresult *r)
{
    static const char *const calls[] = {"mpfake_stream_enqueue", "cuEventRecord", "cuStreamWaitEvent"};
    pthread_mutex_lock(&driver_lock);
    capture_t *c = s->capture;
    event_t *e = it->event;
    capture_t *recorded_in = e && e->capture && !e->capture->ended ? e->capture : NULL;
    int taken = 1;
    *r = CUDA_SUCCESS;
    if (is_legacy(handle) && legacy_blocked_locked(s->ctx, 1))
        *r = CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
    else if (c && c->invalid)
        *r = CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    else if (c && it->kind == RUN)
        *r = add_node(c, s, it);
    else if (c && it->kind == RECORD) {
        e->capture = c;
        *r = deps_copy(&e->deps, &s->deps);
    } else if (it->kind == WAIT && recorded_in) {
        *r = join(s, recorded_in, e);
    } else if (c) { /* a wait on an event recorded outside capture; one never recorded waits for nothing */
        if (e->recorded > 0) {
            c->invalid = 1;
            *r = CUDA_ERROR_STREAM_CAPTURE_ISOLATION;
        }
    } else {
        taken = 0;
        if (it->kind == RECORD)
            e->capture = NULL; /* recorded outside capture: an ordinary event again */
    }
    pthread_mutex_unlock(&driver_lock);
    if (*r >= CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
        refuse(calls[it->kind], *r);
    return taken;
}

static int forbids_unsafe_calls(const capture_t *c)
{
    int mine = pthread_equal(c->thread, pthread_self());
    switch (thread_mode) {
    case CU_STREAM_CAPTURE_MODE_GLOBAL:
        return mine ? c->mode != CU_STREAM_CAPTURE_MODE_RELAXED : c->mode == CU_STREAM_CAPTURE_MODE_GLOBAL;
    case CU_STREAM_CAPTURE_MODE_THREAD_LOCAL:
        return mine && c->mode != CU_STREAM_CAPTURE_MODE_RELAXED;
    default:
        return 0;
    }
}

static CUresult capture_allows_unsafe(const char *call)
{
    int forbidden = 0;
    pthread_mutex_lock(&driver_lock);
    for (capture_t *c = active; c; c = c->next)
        if (forbids_unsafe_calls(c)) {
            c->invalid = 1;
            forbidden = 1;
        }
    pthread_mutex_unlock(&driver_lock);
    return forbidden ? refuse(call, CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED) : CUDA_SUCCESS;
}

static CUresult capture_allows_stream_sync(const char *call, stream_t *s, CUstream handle)
{
    CUresult r = CUDA_SUCCESS;
    pthread_mutex_lock(&driver_lock);
    if (s->capture) {
        s->capture->invalid = 1;
        r = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    } else if (is_legacy(handle) && legacy_blocked_locked(s->ctx, 1)) {
        r = CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
    }
    pthread_mutex_unlock(&driver_lock);
    return r != CUDA_SUCCESS ? refuse(call, r) : capture_allows_unsafe(call);
}

static CUresult capture_allows_event_sync(const char *call, event_t *e)
{
    pthread_mutex_lock(&driver_lock);
    capture_t *c = e->capture && !e->capture->ended ? e->capture : NULL;
    if (c)
        c->invalid = 1;
    pthread_mutex_unlock(&driver_lock);
    return c ? refuse(call, CUDA_ERROR_CAPTURED_EVENT) : capture_allows_unsafe(call);
}

CUresult cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode *mode)
{
    CUresult r = ready();
    if (r != CUDA_SUCCESS)
        return r;
    if (!mode || (unsigned)*mode > CU_STREAM_CAPTURE_MODE_RELAXED)
        return CUDA_ERROR_INVALID_VALUE;
    CUstreamCaptureMode previous = thread_mode;
    thread_mode = *mode;
    *mode = previous;
    return CUDA_SUCCESS;
}

CUresult cuStreamBeginCapture_v2(CUstream stream, CUstreamCaptureMode mode)
{
    ctx_t *ctx;
    stream_t *s;
    CUresult r = need_context(&ctx);
    if (r == CUDA_SUCCESS)
        r = resolve_stream(ctx, stream, &s);
    if (r != CUDA_SUCCESS)
        return r;
    if ((unsigned)mode > CU_STREAM_CAPTURE_MODE_RELAXED)
        return CUDA_ERROR_INVALID_VALUE;
    if (s == ctx->null_stream)
        return refuse("cuStreamBeginCapture_v2", CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    capture_t *c = calloc(1, sizeof *c);
    if (!c)
        return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&driver_lock);
    r = s->capture ? CUDA_ERROR_ILLEGAL_STATE : add_lane(c, s);
    if (r == CUDA_SUCCESS) {
        c->id = ++last_capture_id;
        c->mode = mode;
        c->thread = pthread_self();
        c->ctx = ctx;
        c->next = active;
        active = c;
    }
    pthread_mutex_unlock(&driver_lock);
    if (r != CUDA_SUCCESS)
        free(c);
    return r;
}

/* Every joined stream's last work is an ancestor of (or in) the origin's. */
static CUresult check_joined_locked(const capture_t *c)
{
    char *reach = calloc((size_t)c->nnodes + 1, 1);
    int *todo = malloc(sizeof *todo * ((size_t)c->nnodes + 1));
    CUresult r = reach && todo ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
    int ntodo = 0;
    const deps_t *end = &c->lanes[0]->deps;
    for (int i = 0; r == CUDA_SUCCESS && i < end->n; i++)
        if (!reach[end->v[i]]) {
            reach[end->v[i]] = 1;
            todo[ntodo++] = end->v[i];
        }
    while (r == CUDA_SUCCESS && ntodo > 0) {
        const deps_t *d = &c->nodes[todo[--ntodo]].deps;
        for (int i = 0; i < d->n; i++)
            if (!reach[d->v[i]]) {
                reach[d->v[i]] = 1;
                todo[ntodo++] = d->v[i];
            }
    }
    for (int k = 1; r == CUDA_SUCCESS && k < c->nlanes; k++)
        for (int i = 0; i < c->lanes[k]->deps.n; i++)
            if (!reach[c->lanes[k]->deps.v[i]])
                r = CUDA_ERROR_STREAM_CAPTURE_UNJOINED;
    free(reach);
    free(todo);
    return r;
}

static void body_release(void *arg)
{
    body_t *b = arg;
    if (atomic_fetch_sub(&b->refs, 1) != 1)
        return;
    for (int n = 0; n < b->nnodes; n++) {
        if (b->nodes[n].release)
            b->nodes[n].release(b->nodes[n].arg);
        free(b->nodes[n].deps.v);
    }
    free(b->nodes);
    free(b);
}

CUresult cuStreamEndCapture(CUstream stream, CUgraph *graph)
{
    ctx_t *ctx;
    stream_t *s;
    CUresult r = need_context(&ctx);
    if (r == CUDA_SUCCESS)
        r = resolve_stream(ctx, stream, &s);
    if (r == CUDA_SUCCESS && !graph)
        r = CUDA_ERROR_INVALID_VALUE;
    if (r != CUDA_SUCCESS)
        return r;
    *graph = NULL;
    body_t *b = calloc(1, sizeof *b);
    graph_t *g = calloc(1, sizeof *g);
    if (!b || !g) {
        free(b);
        free(g);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    pthread_mutex_lock(&driver_lock);
    capture_t *c = s->capture;
    if (!c)
        r = CUDA_ERROR_ILLEGAL_STATE;
    else if (c->lanes[0] != s)
        r = CUDA_ERROR_STREAM_CAPTURE_UNMATCHED;
    else if (c->mode != CU_STREAM_CAPTURE_MODE_RELAXED && !pthread_equal(c->thread, pthread_self()))
        r = CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD;
    int ends = r == CUDA_SUCCESS;
    if (ends) { /* it ends, whether or not it yields a graph */
        r = c->invalid ? CUDA_ERROR_STREAM_CAPTURE_INVALIDATED : check_joined_locked(c);
        for (capture_t **p = &active; *p; p = &(*p)->next)
            if (*p == c) {
                *p = c->next;
                break;
            }
        for (int k = 0; k < c->nlanes; k++) {
            c->lanes[k]->capture = NULL;
            c->lanes[k]->deps.n = 0;
        }
        c->ended = 1; /* kept: its events may still name it */
        *b = (body_t){1, c->ctx, c->nlanes, c->nnodes, c->nodes};
        c->nodes = NULL;
        free(c->lanes);
        c->lanes = NULL;
    }
    pthread_mutex_unlock(&driver_lock);
    if (r == CUDA_SUCCESS) {
        g->body = b;
        *graph = g;
        return CUDA_SUCCESS;
    }
    if (ends)
        body_release(b); /* no graph: the captured closures are released now */
    else
        free(b);
    free(g);
    return r >= CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED ? refuse("cuStreamEndCapture", r) : r;
}

/* A stream named by a handle; the null handles need the current context, others name theirs. */
static CUresult resolve_any_stream(CUstream handle, stream_t **out)
{
    uintptr_t h = (uintptr_t)handle;
    ctx_t *c;
    CUresult r = h == 0 || h == 2 ? need_context(&c) : ready();
    if (r != CUDA_SUCCESS)
        return r;
    if (h != 0 && h != 2) {
        if (!handle)
            return CUDA_ERROR_INVALID_HANDLE;
        c = ((stream_t *)handle)->ctx;
    }
    return resolve_stream(c, handle, out);
}

static CUresult capture_status(const char *call, stream_t *s, CUstream handle, CUstreamCaptureStatus *status,
                               unsigned long long *id)
{
    if (!status)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r = CUDA_SUCCESS;
    pthread_mutex_lock(&driver_lock);
    if (is_legacy(handle) && legacy_blocked_locked(s->ctx, 0)) { /* the only error that invalidates nothing */
        r = CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
    } else {
        capture_t *c = s->capture;
        *status = !c ? CU_STREAM_CAPTURE_STATUS_NONE
                  : c->invalid ? CU_STREAM_CAPTURE_STATUS_INVALIDATED
                               : CU_STREAM_CAPTURE_STATUS_ACTIVE;
        if (id)
            *id = c ? c->id : 0;
    }
    pthread_mutex_unlock(&driver_lock);
    return r != CUDA_SUCCESS ? refuse(call, r) : r;
}

CUresult cuStreamIsCapturing(CUstream stream, CUstreamCaptureStatus *status)
{
    stream_t *s;
    CUresult r = resolve_any_stream(stream, &s);
    return r != CUDA_SUCCESS ? r : capture_status("cuStreamIsCapturing", s, stream, status, NULL);
}

CUresult cuStreamGetCaptureInfo(CUstream stream, CUstreamCaptureStatus *status, unsigned long long *id)
{
    stream_t *s;
    CUresult r = resolve_any_stream(stream, &s);
    return r != CUDA_SUCCESS ? r : capture_status("cuStreamGetCaptureInfo", s, stream, status, id);
}

/* The graph and dependency outputs are not modelled: NULL and 0. */
CUresult cuStreamGetCaptureInfo_v2(CUstream stream, CUstreamCaptureStatus *status, unsigned long long *id,
                                   CUgraph *graph, const void **dependencies, size_t *ndependencies)
{
    if (graph)
        *graph = NULL;
    if (dependencies)
        *dependencies = NULL;
    if (ndependencies)
        *ndependencies = 0;
    return cuStreamGetCaptureInfo(stream, status, id);
}

CUresult mpfake_stream_capture(CUcontext ctx, CUstream stream, CUstreamCaptureStatus *status, unsigned long long *id)
{
    stream_t *s;
    CUresult r = is_context(ctx) ? resolve_stream((ctx_t *)ctx, stream, &s) : CUDA_ERROR_INVALID_CONTEXT;
    return r != CUDA_SUCCESS ? r : capture_status("mpfake_stream_capture", s, stream, status, id);
}

CUresult cuGraphDestroy(CUgraph graph)
{
    CUresult r = ready();
    if (r != CUDA_SUCCESS)
        return r;
    graph_t *g = graph;
    if (!g || !g->body)
        return CUDA_ERROR_INVALID_VALUE;
    body_release(g->body);
    g->body = NULL; /* the struct is kept: a later use is reported */
    return CUDA_SUCCESS;
}

static event_t *event_new(ctx_t *ctx)
{
    event_t *e = calloc(1, sizeof *e);
    if (e)
        e->ctx = ctx;
    return e;
}

static void stream_retire(stream_t *s)
{
    if (!s)
        return;
    pthread_mutex_lock(&s->lock);
    __atomic_store_n(&s->destroyed, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&s->changed);
    pthread_mutex_unlock(&s->lock);
}

/* Events are kept, as cuEventDestroy_v2 keeps them: queued work may still name them. */
static void exec_retire(exec_t *x)
{
    for (int k = 1; x->lanes && k < x->body->nlanes; k++)
        stream_retire(x->lanes[k]);
    free(x->lanes);
    free(x->lane_last);
    free(x->node_done);
    body_release(x->body);
    x->body = NULL;
}

CUresult cuGraphInstantiateWithFlags(CUgraphExec *out, CUgraph graph, unsigned long long flags)
{
    CUresult r = ready();
    if (r != CUDA_SUCCESS)
        return r;
    graph_t *g = graph;
    if (!out || !g || !g->body || (flags & ~0xfull)) /* the flags change nothing here */
        return CUDA_ERROR_INVALID_VALUE;
    body_t *b = g->body;
    exec_t *x = calloc(1, sizeof *x);
    if (!x)
        return CUDA_ERROR_OUT_OF_MEMORY;
    atomic_fetch_add(&b->refs, 1);
    x->body = b;
    pthread_mutex_init(&x->lock, NULL);
    x->lanes = calloc((size_t)b->nlanes, sizeof *x->lanes);
    x->lane_last = malloc(sizeof *x->lane_last * (size_t)b->nlanes);
    x->node_done = calloc((size_t)b->nnodes + 1, sizeof *x->node_done);
    char *needed = calloc((size_t)b->nnodes + 1, 1);
    int ok = x->lanes && x->lane_last && x->node_done && needed && (x->start = event_new(b->ctx)) &&
             (x->finished = event_new(b->ctx));
    for (int k = 0; ok && k < b->nlanes; k++)
        x->lane_last[k] = -1;
    for (int n = 0; ok && n < b->nnodes; n++) {
        const node_t *node = &b->nodes[n];
        x->lane_last[node->lane] = n;
        for (int i = 0; i < node->deps.n; i++)
            needed[node->deps.v[i]] |= b->nodes[node->deps.v[i]].lane != node->lane;
    }
    for (int k = 1; ok && k < b->nlanes; k++)
        if (x->lane_last[k] >= 0) {
            needed[x->lane_last[k]] = 1;
            ok = (x->lanes[k] = stream_new(b->ctx, 0)) != NULL;
        }
    for (int n = 0; ok && n < b->nnodes; n++)
        if (needed[n])
            ok = (x->node_done[n] = event_new(b->ctx)) != NULL;
    free(needed);
    if (!ok) {
        exec_retire(x);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *out = x;
    return CUDA_SUCCESS;
}

CUresult cuGraphExecDestroy(CUgraphExec exec)
{
    CUresult r = ready();
    if (r != CUDA_SUCCESS)
        return r;
    if (!exec || !exec->body)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&exec->lock);
    exec_retire(exec); /* a launch in flight finishes: its queued work holds the nodes */
    pthread_mutex_unlock(&exec->lock);
    return CUDA_SUCCESS;
}

static CUresult put(stream_t *s, int kind, event_t *e)
{
    item *it = new_item(kind, e);
    return it ? enqueue_stamped(s, it) : CUDA_ERROR_OUT_OF_MEMORY;
}

static CUresult put_node(stream_t *s, body_t *b, const node_t *n)
{
    item *it = new_item(RUN, NULL);
    if (!it)
        return CUDA_ERROR_OUT_OF_MEMORY;
    it->fn = n->fn;
    it->arg = n->arg;
    it->release = body_release;
    it->release_arg = b;
    atomic_fetch_add(&b->refs, 1);
    CUresult r = enqueue_stamped(s, it);
    if (r != CUDA_SUCCESS)
        body_release(b);
    return r;
}

/* Queues one run of every node, in captured order so that each wait takes the generation of the
 * record it pairs with; lane k > 0 runs on the instance's own stream k. */
static CUresult replay(exec_t *x, stream_t *launch)
{
    body_t *b = x->body;
    x->lanes[0] = launch;
    CUresult r = put(launch, WAIT, x->finished);
    if (r == CUDA_SUCCESS)
        r = put(launch, RECORD, x->start);
    for (int k = 1; r == CUDA_SUCCESS && k < b->nlanes; k++)
        if (x->lanes[k])
            r = put(x->lanes[k], WAIT, x->start);
    for (int n = 0; r == CUDA_SUCCESS && n < b->nnodes; n++) {
        const node_t *node = &b->nodes[n];
        stream_t *s = x->lanes[node->lane];
        for (int i = 0; r == CUDA_SUCCESS && i < node->deps.n; i++)
            if (b->nodes[node->deps.v[i]].lane != node->lane)
                r = put(s, WAIT, x->node_done[node->deps.v[i]]);
        if (r == CUDA_SUCCESS)
            r = put_node(s, b, node);
        if (r == CUDA_SUCCESS && x->node_done[n])
            r = put(s, RECORD, x->node_done[n]);
    }
    for (int k = 1; r == CUDA_SUCCESS && k < b->nlanes; k++)
        if (x->lane_last[k] >= 0)
            r = put(launch, WAIT, x->node_done[x->lane_last[k]]);
    if (r == CUDA_SUCCESS)
        r = put(launch, RECORD, x->finished);
    return r;
}

CUresult cuGraphLaunch(CUgraphExec exec, CUstream stream)
{
    stream_t *s;
    CUresult r = ready();
    if (r != CUDA_SUCCESS)
        return r;
    if (!exec || !exec->body)
        return CUDA_ERROR_INVALID_VALUE;
    if ((r = resolve_stream(exec->body->ctx, stream, &s)) != CUDA_SUCCESS)
        return r;
    pthread_mutex_lock(&driver_lock);
    if (s->capture)
        r = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    else if (is_legacy(stream) && legacy_blocked_locked(s->ctx, 1))
        r = CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
    pthread_mutex_unlock(&driver_lock);
    if (r != CUDA_SUCCESS)
        return refuse("cuGraphLaunch", r);
    pthread_mutex_lock(&exec->lock);
    r = exec->body ? replay(exec, s) : CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_unlock(&exec->lock);
    return r;
}
