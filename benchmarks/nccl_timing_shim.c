/* A timing shim for benchmarks/nccl_host_cost.py: one shared object that stands in for both
 * libnccl and libcuda (MEGATRON_P2P_NCCL_LIBRARY and MEGATRON_P2P_CUDA_LIBRARY both name it) and
 * forwards every call to the real libraries (the model's, build/fakes/), adding the time
 * inside each call of the measured thread to its counters and histograms.
 *
 * The clock: CLOCK_MONOTONIC by default (read through the vDSO, about 20 ns here), which is the
 * thread's CPU time inside a call that neither blocks nor is preempted (the benchmark leaves
 * out the calls long enough to have been preempted); MP_SHIM_CLOCK=thread reads
 * CLOCK_THREAD_CPUTIME_ID instead, a system call (about 570 ns on the 2-core VM of
 * benchmarks/RESULTS.md), costlier than most of the calls it would time, whose kernel entry and
 * exit also slow the call between two reads: there its sums exceeded the whole exchange's CPU
 * time.
 *
 * No LD_PRELOAD: the package's loader opens this file by path and dlsyms its entry points. The
 * real libraries are linked as DT_NEEDED dependencies (rpath to their folder), so a name this
 * shim does not define (ncclCommInitRankConfig, whose unique id is passed by value on the
 * stack; the model's mpfake_* internals; anything a later version of the package resolves) is
 * found in them by the same dlsym, untimed.
 *
 * The list of timed names comes from the build: nccl_host_cost.py writes one SHIM(name) line
 * per exported cu* / nccl* function of the real libraries into the header named by
 * SHIM_SYMBOLS. Every one of them takes at most six integer or pointer arguments and returns
 * an integer or a pointer, so one forwarding signature serves all (x86-64 and aarch64 pass
 * them in registers; extra arguments are ignored by the callee).
 *
 * Nested calls (the model's libnccl binds its cu* references to this shim too, when it is
 * loaded through it) are forwarded untimed: time is counted once, in the outermost call. Only
 * the thread the benchmark names is timed. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifndef SHIM_SYMBOLS
#error "build with -DSHIM_SYMBOLS='\"path/to/symbols.h\"' (benchmarks/nccl_host_cost.py does)"
#endif

typedef intptr_t (*fn6)(intptr_t, intptr_t, intptr_t, intptr_t, intptr_t, intptr_t);

enum {
#define SHIM(name) ID_##name,
#include SHIM_SYMBOLS
#undef SHIM
    SHIM_COUNT,
    ID_NOOP = SHIM_COUNT, /* the shim's own cost, measured on a function that does nothing */
    SLOTS
};

static const char *const shim_names[SLOTS] = {
#define SHIM(name) #name,
#include SHIM_SYMBOLS
#undef SHIM
    "mp_shim_noop",
};

static fn6 real[SLOTS];

/* Only the measured thread's calls are timed (mp_shim_measure_this_thread; the benchmark's calling
 * thread), into plain globals that only it touches: no thread-local storage, which a dlopened
 * library reaches through __tls_get_addr, and no atomics, so that the shim adds little besides
 * its two clock reads. Other threads' calls are forwarded untimed. */
static pthread_t measured_thread;
static atomic_int have_measured;
static int depth;
static uint64_t spent_ns[SLOTS], calls[SLOTS];

/* Per function, how long each timed call took: HIST_NS-wide buckets, the last one for everything
 * longer. A mean over the calls short enough not to have been preempted is then possible, which
 * the sums alone do not allow. */
#define HIST_NS 8
#define HIST_BUCKETS 1024
static uint32_t hist[SLOTS][HIST_BUCKETS];

static clockid_t shim_clock = CLOCK_MONOTONIC;

__attribute__((constructor)) static void choose_clock(void)
{
    const char *which = getenv("MP_SHIM_CLOCK");
    if (which && strcmp(which, "thread") == 0)
        shim_clock = CLOCK_THREAD_CPUTIME_ID;
}

static inline uint64_t shim_ns(void)
{
    struct timespec t;
    clock_gettime(shim_clock, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static fn6 resolve(int id)
{
    fn6 f = real[id];
    if (!f) {
        /* RTLD_NEXT: the next definition after this object in its lookup order, which is the
         * real library's (a dependency of this object). Two threads may both look it up. */
        f = (fn6)dlsym(RTLD_NEXT, shim_names[id]);
        if (!f) {
            fprintf(stderr, "nccl_timing_shim: no real %s: %s\n", shim_names[id], dlerror());
            abort();
        }
        real[id] = f;
    }
    return f;
}

static intptr_t timed(int id, intptr_t a, intptr_t b, intptr_t c, intptr_t d, intptr_t e, intptr_t g)
{
    fn6 f = resolve(id);
    if (depth || !atomic_load_explicit(&have_measured, memory_order_relaxed) ||
        !pthread_equal(pthread_self(), measured_thread))
        return f(a, b, c, d, e, g); /* another thread's call, or one nested in a timed call */
    depth = 1;
    uint64_t t0 = shim_ns();
    intptr_t r = f(a, b, c, d, e, g);
    uint64_t dt = shim_ns() - t0;
    depth = 0;
    spent_ns[id] += dt;
    calls[id]++;
    hist[id][dt / HIST_NS < HIST_BUCKETS - 1 ? dt / HIST_NS : HIST_BUCKETS - 1]++;
    return r;
}

#define SHIM(name)                                                                                  \
    intptr_t name(intptr_t a, intptr_t b, intptr_t c, intptr_t d, intptr_t e, intptr_t g);          \
    intptr_t name(intptr_t a, intptr_t b, intptr_t c, intptr_t d, intptr_t e, intptr_t g)           \
    {                                                                                               \
        return timed(ID_##name, a, b, c, d, e, g);                                                  \
    }
#include SHIM_SYMBOLS
#undef SHIM

/* ---- read by the benchmark through ctypes --------------------------------------------------- */

int mp_shim_count(void);
int mp_shim_thread_clock(void);
const char *mp_shim_name(int id);
void mp_shim_measure_this_thread(void);
void mp_shim_read(uint64_t *ns, uint64_t *n);
int mp_shim_hist_shape(int *bucket_ns);
void mp_shim_hist(uint32_t *out);
double mp_shim_clock_ns(int samples);
double mp_shim_overhead_ns(int calls);

int mp_shim_count(void) { return SHIM_COUNT; }

int mp_shim_thread_clock(void) { return shim_clock == CLOCK_THREAD_CPUTIME_ID; }

const char *mp_shim_name(int id) { return id >= 0 && id < SHIM_COUNT ? shim_names[id] : NULL; }

/* From now on, the calling thread's calls are the ones timed. */
void mp_shim_measure_this_thread(void)
{
    measured_thread = pthread_self();
    atomic_store(&have_measured, 1);
}

/* The measured thread's time in each function and its calls so far, SHIM_COUNT of each. Call it
 * from that thread (the counters are its own, unsynchronised). */
void mp_shim_read(uint64_t *ns, uint64_t *n)
{
    memcpy(ns, spent_ns, sizeof(uint64_t) * SHIM_COUNT);
    memcpy(n, calls, sizeof(uint64_t) * SHIM_COUNT);
}

/* HIST_BUCKETS, and the width of a bucket in ns. */
int mp_shim_hist_shape(int *bucket_ns)
{
    *bucket_ns = HIST_NS;
    return HIST_BUCKETS;
}

/* The histograms of the SHIM_COUNT functions, one after the other (SHIM_COUNT x HIST_BUCKETS). */
void mp_shim_hist(uint32_t *out) { memcpy(out, hist, sizeof(uint32_t) * SHIM_COUNT * HIST_BUCKETS); }

static int by_value(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

/* What the timer itself adds to one timed call: the median of `samples` intervals between two
 * back-to-back reads of the clock, each read with the same code path as a timed call. */
double mp_shim_clock_ns(int samples)
{
    if (samples < 1 || samples > 100000)
        samples = 1001;
    uint64_t *d = malloc(sizeof *d * (size_t)samples);
    if (!d)
        return -1.0;
    for (int i = 0; i < samples; i++) {
        uint64_t t0 = shim_ns();
        d[i] = shim_ns() - t0;
    }
    qsort(d, (size_t)samples, sizeof *d, by_value);
    double median = (double)d[samples / 2];
    free(d);
    return median;
}

static intptr_t noop(intptr_t a, intptr_t b, intptr_t c, intptr_t d, intptr_t e, intptr_t g)
{
    (void)b, (void)c, (void)d, (void)e, (void)g;
    return a;
}

/* What the shim adds to the calling thread per call, all of it (the clock reads, the counters),
 * against calling the function directly: the best of 5 tries of `calls` calls each way. */
double mp_shim_overhead_ns(int calls)
{
    if (calls < 1 || calls > 10000000)
        calls = 100000;
    fn6 volatile direct = noop;
    real[ID_NOOP] = noop;
    double best = -1.0;
    for (int attempt = 0; attempt < 5; attempt++) {
        struct timespec t0, t1, t2;
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0);
        for (int i = 0; i < calls; i++)
            direct(i, 0, 0, 0, 0, 0);
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t1);
        for (int i = 0; i < calls; i++)
            timed(ID_NOOP, i, 0, 0, 0, 0, 0);
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t2);
        double plain = (double)(t1.tv_sec - t0.tv_sec) * 1e9 + (double)(t1.tv_nsec - t0.tv_nsec);
        double shimmed = (double)(t2.tv_sec - t1.tv_sec) * 1e9 + (double)(t2.tv_nsec - t1.tv_nsec);
        double per = (shimmed - plain) / calls;
        if (best < 0 || per < best)
            best = per;
    }
    return best;
}
