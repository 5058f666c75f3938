/* The NCCL transport's state, and the calls between its files: nccl_lifecycle.c (context, open,
 * abort, destroy, the vtable), nccl_post.c (begin, post, end) and nccl_complete.c (events,
 * progress, waits). Only the files of csrc/nccl/ include it. */
#ifndef MP_NCCL_INTERNAL_H
#define MP_NCCL_INTERNAL_H

#include <pthread.h>
#include <stddef.h>

#include "core/plan.h"
#include "match_check.h"
#include "nccl_transport.h"

/* The NCCL transport. Ops complete through CUDA events: end() records one event per lane
 * after the steps posted since begin(), and progress() finishes the ops of every event that has
 * fired, in order. Host waits poll those events and ncclCommGetAsyncError against a deadline,
 * because NCCL itself never times out. */

typedef struct fence {
    mp_CUevent event;
    unsigned long long capture; /* the id of the capture that recorded it, 0 for an eager one */
    double recorded;         /* mp_now() at end(): the watchdog's clock for its steps */
    mp_step *steps;          /* the steps this event completes, in issue order */
    struct fence *next;
} fence;

/* Each lane is one nonblocking NCCL communicator, made, warmed up and used for the data: NCCL's
 * documented way to abort is a nonblocking communicator with no other thread inside a call on it
 * (user guide, usage/communicators.rst "Fault Tolerance"; usage/threadsafety.rst). So every call
 * into it is made under the transport's `lock`, each one returns at once (a nonblocking group end
 * hands the launch to a thread of NCCL's own, src/group.cc ncclGroupEndInternal), and whatever
 * waits (a launch connecting to a peer, a full proxy pool) waits on NCCL's thread, which the
 * abort flag ends or the reaper leaves behind: never on a thread of the caller's. */
typedef struct {
    mp_ncclComm_t comm;      /* NULL once an abort has taken it */
    mp_CUstream stream;
    mp_step *open_head, *open_tail; /* issued since begin(), not yet fenced */
    fence *head, *tail;      /* fenced, oldest first: events on one stream fire in order */
    int unfenced_failed;     /* an abort failed steps issued here before they were fenced (nccl_drain.c) */
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
    lane_t lanes[MP_MAX_LANES];
    fence *spare;            /* recycled fences, each with its event */
    fence *draining;         /* fences of steps an abort failed, until their kernels are over (nccl_drain.c) */
    /* Fences recorded during a CUDA graph capture, never queried: ordering inside the capture
     * only, recycled once it has ended (nccl_post.c recycle_graph_fences). */
    fence *graph_fences;
    /* The capture of the caller's stream at begin(), 0 when none: what end() fences belongs to it.
     * Only posting reads it; every other call asks the stream it is given. */
    unsigned long long open_capture;
    struct nccl_reaper *reaper; /* runs ncclCommAbort once the transport is aborted (nccl_reaper.c) */
    /* `issue` orders the posting calls of threads sharing the communicator; `lock` guards the
     * state and every NCCL call on the lane communicators, and is dropped between the polls of a
     * launch settling, so that an abort, the watchdog and progress never wait behind it. */
    pthread_mutex_t issue;
    pthread_mutex_t lock;
    /* A group the posting thread is settling (it holds `issue`): the watchdog times it like device
     * work. Under `lock`. */
    int launching;
    int launch_lane;
    double launch_began;
    mp_result cause;
    int cause_rank;
    char cause_detail[MP_DETAIL_LEN];
    int *global_ranks; /* the group's: every report names a rank by its global rank */
    /* Debug matching: descriptors out (the first `check_slots`) and in (the next), in pinned
     * host memory and on the device, and the event a step's descriptors are waited on with. */
    int check;
    mp_check_desc *check_host;
    mp_CUdeviceptr check_dev;
    int check_slots;
    mp_CUevent check_done;
} nccl_t;

#define ENTER_FAILED "making the CUDA device's primary context current failed"

/* nccl_lifecycle.c */
#define NCCL_ABORT_BOUND 0.5 /* seconds a destroy waits for ncclCommAbort before leaving it running */
const char *nccl_cu_error(nccl_t *n, mp_CUresult r);
typedef struct {
    char text[MP_DETAIL_LEN];
} nccl_why;
/* An NCCL result as a report's words (nccl_lifecycle.c). */
nccl_why nccl_error(nccl_t *n, mp_ncclComm_t comm, mp_ncclResult_t r);
mp_CUresult nccl_enter(nccl_t *n, mp_CUcontext *saved);
void nccl_leave(nccl_t *n, mp_CUcontext saved);
mp_result nccl_cause_of(mp_ncclResult_t r);
/* Records the first cause and fails every op; false when an abort came first (nothing changes). */
bool nccl_abort_locked(nccl_t *n, mp_result cause, int rank, const char *detail);
mp_result nccl_fail_cuda(nccl_t *n, const char *what, mp_CUresult r);

/* nccl_reaper.c: ncclCommAbort on a thread of its own, which may outlive the transport */
void nccl_reap_start(nccl_t *n);
int nccl_reap_done(nccl_t *n); /* every ncclCommAbort has returned; lock held */
void nccl_reap_finish(nccl_t *n);
void nccl_release(nccl_t *n);

/* nccl_lifecycle.c: event queries in relaxed capture mode */
typedef struct {
    int mode;
    int exchanged;
} nccl_relaxed;
nccl_relaxed nccl_relax(nccl_t *n);
void nccl_unrelax(nccl_t *n, nccl_relaxed saved);

/* nccl_post.c: the vtable's posting entries */
mp_result nccl_begin(mp_transport *t, void *stream);
mp_result nccl_post(mp_transport *t, mp_step *step);
mp_result nccl_end(mp_transport *t);
mp_result nccl_stream_wait(mp_transport *t, mp_op *op, void *stream);
fence *nccl_fence_take(nccl_t *n, mp_CUresult *r); /* a spare fence, or a new one; lock held */

/* nccl_drain.c: the device work of failed ops */
void nccl_drain_fence(nccl_t *n, fence *f);
int nccl_failed_ops_running(mp_transport *t);

/* nccl_complete.c */
void nccl_finish_steps(mp_step *s, mp_result r, const char *detail); /* finishes their ops, frees them */
void nccl_finish_ops(mp_step *s, mp_result r, const char *detail);
void nccl_free_steps(mp_step *s);
mp_ncclResult_t nccl_settle_locked(nccl_t *n, int lane, double deadline);
void nccl_launch_overdue(const nccl_t *n, double now, double timeout, char *detail, size_t len);
void nccl_progress_locked(nccl_t *n);
void nccl_check_async_locked(nccl_t *n);
mp_result nccl_await_event_locked(nccl_t *n, mp_CUevent event, double deadline, char *detail, size_t len);
void nccl_progress(mp_transport *t);
mp_result nccl_wait(mp_transport *t, mp_op *op, double deadline, const mp_interrupt *interrupt);
mp_result nccl_watch(mp_transport *t, double timeout, char *detail, size_t len);
void nccl_describe_peer(mp_transport *t, const mp_op *op, char *buf, size_t len);

#endif
