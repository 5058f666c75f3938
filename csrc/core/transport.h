/* The transport interface: what the bindings drive, whichever transport sits behind it.
 * A transport runs steps (groups of ops); each lane runs its steps in issue order, a step's
 * ops progress together, and the k-th send from A to B on a lane meets B's k-th receive from A. */
#ifndef MP_TRANSPORT_H
#define MP_TRANSPORT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "interrupt.h"
#include "op.h"
#include "result.h"

typedef struct mp_transport mp_transport;

/* The cause rank of an abort whose cause is outside the group (the store's host, which may be
 * no rank at all): a report then names no rank rather than the one that writes it. */
#define MP_RANK_OUTSIDE (-1)

/* What a transport can do (mp_transport_ops.caps). The layer above asks these, never a name. */
/* Its ops run in device stream order: begin() fences a call after the caller's stream, wait()
 * makes a stream wait (stream_wait) and leaves the host free, and a failed op's device work may
 * outlive it (failed_ops_running). Without it, wait() blocks the host. */
#define MP_CAP_DEVICE_STREAMS (1u << 0)
/* begin() and end() may wait for another thread's posting (a lock held across a launch): the
 * bindings then call them with the GIL released. Without it they take a few instructions. */
#define MP_CAP_BEGIN_END_MAY_WAIT (1u << 1)

typedef struct {
    const char *name; /* for messages only */
    unsigned caps;    /* MP_CAP_* */
    /* Takes ownership of `step` (from malloc); its ops are left QUEUED and reach DONE later. Fails only when
     * the communicator is aborted or closed (nothing is posted then). */
    mp_result (*post)(mp_transport *t, mp_step *step);
    /* Blocks until `op` is DONE, or `deadline` (mp_now() seconds) passes: MP_ERR_TIMEOUT, or
     * `interrupt` (may be NULL), asked at least every 50 ms, says stop: MP_ERR_INTERRUPTED, the op
     * still pending. One call is one wait: what the transport learns while blocked (a deadlock
     * search's rounds) lasts for all of it. */
    mp_result (*wait)(mp_transport *t, mp_op *op, double deadline, const mp_interrupt *interrupt);
    /* Fails every pending op here and at every peer; the first cause recorded wins, and the
     * result says whether it was this call's (false: an earlier abort's stands, and it is the one
     * the failures quote). `rank`: the group rank that caused it, or MP_RANK_OUTSIDE. `why` (may
     * be NULL): the aborting rank's reason, which the failures quote. */
    bool (*abort)(mp_transport *t, mp_result cause, int rank, const char *why);
    /* Why the communicator is unusable (MP_OK while it is usable), and which rank caused it. */
    mp_result (*abort_cause)(mp_transport *t, int *rank);
    /* One line on what is known of `op`'s peer, for timeout reports. */
    void (*describe_peer)(mp_transport *t, const mp_op *op, char *buf, size_t len);
    /* Stops progress, fails what is pending with MP_ERR_CLOSED, frees everything. */
    void (*destroy)(mp_transport *t);

    /* Optional: NULL takes the default that the mp_transport_* calls below give. */
    /* Before the steps of one call: the work posted next starts after what `stream` holds
     * (device transports; NULL on the CPU). */
    mp_result (*begin)(mp_transport *t, void *stream);
    /* After them: device transports fence the steps posted since begin(); the CPU transport
     * wakes the peers it notified, once each. */
    mp_result (*end)(mp_transport *t);
    /* Finishes the ops whose device work has completed (the CPU transport has a thread). */
    void (*progress)(mp_transport *t);
    /* Makes `stream` wait for `op` without blocking the host. */
    mp_result (*stream_wait)(mp_transport *t, mp_op *op, void *stream);
    /* A longer account of why `op` failed (a deadlock report), or "" when there is none. */
    void (*failure_report)(mp_transport *t, const mp_op *op, char *buf, size_t len);
    /* For a watchdog (device transports, whose ops no host wait may ever time): finishes what has
     * completed, and says why the communicator must be aborted: MP_ERR_TIMEOUT when device work
     * has been pending longer than `timeout` seconds, an asynchronous error's cause, or MP_OK.
     * Aborts nothing itself, so the caller can report the ops first; never waits on the peers. */
    mp_result (*watch)(mp_transport *t, double timeout, char *detail, size_t len);
    /* Whether device work of ops that failed (an abort fails them at once) may still read or write
     * their buffers, which the bindings keep alive until this says 0 (device transports). */
    int (*failed_ops_running)(mp_transport *t);
    /* Whether `peer`'s messages reach this rank with one copy (default 1: no host copy at all). */
    int (*single_copy)(mp_transport *t, int peer);
} mp_transport_ops;

struct mp_transport {
    const mp_transport_ops *ops;
    int rank;
    int size;
    int nlanes;
    /* The largest send that may complete before its receive is posted; a larger one never does.
     * shm: its eager threshold, exactly; NCCL: a bound from NCCL's parameters (nccl_buffering.c).
     * The stall analysis takes sends at or under it as buffered, so a cycle it names is certain. */
    uint64_t buffered_at_most;
};

/* The optional slots, with their defaults: the layer above calls these, never a slot itself. */
static inline unsigned mp_transport_caps(const mp_transport *t) { return t->ops->caps; }

static inline mp_result mp_transport_begin(mp_transport *t, void *stream)
{
    return t->ops->begin ? t->ops->begin(t, stream) : MP_OK;
}

static inline mp_result mp_transport_end(mp_transport *t) { return t->ops->end ? t->ops->end(t) : MP_OK; }

static inline void mp_transport_progress(mp_transport *t)
{
    if (t->ops->progress)
        t->ops->progress(t);
}

/* Only with MP_CAP_DEVICE_STREAMS; without it there is no stream to order. */
static inline mp_result mp_transport_stream_wait(mp_transport *t, mp_op *op, void *stream)
{
    return t->ops->stream_wait ? t->ops->stream_wait(t, op, stream) : MP_OK;
}

static inline void mp_transport_failure_report(mp_transport *t, const mp_op *op, char *buf, size_t len)
{
    if (len)
        buf[0] = '\0';
    if (t->ops->failure_report)
        t->ops->failure_report(t, op, buf, len);
}

static inline mp_result mp_transport_watch(mp_transport *t, double timeout, char *detail, size_t len)
{
    return t->ops->watch ? t->ops->watch(t, timeout, detail, len) : MP_OK;
}

static inline int mp_transport_failed_ops_running(mp_transport *t)
{
    return t->ops->failed_ops_running ? t->ops->failed_ops_running(t) : 0;
}

static inline int mp_transport_single_copy(mp_transport *t, int peer)
{
    return t->ops->single_copy ? t->ops->single_copy(t, peer) : 1;
}

#endif
