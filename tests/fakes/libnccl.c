/* A model of libnccl's point-to-point subset for running the NCCL backend without a GPU. It
 * runs across processes: the unique id names a shared-memory segment (mode 0600) through which
 * the ranks of one communicator meet and move bytes; the name is unlinked once every rank has
 * attached. Send and receive run as "kernels" on the fake libcuda's streams.
 *
 * What it promises, as NCCL does; docs/nccl-model.md gives each behaviour a row naming the NCCL or
 * CUDA source it follows (the ordering rows: src/enqueue.cc and src/group.cc):
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
 *     connections when the PARENT was made with splitShare (the split's own config does not decide);
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

#include "nccl_model.h"

/* The library's process-wide state, as the real one has: a lock over communicator state
 * changes (each thread's group is in nccl_groups.c). */
pthread_mutex_t lib_lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned random_state;

/* The last error, as NCCL keeps it: one buffer for the whole process (src/debug.cc: the global
 * ncclLastError), which every WARN-level message overwrites, whichever communicator or thread
 * logged it (src/debug.cc: ncclDebugLogV copies each WARN into it under the log's mutex), and
 * which nothing ever clears: a later successful call leaves it as it was. So it may describe an
 * earlier call or another communicator than the one a caller asks about (src/init.cc:
 * ncclGetLastError ignores its comm). Every error the model reports is logged here. */
static pthread_mutex_t last_error_lock = PTHREAD_MUTEX_INITIALIZER;
static char last_error[1024];

void log_warning(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void log_warning(const char *fmt, ...)
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

void sleep_ms(double ms)
{
    struct timespec t = {(time_t)(ms / 1000), (long)((ms - (time_t)(ms / 1000) * 1000) * 1e6)};
    while (nanosleep(&t, &t) == -1 && errno == EINTR) {
    }
}

/* Polling back-off for a loop that waits on another process. */
void pause_for(unsigned spins)
{
    if (spins < 64)
        sched_yield();
    else
        sleep_ms(spins < 2048 ? 0.02 : 0.5);
}

int random_below(int n)
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

void log_line(const char *what, int ms)
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

long env_long(const char *name, long fallback)
{
    const char *v = getenv(name);
    return v && v[0] ? atol(v) : fallback;
}

size_t type_size(int type)
{
    switch (type) {
    case 0: case 1: case 10: case 11: return 1;
    case 6: case 9: return 2;
    case 2: case 3: case 7: return 4;
    case 4: case 5: case 8: return 8;
    default: return 0;
    }
}

const char *type_name(int type)
{
    static const char *names[] = {"int8", "uint8", "int32", "uint32", "int64", "uint64", "float16",
                                  "float32", "float64", "bfloat16", "float8e4m3", "float8e5m2"};
    return type >= 0 && type < 12 ? names[type] : "?";
}

/* ---- version, ids, errors ------------------------------------------------------------------ */

API ncclResult_t ncclGetVersion(int *version)
{
    if (!version)
        return ncclInvalidArgument;
    *version = VERSION;
    return ncclSuccess;
}

static void init_env(void); /* with nccl_param, below */

API ncclResult_t ncclGetUniqueId(ncclUniqueId *id)
{
    init_env(); /* src/init.cc ncclGetUniqueId: ncclInitEnv first */
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

API const char *ncclGetErrorString(ncclResult_t r)
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
API const char *ncclGetLastError(comm_t *comm)
{
    (void)comm;
    return last_error;
}

/* For tests: calls made while another thread was inside a call on the same communicator, or on
 * one sharing its resources. NCCL's user guide forbids both (usage/threadsafety.rst), and NCCL
 * does not guard them: ncclCommGetAsyncError completes a finished group job with no lock
 * (src/init.cc: ncclCommGetAsyncError -> src/group.cc: ncclGroupJobComplete), so two pollers can
 * free the job twice. The model runs them safely, and counts and logs each instead. */
static _Atomic long parallel_calls;
API long mpfake_nccl_parallel_calls(void) { return atomic_load(&parallel_calls); }

/* Marks a call on `c` (entering: by 1, leaving: by -1), for the parallel-call count above and
 * ncclCommAbort's check of its condition. */
void enter_call(comm_t *c, int by)
{
    if (!c)
        return;
    if (atomic_fetch_add(&c->conns->in_call, by) > 0 && by > 0) {
        atomic_fetch_add(&parallel_calls, 1);
        log_warning("a call on a communicator (rank %d) while another thread is inside a call on it or on one "
                    "sharing its resources", c->rank);
    }
}

/* A usable communicator, or the error its use is. */
ncclResult_t usable(comm_t *c, const char *call)
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

/* An NCCL parameter, read once per process and kept, as NCCL_PARAM does (src/include/param.h; NCCL
 * 2.30 src/misc/param.cc ncclLoadParam): the first read, under a lock, takes the environment, into
 * which init_env has loaded NCCL's conf files, and parses with strtoll in base 0 and no end pointer (trailing text ignored, text with no number 0); unset, empty or out of range
 * is CONFIG_UNDEF_INT, NCCL's default for both parameters below (src/init.cc). */

/* One conf file's lines into the environment, as src/misc/param.cc setEnvFile reads them: fgets
 * into 4096 bytes (a longer line reads as several), a trailing '\n' then '\r' removed, '#' lines
 * and lines without '=' skipped, the name everything before the first '=' (untrimmed, cut to 1023
 * bytes), the value everything after it (cut to 1023 bytes), set with setenv(..., 0)
 * (src/os/linux.cc ncclOsSetEnv): nothing already in the environment is replaced. */
static void load_conf_file(const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return;
    char line[4096], name[1024], value[1024];
    while (fgets(line, (int)sizeof line, f)) {
        size_t len = strlen(line);
        if (len > 0 && line[len - 1] == '\n')
            line[--len] = '\0';
        if (len > 0 && line[len - 1] == '\r')
            line[--len] = '\0';
        const char *eq = line[0] == '#' ? NULL : strchr(line, '=');
        if (!eq)
            continue;
        size_t n = (size_t)(eq - line) < sizeof name - 1 ? (size_t)(eq - line) : sizeof name - 1;
        memcpy(name, line, n);
        name[n] = '\0';
        snprintf(value, sizeof value, "%s", eq + 1);
        setenv(name, value, 0); /* an empty name fails, as NCCL's does */
    }
    fclose(f);
}

/* NCCL's conf files, loaded into the environment once per process (src/misc/param.cc initEnvFunc,
 * under call_once in initEnv): the file NCCL_CONF_FILE names when set and not empty, else
 * $HOME/.nccl.conf (userHomeDir), then /etc/nccl.conf; paths cut to 1024 bytes. NCCL does it at
 * its first ncclInitEnv (src/init.cc; src/plugin/env.cc ncclEnvPluginInit calls initEnv), which
 * ncclGetUniqueId and the ncclCommInitRank* calls run first and every parameter read runs
 * (src/misc/param.cc ncclGetEnv); ncclGetVersion does not. Env plugins are not modelled: the
 * model's parameters come from the environment only, as with NCCL's internal plugin
 * (src/plugin/env/default_env.cc). */
static void load_conf_files(void)
{
    char path[1024];
    const char *user = getenv("NCCL_CONF_FILE"), *home = getenv("HOME");
    if (user && user[0]) {
        snprintf(path, sizeof path, "%s", user);
        load_conf_file(path);
    } else if (home) {
        snprintf(path, sizeof path, "%s/.nccl.conf", home);
        load_conf_file(path);
    }
    load_conf_file("/etc/nccl.conf");
}

static void init_env(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, load_conf_files);
}

long long nccl_param(const char *name, long long *cache)
{
    init_env(); /* src/misc/param.cc ncclGetEnv */
    pthread_mutex_lock(&lib_lock);
    if (*cache == PARAM_UNREAD) {
        const char *text = getenv(name);
        long long value = CONFIG_UNDEF_INT;
        if (text && text[0]) {
            errno = 0;
            value = strtoll(text, NULL, 0);
            if (errno)
                value = CONFIG_UNDEF_INT;
        }
        *cache = value;
    }
    long long value = *cache;
    pthread_mutex_unlock(&lib_lock);
    return value;
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

/* For tests: configs whose `size` covers bytes past the fields their `version` defines. NCCL
 * copies `size` bytes (src/init.cc: parseCommConfig) and v2.26 reads trafficClass, at offset 44,
 * whatever the version: bytes nothing set become a later release's field. */
static _Atomic long config_overreach;
API long mpfake_nccl_config_overreach(void) { return atomic_load(&config_overreach); }

/* The end of the fields a config of `version` defines (nccl.h of each release: blocking in 2.14,
 * cgaClusterSize..netName in 2.17, splitShare in 2.18, trafficClass in 2.25). */
static size_t fields_end(unsigned version)
{
    return version < 21700 ? offsetof(config_t, cgaClusterSize)
         : version < 21800 ? offsetof(config_t, splitShare)
         : version < 22500 ? offsetof(config_t, splitShare) + sizeof(int)
                           : (size_t)-1;
}

/* Reads `config` over the defaults in *blocking and *share; 0, or -1 for a config NCCL refuses. */
static int read_config(const void *config, const char *call, int *blocking, int *share)
{
    if (config) {
        const config_t *c = config;
        if (c->magic != CONFIG_MAGIC || c->size < offsetof(config_t, cgaClusterSize)) {
            log_warning("%s: config was not made by NCCL_CONFIG_INITIALIZER", call);
            return -1;
        }
        if (c->size > fields_end(c->version)) {
            atomic_fetch_add(&config_overreach, 1);
            log_warning("%s: config size %zu covers bytes past the fields of version %u", call, c->size, c->version);
        }
        if (c->blocking != CONFIG_UNDEF_INT)
            *blocking = c->blocking != 0;
        if (c->size >= sizeof(config_t) && c->splitShare != CONFIG_UNDEF_INT)
            *share = c->splitShare != 0;
    }
    /* src/init.cc envConfigOverride: NCCL_COMM_BLOCKING overrides when it reads 0 or 1,
     * NCCL_COMM_SPLIT_SHARE_RESOURCES whenever it is set (nonzero shares). */
    static long long comm_blocking = PARAM_UNREAD, split_share = PARAM_UNREAD;
    long long forced = nccl_param("NCCL_COMM_BLOCKING", &comm_blocking);
    if (forced == 0 || forced == 1)
        *blocking = (int)forced;
    forced = nccl_param("NCCL_COMM_SPLIT_SHARE_RESOURCES", &split_share);
    if (forced != CONFIG_UNDEF_INT)
        *share = forced != 0;
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

API ncclResult_t ncclCommInitRankConfig(comm_t **out, int nranks, ncclUniqueId id, int rank, void *config)
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
    c->split_share = share;
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
 * copyCommConfig). When the PARENT was made with splitShare (its own config at init, or
 * NCCL_COMM_SPLIT_SHARE_RESOURCES; the split's config sets only the child's, for grandchildren:
 * src/init.cc ncclCommInitChildComm reads comm->config.splitShare of the parent) the child shares
 * its abort flag and connections; else the parent's abort reaches the child only while its init
 * runs (childAbortFlag). The
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

API ncclResult_t ncclCommSplit(comm_t *comm, int color, int key, comm_t **newcomm, void *config)
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
    /* The child's config gives its mode and ITS children's sharing; whether it shares this
     * parent's resources is the parent's own splitShare (src/init.cc: ncclCommInitChildComm). */
    int blocking = comm->blocking, child_share = comm->split_share, share = comm->split_share;
    if (read_config(config, "ncclCommSplit", &blocking, &child_share) < 0)
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
    c->split_share = child_share;
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

/* For tests: the aborts that broke NCCL's condition for a safe abort (see ncclCommAbort). */
static _Atomic long unsafe_aborts;
API long mpfake_nccl_unsafe_aborts(void) { return atomic_load(&unsafe_aborts); }

/* ---- state, abort ------------------------------------------------------------------------------ */

static ncclResult_t get_async_error(comm_t *comm, ncclResult_t *error);

API ncclResult_t ncclCommGetAsyncError(comm_t *comm, ncclResult_t *error)
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
API ncclResult_t ncclCommAbort(comm_t *comm)
{
    if (!comm)
        return ncclSuccess;
    if (!comm->alive) {
        log_warning("ncclCommAbort on a communicator that was already aborted");
        return ncclInvalidUsage;
    }
    /* The user guide's condition for a safe abort ("Fault Tolerance": no thread may be calling any
     * NCCL operation on the communicator meanwhile): broken here, it is counted and logged. */
    if (atomic_load(&comm->conns->in_call) > 0) {
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
