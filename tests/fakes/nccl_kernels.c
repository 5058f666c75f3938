/* The model of libnccl, part 2: kernels. A group's ops of one communicator on one stream run as
 * one "kernel" on the fake driver's stream thread (tests/fakes/libcuda.c), moving bytes through
 * the communicator's shared segment; libnccl.c says what the model promises. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nccl_model.h"

/* ---- kernels --------------------------------------------------------------------------------- */

static channel *chan(comm_t *c, int src, int dst) { return &c->seg->ch[src * c->nranks + dst]; }

/* A kernel that can no longer progress: it stalls, as a GPU kernel would, until aborted. */
static int stalled(comm_t *c)
{
    return atomic_load(&c->seg->error) || atomic_load(&c->conns->injected);
}

/* An injected error is logged before it is raised: NCCL's failure is warned where it happens and
 * only then returned up to where it is stored (src/proxy.cc: ncclProxyProgress stores progressOps'
 * result into asyncResult after it returns), so whoever reads the error finds its warning as the
 * last error. */
static void count_done(comm_t *c)
{
    long done = atomic_fetch_add(&c->conns->ops_done, 1) + 1;
    if (c->f.async_error_after < 0 || done < c->f.async_error_after || atomic_exchange(&c->conns->inject_claimed, 1))
        return;
    if (!c->f.async_error_quiet)
        log_warning("injected asynchronous error %d after %ld ops on rank %d", c->f.async_error_code, done,
                    c->rank);
    atomic_store(&c->conns->injected, 1);
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

/* Receives that wrote into their buffer after their communicator was aborted: the hazard that a
 * caller who frees a failed op's buffer at the abort meets (a test asserts the package still held
 * the buffer then). */
static _Atomic long writes_after_abort;
API long mpfake_nccl_writes_after_abort(void) { return atomic_load(&writes_after_abort); }

/* Runs the kernel's ops together until all are done, or until the communicator is aborted while
 * none can move. NCCL's kernel reads the abort flag only while it waits: ncclKernelMain clears
 * ncclShmem.aborted as it starts and never reads the flag there (src/device/common.h), and the
 * primitives poll it in their wait loops only (src/device/primitives.h checkAbort, called from
 * src/device/prims_simple.h waitPeer). So a kernel that starts after the abort, or is running at
 * it, still moves the data that is ready: a receive whose bytes are buffered writes its buffer. */
static void run_ops(const task_t *t)
{
    comm_t *c = t->comm;
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
    for (unsigned spins = 0; left > 0; spins++) {
        int moved = 0;
        for (int i = 0; i < t->nops && !stalled(c); i++) {
            const op_t *o = &t->ops[i];
            op_run *st = &run[i];
            if (st->done || st->silent)
                continue;
            size_t before = st->progress;
            int before_flags = st->flag + 2 * st->announced;
            int done = o->send ? send_step(c, o, st) : recv_step(c, o, st);
            if (done) {
                st->done = 1;
                left--;
                count_done(c);
            }
            if (!o->send && (done || st->progress != before) && atomic_load(c->abort_flag))
                atomic_fetch_add(&writes_after_abort, 1);
            moved |= st->done || st->progress != before || st->flag + 2 * st->announced != before_flags;
        }
        if (moved)
            spins = 0;
        else if (atomic_load(c->abort_flag))
            break; /* waiting, where NCCL reads the flag */
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

/* Hands one kernel to its stream (the driver owns it from there). A captured one holds a
 * reference on its communicator until its graph is gone; an uncaptured one takes its place in
 * the device's launch order, if ordered. */
CUresult enqueue_task(task_t *t, CUstream stream)
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
