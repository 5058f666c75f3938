/* The model of libnccl, part 3: groups (ncclGroupStart/End, ncclSend/Recv), their launch and
 * the connections a launch makes, and a nonblocking group's thread; libnccl.c says what the model
 * promises. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "nccl_model.h"

/* Each thread's group, as NCCL keeps it (src/group.cc: thread-local ncclGroupDepth and tasks). */
static _Thread_local int group_depth;
static _Thread_local op_t *group_ops;
static _Thread_local int group_nops;
static _Thread_local ncclResult_t group_error;

/* ---- groups ----------------------------------------------------------------------------------- */

int in_group(void) { return group_depth > 0; }

API ncclResult_t ncclGroupStart(void)
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
int connected_to(comm_t *c, int peer)
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

static _Atomic long group_threads;

/* For tests and benchmarks: the group threads this process has started. */
API long mpfake_nccl_group_threads(void) { return atomic_load(&group_threads); }


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
void complete_job(comm_t *c)
{
    pthread_mutex_lock(&lib_lock);
    group_job *j = c->job;
    c->job = NULL;
    pthread_mutex_unlock(&lib_lock);
    if (!j)
        return;
    /* MPFAKE_NCCL_JOIN_US stands for what joining NCCL's group thread costs inside the poll
     * (52-102 us measured on a 2-core machine), the window in which a second poller races it. */
    long join_us = env_long("MPFAKE_NCCL_JOIN_US", 0);
    if (join_us > 0)
        usleep((useconds_t)join_us);
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

API ncclResult_t ncclGroupEnd(void)
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

API ncclResult_t ncclSend(const void *buf, size_t count, int type, int peer, comm_t *comm, CUstream stream)
{
    enter_call(comm, 1);
    ncclResult_t r = post_op(1, buf, count, type, peer, comm, stream);
    enter_call(comm, -1);
    return r;
}

API ncclResult_t ncclRecv(void *buf, size_t count, int type, int peer, comm_t *comm, CUstream stream)
{
    enter_call(comm, 1);
    ncclResult_t r = post_op(0, buf, count, type, peer, comm, stream);
    enter_call(comm, -1);
    return r;
}
