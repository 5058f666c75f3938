/* A session: a Communicator's state and its in-flight Requests, and what both the posting calls
 * and the Requests do with them (enter and leave the transport, prune, report, abort, hand errors
 * to the hooks). Below communicator*.c and request.c, which both use it; it calls neither. */
#ifndef MP_SESSION_H
#define MP_SESSION_H

#include <sys/types.h>

#include "bindings.h"
#include "core/numbering.h"
#include "core/trace.h"
#include "core/transport.h"

typedef struct {
    PyObject_HEAD
    mp_transport *transport; /* NULL once closed */
    /* Transport calls running with the GIL released (posts, waits). A close meanwhile, from
     * another thread or from a signal handler that a wait runs, aborts the transport and leaves
     * it in `closing` for the last of them to destroy. */
    int busy;
    mp_transport *closing;
    /* The process that created it. A fork child inherits the object but not the transport: its
     * threads, locks and shared memory are the parent's (docs/api.md, "Fork"). */
    pid_t owner;
    int forked;              /* set in a fork child: the transport is forgotten, never touched */
    int group_rank;
    int size;
    int nlanes;
    int *global_ranks;       /* group rank -> global rank */
    double timeout;
    uint64_t eager_threshold;
    uint64_t buffered_at_most; /* the transport's (transport.h), kept past close */
    mp_channel_numbers *numbers; /* [lane][peer] (core/numbering.h): the ops issued so far */
    uint64_t *lane_steps;    /* [lane] */
    PyObject *inflight;      /* list of Requests the transport may still touch */
    PyObject *backend;       /* str */
    int device;              /* CUDA ordinal of the tensors it carries; -1: CPU memory */
    int check;               /* debug matching: ops carry their tensor's shape */
    PyObject *stream_fn;     /* device transports: () -> the caller's current stream, as an int */
    PyObject *on_abort;      /* called with a message when this rank aborts the communicator */
    PyObject *on_error;      /* called with each P2PError about to be raised (the flight recorder dumps) */
    PyObject *abort_report;  /* str: what the watchdog found when it aborted the communicator, or NULL */
    PyObject *group_picture; /* str: what the stalled ranks published (NCCL's stall analysis), or NULL */
    mp_trace *trace;
    uint64_t calls;          /* API calls that posted ops: exchange, isend, irecv, batch */
    char id[20];             /* the same on every rank of this communicator: hex of its unique id */
    uint64_t sends, recvs, bytes_sent, bytes_received;
    double wait_seconds;
    int host_waits;          /* threads blocked in a host wait (synchronize) on it now; under the GIL */
    mp_state *state;
    PyObject *weakrefs;
} CommObject;

typedef struct {
    PyObject_HEAD
    CommObject *comm;  /* strong */
    PyObject *tensor;  /* strong: what the caller passed */
    PyObject *storage; /* strong: the memory itself, which outlives a `tensor.data = ...` swap */
    mp_op op;
} RequestObject;

/* Around a transport call made with the GIL released: returns the transport to call (NULL once
 * closed and destroyed), and ends the call, destroying the transport if it was closed meanwhile
 * and this was the last call inside it. */
mp_transport *mp_comm_enter(CommObject *comm);
void mp_comm_leave(CommObject *comm);
/* Stops the transport (close, dealloc); it finishes every op still pending (as closed), so no
 * Request is left pointing into a dead transport. */
void mp_comm_shutdown(CommObject *comm);
/* In a fork child: forgets the transport without touching it (its memory here is a copy of the
 * parent's, whose locks may be held by threads that do not exist here); every later call raises. */
void mp_comm_disown(CommObject *comm);
/* 0 in the process that created the communicator; else -1 with the P2PError that says so. */
int mp_comm_check_owner(CommObject *comm);
/* Drops the finished Requests from the in-flight list, recording their results in the trace. */
void mp_comm_prune(CommObject *comm);
/* The pending-op report used by timeouts and aborts. */
PyObject *mp_comm_pending_report(CommObject *comm);
/* 0 while the communicator is open and not aborted; else -1 with the exception that says why. */
int mp_comm_check_usable(CommObject *comm);
/* The group rank of global rank `peer_obj`; -1 with TypeError or ValueError naming `what`. */
int mp_comm_group_rank(CommObject *comm, PyObject *peer_obj, const char *what);
/* The caller's current stream on the communicator's device (NULL on the CPU transport). */
int mp_comm_stream(CommObject *comm, void **stream);
/* Hands the exception being raised to the communicator's on_error hook, if any. */
void mp_comm_error_hook(CommObject *comm);
/* Marks the op's flight-recorder entry as waited on. */
void mp_comm_trace_waited(CommObject *comm, const mp_op *op);
/* Tells the other ranks (on_abort) that this rank aborted, and why. */
void mp_comm_publish_abort(CommObject *comm, PyObject *message);
/* Aborts the transport (nothing once closed), the GIL released. */
bool mp_comm_abort(CommObject *comm, mp_result cause, int rank, const char *why);
/* Tells the other ranks (on_abort), then aborts after a local timeout. */
void mp_comm_abort_for_timeout(CommObject *comm, PyObject *message);

#endif
