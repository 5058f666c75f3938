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
 *   - device memory is host memory.
 * The fake libnccl enqueues its kernels through the mpfake_ functions at the end.
 *
 * Environment (read by cuInit):
 *   MPFAKE_CUDA_DEVICES              number of devices (default 1)
 *   MPFAKE_CUDA_FAIL_SET_CURRENT_AFTER=N
 *                                    after N successful cuCtxSetCurrent calls in the process,
 *                                    every later one fails with CUDA_ERROR_INVALID_CONTEXT */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "mpfake.h"

#define MAX_DEVICES 8

typedef struct item {
    enum { RUN, RECORD, WAIT } kind;
    void (*fn)(void *);
    void *arg;
    struct mp_fake_event *event;
    uint64_t generation;
    struct item *next;
} item;

typedef struct mp_fake_stream {
    struct mp_fake_ctx *ctx;
    pthread_mutex_t lock;
    pthread_cond_t changed;
    item *head, *tail;
    uint64_t enqueued, done; /* items, for cuStreamSynchronize */
    int destroyed;
    pthread_t worker;
} stream_t;

typedef struct mp_fake_event {
    struct mp_fake_ctx *ctx;
    uint64_t recorded; /* generation of the last cuEventRecord */
    uint64_t fired;    /* generation that has run on its stream */
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
    {CUDA_ERROR_NOT_READY, "device not ready"},
    {CUDA_ERROR_CONTEXT_IS_DESTROYED, "context is destroyed"},
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

static stream_t *stream_new(ctx_t *ctx)
{
    stream_t *s = calloc(1, sizeof *s);
    if (!s)
        return NULL;
    s->ctx = ctx;
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
        c->null_stream = stream_new(c);
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

CUresult cuStreamCreateWithPriority(CUstream *stream, unsigned int flags, int priority)
{
    ctx_t *c;
    CUresult r = need_context(&c);
    if (r != CUDA_SUCCESS)
        return r;
    if (flags > 1 || priority > 0 || priority < -5)
        return CUDA_ERROR_INVALID_VALUE;
    stream_t *s = stream_new(c);
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
    CUresult r = need_context(&c);
    if (r == CUDA_SUCCESS && (r = resolve_stream(c, stream, &s)) == CUDA_SUCCESS && s == c->null_stream)
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
    CUresult r = need_context(&c);
    if (r == CUDA_SUCCESS)
        r = resolve_stream(c, stream, &s);
    if (r != CUDA_SUCCESS)
        return r;
    pthread_mutex_lock(&s->lock);
    uint64_t target = s->enqueued;
    while (s->done < target)
        pthread_cond_wait(&s->changed, &s->lock);
    pthread_mutex_unlock(&s->lock);
    return CUDA_SUCCESS;
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
    item *it = calloc(1, sizeof *it);
    if (!it)
        return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&driver_lock);
    it->generation = ++e->recorded;
    pthread_mutex_unlock(&driver_lock);
    it->kind = RECORD;
    it->event = e;
    return enqueue(s, it);
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
    pthread_mutex_lock(&driver_lock);
    r = e->fired < e->recorded ? CUDA_ERROR_NOT_READY : CUDA_SUCCESS;
    pthread_mutex_unlock(&driver_lock);
    return r;
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
    item *it = calloc(1, sizeof *it);
    if (!it)
        return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&driver_lock);
    it->generation = e->recorded; /* the work recorded so far; 0 (never recorded) waits for nothing */
    pthread_mutex_unlock(&driver_lock);
    it->kind = WAIT;
    it->event = e;
    return enqueue(s, it);
}

/* ---- memory --------------------------------------------------------------------------------- */

CUresult cuMemAlloc_v2(CUdeviceptr *ptr, size_t bytes)
{
    ctx_t *c;
    CUresult r = need_context(&c);
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
    if (r != CUDA_SUCCESS)
        return r;
    free((void *)(uintptr_t)ptr);
    return CUDA_SUCCESS;
}

/* ---- for the fake libnccl -------------------------------------------------------------------- */

CUcontext mpfake_current_context(void) { return (CUcontext)current; }

CUresult mpfake_stream_context(CUstream stream, CUcontext *ctx)
{
    ctx_t *c;
    stream_t *s;
    CUresult r = need_context(&c);
    if (r == CUDA_SUCCESS)
        r = resolve_stream(c, stream, &s);
    if (r == CUDA_SUCCESS)
        *ctx = (CUcontext)s->ctx;
    return r;
}

CUresult mpfake_stream_enqueue(CUcontext ctx, CUstream stream, void (*fn)(void *), void *arg)
{
    stream_t *s;
    CUresult r = is_context(ctx) ? resolve_stream((ctx_t *)ctx, stream, &s) : CUDA_ERROR_INVALID_CONTEXT;
    if (r != CUDA_SUCCESS)
        return r;
    item *it = calloc(1, sizeof *it);
    if (!it)
        return CUDA_ERROR_OUT_OF_MEMORY;
    it->kind = RUN;
    it->fn = fn;
    it->arg = arg;
    return enqueue(s, it);
}
