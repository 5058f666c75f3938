/* The NCCL transport's state, and the calls between its files: nccl_lifecycle.c (context, open,
 * abort, destroy, the vtable), nccl_post.c (begin, post, end) and nccl_complete.c (events,
 * progress, waits). Only the files of csrc/nccl/ include it. */
#ifndef MP_NCCL_INTERNAL_H
#define MP_NCCL_INTERNAL_H

#include <pthread.h>
#include <stddef.h>

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

/* Each lane has a nonblocking communicator made at creation, whose init and warm-up any abort,
 * timeout or Ctrl-C can end, and where NCCL has ncclCommSplit, a blocking child of it for the data:
 * NCCL launches a blocking communicator's group on the caller's thread, where a nonblocking one
 * starts a thread per group end (NCCL 2.30: src/group.cc ncclGroupEndInternal). The child shares
 * the parent's abort flag and connections (splitShare; src/init.cc ncclCommInitChildComm,
 * src/channel.cc initChannel), so the parent's abort ends a launch of the child stuck connecting
 * to a peer, and the parent's warm-up connects the child. */
typedef struct {
    mp_ncclComm_t comm;      /* the data's: the child, or the parent itself; NULL once aborted */
    mp_ncclComm_t root;      /* the parent, when `comm` is its child; else NULL */
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
    /* The capture of the caller's stream at begin(), 0 when none: what end() fences belongs to it.
     * Only posting reads it; every other call asks the stream it is given. */
    unsigned long long open_capture;
    struct nccl_reaper *reaper; /* runs ncclCommAbort once the transport is aborted (nccl_reaper.c) */
    /* `issue` orders the posting calls of threads sharing the communicator; `lock` guards the
     * state and every call on a lane communicator, and is dropped while a launch settles, so
     * that an abort from the relay or the watchdog reaches a group stuck in ncclInProgress. */
    pthread_mutex_t issue;
    pthread_mutex_t lock;
    /* A group being launched by the posting thread, which holds `issue` but not `lock` meanwhile
     * (a blocking launch may wait for a peer to connect): the watchdog times it, and the reaper
     * aborts the lane communicators only once it has returned, since NCCL's abort needs no other
     * thread inside a call on the communicator (user guide, "Fault Tolerance"). Under `lock`. */
    int launching;
    int launch_lane;
    double launch_began;
    pthread_cond_t launched;
    mp_step *retired;        /* steps an abort failed while the launch read them: freed when it returns */
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
void nccl_abort_locked(nccl_t *n, mp_result cause, int rank, const char *detail);
mp_result nccl_fail_cuda(nccl_t *n, const char *what, mp_CUresult r);

/* nccl_reaper.c: ncclCommAbort on a thread of its own, which may outlive the transport */
void nccl_reap_start(nccl_t *n);
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

/* nccl_complete.c */
void nccl_finish_steps(mp_step *s, mp_result r, const char *detail); /* finishes their ops, frees them */
void nccl_finish_ops(mp_step *s, mp_result r, const char *detail);
void nccl_free_steps(mp_step *s);
mp_ncclResult_t nccl_settle(nccl_t *n, mp_ncclComm_t comm, double deadline, int watch_abort);
void nccl_progress_locked(nccl_t *n);
void nccl_check_async_locked(nccl_t *n);
mp_result nccl_await_event_locked(nccl_t *n, mp_CUevent event, double deadline, char *detail, size_t len);
void nccl_progress(mp_transport *t);
mp_result nccl_wait(mp_transport *t, mp_op *op, double deadline, const mp_interrupt *interrupt);
mp_result nccl_watch(mp_transport *t, double timeout, char *detail, size_t len);
void nccl_describe_peer(mp_transport *t, const mp_op *op, char *buf, size_t len);

#endif
