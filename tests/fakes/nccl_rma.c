/* The model of libnccl, part 4: one-sided RMA, after NCCL v2.30.7-1. Memory from ncclMemAlloc,
 * windows registered collectively over it, ncclPutSignal / ncclSignal / ncclWaitSignal on the
 * fake driver's streams, and ncclCommQueryProperties' hostRmaSupport. docs/nccl-model.md lists
 * what each behaviour follows; the citations below name NCCL's files and functions.
 *
 * Device memory is host memory in this model (tests/fakes/libcuda.c), so ncclMemAlloc's "cuMem"
 * memory is a memfd mapping that peers map at registration, and a put is a memcpy into the
 * peer's mapping, followed by the signal, on the putting rank's stream: every rank of a
 * communicator is in one LSA team here, NCCL's copy-engine path (src/rma/rma_ce.cc). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "nccl_model.h"

#define GRANULARITY (2u << 20)         /* cuMem's recommended granularity on current GPUs */
#define WINDOW_ALIGNMENT 4096u         /* nccl.h: NCCL_WIN_REQUIRED_ALIGNMENT */
#define WIN_COLL_SYMMETRIC 0x01        /* nccl.h: NCCL_WIN_COLL_SYMMETRIC */
#define RMA_DRIVER_VERSION 12050       /* src/enqueue.cc rmaTaskAppend: CUDA driver 12.5 */
#define PROPERTIES_RMA_VERSION 22903   /* src/dev_runtime.cc ncclCommQueryProperties */
#define PUT_CHUNK (1ull << 30)         /* src/enqueue.cc rmaTaskAppend: puts split at 1 GiB */

/* For tests: hazards NCCL leaves undefined, counted and logged so that a test can assert none. */
static _Atomic long overruns;           /* puts past the end of the peer's window */
static _Atomic long deregistered_in_use; /* windows deregistered with an op of theirs still queued */
API long mpfake_nccl_rma_overruns(void) { return atomic_load(&overruns); }
API long mpfake_nccl_windows_deregistered_in_use(void) { return atomic_load(&deregistered_in_use); }

/* ---- memory: ncclMemAlloc, ncclMemFree (src/allocator.cc) --------------------------------- */

typedef struct allocation {
    char *base;
    size_t size;
    int fd;
    struct allocation *next;
} allocation;
static allocation *allocations; /* lib_lock */

/* src/misc/cudawrap.cc ncclCuMemEnable: NCCL_CUMEM_ENABLE, or with -2 (the default) the driver's
 * support: 12.0 or later (ncclIsCuMemSupported). VMM support is taken for granted here. */
static int cumem_enabled(void)
{
    static long long param = PARAM_UNREAD;
    long long v = nccl_param("NCCL_CUMEM_ENABLE", &param);
    if (v == CONFIG_UNDEF_INT)
        v = -2;
    int driver = 0;
    return v >= 0 ? v != 0 : v == -2 && cuDriverGetVersion(&driver) == CUDA_SUCCESS && driver >= 12000;
}

/* The allocation holding [p, p + n), or NULL (lib_lock). */
static allocation *allocation_of(const void *p, size_t n)
{
    for (allocation *a = allocations; a; a = a->next)
        if ((const char *)p >= a->base && (const char *)p + n <= a->base + a->size)
            return a;
    return NULL;
}

/* With cuMem, a VMM allocation rounded up to the granularity; without, or for a NULL `ptr` or a
 * size of 0, cudaMalloc's answer (src/allocator.cc ncclMemAlloc, its fallback). */
API ncclResult_t ncclMemAlloc(void **ptr, size_t size)
{
    if (!mpfake_current_context()) {
        log_warning("ncclMemAlloc: no current CUDA context on this thread");
        return ncclUnhandledCudaError;
    }
    if (!ptr || !size || !cumem_enabled()) {
        CUdeviceptr d = 0;
        if (!ptr || cuMemAlloc_v2(&d, size) != CUDA_SUCCESS)
            return ncclUnhandledCudaError;
        *ptr = (void *)(uintptr_t)d;
        return ncclSuccess;
    }
    size_t rounded = (size + GRANULARITY - 1) / GRANULARITY * GRANULARITY;
    int fd = memfd_create("mpfake-nccl-mem", MFD_CLOEXEC);
    void *p = fd < 0 || ftruncate(fd, (off_t)rounded) != 0 ? MAP_FAILED
                                                          : mmap(NULL, rounded, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    allocation *a = p == MAP_FAILED ? NULL : malloc(sizeof *a);
    if (!a) {
        if (p != MAP_FAILED)
            munmap(p, rounded);
        if (fd >= 0)
            close(fd);
        log_warning("ncclMemAlloc: cuMemCreate of %zu bytes failed", rounded);
        return ncclUnhandledCudaError;
    }
    *a = (allocation){p, rounded, fd, NULL};
    pthread_mutex_lock(&lib_lock);
    a->next = allocations;
    allocations = a;
    pthread_mutex_unlock(&lib_lock);
    *ptr = p;
    return ncclSuccess;
}

/* NULL is cudaFree(NULL); memory not from ncclMemAlloc fails cuMem's calls when cuMem is on
 * (src/allocator.cc ncclMemFree -> ncclCuMemFree), and is cudaFree'd when it is off. */
API ncclResult_t ncclMemFree(void *ptr)
{
    if (!ptr)
        return ncclSuccess;
    pthread_mutex_lock(&lib_lock);
    allocation **at = &allocations;
    while (*at && (*at)->base != ptr)
        at = &(*at)->next;
    allocation *a = *at;
    if (a)
        *at = a->next;
    pthread_mutex_unlock(&lib_lock);
    if (!a) {
        if (cumem_enabled())
            return ncclUnhandledCudaError;
        return cuMemFree_v2((CUdeviceptr)(uintptr_t)ptr) == CUDA_SUCCESS ? ncclSuccess : ncclUnhandledCudaError;
    }
    munmap(a->base, a->size);
    close(a->fd); /* peers' mappings keep the memory */
    free(a);
    return ncclSuccess;
}

/* ---- what the communicator supports (src/init.cc initTransportsRank) ---------------------- */

/* src/dev_runtime.cc computeLsaSize: NCCL_LSA_TEAM_SIZE (0: all) reduced by gcd to the runs of
 * consecutive ranks on one node. Every rank of the model is on one node, unless
 * MPFAKE_NCCL_RANKS_PER_NODE says how many share one. */
static long gcd(long a, long b) { return b ? gcd(b, a % b) : a; }

static int lsa_size(const comm_t *c)
{
    static long long param = PARAM_UNREAD;
    long long team = nccl_param("NCCL_LSA_TEAM_SIZE", &param);
    long per_node = env_long("MPFAKE_NCCL_RANKS_PER_NODE", c->nranks);
    long size = team > 0 && team != CONFIG_UNDEF_INT ? (long)team : c->nranks;
    return (int)gcd(gcd(size, per_node > 0 ? per_node : c->nranks), c->nranks);
}

/* symmetricSupport: CUDA P2P between local ranks (always here), NCCL_WIN_ENABLE, cuMem, and one
 * LSA team, there being no GIN in the model (init.cc, before hostRmaSupport). */
static int symmetric_support(const comm_t *c)
{
    static long long param = PARAM_UNREAD;
    long long win = nccl_param("NCCL_WIN_ENABLE", &param);
    return (win == CONFIG_UNDEF_INT || win != 0) && cumem_enabled() && lsa_size(c) == c->nranks;
}

/* numRmaCtx: the config's default of 1 (src/init.cc parseCommConfig; the package's configs
 * stop before the field), overridden by NCCL_NUM_RMA_CTX unless negative (envConfigOverride). */
static int host_rma_support(const comm_t *c)
{
    static long long param = PARAM_UNREAD;
    long long ctxs = nccl_param("NCCL_NUM_RMA_CTX", &param);
    if (ctxs == CONFIG_UNDEF_INT || ctxs < 0)
        ctxs = 1;
    return ctxs > 0 && symmetric_support(c);
}

/* ncclCommProperties_t of nccl_device/core.h, through the fields of 2.30. */
typedef struct {
    size_t size;
    unsigned int magic, version;
    int rank, nRanks, cudaDev, nvmlDev;
    bool deviceApiSupport, multimemSupport;
    int ginType, nLsaTeams;
    bool hostRmaSupport;
    int railedGinType;
} properties_t;

/* src/dev_runtime.cc ncclCommQueryProperties: the RMA fields only for callers of a version after
 * 2.29.3; a struct not made by NCCL_COMM_PROPERTIES_INITIALIZER is refused. */
API ncclResult_t ncclCommQueryProperties(comm_t *comm, properties_t *props)
{
    enter_call(comm, 1);
    ncclResult_t r = usable(comm, "ncclCommQueryProperties");
    if (r == ncclSuccess && !props) {
        log_warning("ncclCommQueryProperties: props is NULL");
        r = ncclInvalidArgument;
    }
    if (r == ncclSuccess && props->magic != CONFIG_MAGIC) {
        log_warning("ncclCommQueryProperties: props must be initialized via NCCL_COMM_PROPERTIES_INITIALIZER");
        r = ncclInvalidUsage;
    }
    if (r == ncclSuccess) {
        properties_t p = *props;
        p.rank = comm->rank;
        p.nRanks = comm->nranks;
        p.cudaDev = p.nvmlDev = 0;
        p.deviceApiSupport = symmetric_support(comm);
        p.multimemSupport = false;
        if (props->version > PROPERTIES_RMA_VERSION) {
            p.hostRmaSupport = host_rma_support(comm);
            p.ginType = p.railedGinType = 0; /* ncclGinTypeNone */
            p.nLsaTeams = comm->nranks / lsa_size(comm);
        }
        memcpy(props, &p, props->size < sizeof p ? props->size : sizeof p);
    }
    enter_call(comm, -1);
    return r;
}

/* ---- windows (src/dev_runtime.cc ncclCommWindowRegister, ncclDevrWindowRegisterInGroup) ---- */

struct ncclWindow_vidmem {
    comm_t *comm;
    int rank, nranks;
    char *base; /* this rank's part */
    size_t size;
    int flags;
    _Atomic int refs; /* its registration, and each op of it queued on a stream and not yet run */
    char *peer_base[MAX_RANKS];
    size_t peer_size[MAX_RANKS];
    struct ncclWindow_vidmem *next;
};
typedef struct ncclWindow_vidmem window_t;

/* Waits for every rank's bit in *word, or the abort flag; 0 once all are in. */
static int all_arrived(comm_t *c, _Atomic uint64_t *word)
{
    uint64_t all = c->nranks == 64 ? ~0ull : (1ull << c->nranks) - 1;
    for (unsigned spins = 0; (atomic_load(word) & all) != all; spins++) {
        if (atomic_load(c->abort_flag))
            return -1;
        pause_for(spins);
    }
    return 0;
}

static void unmap_peers(window_t *w)
{
    for (int r = 0; r < w->nranks; r++)
        if (w->peer_base[r] && r != w->rank)
            munmap(w->peer_base[r], w->peer_size[r]);
}

/* Maps rank r's part of registration k; 0, or -1 with a warning. */
static int map_peer(window_t *w, int k, int r)
{
    window_part *part = &w->comm->seg->windows[k][r];
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", part->pid, part->fd);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    void *p = fd < 0 ? MAP_FAILED : mmap(NULL, part->size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, (off_t)part->offset);
    if (fd >= 0)
        close(fd);
    if (p == MAP_FAILED) {
        log_warning("ncclCommWindowRegister: mapping rank %d's window: %s", r, strerror(errno));
        return -1;
    }
    w->peer_base[r] = p;
    w->peer_size[r] = part->size;
    return 0;
}

/* Collective: every rank publishes its part, a barrier, then each maps every peer's. */
static ncclResult_t register_window(comm_t *c, void *buff, size_t size, window_t **out, int flags)
{
    pthread_mutex_lock(&lib_lock);
    allocation *a = allocation_of(buff, size);
    int fd = a ? a->fd : -1;
    size_t offset = a ? (size_t)((char *)buff - a->base) : 0;
    pthread_mutex_unlock(&lib_lock);
    if (!a) { /* src/include/alloc.h ncclCuMemGetAddressRange: CUCHECK on memory cuMem did not map */
        log_warning("ncclCommWindowRegister: %p is not memory from ncclMemAlloc (cuMemGetAddressRange failed)", buff);
        return ncclUnhandledCudaError;
    }
    if (offset % WINDOW_ALIGNMENT) {
        log_warning("Window address must be suitably aligned.");
        return ncclInvalidArgument;
    }
    if (c->windows == MAX_WINDOWS) {
        log_warning("ncclCommWindowRegister: the model holds %d registrations per communicator", MAX_WINDOWS);
        return ncclInternalError;
    }
    int k = c->windows++;
    window_part *mine = &c->seg->windows[k][c->rank];
    window_barriers *b = &c->seg->window_barriers[k];
    *mine = (window_part){.pid = (int32_t)getpid(), .fd = fd, .offset = offset, .size = size};
    window_t *w = calloc(1, sizeof *w);
    if (!w)
        return ncclSystemError;
    *w = (window_t){.comm = c, .rank = c->rank, .nranks = c->nranks, .base = buff, .size = size, .flags = flags,
                    .refs = 1};
    w->peer_base[c->rank] = buff;
    w->peer_size[c->rank] = size;
    /* Published parts, then every peer's mapped, then the closing barrier
     * (ncclDevrWindowRegisterInGroup: bootstrapBarrier): no rank leaves, or exits, while a peer
     * still maps its part. */
    uint64_t bit = 1ull << c->rank;
    atomic_fetch_or(&b->published, bit);
    ncclResult_t r = all_arrived(c, &b->published) != 0 ? ncclInvalidUsage : ncclSuccess;
    for (int peer = 0; r == ncclSuccess && peer < c->nranks; peer++)
        if (peer != c->rank && map_peer(w, k, peer) != 0)
            r = ncclSystemError;
    if (r == ncclSuccess) {
        atomic_fetch_or(&b->mapped, bit);
        if (all_arrived(c, &b->mapped) != 0)
            r = ncclInvalidUsage;
    }
    if (r != ncclSuccess) {
        unmap_peers(w);
        free(w);
        return r;
    }
    w->next = c->live_windows;
    c->live_windows = w;
    *out = w;
    return ncclSuccess;
}

API ncclResult_t ncclCommWindowRegister(comm_t *comm, void *buff, size_t size, window_t **win, int flags)
{
    enter_call(comm, 1);
    ncclResult_t r = usable(comm, "ncclCommWindowRegister");
    if (r == ncclSuccess && !win) {
        log_warning("ncclCommWindowRegister: win is NULL");
        r = ncclInvalidArgument;
    }
    if (r == ncclSuccess)
        *win = NULL;
    if (r == ncclSuccess && (!buff || !size)) {
        log_warning("ncclCommWindowRegister: invalid pointer %p / size %zu", buff, size);
        r = ncclInvalidArgument;
    }
    if (r == ncclSuccess && in_group()) {
        log_warning("ncclCommWindowRegister inside a group: not modelled (NCCL registers at ncclGroupEnd)");
        r = ncclInvalidUsage;
    }
    /* Without symmetric memory: success, and no window (dev_runtime.cc ncclCommWindowRegister). */
    if (r == ncclSuccess && symmetric_support(comm))
        r = register_window(comm, buff, size, win, flags);
    enter_call(comm, -1);
    return r;
}

static void release_window(window_t *w)
{
    if (w && atomic_fetch_sub(&w->refs, 1) == 1) {
        unmap_peers(w);
        free(w);
    }
}

/* Local, no barrier; an unknown window is an error of the shadow pool (dev_runtime.cc
 * ncclCommWindowDeregister). One whose ops are still queued breaks NCCL's rule that nothing
 * accesses it (user guide, comms.rst): counted. */
API ncclResult_t ncclCommWindowDeregister(comm_t *comm, window_t *win)
{
    enter_call(comm, 1);
    ncclResult_t r = usable(comm, "ncclCommWindowDeregister");
    window_t **at = comm ? &comm->live_windows : NULL;
    while (r == ncclSuccess && win && *at && *at != win)
        at = &(*at)->next;
    if (r == ncclSuccess && win && !*at) {
        log_warning("Device object does not exist in shadow pool.");
        r = ncclInternalError;
    }
    if (r == ncclSuccess && win) {
        *at = win->next;
        int queued = atomic_load(&win->refs) - 1;
        if (queued) {
            atomic_fetch_add(&deregistered_in_use, 1);
            log_warning("ncclCommWindowDeregister on rank %d while %d of its ops are still queued", comm->rank,
                        queued);
        }
        release_window(win); /* a queued op's run releases the rest */
    }
    enter_call(comm, -1);
    return r;
}

/* ---- puts, signals and waits (src/enqueue.cc rmaTaskAppend, src/rma/rma_ce.cc) ----------- */

typedef struct {
    comm_t *comm;
    window_t *src_win, *dst_win; /* NULL for a signal */
    char *dst;
    const char *src;
    size_t bytes;
    _Atomic uint64_t *signal;    /* the peer's slot for this rank */
    uint64_t value;              /* the absolute sequence it takes (rma_ce.cc: signalOpSeqs) */
} put_t;

typedef struct {
    comm_t *comm;
    int n;
    struct {
        _Atomic uint64_t *slot;
        uint64_t until;
    } waits[];
} wait_t;


/* Data, then its signal, in stream order (rma_ce.cc ncclRmaCePutLaunchNonPersist: the data
 * batch before the signal batch, never in one batch). A stalled comm writes nothing. */
static void run_put(void *arg)
{
    put_t *p = arg;
    if (!atomic_load(p->comm->abort_flag)) {
        if (p->bytes)
            memcpy(p->dst, p->src, p->bytes);
        atomic_store_explicit(p->signal, p->value, memory_order_release);
    }
    release_window(p->src_win);
    release_window(p->dst_win);
    free(p);
}

/* cuStreamWaitValue64 GEQ on each slot (rma_ce.cc ncclRmaCeWaitLaunch); ends at the abort flag as
 * a stuck kernel does. */
static void run_wait(void *arg)
{
    wait_t *w = arg;
    for (int i = 0; i < w->n; i++)
        for (unsigned spins = 0; atomic_load_explicit(w->waits[i].slot, memory_order_acquire) < w->waits[i].until;
             spins++) {
            if (atomic_load(w->comm->abort_flag))
                goto out;
            pause_for(spins);
        }
out:
    free(w);
}

/* What every RMA call checks, in rmaTaskAppend's order after ncclEnqueueCheck and ArgsCheck; and
 * what the model does not model. ncclWaitSignal has no peer (its root is 0: `peer` 0). */
static ncclResult_t rma_usable(comm_t *c, const char *call, int peer, int ctx, int sig_idx, unsigned flags,
                               CUstream stream)
{
    ncclResult_t r = usable(c, call);
    if (r != ncclSuccess)
        return r;
    if (peer >= c->nranks || peer < 0) { /* src/misc/argcheck.cc ArgsCheck: the root */
        log_warning("%s: invalid root %d (root must be in [0, %d))", call, peer, c->nranks);
        return ncclInvalidArgument;
    }
    int driver = 0;
    if (!host_rma_support(c)) {
        log_warning("One sided RMA: host RMA is not supported in this communicator.");
        return ncclInvalidArgument;
    }
    if (cuDriverGetVersion(&driver) != CUDA_SUCCESS || driver < RMA_DRIVER_VERSION) {
        log_warning("One-sided RMA requires CUDA driver 12.5 or later (found %d.%d).", driver / 1000,
                    driver % 1000 / 10);
        return ncclInvalidUsage;
    }
    if (ctx || sig_idx || flags) {
        log_warning("%s: %s %d is invalid (must be 0)", call, ctx ? "Context" : sig_idx ? "Signal index" : "Flags",
                    ctx ? ctx : sig_idx ? sig_idx : (int)flags);
        return ncclInvalidArgument;
    }
    CUcontext stream_ctx = NULL;
    if (mpfake_current_context() != c->ctx || mpfake_stream_context(stream, &stream_ctx) != CUDA_SUCCESS ||
        stream_ctx != c->ctx) {
        log_warning("%s: the current CUDA context or the stream is not the communicator's device's", call);
        return ncclUnhandledCudaError;
    }
    CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
    unsigned long long id = 0;
    if (in_group() || mpfake_stream_capture(c->ctx, stream, &status, &id) != CUDA_SUCCESS ||
        status != CU_STREAM_CAPTURE_STATUS_NONE) {
        log_warning("%s %s: not modelled yet", call, in_group() ? "inside a group" : "under stream capture");
        return ncclInvalidUsage;
    }
    return ncclSuccess;
}

/* The first RMA call that passes its checks registers NCCL's signal window, collectively, at its
 * (implicit) group end (enqueue.cc rmaTaskAppend queues rma_ce.cc ncclRmaCeInit after them):
 * every rank waits there for all. */
static ncclResult_t rma_join(comm_t *c)
{
    if (!c->rma_joined) {
        atomic_fetch_or(&c->seg->rma_arrived, 1ull << c->rank);
        if (all_arrived(c, &c->seg->rma_arrived) != 0)
            return ncclInvalidUsage;
        c->rma_joined = 1;
    }
    return ncclSuccess;
}

static window_t *window_holding(comm_t *c, const void *p)
{
    for (window_t *w = c->live_windows; w; w = w->next)
        if ((const char *)p >= w->base && (const char *)p < w->base + w->size)
            return w;
    return NULL;
}

static int is_live(comm_t *c, const window_t *win)
{
    for (window_t *w = c->live_windows; w; w = w->next)
        if (w == win)
            return 1;
    return 0;
}

/* ncclPutSignal (`data`), or ncclSignal: a put of no data (collectives.cc). */
static ncclResult_t put(int data, const void *src, size_t count, int type, int peer, window_t *win, size_t offset,
                        int sig_idx, int ctx, unsigned flags, comm_t *c, CUstream stream)
{
    const char *call = data ? "ncclPutSignal" : "ncclSignal";
    ncclResult_t r = rma_usable(c, call, peer, ctx, sig_idx, flags, stream);
    if (r != ncclSuccess)
        return r;
    size_t bytes = data ? count * type_size(type) : 0;
    window_t *src_win = NULL;
    if (data) {
        if (!win) {
            log_warning("ncclPutSignal: peerWin is NULL");
            return ncclInvalidArgument;
        }
        if (!is_live(c, win)) {
            log_warning("Device object does not exist in shadow pool.");
            return ncclInternalError;
        }
        if (!src) {
            log_warning("ncclPutSignal: srcBuff is NULL");
            return ncclInvalidArgument;
        }
        src_win = window_holding(c, src); /* its start alone is looked up (ncclDevrFindWindow) */
        if (!src_win || !(src_win->flags & WIN_COLL_SYMMETRIC)) {
            log_warning("ncclPutSignal: srcWinHost is not in a valid symmetric window");
            return ncclInvalidArgument;
        }
        /* At launch, only the start is checked, against the caller's own part (dev_runtime.cc
         * ncclDevrGetLsaRankPtr), with no warning. */
        if (offset >= win->size)
            return ncclInvalidArgument;
        if (offset + bytes > win->peer_size[peer]) {
            atomic_fetch_add(&overruns, 1);
            log_warning("%s of %zu bytes at offset %zu overruns rank %d's window of %zu bytes (NCCL writes past "
                        "it)", call, bytes, offset, peer, win->peer_size[peer]);
            bytes = offset < win->peer_size[peer] ? win->peer_size[peer] - offset : 0;
        }
    }
    if ((r = rma_join(c)) != ncclSuccess)
        return r;
    put_t *p = malloc(sizeof *p);
    if (!p)
        return ncclSystemError;
    /* A put over 1 GiB is several, and only the last signals (rmaTaskAppend): one copy here. */
    *p = (put_t){.comm = c, .src_win = src_win, .dst_win = data ? win : NULL,
                 .dst = data ? win->peer_base[peer] + offset : NULL, .src = src, .bytes = bytes,
                 .signal = &c->seg->signals[peer][c->rank], .value = ++c->signals_sent[peer]};
    if (src_win)
        atomic_fetch_add(&src_win->refs, 1);
    if (data)
        atomic_fetch_add(&win->refs, 1);
    if (mpfake_stream_enqueue(c->ctx, stream, run_put, p) != CUDA_SUCCESS) {
        c->signals_sent[peer]--;
        release_window(src_win);
        release_window(data ? win : NULL);
        free(p);
        return ncclUnhandledCudaError;
    }
    return ncclSuccess;
}

API ncclResult_t ncclPutSignal(const void *localbuff, size_t count, int type, int peer, window_t *peerWin,
                               size_t peerWinOffset, int sigIdx, int ctx, unsigned int flags, comm_t *comm,
                               CUstream stream)
{
    enter_call(comm, 1);
    ncclResult_t r = put(1, localbuff, count, type, peer, peerWin, peerWinOffset, sigIdx, ctx, flags, comm, stream);
    enter_call(comm, -1);
    return r;
}

API ncclResult_t ncclSignal(int peer, int sigIdx, int ctx, unsigned int flags, comm_t *comm, CUstream stream)
{
    enter_call(comm, 1);
    ncclResult_t r = put(0, NULL, 0, 0, peer, NULL, 0, sigIdx, ctx, flags, comm, stream);
    enter_call(comm, -1);
    return r;
}

typedef struct {
    int opCnt, peer, sigIdx, ctx;
} wait_desc_t;

/* Each descriptor waits for opCnt more signals from its peer than the rank's earlier waits asked
 * for, counted on the host (rma_ce.cc ncclRmaCeWaitLaunch: signalsHost): signals that came first
 * count. A peer outside the team reaches the proxy path, unconnected here (rma_proxy_launch.cc). */
API ncclResult_t ncclWaitSignal(int nDesc, wait_desc_t *descs, comm_t *comm, CUstream stream)
{
    enter_call(comm, 1);
    ncclResult_t r = rma_usable(comm, "ncclWaitSignal", 0, 0, 0, 0, stream);
    if (r == ncclSuccess && (!descs || nDesc == 0)) {
        log_warning("ncclWaitSignal: invalid arguments");
        r = ncclInvalidArgument;
    }
    for (int i = 0; r == ncclSuccess && i < nDesc; i++) {
        const wait_desc_t *d = &descs[i];
        if (d->opCnt <= 0 || d->sigIdx || d->ctx) {
            log_warning("ncclWaitSignal: descriptor %d has invalid %s %d", i,
                        d->opCnt <= 0 ? "opCnt" : d->sigIdx ? "sigIdx" : "context",
                        d->opCnt <= 0 ? d->opCnt : d->sigIdx ? d->sigIdx : d->ctx);
            r = ncclInvalidArgument;
        } else if (d->peer < 0 || d->peer >= comm->nranks) {
            log_warning("RMA proxy is not connected");
            r = ncclInternalError;
        }
    }
    if (r == ncclSuccess)
        r = rma_join(comm);
    wait_t *w = r == ncclSuccess && nDesc > 0 ? malloc(sizeof *w + sizeof w->waits[0] * (size_t)nDesc) : NULL;
    if (r == ncclSuccess && nDesc > 0 && !w)
        r = ncclSystemError;
    if (w) {
        w->comm = comm;
        w->n = nDesc;
        for (int i = 0; i < nDesc; i++) {
            comm->signals_waited[descs[i].peer] += (uint64_t)descs[i].opCnt; /* duplicate peers add up */
            w->waits[i].slot = &comm->seg->signals[comm->rank][descs[i].peer];
            w->waits[i].until = comm->signals_waited[descs[i].peer];
        }
        if (mpfake_stream_enqueue(comm->ctx, stream, run_wait, w) != CUDA_SUCCESS) {
            for (int i = 0; i < nDesc; i++)
                comm->signals_waited[descs[i].peer] -= (uint64_t)descs[i].opCnt;
            free(w);
            r = ncclUnhandledCudaError;
        }
    }
    enter_call(comm, -1);
    return r;
}
