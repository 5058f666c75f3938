/* The model of libnccl (tests/fakes/libnccl.c, nccl_kernels.c, nccl_groups.c): the types and
 * calls its files share. Only they include it. The library exports NCCL's API and the model's
 * counters (API); everything else stays inside it (built with -fvisibility=hidden). */
#ifndef MPFAKE_NCCL_MODEL_H
#define MPFAKE_NCCL_MODEL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "mpfake.h"

#define API __attribute__((visibility("default")))

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

/* One rank's part of a window registered collectively (nccl_rma.c): the memory its peers map. */
#define MAX_WINDOWS 32
typedef struct {
    int32_t pid, fd;           /* the ncclMemAlloc memfd, as /proc/pid/fd/fd */
    uint64_t offset, size;     /* of the window in it */
} window_part;

/* A registration's two barriers: a bit per rank that has published its part, then mapped all. */
typedef struct {
    _Atomic uint64_t published, mapped;
} window_barriers;

typedef struct {
    _Atomic int nranks;
    _Atomic uint64_t joined;   /* bit per rank */
    _Atomic int attached;
    _Atomic int error_claimed; /* by the rank that writes error_text */
    _Atomic int error;         /* the first mismatch: an async error on every rank */
    char error_text[256];
    _Atomic int connecting[MAX_RANKS][MAX_RANKS]; /* [a][b]: a has reached its connect to b */
    /* One-sided RMA (nccl_rma.c). */
    _Atomic uint64_t rma_arrived;  /* bit per rank that made its first RMA call (implicitly collective) */
    _Atomic uint64_t signals[MAX_RANKS][MAX_RANKS]; /* [receiver][sender]: the sender's last signal */
    window_part windows[MAX_WINDOWS][MAX_RANKS];    /* [k-th registration][rank] */
    window_barriers window_barriers[MAX_WINDOWS];
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
    /* Its own config's splitShare (NCCL_COMM_SPLIT_SHARE_RESOURCES overriding it): whether ITS
     * children share its resources. NCCL reads it from the parent, never from the child's config
     * (src/init.cc: ncclCommInitChildComm, comm->shareResources = ... comm->config.splitShare). */
    int split_share;
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
    /* Threads inside a call on it, or on a communicator sharing its resources, now: kept by
     * `conns`, since NCCL forbids calls on one communicator in parallel, and on a parent and a
     * child that share resources in parallel (user guide, usage/threadsafety.rst). */
    _Atomic int in_call;
    /* The fault options count the ops of a communicator and of the children sharing its resources
     * together (kept by `conns`), so that a count means the same with or without a split. */
    _Atomic int inject_claimed; /* the op that raises the injected error has been chosen */
    _Atomic int injected;      /* an injected async error, once raised */
    _Atomic long ops_done;
    long ops_issued;           /* ops whose kernel has started, under lib_lock, as the two below */
    long groups;
    uint64_t send_seq[MAX_RANKS], recv_seq[MAX_RANKS]; /* numbered, per peer */
    _Atomic uint64_t sends_done[MAX_RANKS], recvs_done[MAX_RANKS];
    struct group_job *job;     /* the nonblocking group whose thread it has not joined yet (lib_lock) */
    _Atomic long persistent_refs; /* captured kernels whose graph still lives */
    faults f;
    /* One-sided RMA (nccl_rma.c), under the rule of one thread per call. */
    int rma_joined;            /* made its first RMA call */
    int windows;               /* collective registrations made */
    struct ncclWindow_vidmem *live_windows;
    uint64_t signals_sent[MAX_RANKS];  /* per peer */
    uint64_t signals_waited[MAX_RANKS]; /* per peer: what this rank's waits have asked for in all */
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

struct launch_order {
    CUcontext ctx;
    uint64_t issued;           /* order_lock */
    _Atomic uint64_t released; /* tickets whose successor may start */
};

typedef struct group_job {
    launch_t *l;
    int delay_ms;              /* injected, before the launch */
    pthread_t thread;
    _Atomic int aborted, joined, refs;
    int ncomms;
    comm_t **comms;
} group_job;

/* NCCL's value for a parameter or config field nothing set (src/init.cc), and a parameter's
 * cache before its first read. */
#define CONFIG_UNDEF_INT (-2147483647 - 1)
#define PARAM_UNREAD (-0x7fffffffffffffffLL - 1)

/* libnccl.c: the process-wide lock, the last error, and what every part uses */
extern pthread_mutex_t lib_lock;
void log_warning(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void sleep_ms(double ms);
void pause_for(unsigned spins);
int random_below(int n);
void log_line(const char *what, int ms);
size_t type_size(int type);
const char *type_name(int type);
void enter_call(comm_t *c, int by);
long env_long(const char *name, long fallback); /* an MPFAKE_ option, or `fallback` */
ncclResult_t usable(comm_t *c, const char *call);
/* An NCCL_ parameter, read once per process into *cache; CONFIG_UNDEF_INT when unset. */
long long nccl_param(const char *name, long long *cache);

/* nccl_kernels.c: a group's kernels on the fake driver's streams */
/* Enqueues the task's kernel on `stream` (the driver owns `t` from then on). */
CUresult enqueue_task(task_t *t, CUstream stream);

/* nccl_groups.c: groups, their launch and connections, a nonblocking group's thread */
void complete_job(comm_t *c);
int in_group(void); /* the calling thread is between ncclGroupStart and ncclGroupEnd */
int connected_to(comm_t *c, int peer);

#endif
