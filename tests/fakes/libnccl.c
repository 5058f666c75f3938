/* A model of libnccl's point-to-point subset for running the NCCL backend without a GPU. It
 * runs across processes: the unique id names a shared-memory segment (mode 0600) through which
 * the ranks of one communicator meet and move bytes; the name is unlinked once every rank has
 * attached. Send and receive run as "kernels" on the fake libcuda's streams.
 *
 * What it promises, as NCCL does (DESIGN.md, "Semantics"):
 *   - the k-th send from A to B on a communicator matches the k-th receive by B from A;
 *   - a communicator's ops run in order on their stream; the ops of one group progress
 *     together; a send does not complete before its receive is posted (unless
 *     MPFAKE_NCCL_EAGER_BYTES lets a small one be buffered, as NCCL's connection buffers do);
 *   - a self send is legal only with its receive in the same group;
 *   - nonblocking communicators answer ncclInProgress from init and from ncclGroupEnd with work:
 *     the group is launched on a thread of its own, and the ncclCommGetAsyncError that reads
 *     ncclSuccess joins that thread (a blocking communicator's group launches on the caller's
 *     thread), for every such group, as NCCL (MPFAKE_NCCL_GROUP_THREAD=0 keeps only the groups
 *     MPFAKE_NCCL_GROUP_IN_PROGRESS_* delays on threads);
 *   - a launch connects the pairs of ranks its group is the first to use, waiting for the peer's
 *     launch to reach the same connection, until the communicator is aborted;
 *   - ncclCommSplit makes a child in the parent's mode, sharing the parent's abort flag and
 *     connections with splitShare;
 *   - ncclCommAbort unblocks the communicator's stuck work, never waits for peers, joins a group
 *     thread still running, waits until every CUDA graph that captured work on the communicator
 *     is destroyed, and ends the communicator: any later call on it fails;
 *   - CUDA graphs: ops whose stream is capturing are captured (the fake libcuda records their
 *     kernels) and run again at each launch of the graph; a communicator's streams in one group
 *     must be all uncaptured or all captured by the same capture (else ncclInvalidUsage, as
 *     NCCL). Ops are numbered when their kernel runs, so each replay matches the peer's replay
 *     in order; every rank must launch its graph as many times, or the unmatched ops stall.
 * What NCCL leaves undefined fails loudly here: a count or datatype that differs between a send
 * and its receive is an asynchronous error on both ranks (ncclInvalidUsage, the ranks named in
 * the last error) and the kernels stall until aborted, as a real mismatch stalls; calls with
 * no current CUDA context, or on a communicator that was aborted, return ncclUnhandledCudaError
 * or ncclInvalidUsage with a message. As NCCL: unbalanced ncclGroupStart/End is ncclInvalidUsage,
 * a call on a communicator still in progress ncclInvalidArgument, one in error that error.
 * Every message goes to the one process-wide last error, as NCCL's warnings do (see log_warning).
 * docs/nccl-model.md lists each modelled behaviour with the NCCL or CUDA source it follows.
 *
 * Options and fault injection (environment, read at ncclCommInitRankConfig):
 *   MPFAKE_NCCL_INIT_IN_PROGRESS_MS=N  nonblocking init stays in progress a random 0..N ms (default 20)
 *   MPFAKE_NCCL_GROUP_THREAD=0         a nonblocking ncclGroupEnd with work launches on the caller's thread
 *                                      unless delayed below (default 1: every one starts a thread and answers
 *                                      ncclInProgress, as NCCL's does)
 *   MPFAKE_NCCL_GROUP_IN_PROGRESS_MS=N a nonblocking group's thread waits a random 0..N ms before it
 *                                      launches, every other group at random (default 5; 0: never)
 *   MPFAKE_NCCL_DELAY_MS=N             each kernel waits N ms before it starts (slow kernels)
 *   MPFAKE_NCCL_ASYNC_ERROR_AFTER=N    after N completed ops on a communicator, it reports an async
 *   MPFAKE_NCCL_ASYNC_ERROR_CODE=C     error C (default 6, ncclRemoteError) and its kernels stall
 *   MPFAKE_NCCL_ASYNC_ERROR_QUIET=1    ... and logs no warning for it: the last error stays what it was,
 *                                      as when NCCL's progress thread fails (src/proxy.cc:
 *                                      ncclProxyProgress stores the result and logs it at INFO only)
 *   MPFAKE_NCCL_SILENT_RANK=R          rank R of every communicator never posts its ops ...
 *   MPFAKE_NCCL_SILENT_AFTER=N         ... after its first N (default 0) on that communicator (the ops of
 *                                      children split with splitShare count with their parent's, as the
 *                                      options' other counts do)
 *   MPFAKE_NCCL_GROUP_IN_PROGRESS_AFTER=N  ... only after a communicator's first N groups (default 0)
 *   MPFAKE_NCCL_GROUP_IN_PROGRESS_EVERY=1  ... for every group, for exactly N ms
 *   MPFAKE_NCCL_SEED=S                 seed of the random in-progress durations (default: pid)
 *   MPFAKE_NCCL_EAGER_BYTES=N          a send of at most N bytes (capped at 64 KiB) to another rank
 *                                      completes once buffered, without its receive, once the pair
 *                                      is connected (default 0: never)
 *   MPFAKE_NCCL_LAUNCH_ORDER_IMPLICIT=M  NCCL_LAUNCH_ORDER_IMPLICIT=1: the uncaptured kernels of all
 *                                      communicators on a device start in host launch order; M=1: each
 *                                      once the one before has finished (NCCL's serial order), M=2: once
 *                                      it has started (NCCL's launch-completion order); 0 (default): none
 *   MPFAKE_NCCL_LOG=PATH               appends one line per injected delay (for tests to see that a
 *                                      path was taken): "init-in-progress MS", "group-in-progress MS"
 * mpfake_nccl_group_threads() counts the group threads the process has started. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "mpfake.h"

typedef enum {
    ncclSuccess = 0,
    ncclUnhandledCudaError = 1,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
    ncclRemoteError = 6,
    ncclInProgress = 7,
} ncclResult_t;

#define VERSION 23007
#define ID_MAGIC "mpfake-nccl"
#define CONFIG_MAGIC 0xcafebeefu
#define MAX_RANKS 64
#define RING 64              /* receives a rank may have posted ahead of their sends */
#define CHUNK (64 * 1024)    /* bytes in flight per directed pair */
#define MAX_GROUP_OPS 4096
/* Sends a connection buffers ahead of their receives: NCCL's send primitive runs up to NCCL_STEPS
 * steps ahead of the receiver's head (src/include/device.h: NCCL_STEPS; src/device/prims_simple.h:
 * waitPeer). The model keeps one whole small send per step. */
#define EAGER_SLOTS 8
#define EAGER_MAX CHUNK

typedef struct {
    char internal[128];
} ncclUniqueId;

/* ---- the shared segment: one per communicator ------------------------------------------- */

typedef struct {
    _Atomic uint64_t posted;   /* receives posted by the destination from the source */
    struct {
        uint64_t count;
        int type;
    } post[RING];
    _Atomic uint64_t matched;  /* sends that found their receive and agreed with it */
    _Atomic uint64_t produced, consumed; /* chunks through `data` */
    uint64_t chunk_len;
    char data[CHUNK];
    _Atomic uint64_t announced;  /* sends the source has started, in order; each described below */
    struct {
        uint64_t count;
        int type;
        int eager;               /* its bytes are in the next eager slot */
    } sent[RING];
    _Atomic uint64_t eager_put, eager_taken; /* whole sends through `eager` */
    char eager[EAGER_SLOTS][EAGER_MAX];      /* untouched (no memory) unless eager sends are on */
} channel;

typedef struct {
    _Atomic int nranks;
    _Atomic uint64_t joined;   /* bit per rank */
    _Atomic int attached;
    _Atomic int error_claimed; /* by the rank that writes error_text */
    _Atomic int error;         /* the first mismatch: an async error on every rank */
    char error_text[256];
    _Atomic int connecting[MAX_RANKS][MAX_RANKS]; /* [a][b]: a has reached its connect to b */
    channel ch[];              /* [src * nranks + dst] */
} segment;

/* ---- communicators ------------------------------------------------------------------------ */

typedef struct {
    int init_in_progress_ms, group_in_progress_ms, delay_ms;
    long group_in_progress_after;
    int group_in_progress_every;
    long async_error_after;
    int async_error_code, async_error_quiet;
    int silent_rank;
    long silent_after;
    long eager_bytes;
    int group_thread;          /* every nonblocking group on a thread, as NCCL (else: only delayed ones) */
    int launch_order;          /* 0 none, 1 serial (after the previous finished), 2 after it started */
} faults;

struct group_job;

typedef struct ncclComm {
    int alive;                 /* 0 once aborted: every later call fails */
    int rank, nranks, blocking;
    CUcontext ctx;
    char name[128];
    segment *seg;
    size_t seg_bytes;
    _Atomic int state;         /* ncclInProgress while initialising or launching, else its result */
    _Atomic int aborted;
    /* The flag that ends its stuck work: its own `aborted`, or, for a child split with splitShare,
     * its parent's (src/init.cc: ncclCommInitChildComm, childComm->abortFlag = comm->abortFlag).
     * Comm structs are never freed, so the pointer stays valid. */
    _Atomic int *abort_flag;
    /* A child whose init is running, reached by this communicator's abort (the parent's
     * childAbortFlag, set by ncclCommInitChildComm and cleared when the child's init ends). */
    struct ncclComm *_Atomic init_child;
    /* Whose connections it uses: itself, or its parent's for a shared split (src/channel.cc:
     * initChannel takes channel->peers from comm->sharedRes->peers, by parent rank). */
    struct ncclComm *conns;
    uint64_t connected;        /* bit per peer whose connection exists (conns' own, under lib_lock) */
    int children;              /* splits made from it, which name the children */
    _Atomic int in_call;       /* threads inside a call on it now */
    /* The fault options count the ops of a communicator and of the children sharing its resources
     * together (kept by `conns`), so that a count means the same with or without a split. */
    _Atomic int injected;      /* an injected async error, once raised */
    _Atomic long ops_done;
    long ops_issued;           /* ops whose kernel has started, under lib_lock, as the two below */
    long groups;
    uint64_t send_seq[MAX_RANKS], recv_seq[MAX_RANKS]; /* numbered, per peer */
    _Atomic uint64_t sends_done[MAX_RANKS], recvs_done[MAX_RANKS];
    struct group_job *job;     /* the nonblocking group whose thread it has not joined yet (lib_lock) */
    _Atomic long persistent_refs; /* captured kernels whose graph still lives */
    faults f;
    _Atomic int mismatch_logged; /* the segment's mismatch, logged when this rank first saw it */
    pthread_t init_thread;
} comm_t;

typedef struct {
    int send;
    void *buf;
    size_t count;
    int type;
    int peer;
    comm_t *comm;
    CUstream stream;
    CUcontext ctx;
    unsigned long long capture; /* the id of the capture its stream was in at the call, or 0 */
} op_t;

/* One kernel: a group's ops of one communicator on one stream. A captured one runs at each launch
 * of its graph, so what one run changes lives in op_run. */
typedef struct launch_order launch_order;

typedef struct {
    comm_t *comm;
    int persistent;            /* captured: released when its graph is gone */
    launch_order *order;       /* its device's order, when launch order is implicit */
    uint64_t ticket;           /* its place in that order */
    int nops;
    op_t ops[];
} task_t;

typedef struct {
    uint64_t seq;    /* the op's number among the ops between this rank and the peer, one way */
    int silent;      /* injected: it never posts */
    size_t progress; /* bytes moved */
    int flag;        /* posted (receive) or matched (send) */
    int announced;   /* send: described to the receiver */
    int done;
} op_run;

typedef struct launch {
    int ntasks;
    task_t **tasks;
    CUstream *streams;
} launch_t;

/* The library's process-wide state, as the real one has: a lock over communicator state
 * changes, and each thread's group. */
static pthread_mutex_t lib_lock = PTHREAD_MUTEX_INITIALIZER;
static _Thread_local int group_depth;
static _Thread_local op_t *group_ops;
static _Thread_local int group_nops;
static _Thread_local ncclResult_t group_error;
static unsigned random_state;

/* The last error, as NCCL keeps it: one buffer for the whole process (src/debug.cc: the global
 * ncclLastError), which every WARN-level message overwrites, whichever communicator or thread
 * logged it (src/debug.cc: ncclDebugLogV copies each WARN into it under the log's mutex), and
 * which nothing ever clears: a later successful call leaves it as it was. So it may describe an
 * earlier call or another communicator than the one a caller asks about (src/init.cc:
 * ncclGetLastError ignores its comm). Every error the model reports is logged here. */
static pthread_mutex_t last_error_lock = PTHREAD_MUTEX_INITIALIZER;
static char last_error[1024];

static void log_warning(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void log_warning(const char *fmt, ...)
{
    char text[sizeof last_error];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    pthread_mutex_lock(&last_error_lock);
    snprintf(last_error, sizeof last_error, "%s", text);
    pthread_mutex_unlock(&last_error_lock);
    if (getenv("MPFAKE_NCCL_VERBOSE"))
        fprintf(stderr, "fake libnccl: %s\n", text);
}

static void sleep_ms(double ms)
{
    struct timespec t = {(time_t)(ms / 1000), (long)((ms - (time_t)(ms / 1000) * 1000) * 1e6)};
    while (nanosleep(&t, &t) == -1 && errno == EINTR) {
    }
}

/* Polling back-off for a loop that waits on another process. */
static void pause_for(unsigned spins)
{
    if (spins < 64)
        sched_yield();
    else
        sleep_ms(spins < 2048 ? 0.02 : 0.5);
}

static int random_below(int n)
{
    if (n <= 0)
        return 0;
    pthread_mutex_lock(&lib_lock);
    if (!random_state) {
        const char *seed = getenv("MPFAKE_NCCL_SEED");
        random_state = seed ? (unsigned)atoi(seed) + 1 : (unsigned)getpid();
    }
    int r = rand_r(&random_state) % (n + 1);
    pthread_mutex_unlock(&lib_lock);
    return r;
}

static void log_line(const char *what, int ms)
{
    const char *path = getenv("MPFAKE_NCCL_LOG");
    if (!path || !path[0])
        return;
    int fd = open(path, O_WRONLY | O_CREAT | O_APPEND, 0600);
    if (fd < 0)
        return;
    char line[64];
    int n = snprintf(line, sizeof line, "%s %d\n", what, ms);
    if (write(fd, line, (size_t)n) < 0) { /* a log line lost fails the test that counts them */
    }
    close(fd);
}

static long env_long(const char *name, long fallback)
{
    const char *v = getenv(name);
    return v && v[0] ? atol(v) : fallback;
}

static size_t type_size(int type)
{
    switch (type) {
    case 0: case 1: case 10: case 11: return 1;
    case 6: case 9: return 2;
    case 2: case 3: case 7: return 4;
    case 4: case 5: case 8: return 8;
    default: return 0;
    }
}

static const char *type_name(int type)
{
    static const char *names[] = {"int8", "uint8", "int32", "uint32", "int64", "uint64", "float16",
                                  "float32", "float64", "bfloat16", "float8e4m3", "float8e5m2"};
    return type >= 0 && type < 12 ? names[type] : "?";
}

/* ---- version, ids, errors ------------------------------------------------------------------ */

ncclResult_t ncclGetVersion(int *version)
{
    if (!version)
        return ncclInvalidArgument;
    *version = VERSION;
    return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId *id)
{
    if (!id)
        return ncclInvalidArgument;
    memset(id, 0, sizeof *id);
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    static _Atomic unsigned counter;
    snprintf(id->internal, sizeof id->internal, "%s /mpfake-nccl-%d-%lx-%u", ID_MAGIC, (int)getpid(),
             (unsigned long)(t.tv_nsec ^ t.tv_sec), atomic_fetch_add(&counter, 1));
    return ncclSuccess;
}

const char *ncclGetErrorString(ncclResult_t r)
{
    switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
    }
}

/* src/init.cc: ncclGetLastError returns the process's one buffer, whatever `comm` is (NULL too). */
const char *ncclGetLastError(comm_t *comm)
{
    (void)comm;
    return last_error;
}

static void complete_job(comm_t *c);

/* Marks a call on `c` for ncclCommAbort's check of its condition. */
static void enter_call(comm_t *c, int by)
{
    if (c)
        atomic_fetch_add(&c->in_call, by);
}

/* A usable communicator, or the error its use is. */
static ncclResult_t usable(comm_t *c, const char *call)
{
    if (!c) {
        log_warning("%s: communicator is NULL", call);
        return ncclInvalidArgument;
    }
    if (!c->alive) {
        log_warning("%s on a communicator that was aborted", call);
        return ncclInvalidUsage;
    }
    /* src/init.cc: ncclCommEnsureReady (ncclEnqueueCheck's check, src/enqueue.cc): a communicator
     * still in progress is refused with a warning and ncclInvalidArgument; one in error returns
     * that error as it is, and logs nothing. */
    int state = atomic_load(&c->state);
    if (state == ncclSuccess) /* the check polls ncclCommGetAsyncError, which joins a finished group */
        complete_job(c);
    if (state == ncclInProgress) {
        log_warning("%s on a nonblocking communicator still in progress: poll ncclCommGetAsyncError until it "
                    "returns ncclSuccess first", call);
        return ncclInvalidArgument;
    }
    return (ncclResult_t)state;
}

/* ---- init ------------------------------------------------------------------------------------ */

static size_t segment_bytes(int nranks)
{
    return sizeof(segment) + sizeof(channel) * (size_t)nranks * (size_t)nranks;
}

/* Attaches to the segment and waits for every rank; the last to attach unlinks the name. */
static ncclResult_t join(comm_t *c)
{
    int fd = shm_open(c->name, O_CREAT | O_RDWR, 0600);
    if (fd < 0) {
        log_warning("shm_open(%s): %s", c->name, strerror(errno));
        return ncclSystemError;
    }
    c->seg_bytes = segment_bytes(c->nranks);
    struct stat st;
    if (fstat(fd, &st) < 0 || ((size_t)st.st_size < c->seg_bytes && ftruncate(fd, (off_t)c->seg_bytes) < 0)) {
        log_warning("sizing %s: %s", c->name, strerror(errno));
        close(fd);
        return ncclSystemError;
    }
    if ((size_t)st.st_size > c->seg_bytes) {
        log_warning("rank %d joined with nranks %d, but another rank created the communicator larger", c->rank,
                    c->nranks);
        close(fd);
        return ncclInvalidUsage;
    }
    void *p = mmap(NULL, c->seg_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) {
        log_warning("mmap(%s): %s", c->name, strerror(errno));
        return ncclSystemError;
    }
    segment *s = c->seg = p;
    int expected = 0;
    if (!atomic_compare_exchange_strong(&s->nranks, &expected, c->nranks) && expected != c->nranks) {
        log_warning("rank %d joined with nranks %d, but the communicator has %d ranks", c->rank, c->nranks,
                    expected);
        return ncclInvalidUsage;
    }
    uint64_t bit = 1ull << c->rank;
    if (atomic_fetch_or(&s->joined, bit) & bit) {
        log_warning("rank %d joined the communicator twice (one unique id used for two communicators?)", c->rank);
        return ncclInvalidUsage;
    }
    if (atomic_fetch_add(&s->attached, 1) + 1 == c->nranks)
        shm_unlink(c->name);
    for (unsigned spins = 0; atomic_load(&s->attached) < c->nranks; spins++) {
        if (atomic_load(c->abort_flag))
            return ncclInvalidUsage;
        pause_for(spins);
    }
    return ncclSuccess;
}

static void *init_main(void *arg)
{
    comm_t *c = arg;
    int ms = random_below(c->f.init_in_progress_ms);
    log_line("init-in-progress", ms);
    sleep_ms(ms);
    atomic_store(&c->state, join(c));
    return NULL;
}

/* NCCL_COMM_BLOCKING, when it reads 0 or 1, overrides the config's blocking field (src/init.cc:
 * envConfigOverride, NCCL_PARAM(CommBlocking)) of every communicator, split ones too; NCCL reads
 * it once per process, the model at each init. So does NCCL_COMM_SPLIT_SHARE_RESOURCES for
 * splitShare (NCCL_PARAM(CommSplitShareResources)). */
static int env_override(const char *name, int value)
{
    const char *v = getenv(name);
    char *end;
    long long forced = v && v[0] ? strtoll(v, &end, 0) : -1;
    return forced >= 0 && !*end && (forced == 0 || forced == 1) ? (int)forced : value;
}

/* The fields of ncclConfig_t the model reads: its prefix through splitShare (nccl.h). */
typedef struct {
    size_t size;
    unsigned magic, version;
    int blocking;
    int cgaClusterSize, minCTAs, maxCTAs;
    const char *netName;
    int splitShare;
} config_t;
#define CONFIG_UNDEF_INT (-2147483647 - 1)

/* Reads `config` over the defaults in *blocking and *share; 0, or -1 for a config NCCL refuses. */
static int read_config(const void *config, const char *call, int *blocking, int *share)
{
    if (config) {
        const config_t *c = config;
        if (c->magic != CONFIG_MAGIC || c->size < offsetof(config_t, cgaClusterSize)) {
            log_warning("%s: config was not made by NCCL_CONFIG_INITIALIZER", call);
            return -1;
        }
        if (c->blocking != CONFIG_UNDEF_INT)
            *blocking = c->blocking != 0;
        if (c->size >= sizeof(config_t) && c->splitShare != CONFIG_UNDEF_INT)
            *share = c->splitShare != 0;
    }
    *blocking = env_override("NCCL_COMM_BLOCKING", *blocking);
    *share = env_override("NCCL_COMM_SPLIT_SHARE_RESOURCES", *share);
    return 0;
}

static comm_t *new_comm(int rank, int nranks, int blocking, CUcontext ctx, const char *name)
{
    comm_t *c = calloc(1, sizeof *c);
    if (!c)
        return NULL;
    c->alive = 1;
    c->rank = rank;
    c->nranks = nranks;
    c->blocking = blocking;
    c->ctx = ctx;
    c->abort_flag = &c->aborted;
    c->conns = c;
    snprintf(c->name, sizeof c->name, "%s", name);
    c->f.init_in_progress_ms = (int)env_long("MPFAKE_NCCL_INIT_IN_PROGRESS_MS", 20);
    c->f.group_in_progress_ms = (int)env_long("MPFAKE_NCCL_GROUP_IN_PROGRESS_MS", 5);
    c->f.group_in_progress_after = env_long("MPFAKE_NCCL_GROUP_IN_PROGRESS_AFTER", 0);
    c->f.group_in_progress_every = env_long("MPFAKE_NCCL_GROUP_IN_PROGRESS_EVERY", 0) != 0;
    c->f.delay_ms = (int)env_long("MPFAKE_NCCL_DELAY_MS", 0);
    c->f.async_error_after = env_long("MPFAKE_NCCL_ASYNC_ERROR_AFTER", -1);
    c->f.async_error_code = (int)env_long("MPFAKE_NCCL_ASYNC_ERROR_CODE", ncclRemoteError);
    c->f.async_error_quiet = env_long("MPFAKE_NCCL_ASYNC_ERROR_QUIET", 0) != 0;
    c->f.silent_rank = (int)env_long("MPFAKE_NCCL_SILENT_RANK", -1);
    c->f.silent_after = env_long("MPFAKE_NCCL_SILENT_AFTER", 0);
    c->f.group_thread = env_long("MPFAKE_NCCL_GROUP_THREAD", 1) != 0;
    c->f.eager_bytes = env_long("MPFAKE_NCCL_EAGER_BYTES", 0);
    c->f.launch_order = (int)env_long("MPFAKE_NCCL_LAUNCH_ORDER_IMPLICIT", 0);
    return c;
}

ncclResult_t ncclCommInitRankConfig(comm_t **out, int nranks, ncclUniqueId id, int rank, void *config)
{
    if (!out)
        return ncclInvalidArgument;
    *out = NULL;
    if (nranks < 1 || nranks > MAX_RANKS || rank < 0 || rank >= nranks) {
        log_warning("ncclCommInitRankConfig: rank %d of %d ranks is out of range (the model allows %d ranks)",
                    rank, nranks, MAX_RANKS);
        return ncclInvalidArgument;
    }
    if (strncmp(id.internal, ID_MAGIC " /", sizeof ID_MAGIC + 1) != 0 || !memchr(id.internal, 0, sizeof id.internal)) {
        log_warning("ncclCommInitRankConfig: the unique id did not come from ncclGetUniqueId");
        return ncclInvalidArgument;
    }
    int blocking = 1, share = 0;
    if (read_config(config, "ncclCommInitRankConfig", &blocking, &share) < 0)
        return ncclInvalidArgument;
    CUcontext ctx = mpfake_current_context();
    if (!ctx) {
        log_warning("ncclCommInitRankConfig: no current CUDA context on this thread");
        return ncclUnhandledCudaError;
    }
    comm_t *c = new_comm(rank, nranks, blocking, ctx, id.internal + sizeof ID_MAGIC);
    if (!c)
        return ncclSystemError;
    *out = c;
    if (blocking) {
        ncclResult_t r = join(c);
        atomic_store(&c->state, r);
        return r;
    }
    atomic_store(&c->state, ncclInProgress);
    if (pthread_create(&c->init_thread, NULL, init_main, c) != 0) {
        atomic_store(&c->state, ncclSystemError);
        return ncclSystemError;
    }
    pthread_detach(c->init_thread);
    return ncclInProgress;
}

/* ---- split ------------------------------------------------------------------------------------
 * src/init.cc: ncclCommSplit runs ncclCommInitChildComm inside a group, as an async job launched
 * in the PARENT's mode (src/group.cc: ncclAsyncLaunch sets ncclGroupBlocking from the parent's
 * config): for a nonblocking parent on a thread, the parent reading ncclInProgress meanwhile and
 * ncclCommSplit answering ncclInProgress; the child comes out of the job (ncclCommInitRankFunc's
 * exit stores it into *newcomm), with the blocking mode of its own config (NULL: the parent's,
 * copyCommConfig). With splitShare the child shares the parent's abort flag and connections;
 * without, the parent's abort reaches the child only while its init runs (childAbortFlag). The
 * model splits into one child of all the parent's ranks, in the parent's order (color equal on
 * every rank, key = rank), which is what a duplicate is; NCCL_SPLIT_NOCOLOR makes none. */
typedef struct {
    comm_t *parent, *child, **out;
} split_job;

static void *split_main(void *arg)
{
    split_job *j = arg;
    comm_t *p = j->parent, *c = j->child;
    ncclResult_t r = join(c);
    atomic_store(&c->state, r);
    atomic_store(&p->init_child, NULL);
    if (r == ncclSuccess)
        atomic_store(j->out, c);
    atomic_store(&p->state, r);
    free(j);
    return NULL;
}

ncclResult_t ncclCommSplit(comm_t *comm, int color, int key, comm_t **newcomm, void *config)
{
    if (!newcomm) {
        log_warning("ncclCommSplit: newcomm is NULL");
        return ncclInvalidArgument;
    }
    *newcomm = NULL;
    ncclResult_t r = usable(comm, "ncclCommSplit");
    if (r != ncclSuccess)
        return r;
    if (color == -1) /* NCCL_SPLIT_NOCOLOR */
        return ncclSuccess;
    if (key != comm->rank) {
        log_warning("ncclCommSplit: the model splits only with key = rank (a duplicate of the communicator)");
        return ncclInvalidArgument;
    }
    int blocking = comm->blocking, share = 0;
    if (read_config(config, "ncclCommSplit", &blocking, &share) < 0)
        return ncclInvalidArgument;
    char name[sizeof comm->name];
    snprintf(name, sizeof name, "%.100s-split%d", comm->name, ++comm->children);
    comm_t *c = new_comm(comm->rank, comm->nranks, blocking, comm->ctx, name);
    split_job *j = malloc(sizeof *j);
    if (!c || !j) {
        free(c);
        free(j);
        return ncclSystemError;
    }
    if (share) {
        c->abort_flag = comm->abort_flag;
        c->conns = comm->conns;
    } else {
        atomic_store(&comm->init_child, c);
    }
    c->f.init_in_progress_ms = 0;
    *j = (split_job){comm, c, newcomm};
    atomic_store(&c->state, ncclInProgress);
    if (comm->blocking) {
        split_main(j);
        return (ncclResult_t)atomic_load(&comm->state);
    }
    atomic_store(&comm->state, ncclInProgress);
    pthread_t thread;
    if (pthread_create(&thread, NULL, split_main, j) != 0) {
        free(j);
        atomic_store(&comm->state, ncclSystemError);
        return ncclSystemError;
    }
    pthread_detach(thread);
    return ncclInProgress;
}

/* ---- kernels --------------------------------------------------------------------------------- */

static channel *chan(comm_t *c, int src, int dst) { return &c->seg->ch[src * c->nranks + dst]; }

/* A kernel that can no longer progress: it stalls, as a GPU kernel would, until aborted. */
static int stalled(comm_t *c)
{
    return atomic_load(&c->seg->error) || atomic_load(&c->conns->injected);
}

static void count_done(comm_t *c)
{
    long done = atomic_fetch_add(&c->conns->ops_done, 1) + 1;
    if (c->f.async_error_after >= 0 && done >= c->f.async_error_after && !atomic_exchange(&c->conns->injected, 1) &&
        !c->f.async_error_quiet)
        log_warning("injected asynchronous error %d after %ld ops on rank %d", c->f.async_error_code, done,
                    c->rank);
}

/* Claims the communicator's one mismatch error and publishes it (text first) to every rank. */
static void report_mismatch(comm_t *c, int src, int dst, uint64_t sent, int sent_type, uint64_t recvd, int recvd_type)
{
    int none = 0;
    if (atomic_compare_exchange_strong(&c->seg->error_claimed, &none, 1)) {
        snprintf(c->seg->error_text, sizeof c->seg->error_text,
                 "rank %d sent %llu x %s to rank %d, which receives %llu x %s", src, (unsigned long long)sent,
                 type_name(sent_type), dst, (unsigned long long)recvd, type_name(recvd_type));
        atomic_store(&c->seg->error, ncclInvalidUsage);
    }
}

/* A buffered send's bytes, taken by its receive: 1 when done. */
static int take_eager(comm_t *c, const op_t *o, op_run *st, channel *ch)
{
    uint64_t count = ch->sent[st->seq % RING].count;
    int type = ch->sent[st->seq % RING].type;
    if (count != o->count || type != o->type) {
        report_mismatch(c, o->peer, c->rank, count, type, o->count, o->type);
        return 0;
    }
    uint64_t slot = atomic_load(&ch->eager_taken);
    memcpy(o->buf, ch->eager[slot % EAGER_SLOTS], o->count * type_size(o->type));
    atomic_store(&ch->eager_taken, slot + 1); /* frees the slot, as the receiver's head returns credit */
    atomic_store(&c->recvs_done[o->peer], st->seq + 1);
    return 1;
}

/* One step of a receive; 1 when it is complete. `progress` carries the bytes taken so far. */
static int recv_step(comm_t *c, const op_t *o, op_run *st)
{
    size_t *progress = &st->progress;
    int *posted = &st->flag;
    channel *ch = chan(c, o->peer, c->rank);
    if (!*posted) {
        if (atomic_load(&ch->posted) != st->seq || atomic_load(&c->recvs_done[o->peer]) + RING <= st->seq)
            return 0;
        ch->post[st->seq % RING].count = o->count;
        ch->post[st->seq % RING].type = o->type;
        atomic_store(&ch->posted, st->seq + 1);
        *posted = 1;
    }
    if (atomic_load(&c->recvs_done[o->peer]) != st->seq || atomic_load(&ch->announced) <= st->seq)
        return 0; /* an earlier receive from the peer first, and its send must have started */
    if (ch->sent[st->seq % RING].eager)
        return take_eager(c, o, st, ch);
    if (atomic_load(&ch->matched) <= st->seq)
        return 0; /* a rendezvous send, which has yet to find this receive */
    size_t total = o->count * type_size(o->type);
    if (*progress < total && atomic_load(&ch->produced) > atomic_load(&ch->consumed)) {
        memcpy((char *)o->buf + *progress, ch->data, ch->chunk_len);
        *progress += ch->chunk_len;
        atomic_fetch_add(&ch->consumed, 1);
    }
    if (*progress < total)
        return 0;
    atomic_store(&c->recvs_done[o->peer], st->seq + 1);
    return 1;
}

/* Whether a send may complete into the connection's buffers, before its receive is posted. NCCL's
 * send primitive waits only for a free step of the peer's buffer (src/device/prims_simple.h:
 * waitPeer polls the receiver's head, NCCL_STEPS ahead; src/device/sendrecv.h: runSend), so a
 * send whose chunks fit the free steps completes without its receive; the buffer exists once the
 * connection is set up, which happens in the first group with an op for that peer and waits for
 * the peer's side (src/enqueue.cc: p2pTaskAppend marks the connection, src/group.cc:
 * ncclP2PPreconnectFunc, src/transport.cc: ncclTransportP2pSetup exchanges with the peer). The
 * model: on, small, not to self (a self send is a copy in the kernel: src/enqueue.cc:
 * addP2pToPlan), and the pair connected (see connect_peers; a child split with splitShare uses its
 * parent's connections, and so their buffers). */
static int connected_to(comm_t *c, int peer);

static int may_buffer(comm_t *c, const op_t *o)
{
    size_t total = o->count * type_size(o->type);
    return c->f.eager_bytes > 0 && total <= (size_t)c->f.eager_bytes && total <= EAGER_MAX &&
           o->peer != c->rank && connected_to(c, o->peer);
}

/* Describes the send to the receiver, in order, buffering its bytes when it may: 1 when that
 * completed it. 0 with st->announced unset: no free slot yet. */
static int announce(comm_t *c, const op_t *o, op_run *st, channel *ch)
{
    int eager = may_buffer(c, o);
    uint64_t slot = atomic_load(&ch->eager_put);
    if (eager && slot - atomic_load(&ch->eager_taken) >= EAGER_SLOTS)
        return 0; /* every step in use: wait for the receiver to free one */
    ch->sent[st->seq % RING].count = o->count;
    ch->sent[st->seq % RING].type = o->type;
    ch->sent[st->seq % RING].eager = eager;
    if (eager) {
        memcpy(ch->eager[slot % EAGER_SLOTS], o->buf, o->count * type_size(o->type));
        atomic_store(&ch->eager_put, slot + 1);
    }
    atomic_store(&ch->announced, st->seq + 1); /* published after what it describes */
    st->announced = 1;
    if (!eager)
        return 0;
    atomic_store(&c->sends_done[o->peer], st->seq + 1);
    return 1;
}

static int send_step(comm_t *c, const op_t *o, op_run *st)
{
    size_t *progress = &st->progress;
    int *matched = &st->flag;
    channel *ch = chan(c, c->rank, o->peer);
    if (atomic_load(&c->sends_done[o->peer]) != st->seq)
        return 0; /* the earlier sends to the peer first */
    if (!st->announced)
        return announce(c, o, st, ch);
    if (atomic_load(&ch->posted) <= st->seq)
        return 0; /* rendezvous: the receive must be posted */
    size_t total = o->count * type_size(o->type);
    if (!*matched) {
        uint64_t count = ch->post[st->seq % RING].count;
        int type = ch->post[st->seq % RING].type;
        if (count != o->count || type != o->type) {
            report_mismatch(c, c->rank, o->peer, o->count, o->type, count, type);
            return 0;
        }
        atomic_store(&ch->matched, st->seq + 1);
        *matched = 1;
    }
    if (*progress < total && atomic_load(&ch->produced) == atomic_load(&ch->consumed)) {
        size_t n = total - *progress < CHUNK ? total - *progress : CHUNK;
        memcpy(ch->data, (const char *)o->buf + *progress, n);
        ch->chunk_len = n;
        *progress += n;
        atomic_fetch_add(&ch->produced, 1);
    }
    if (*progress < total || atomic_load(&ch->produced) != atomic_load(&ch->consumed))
        return 0; /* complete once the receiver has taken every byte */
    atomic_store(&c->sends_done[o->peer], st->seq + 1);
    return 1;
}

/* Numbers a kernel's ops as it starts: the k-th send to a peer that runs meets the peer's k-th
 * receive that runs, whether issued or replayed from a graph. */
static void number_ops(const task_t *t, op_run *st)
{
    comm_t *c = t->comm;
    pthread_mutex_lock(&lib_lock);
    for (int i = 0; i < t->nops; i++) {
        const op_t *o = &t->ops[i];
        st[i].seq = o->send ? c->send_seq[o->peer]++ : c->recv_seq[o->peer]++;
        st[i].silent = c->rank == c->f.silent_rank && c->conns->ops_issued >= c->f.silent_after;
        c->conns->ops_issued++;
    }
    pthread_mutex_unlock(&lib_lock);
}

/* Runs the kernel's ops together until all are done or the communicator is aborted. */
static void run_ops(const task_t *t)
{
    comm_t *c = t->comm;
    if (atomic_load(c->abort_flag))
        return;
    if (c->f.delay_ms > 0)
        sleep_ms(c->f.delay_ms);
    op_run *run = calloc((size_t)t->nops, sizeof *run);
    if (!run) {
        log_warning("a kernel could not allocate its state");
        atomic_store(&c->state, ncclSystemError);
        return;
    }
    number_ops(t, run);
    int left = t->nops;
    for (unsigned spins = 0; left > 0 && !atomic_load(c->abort_flag); spins++) {
        int moved = 0;
        for (int i = 0; i < t->nops && !stalled(c); i++) {
            const op_t *o = &t->ops[i];
            op_run *st = &run[i];
            if (st->done || st->silent)
                continue;
            size_t before = st->progress;
            int before_flags = st->flag + 2 * st->announced;
            if (o->send ? send_step(c, o, st) : recv_step(c, o, st)) {
                st->done = 1;
                left--;
                count_done(c);
            }
            moved |= st->done || st->progress != before || st->flag + 2 * st->announced != before_flags;
        }
        if (moved)
            spins = 0;
        else
            pause_for(spins);
    }
    free(run);
}

/* ---- implicit launch order ----------------------------------------------------------------------
 * NCCL_LAUNCH_ORDER_IMPLICIT (src/enqueue.cc: NCCL_PARAM(LaunchOrderImplicit), getImplicitOrder)
 * makes each launch wait on a per-device "launch order" stream (ncclLaunchPrepare) that the
 * launch then advances (ncclLaunchFinish): by the kernel's completion event when CUDA is older
 * than 12.3, or while capturing with a driver older than 12.9 (serial), else by its launch
 * completion event, which fires once the kernel has started (launch). The model: per device
 * (context), each uncaptured kernel takes the next ticket as it is enqueued and starts once the
 * previous ticket has finished (1) or started (2). Captured kernels are not ordered. */
struct launch_order {
    CUcontext ctx;
    uint64_t issued;           /* order_lock */
    _Atomic uint64_t released; /* tickets whose successor may start */
};

static pthread_mutex_t order_lock = PTHREAD_MUTEX_INITIALIZER;
static launch_order orders[16];

static launch_order *order_of(CUcontext ctx)
{
    for (size_t i = 0; i < sizeof orders / sizeof *orders; i++)
        if (orders[i].ctx == ctx || !orders[i].ctx) {
            orders[i].ctx = ctx;
            return &orders[i];
        }
    return NULL; /* more contexts than the model orders: unordered */
}

static void wait_turn(const task_t *t)
{
    for (unsigned spins = 0; atomic_load(&t->order->released) != t->ticket; spins++)
        pause_for(spins);
}

static void pass_turn(const task_t *t) { atomic_store(&t->order->released, t->ticket + 1); }

static void run_task(void *arg)
{
    const task_t *t = arg;
    int serial = t->order && t->comm->f.launch_order == 1;
    if (t->order)
        wait_turn(t);
    if (t->order && !serial)
        pass_turn(t);
    run_ops(t);
    if (serial)
        pass_turn(t); /* an aborted kernel ends too, and lets the next one start */
}

/* The driver's release of a kernel: a captured one's graph, and every instance, is gone. NCCL
 * counts a captured plan in comm->localPersistentRefs (src/enqueue.cc: ncclLaunchPrepare) until
 * the graph's destructor hands it back (persistentDestructor, reclaimPlan). */
static void release_task(void *arg)
{
    task_t *t = arg;
    if (t->persistent)
        atomic_fetch_sub(&t->comm->persistent_refs, 1);
    free(t);
}

/* ---- groups ----------------------------------------------------------------------------------- */

ncclResult_t ncclGroupStart(void)
{
    if (group_depth == 0) {
        group_nops = 0;
        group_error = ncclSuccess;
    }
    group_depth++;
    return ncclSuccess;
}

static ncclResult_t add_op(int send, const void *buf, size_t count, int type, int peer, comm_t *c, CUstream stream)
{
    const char *call = send ? "ncclSend" : "ncclRecv";
    ncclResult_t r = usable(c, call);
    if (r != ncclSuccess)
        return r;
    CUcontext ctx = mpfake_current_context(), stream_ctx = NULL;
    if (!ctx) {
        log_warning("%s: no current CUDA context on this thread", call);
        return ncclUnhandledCudaError;
    }
    if (ctx != c->ctx || mpfake_stream_context(stream, &stream_ctx) != CUDA_SUCCESS || stream_ctx != c->ctx) {
        log_warning("%s: the current CUDA context or the stream is not the communicator's device's", call);
        return ncclUnhandledCudaError;
    }
    if (peer < 0 || peer >= c->nranks || !type_size(type) || (!buf && count)) {
        log_warning("%s: invalid argument (peer %d of %d ranks, datatype %d, buffer %p)", call, peer, c->nranks,
                    type, buf);
        return ncclInvalidArgument;
    }
    if (group_nops == MAX_GROUP_OPS) {
        log_warning("%s: more than %d ops in one group", call, MAX_GROUP_OPS);
        return ncclInvalidUsage;
    }
    CUstreamCaptureStatus status;
    unsigned long long capture = 0;
    if (mpfake_stream_capture(c->ctx, stream, &status, &capture) != CUDA_SUCCESS) {
        log_warning("%s: asking whether the stream is capturing failed", call);
        return ncclUnhandledCudaError;
    }
    for (int i = 0; i < group_nops; i++)
        if (group_ops[i].comm == c && group_ops[i].capture != capture) {
            log_warning("%s: the streams of a communicator in one group must be all uncaptured or all captured by "
                        "the same capture (this op's capture: %llu, an earlier op's: %llu)", call, capture,
                        group_ops[i].capture);
            return ncclInvalidUsage;
        }
    if (!group_ops && !(group_ops = malloc(sizeof(op_t) * MAX_GROUP_OPS)))
        return ncclSystemError;
    op_t *o = &group_ops[group_nops++];
    *o = (op_t){send, (void *)buf, count, type, peer, c, stream, c->ctx, capture};
    return ncclSuccess;
}

/* A group issued while its stream captured, launched later (it was in progress): it belongs to
 * the graph only if that capture is still on. */
static int capture_unchanged(const task_t *t, CUstream stream)
{
    CUstreamCaptureStatus status;
    unsigned long long now = 0;
    return mpfake_stream_capture(t->ops[0].ctx, stream, &status, &now) == CUDA_SUCCESS && now == t->ops[0].capture;
}

/* Hands one kernel to its stream (the driver owns it from there). A captured one holds a
 * reference on its communicator until its graph is gone; an uncaptured one takes its place in
 * the device's launch order, if ordered. */
static CUresult enqueue_task(task_t *t, CUstream stream)
{
    comm_t *c = t->comm;
    t->persistent = t->ops[0].capture != 0;
    if (t->persistent)
        atomic_fetch_add(&c->persistent_refs, 1);
    int ordered = !t->persistent && c->f.launch_order > 0;
    if (ordered) {
        pthread_mutex_lock(&order_lock); /* the ticket and the stream's queue in one order */
        t->order = order_of(c->ctx);
        t->ticket = t->order ? t->order->issued : 0;
    }
    launch_order *order = t->order;
    CUresult r = mpfake_stream_enqueue_owned(t->ops[0].ctx, stream, run_task, t, release_task);
    if (ordered) {
        if (r == CUDA_SUCCESS && order)
            order->issued++;
        pthread_mutex_unlock(&order_lock);
    }
    if (r != CUDA_SUCCESS && t->persistent)
        atomic_fetch_sub(&c->persistent_refs, 1);
    return r;
}

/* Enqueues each task; returns the first failure, which is also left as its communicator's
 * state. The launch keeps `l`. */
static ncclResult_t launch(launch_t *l)
{
    ncclResult_t first = ncclSuccess;
    for (int i = 0; i < l->ntasks; i++) {
        task_t *t = l->tasks[i];
        l->tasks[i] = NULL; /* the driver's, or freed */
        ncclResult_t r = ncclSuccess;
        CUresult cr = CUDA_SUCCESS;
        if (!capture_unchanged(t, l->streams[i])) {
            log_warning("a group issued while its stream was capturing (capture %llu) was launched after "
                        "that capture ended: poll ncclCommGetAsyncError until ncclSuccess before ending the capture",
                        t->ops[0].capture);
            r = ncclInvalidUsage;
        } else if ((cr = enqueue_task(t, l->streams[i])) != CUDA_SUCCESS) {
            log_warning("launching a kernel on its stream failed (CUDA error %d)", cr);
            r = ncclUnhandledCudaError;
        }
        if (r != ncclSuccess) {
            atomic_store(&t->comm->state, r);
            free(t);
            if (first == ncclSuccess)
                first = r;
        }
    }
    return first;
}

static void free_launch(launch_t *l)
{
    for (int i = 0; i < l->ntasks; i++)
        free(l->tasks[i]); /* those never launched */
    free(l->tasks);
    free(l->streams);
    free(l);
}

/* A self send needs its receive in the same group, and the reverse: NCCL finds one without the
 * other while it plans the launch (src/enqueue.cc: scheduleP2pTasksToPlan), so on a nonblocking
 * group's thread. */
static ncclResult_t check_self_sends(const launch_t *l)
{
    for (int k = 0; k < l->ntasks; k++) {
        comm_t *c = l->tasks[k]->comm;
        int balance = 0;
        for (int j = 0; j < l->ntasks; j++)
            for (int i = 0; l->tasks[j]->comm == c && i < l->tasks[j]->nops; i++)
                if (l->tasks[j]->ops[i].peer == c->rank)
                    balance += l->tasks[j]->ops[i].send ? 1 : -1;
        if (balance != 0) {
            log_warning("a self send on rank %d without its receive in the same group (or the reverse)", c->rank);
            return ncclInvalidUsage;
        }
    }
    return ncclSuccess;
}

/* ---- connections ------------------------------------------------------------------------------
 * NCCL connects a pair of ranks the first time a group has work between them: the launch runs the
 * p2p setup (src/group.cc: groupLaunch -> asyncJobLaunch of the preconnect jobs; src/transport.cc:
 * ncclTransportP2pSetup), which trades connect info with the peer over the bootstrap network and
 * waits for the peer's (bootstrapRecv). So the launch, on the caller's thread for a blocking
 * communicator, waits until the peer's launch reaches its side of that connection. Only the abort
 * flag ends the wait (src/bootstrap.cc: checkAbort, src/misc/socket.cc: both answer
 * ncclInternalError once it is set). The model: each rank flags the pairs it reaches, in the
 * segment of the communicator that owns the connections, and waits for the peer's flag. */
static int connected_to(comm_t *c, int peer)
{
    pthread_mutex_lock(&lib_lock);
    int known = peer == c->rank || (c->conns->connected >> peer & 1);
    pthread_mutex_unlock(&lib_lock);
    return known;
}

/* Every new pair's side first, then the peers' (ncclTransportP2pSetup sends each peer's connect
 * info before it receives any), so that ranks connecting in a ring do not wait on one another. */
static ncclResult_t connect_peers(const launch_t *l)
{
    for (int pass = 0; pass < 2; pass++)
        for (int k = 0; k < l->ntasks; k++) {
            const task_t *t = l->tasks[k];
            comm_t *c = t->comm, *owner = c->conns;
            for (int i = 0; i < t->nops; i++) {
                int peer = t->ops[i].peer;
                if (connected_to(c, peer))
                    continue;
                if (pass == 0) {
                    atomic_store(&owner->seg->connecting[c->rank][peer], 1);
                    continue;
                }
                for (unsigned spins = 0; !atomic_load(&owner->seg->connecting[peer][c->rank]); spins++) {
                    if (atomic_load(c->abort_flag)) {
                        log_warning("connecting rank %d to rank %d: the communicator was aborted", c->rank, peer);
                        return ncclInternalError;
                    }
                    pause_for(spins);
                }
                pthread_mutex_lock(&lib_lock);
                owner->connected |= 1ull << peer;
                pthread_mutex_unlock(&lib_lock);
            }
        }
    return ncclSuccess;
}

static ncclResult_t launch_group(launch_t *l)
{
    ncclResult_t r = check_self_sends(l);
    if (r == ncclSuccess)
        r = connect_peers(l);
    return r != ncclSuccess ? r : launch(l);
}

/* ---- a nonblocking group's thread -------------------------------------------------------------
 * src/group.cc: ncclGroupEndInternal sets each of the group's communicators to ncclInProgress,
 * starts a thread (STDTHREADCREATE of ncclAsyncJobMain -> groupLaunchNonBlocking) and returns
 * ncclInProgress; groupLaunch sets every communicator's state to the group's result at its end
 * (groupCleanup on failure). src/init.cc: ncclCommGetAsyncError, once the state reads ncclSuccess,
 * joins the thread (ncclGroupJobComplete -> ncclAsyncJobComplete); ncclCommAbort joins it too,
 * after flagging the job aborted (ncclCommEnsureReady -> ncclGroupJobAbort). */
typedef struct group_job {
    launch_t *l;
    int delay_ms;              /* injected, before the launch */
    pthread_t thread;
    _Atomic int aborted, joined, refs;
    int ncomms;
    comm_t **comms;
} group_job;

static _Atomic long group_threads;

/* For tests and benchmarks: the group threads this process has started. */
long mpfake_nccl_group_threads(void) { return atomic_load(&group_threads); }

/* For tests: the aborts that broke NCCL's condition for a safe abort (see ncclCommAbort). */
static _Atomic long unsafe_aborts;
long mpfake_nccl_unsafe_aborts(void) { return atomic_load(&unsafe_aborts); }

static void *group_main(void *arg)
{
    group_job *j = arg;
    for (int ms = 0; ms < j->delay_ms && !atomic_load(&j->aborted); ms++)
        sleep_ms(1);
    int aborted = atomic_load(&j->aborted);
    ncclResult_t r = aborted ? ncclInvalidUsage : launch_group(j->l);
    free_launch(j->l);
    j->l = NULL;
    int others = 0;
    for (int k = 0; k < j->ncomms; k++) {
        others |= j->comms[k]->alive;
        atomic_store(&j->comms[k]->state, r);
    }
    if (aborted && others) /* the model's choice: the group dies with any of its communicators */
        log_warning("a nonblocking group was not launched: ncclCommAbort ended one of its communicators first");
    return NULL;
}

/* Joins the communicator's group thread, once for the whole group, and drops its hold on the job. */
static void complete_job(comm_t *c)
{
    pthread_mutex_lock(&lib_lock);
    group_job *j = c->job;
    c->job = NULL;
    pthread_mutex_unlock(&lib_lock);
    if (!j)
        return;
    if (!atomic_exchange(&j->joined, 1))
        pthread_join(j->thread, NULL);
    if (atomic_fetch_sub(&j->refs, 1) == 1) {
        free(j->comms);
        free(j);
    }
}

static ncclResult_t start_group_thread(launch_t *l, int delay_ms)
{
    group_job *j = calloc(1, sizeof *j);
    comm_t **comms = calloc((size_t)l->ntasks, sizeof *comms);
    if (!j || !comms) {
        free(j);
        free(comms);
        free_launch(l);
        return ncclSystemError;
    }
    j->l = l;
    j->delay_ms = delay_ms;
    j->comms = comms;
    for (int k = 0; k < l->ntasks; k++) {
        comm_t *c = l->tasks[k]->comm;
        int seen = 0;
        for (int i = 0; i < j->ncomms; i++)
            seen |= j->comms[i] == c;
        if (seen)
            continue;
        complete_job(c); /* none left: a send on it would have been refused, or joined it */
        j->comms[j->ncomms++] = c;
        atomic_store(&c->state, ncclInProgress);
    }
    atomic_store(&j->refs, j->ncomms);
    pthread_mutex_lock(&lib_lock);
    for (int i = 0; i < j->ncomms; i++)
        j->comms[i]->job = j;
    pthread_mutex_unlock(&lib_lock);
    if (pthread_create(&j->thread, NULL, group_main, j) != 0) {
        log_warning("ncclGroupEnd: starting the group's thread failed");
        atomic_store(&j->joined, 1); /* nothing to join */
        for (int i = 0; i < j->ncomms; i++) {
            atomic_store(&j->comms[i]->state, ncclSystemError);
            complete_job(j->comms[i]);
        }
        free_launch(l);
        return ncclSystemError;
    }
    atomic_fetch_add(&group_threads, 1);
    if (delay_ms > 0)
        log_line("group-in-progress", delay_ms);
    return ncclInProgress;
}

/* The group's ops as one kernel per (communicator, stream), in issue order: launched here for
 * blocking communicators (src/group.cc: ncclGroupEndInternal, the blocking branch runs
 * groupLaunch on the caller's thread), on a thread of the group's own for nonblocking ones. */
static ncclResult_t close_group(void)
{
    op_t *ops = group_ops;
    size_t n = (size_t)group_nops;
    group_nops = 0;
    if (group_error != ncclSuccess)
        return group_error;
    if (n == 0)
        return ncclSuccess;
    launch_t *l = calloc(1, sizeof *l);
    if (!l || !(l->tasks = calloc(n, sizeof *l->tasks)) || !(l->streams = calloc(n, sizeof *l->streams))) {
        if (l)
            free(l->tasks);
        free(l);
        return ncclSystemError;
    }
    int nonblocking = 0;
    for (size_t i = 0; i < n; i++) {
        int k = 0;
        while (k < l->ntasks && !(l->tasks[k]->comm == ops[i].comm && l->streams[k] == ops[i].stream))
            k++;
        if (k == l->ntasks) {
            int count = 0;
            for (size_t j = i; j < n; j++)
                count += ops[j].comm == ops[i].comm && ops[j].stream == ops[i].stream;
            if (!(l->tasks[k] = calloc(1, sizeof(task_t) + sizeof(op_t) * (size_t)count))) {
                free_launch(l);
                return ncclSystemError;
            }
            l->tasks[k]->comm = ops[i].comm;
            l->streams[k] = ops[i].stream;
            l->ntasks++;
            nonblocking |= !ops[i].comm->blocking;
        }
        l->tasks[k]->ops[l->tasks[k]->nops++] = ops[i];
    }
    comm_t *first = l->tasks[0]->comm;
    int eligible = nonblocking && first->conns->groups++ >= first->f.group_in_progress_after;
    int delay = !eligible ? 0
                : first->f.group_in_progress_every ? first->f.group_in_progress_ms
                : random_below(1) ? random_below(first->f.group_in_progress_ms) : 0;
    if (!nonblocking || (delay <= 0 && !first->f.group_thread)) { /* see MPFAKE_NCCL_GROUP_THREAD */
        /* On the caller's thread: a call on each communicator until it returns (launch() hands
         * the tasks on, so their communicators are kept here). */
        int ntasks = l->ntasks;
        comm_t **comms = calloc((size_t)(unsigned)ntasks, sizeof *comms);
        if (!comms) {
            free_launch(l);
            return ncclSystemError;
        }
        for (int k = 0; k < ntasks; k++)
            enter_call(comms[k] = l->tasks[k]->comm, 1);
        ncclResult_t r = launch_group(l);
        free_launch(l);
        for (int k = 0; k < ntasks; k++)
            enter_call(comms[k], -1);
        free(comms);
        return r;
    }
    return start_group_thread(l, delay);
}

ncclResult_t ncclGroupEnd(void)
{
    if (group_depth == 0) {
        log_warning("ncclGroupEnd without ncclGroupStart");
        return ncclInvalidUsage;
    }
    if (--group_depth > 0)
        return ncclSuccess;
    return close_group();
}

/* Outside a group an op is a group of its own, as in NCCL. */
static ncclResult_t post_op(int is_send, const void *buf, size_t count, int type, int peer, comm_t *comm, CUstream stream)
{
    if (group_depth == 0) {
        ncclGroupStart();
        ncclResult_t r = post_op(is_send, buf, count, type, peer, comm, stream);
        ncclResult_t e = ncclGroupEnd();
        return r != ncclSuccess ? r : e;
    }
    /* src/include/group.h: ncclGroupErrCheck keeps a failure inside a group for ncclGroupEnd to
     * return (each later failure replacing it). */
    ncclResult_t r = add_op(is_send, buf, count, type, peer, comm, stream);
    if (r != ncclSuccess)
        group_error = r;
    return r;
}

ncclResult_t ncclSend(const void *buf, size_t count, int type, int peer, comm_t *comm, CUstream stream)
{
    enter_call(comm, 1);
    ncclResult_t r = post_op(1, buf, count, type, peer, comm, stream);
    enter_call(comm, -1);
    return r;
}

ncclResult_t ncclRecv(void *buf, size_t count, int type, int peer, comm_t *comm, CUstream stream)
{
    enter_call(comm, 1);
    ncclResult_t r = post_op(0, buf, count, type, peer, comm, stream);
    enter_call(comm, -1);
    return r;
}

/* ---- state, abort ------------------------------------------------------------------------------ */

static ncclResult_t get_async_error(comm_t *comm, ncclResult_t *error);

ncclResult_t ncclCommGetAsyncError(comm_t *comm, ncclResult_t *error)
{
    enter_call(comm, 1);
    ncclResult_t r = get_async_error(comm, error);
    enter_call(comm, -1);
    return r;
}

static ncclResult_t get_async_error(comm_t *comm, ncclResult_t *error)
{
    if (!comm || !error) { /* src/misc/argcheck.cc: CommCheck, PtrCheck warn and refuse a NULL */
        log_warning("ncclCommGetAsyncError: %s is NULL", comm ? "asyncError" : "comm");
        return ncclInvalidArgument;
    }
    if (!comm->alive) {
        log_warning("ncclCommGetAsyncError on a communicator that was aborted");
        return ncclInvalidUsage;
    }
    int state = atomic_load(&comm->state);
    if (state == ncclSuccess) /* src/init.cc: ncclCommGetAsyncError completes a finished group job */
        complete_job(comm);
    if (state == ncclSuccess && comm->seg && atomic_load(&comm->seg->error)) {
        state = atomic_load(&comm->seg->error);
        /* Logged once, when this rank first learns of it, as a warning is logged where a failure
         * is found; not at every poll (src/init.cc: ncclCommGetAsyncError only reads the state),
         * which would overwrite later, unrelated warnings. */
        if (!atomic_exchange(&comm->mismatch_logged, 1))
            log_warning("%s", comm->seg->error_text);
    } else if (state == ncclSuccess && atomic_load(&comm->conns->injected)) {
        state = comm->f.async_error_code;
    }
    *error = (ncclResult_t)state;
    return ncclSuccess;
}

/* Local, like NCCL's: the peers learn nothing. src/init.cc: ncclCommAbort sets the abort flags
 * first (setCommAbortFlags: stuck kernels end), joins a group thread still running
 * (ncclCommEnsureReady -> src/group.cc: ncclGroupJobAbort), then reclaims the communicator
 * (commReclaim -> commDestroySync), which waits until comm->localPersistentRefs is 0: every CUDA
 * graph that captured work on it, and every instance, destroyed. The struct outlives the call (a
 * model may keep it) so that any later use is reported rather than undefined. */
ncclResult_t ncclCommAbort(comm_t *comm)
{
    if (!comm)
        return ncclSuccess;
    if (!comm->alive) {
        log_warning("ncclCommAbort on a communicator that was already aborted");
        return ncclInvalidUsage;
    }
    /* The user guide's condition for a safe abort ("Fault Tolerance": no thread may be calling any
     * NCCL operation on the communicator meanwhile): broken here, it is counted and logged. */
    if (atomic_load(&comm->in_call) > 0) {
        atomic_fetch_add(&unsafe_aborts, 1);
        log_warning("ncclCommAbort while another thread is inside a call on the communicator (rank %d)", comm->rank);
    }
    comm->alive = 0;
    atomic_store(comm->abort_flag, 1);
    comm_t *child = atomic_load(&comm->init_child);
    if (child) /* src/init.cc: setCommAbortFlags sets childAbortFlag too */
        atomic_store(child->abort_flag, 1);
    pthread_mutex_lock(&lib_lock);
    if (comm->job)
        atomic_store(&comm->job->aborted, 1); /* an unlaunched group dies with its communicator */
    pthread_mutex_unlock(&lib_lock);
    complete_job(comm);
    for (unsigned spins = 0; atomic_load(&comm->persistent_refs) > 0; spins++)
        pause_for(spins);
    if (comm->seg && atomic_load(&comm->seg->attached) < comm->nranks)
        shm_unlink(comm->name); /* this rank will never join: no one may wait on the name */
    return ncclSuccess;
}
