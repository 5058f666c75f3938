/* NCCL's one-sided RMA as a user of its API sees it, with no package in between: two ranks as
 * forked processes, each on device 0, run one scenario and print what they found as one JSON
 * line each. Built against the model (tests/fakes/, by tests/test_nccl_model_rma.py) and against
 * the real libnccl and libcuda (tests/gpu/run_device_checks.sh), so the model's claims about
 * NCCL are checked by the same program on a GPU.
 *
 *   nccl_rma_check SCENARIO [BYTES]
 *
 * Scenarios: properties, exchange, order, early, refusals, overrun, deregister. Exit status 0
 * when both ranks ran to the end (what they found is in their lines), 1 otherwise. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "nccl/nccl_abi.h"

/* The CUDA driver calls used, declared as cuda.h declares them. */
typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUstream;
typedef unsigned long long CUdeviceptr;
CUresult cuInit(unsigned int flags);
CUresult cuDeviceGet(CUdevice *dev, int ordinal);
CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev);
CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuStreamCreateWithPriority(CUstream *stream, unsigned int flags, int priority);
CUresult cuStreamSynchronize(CUstream stream);
CUresult cuStreamQuery(CUstream stream);
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t bytes, CUstream stream);
CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t bytes, CUstream stream);
CUresult cuMemAlloc_v2(CUdeviceptr *ptr, size_t bytes);
#define CUDA_ERROR_NOT_READY 600

/* NCCL's API, under its own names, with nccl_abi.h's types (checked against nccl.h). */
mp_ncclResult_t ncclGetUniqueId(mp_ncclUniqueId *id);
mp_ncclResult_t ncclCommInitRankConfig(mp_ncclComm_t *comm, int nranks, mp_ncclUniqueId id, int rank, void *config);
mp_ncclResult_t ncclCommAbort(mp_ncclComm_t comm);
mp_ncclResult_t ncclMemAlloc(void **ptr, size_t size);
mp_ncclResult_t ncclMemFree(void *ptr);
mp_ncclResult_t ncclCommWindowRegister(mp_ncclComm_t comm, void *buff, size_t size, mp_ncclWindow_t *win, int flags);
mp_ncclResult_t ncclCommWindowDeregister(mp_ncclComm_t comm, mp_ncclWindow_t win);
mp_ncclResult_t ncclPutSignal(const void *localbuff, size_t count, mp_ncclDataType_t type, int peer,
                              mp_ncclWindow_t peer_win, size_t peer_win_offset, int sig_idx, int ctx,
                              unsigned int flags, mp_ncclComm_t comm, void *stream);
mp_ncclResult_t ncclSignal(int peer, int sig_idx, int ctx, unsigned int flags, mp_ncclComm_t comm, void *stream);
mp_ncclResult_t ncclWaitSignal(int ndesc, mp_ncclWaitSignalDesc *descs, mp_ncclComm_t comm, void *stream);
mp_ncclResult_t ncclCommQueryProperties(mp_ncclComm_t comm, mp_ncclCommProperties *props);

#define LIMIT_SECONDS 60

typedef struct {
    int rank, peer;
    mp_ncclComm_t comm;
    CUstream stream;
    char out[4096];
} rank_t;

static void add(rank_t *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void add(rank_t *r, const char *fmt, ...)
{
    size_t used = strlen(r->out);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->out + used, sizeof r->out - used, fmt, ap);
    va_end(ap);
}

static void die(rank_t *r, const char *what, int code)
{
    fprintf(stderr, "rank %d: %s failed (%d)\n", r->rank, what, code);
    exit(1);
}
#define CU(r, call) do { CUresult e_ = (call); if (e_) die(r, #call, e_); } while (0)
#define NC(r, call) do { mp_ncclResult_t e_ = (call); if (e_) die(r, #call, e_); } while (0)

static uint8_t pattern(int rank, size_t i) { return (uint8_t)(rank * 101 + i * 7 + (i >> 12)); }

static mp_ncclWaitSignalDesc from(int peer, int count) { return (mp_ncclWaitSignalDesc){count, peer, 0, 0}; }

/* A window of `bytes` from ncclMemAlloc, registered collectively. */
static void *window(rank_t *r, size_t bytes, mp_ncclWindow_t *win)
{
    void *p = NULL;
    NC(r, ncclMemAlloc(&p, bytes));
    NC(r, ncclCommWindowRegister(r->comm, p, bytes, win, MP_NCCL_WIN_COLL_SYMMETRIC));
    if (!*win) {
        fprintf(stderr, "rank %d: ncclCommWindowRegister gave no window (no symmetric memory)\n", r->rank);
        exit(1);
    }
    return p;
}

static int query(rank_t *r, unsigned version, mp_ncclCommProperties *p)
{
    *p = (mp_ncclCommProperties){.size = sizeof *p, .magic = MP_NCCL_CONFIG_MAGIC, .version = version};
    return ncclCommQueryProperties(r->comm, p);
}

static void properties(rank_t *r)
{
    mp_ncclCommProperties p, old;
    int e = query(r, MP_NCCL_VERSION(2, 30, 7), &p);
    query(r, MP_NCCL_PROPERTIES_RMA_AFTER, &old);
    mp_ncclCommProperties bad = {.size = sizeof bad, .magic = 1, .version = MP_NCCL_VERSION(2, 30, 7)};
    add(r, "\"result\": %d, \"rank\": %d, \"nRanks\": %d, \"hostRmaSupport\": %s, \"deviceApiSupport\": %s, "
           "\"nLsaTeams\": %d, \"old_version_hostRmaSupport\": %s, \"bad_magic\": %d",
        e, p.rank, p.nRanks, p.hostRmaSupport ? "true" : "false", p.deviceApiSupport ? "true" : "false",
        p.nLsaTeams, old.hostRmaSupport ? "true" : "false", ncclCommQueryProperties(r->comm, &bad));
}

/* Each rank puts `bytes` from its window's first half into the peer's second half, then waits. */
static void exchange(rank_t *r, size_t bytes)
{
    mp_ncclWindow_t win;
    char *base = window(r, 2 * bytes, &win);
    uint8_t *host = malloc(bytes);
    for (size_t i = 0; i < bytes; i++)
        host[i] = pattern(r->rank, i);
    CU(r, cuMemcpyHtoDAsync_v2((CUdeviceptr)(uintptr_t)base, host, bytes, r->stream));
    NC(r, ncclPutSignal(base, bytes, MP_NCCL_UINT8, r->peer, win, bytes, 0, 0, 0, r->comm, r->stream));
    mp_ncclWaitSignalDesc d = from(r->peer, 1);
    NC(r, ncclWaitSignal(1, &d, r->comm, r->stream));
    CU(r, cuMemcpyDtoHAsync_v2(host, (CUdeviceptr)(uintptr_t)(base + bytes), bytes, r->stream));
    CU(r, cuStreamSynchronize(r->stream));
    size_t wrong = 0;
    for (size_t i = 0; i < bytes; i++)
        wrong += host[i] != pattern(r->peer, i);
    add(r, "\"bytes\": %zu, \"wrong_bytes\": %zu", bytes, wrong);
    NC(r, ncclCommWindowDeregister(r->comm, win));
    NC(r, ncclMemFree(base));
    free(host);
}

/* Rank 0 puts 8-byte values 1..K into successive slots and then value K+1 over slot 0; rank 1
 * waits for all K+1 and reads: per-peer order means slot 0 holds K+1, the others their own. */
static void order(rank_t *r)
{
    enum { K = 16 };
    mp_ncclWindow_t win;
    char *base = window(r, 2 * K * sizeof(uint64_t), &win); /* [0, K): received; [K, 2K): to send */
    uint64_t values[K + 1];
    if (r->rank == 0) {
        for (int i = 0; i <= K; i++)
            values[i] = (uint64_t)i + 1;
        CU(r, cuMemcpyHtoDAsync_v2((CUdeviceptr)(uintptr_t)(base + K * 8), values, (K) * 8, r->stream));
        CU(r, cuStreamSynchronize(r->stream));
        for (int i = 0; i < K; i++)
            NC(r, ncclPutSignal(base + (K + i) * 8, 1, MP_NCCL_UINT64, 1, win, (size_t)i * 8, 0, 0, 0, r->comm,
                                r->stream));
        uint64_t last = K + 1;
        CU(r, cuMemcpyHtoDAsync_v2((CUdeviceptr)(uintptr_t)(base + K * 8), &last, 8, r->stream));
        NC(r, ncclPutSignal(base + K * 8, 1, MP_NCCL_UINT64, 1, win, 0, 0, 0, 0, r->comm, r->stream));
        CU(r, cuStreamSynchronize(r->stream));
        add(r, "\"puts\": %d", K + 1);
    } else {
        mp_ncclWaitSignalDesc d = from(0, K + 1);
        NC(r, ncclWaitSignal(1, &d, r->comm, r->stream));
        CU(r, cuMemcpyDtoHAsync_v2(values, (CUdeviceptr)(uintptr_t)base, K * 8, r->stream));
        CU(r, cuStreamSynchronize(r->stream));
        int in_order = values[0] == K + 1;
        for (int i = 1; i < K; i++)
            in_order &= values[i] == (uint64_t)i + 1;
        add(r, "\"in_order\": %s", in_order ? "true" : "false");
    }
    NC(r, ncclCommWindowDeregister(r->comm, win));
    NC(r, ncclMemFree(base));
}

static int query_after(rank_t *r, double seconds)
{
    struct timespec t = {0, (long)(seconds * 1e9)};
    nanosleep(&t, NULL);
    return cuStreamQuery(r->stream);
}

/* After a handshake (every rank's first RMA call is collective), rank 0 signals 3 times before
 * rank 1 waits: three waits of one each complete, and a fourth waits for rank 0's fourth signal.
 * A wait counts the signals that came before it. */
static void early(rank_t *r)
{
    mp_ncclWaitSignalDesc d = from(r->peer, 1);
    if (r->rank == 0) {
        NC(r, ncclWaitSignal(1, &d, r->comm, r->stream));
        CU(r, cuStreamSynchronize(r->stream));
        for (int i = 0; i < 3; i++)
            NC(r, ncclSignal(1, 0, 0, 0, r->comm, r->stream));
        CU(r, cuStreamSynchronize(r->stream));
        struct timespec t = {0, 700 * 1000 * 1000};
        nanosleep(&t, NULL); /* rank 1's fourth wait is queued and pending meanwhile */
        NC(r, ncclSignal(1, 0, 0, 0, r->comm, r->stream));
        CU(r, cuStreamSynchronize(r->stream));
        add(r, "\"signals\": 4");
    } else {
        NC(r, ncclSignal(0, 0, 0, 0, r->comm, r->stream));
        CU(r, cuStreamSynchronize(r->stream));
        struct timespec t = {0, 300 * 1000 * 1000};
        nanosleep(&t, NULL); /* rank 0's three signals land first */
        for (int i = 0; i < 3; i++)
            NC(r, ncclWaitSignal(1, &d, r->comm, r->stream));
        int three_done = query_after(r, 0.2) == 0;
        NC(r, ncclWaitSignal(1, &d, r->comm, r->stream));
        int fourth_pending = query_after(r, 0.1) == CUDA_ERROR_NOT_READY;
        CU(r, cuStreamSynchronize(r->stream));
        add(r, "\"three_done\": %s, \"fourth_pending\": %s", three_done ? "true" : "false",
            fourth_pending ? "true" : "false");
    }
}

/* Every misuse one call at a time, each with its result code (run on both ranks alike, so that
 * the implicit collective of the first RMA call is met). */
static void refusals(rank_t *r)
{
    mp_ncclWindow_t win, none = NULL;
    char *base = window(r, 1 << 20, &win);
    CUdeviceptr plain = 0;
    CU(r, cuMemAlloc_v2(&plain, 1 << 20));
    mp_ncclWaitSignalDesc zero = from(r->peer, 0), sig = {1, r->peer, 1, 0}, ctx = {1, r->peer, 0, 1};
    add(r, "\"put_ctx\": %d, ", ncclPutSignal(base, 8, MP_NCCL_UINT8, r->peer, win, 0, 0, 1, 0, r->comm, r->stream));
    add(r, "\"put_sig_idx\": %d, ", ncclPutSignal(base, 8, MP_NCCL_UINT8, r->peer, win, 0, 1, 0, 0, r->comm, r->stream));
    add(r, "\"put_flags\": %d, ", ncclPutSignal(base, 8, MP_NCCL_UINT8, r->peer, win, 0, 0, 0, 1, r->comm, r->stream));
    add(r, "\"put_peer_out_of_range\": %d, ",
        ncclPutSignal(base, 8, MP_NCCL_UINT8, 2, win, 0, 0, 0, 0, r->comm, r->stream));
    add(r, "\"put_no_window\": %d, ", ncclPutSignal(base, 8, MP_NCCL_UINT8, r->peer, none, 0, 0, 0, 0, r->comm, r->stream));
    add(r, "\"put_no_source\": %d, ", ncclPutSignal(NULL, 8, MP_NCCL_UINT8, r->peer, win, 0, 0, 0, 0, r->comm, r->stream));
    add(r, "\"put_source_outside_windows\": %d, ",
        ncclPutSignal((void *)(uintptr_t)plain, 8, MP_NCCL_UINT8, r->peer, win, 0, 0, 0, 0, r->comm, r->stream));
    add(r, "\"put_offset_past_window\": %d, ",
        ncclPutSignal(base, 8, MP_NCCL_UINT8, r->peer, win, 1 << 20, 0, 0, 0, r->comm, r->stream));
    add(r, "\"signal_peer_out_of_range\": %d, ", ncclSignal(-1, 0, 0, 0, r->comm, r->stream));
    add(r, "\"wait_no_descriptors\": %d, ", ncclWaitSignal(0, &zero, r->comm, r->stream));
    add(r, "\"wait_zero_count\": %d, ", ncclWaitSignal(1, &zero, r->comm, r->stream));
    add(r, "\"wait_sig_idx\": %d, ", ncclWaitSignal(1, &sig, r->comm, r->stream));
    add(r, "\"wait_ctx\": %d, ", ncclWaitSignal(1, &ctx, r->comm, r->stream));
    add(r, "\"register_plain_memory\": %d, ",
        ncclCommWindowRegister(r->comm, (void *)(uintptr_t)plain, 1 << 20, &none, MP_NCCL_WIN_COLL_SYMMETRIC));
    add(r, "\"register_null\": %d, ", ncclCommWindowRegister(r->comm, NULL, 4096, &none, MP_NCCL_WIN_COLL_SYMMETRIC));
    add(r, "\"register_misaligned\": %d, ",
        ncclCommWindowRegister(r->comm, base + 64, 4096, &none, MP_NCCL_WIN_COLL_SYMMETRIC));
    add(r, "\"mem_alloc_null\": %d, ", ncclMemAlloc(NULL, 4096));
    add(r, "\"deregister_null\": %d", ncclCommWindowDeregister(r->comm, NULL));
    CU(r, cuStreamSynchronize(r->stream));
    NC(r, ncclCommWindowDeregister(r->comm, win));
    NC(r, ncclMemFree(base));
}

/* The model's count of a hazard NCCL leaves undefined, or -1 on real NCCL, which has none. */
static long hazard(const char *counter)
{
    long (*count)(void) = (long (*)(void))dlsym(RTLD_DEFAULT, counter);
    return count ? count() : -1;
}

/* Rank 0 puts 4096 bytes at offset 4096 of rank 1's 4096-byte window part (past its end), then
 * 4096 at offset 0 (inside): the model counts the first as an overrun, not the second. */
static void overrun(rank_t *r)
{
    mp_ncclWindow_t win;
    size_t mine = r->rank == 0 ? 3 * 4096 : 4096; /* sizes may differ between ranks */
    char *base = window(r, mine, &win);
    long before = hazard("mpfake_nccl_rma_overruns"), inside = 0;
    if (r->rank == 0) {
        NC(r, ncclPutSignal(base, 4096, MP_NCCL_UINT8, 1, win, 0, 0, 0, 0, r->comm, r->stream));
        CU(r, cuStreamSynchronize(r->stream));
        inside = hazard("mpfake_nccl_rma_overruns") - before;
        NC(r, ncclPutSignal(base, 4096, MP_NCCL_UINT8, 1, win, 4096, 0, 0, 0, r->comm, r->stream));
        CU(r, cuStreamSynchronize(r->stream));
        add(r, "\"inside\": %ld, \"past_the_end\": %ld", inside, hazard("mpfake_nccl_rma_overruns") - before - inside);
    } else {
        mp_ncclWaitSignalDesc d = from(0, 2);
        NC(r, ncclWaitSignal(1, &d, r->comm, r->stream));
        CU(r, cuStreamSynchronize(r->stream));
        add(r, "\"received\": 2");
    }
    NC(r, ncclCommWindowDeregister(r->comm, win));
    NC(r, ncclMemFree(base));
}

/* Rank 0 queues a put behind a wait for rank 1's late signal and deregisters its window while the
 * put is queued, then a second window after its put ran: the model counts the first only. */
static void deregister(rank_t *r)
{
    mp_ncclWindow_t a, b;
    char *pa = window(r, 4096, &a), *pb = window(r, 4096, &b);
    if (r->rank == 0) {
        long before = hazard("mpfake_nccl_windows_deregistered_in_use");
        mp_ncclWaitSignalDesc d = from(1, 2); /* rank 1's second signal comes 0.5 s after its first */
        NC(r, ncclWaitSignal(1, &d, r->comm, r->stream));
        NC(r, ncclPutSignal(pa, 64, MP_NCCL_UINT8, 1, a, 0, 0, 0, 0, r->comm, r->stream));
        NC(r, ncclCommWindowDeregister(r->comm, a));
        long queued = hazard("mpfake_nccl_windows_deregistered_in_use") - before;
        NC(r, ncclSignal(1, 0, 0, 0, r->comm, r->stream)); /* releases rank 1 */
        CU(r, cuStreamSynchronize(r->stream));
        NC(r, ncclPutSignal(pb, 64, MP_NCCL_UINT8, 1, b, 0, 0, 0, 0, r->comm, r->stream));
        CU(r, cuStreamSynchronize(r->stream));
        NC(r, ncclCommWindowDeregister(r->comm, b));
        add(r, "\"while_queued\": %ld, \"after_it_ran\": %ld", queued,
            hazard("mpfake_nccl_windows_deregistered_in_use") - before - queued);
    } else {
        NC(r, ncclSignal(0, 0, 0, 0, r->comm, r->stream));
        struct timespec t = {0, 500 * 1000 * 1000};
        nanosleep(&t, NULL);
        NC(r, ncclSignal(0, 0, 0, 0, r->comm, r->stream));
        mp_ncclWaitSignalDesc d = from(0, 3);
        NC(r, ncclWaitSignal(1, &d, r->comm, r->stream));
        CU(r, cuStreamSynchronize(r->stream));
        NC(r, ncclCommWindowDeregister(r->comm, a));
        NC(r, ncclCommWindowDeregister(r->comm, b));
        add(r, "\"received\": 3");
    }
    NC(r, ncclMemFree(pa));
    NC(r, ncclMemFree(pb));
}

static int run_rank(int rank, const char *scenario, size_t bytes, int id_pipe[2])
{
    rank_t r = {.rank = rank, .peer = 1 - rank};
    mp_ncclUniqueId id;
    if (rank == 0) {
        NC(&r, ncclGetUniqueId(&id));
        if (write(id_pipe[1], &id, sizeof id) != (ssize_t)sizeof id)
            die(&r, "passing the unique id", 0);
    } else if (read(id_pipe[0], &id, sizeof id) != (ssize_t)sizeof id) {
        die(&r, "reading the unique id", 0);
    }
    CUdevice dev;
    CUcontext ctx;
    CU(&r, cuInit(0));
    CU(&r, cuDeviceGet(&dev, 0));
    CU(&r, cuDevicePrimaryCtxRetain(&ctx, dev));
    CU(&r, cuCtxSetCurrent(ctx));
    CU(&r, cuStreamCreateWithPriority(&r.stream, 1, 0));
    NC(&r, ncclCommInitRankConfig(&r.comm, 2, id, rank, NULL));
    if (!strcmp(scenario, "properties"))
        properties(&r);
    else if (!strcmp(scenario, "exchange"))
        exchange(&r, bytes);
    else if (!strcmp(scenario, "order"))
        order(&r);
    else if (!strcmp(scenario, "early"))
        early(&r);
    else if (!strcmp(scenario, "refusals"))
        refusals(&r);
    else if (!strcmp(scenario, "overrun"))
        overrun(&r);
    else if (!strcmp(scenario, "deregister"))
        deregister(&r);
    else
        die(&r, "unknown scenario", 0);
    printf("{\"scenario\": \"%s\", \"rank\": %d, %s}\n", scenario, rank, r.out);
    fflush(stdout);
    ncclCommAbort(r.comm);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 2 || argc > 3) {
        fprintf(stderr, "usage: %s SCENARIO [BYTES]\n", argv[0]);
        return 2;
    }
    size_t bytes = argc == 3 ? strtoull(argv[2], NULL, 0) : 1 << 20;
    int id_pipe[2];
    if (pipe(id_pipe) != 0)
        return 1;
    pid_t pids[2];
    for (int rank = 0; rank < 2; rank++) {
        pids[rank] = fork();
        if (pids[rank] == 0) {
            alarm(LIMIT_SECONDS); /* a rank that hangs ends; the parent reports it */
            _exit(run_rank(rank, argv[1], bytes, id_pipe));
        }
    }
    int ok = 1;
    for (int rank = 0; rank < 2; rank++) {
        int status = 0;
        waitpid(pids[rank], &status, 0);
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
            fprintf(stderr, "rank %d ended with status %d\n", rank, status);
            ok = 0;
        }
    }
    return ok ? 0 : 1;
}
