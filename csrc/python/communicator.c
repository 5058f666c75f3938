/* The Communicator type: its life cycle (creation's entry, abort, the watchdog's check, close,
 * dealloc) and its method table; the methods themselves live in the files of communicator.h. */
#include <stddef.h>

#include "arena_tensor.h"
#include "communicator.h"
#include <structmember.h> /* after Python.h */
#include "errors.h"

static PyObject *comm_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    return mp_comm_create(type, args, kwargs, NULL, NULL);
}

/* The cyclic GC sees what a Communicator holds: its in-flight Requests hold it back, and its hooks
 * may too (a dump that closes over it). */
static int comm_traverse(CommObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->inflight);
    Py_VISIT(self->stream_fn);
    Py_VISIT(self->on_abort);
    Py_VISIT(self->on_error);
    return 0;
}

/* Breaks a cycle through an unreachable Communicator: shutting down finishes every op, so pruning
 * empties the in-flight list (no Request is ever dropped while the transport may still use it),
 * and the hooks go. Nothing can be inside the transport: a caller there would hold a reference. */
static int comm_clear(CommObject *self)
{
    mp_comm_shutdown(self);
    Py_CLEAR(self->stream_fn);
    Py_CLEAR(self->on_abort);
    Py_CLEAR(self->on_error);
    return 0;
}

static void comm_dealloc(CommObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    if (self->weakrefs)
        PyObject_ClearWeakRefs((PyObject *)self);
    mp_comm_shutdown(self);
    Py_XDECREF(self->inflight);
    Py_XDECREF(self->backend);
    Py_XDECREF(self->stream_fn);
    Py_XDECREF(self->on_abort);
    Py_XDECREF(self->on_error);
    Py_XDECREF(self->abort_report);
    Py_XDECREF(self->group_picture);
    PyMem_Free(self->trace);
    PyMem_Free(self->global_ranks);
    PyMem_Free(self->numbers);
    PyMem_Free(self->lane_steps);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyObject *comm_abort(CommObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"rank", "reason", "peer_failed", "deadlock", NULL};
    PyObject *rank_obj = Py_None;
    const char *reason = NULL;
    int peer_failed = 0, deadlock = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|$Ozpp:abort", kwlist, &rank_obj, &reason, &peer_failed,
                                     &deadlock) ||
        mp_comm_check_owner(self) < 0)
        return NULL;
    if (peer_failed && deadlock) {
        PyErr_SetString(PyExc_ValueError, "abort(): a cause is either a failed peer or a deadlock, not both");
        return NULL;
    }
    int cause = self->group_rank;
    int overflow = 0; /* a rank past a long is no rank: mp_comm_group_rank names it below */
    int outside = rank_obj != Py_None && PyLong_Check(rank_obj) &&
                  PyLong_AsLongAndOverflow(rank_obj, &overflow) == MP_RANK_OUTSIDE && !overflow;
    if (outside && !peer_failed) {
        PyErr_SetString(PyExc_ValueError, "abort(): rank=-1 (a cause outside the group) needs peer_failed=True");
        return NULL;
    }
    if (outside)
        cause = MP_RANK_OUTSIDE;
    else if (rank_obj != Py_None && (cause = mp_comm_group_rank(self, rank_obj, "rank")) < 0)
        return NULL;
    int aborted_by;
    /* It starts here: the peers first (a deadlock's verdict, with its cycle, is published by its finder). */
    if (!peer_failed && !deadlock && cause == self->group_rank && self->transport &&
        self->transport->ops->abort_cause(self->transport, &aborted_by) == MP_OK) {
        PyObject *why = PyUnicode_FromFormat("rank %d aborted the communicator%s%s",
                                             self->global_ranks[self->group_rank], reason ? ": " : "",
                                             reason ? reason : "");
        if (!why)
            return NULL;
        mp_comm_publish_abort(self, why);
        Py_DECREF(why);
    }
    if (deadlock && reason && !self->abort_report) {
        /* The cycle's whole report, which the transport's failure detail would cut: the ops that
         * fail report it, with the ops as they stood, as after a watchdog abort. */
        PyObject *pending = mp_comm_pending_report(self);
        PyObject *report = pending ? PyUnicode_FromFormat("%s\n%U", reason, pending) : NULL;
        Py_XDECREF(pending);
        if (!report)
            return NULL;
        self->abort_report = report;
    }
    mp_comm_abort(self, peer_failed ? MP_ERR_PEER_DEAD : deadlock ? MP_ERR_DEADLOCK : MP_ERR_ABORTED, cause, reason);
    Py_RETURN_NONE;
}

/* Called by the process's watchdog thread. The check holds the GIL: it is short (the transport
 * never waits on the peers in it), and a close() meanwhile cannot free the transport. What it
 * finds is published to the peers (on_abort), then the transport is aborted. The ops run with
 * the GIL released, so one of them may meet the same failure and abort first: then its report
 * stands alone, and the watchdog's, which would say it again, is dropped. */
static PyObject *comm_watchdog_check(CommObject *self, PyObject *Py_UNUSED(ignored))
{
    mp_transport *t = self->transport;
    char detail[256] = "";
    mp_result cause = t ? mp_transport_watch(t, self->timeout, detail, sizeof detail) : MP_OK;
    if (cause == MP_OK)
        Py_RETURN_NONE;
    PyObject *report = mp_comm_pending_report(self);
    if (!report)
        return NULL;
    PyObject *msg = PyUnicode_FromFormat("rank %d: the watchdog found %s: %s; the communicator is aborted.\n%U",
                                         self->global_ranks[self->group_rank],
                                         cause == MP_ERR_TIMEOUT ? "an op past its timeout" : "an asynchronous error",
                                         detail, report);
    Py_DECREF(report);
    if (!msg)
        return NULL;
    mp_comm_publish_abort(self, msg);
    if (!mp_comm_abort(self, cause, self->group_rank, detail)) {
        Py_DECREF(msg);
        Py_RETURN_NONE;
    }
    Py_XSETREF(self->abort_report, Py_NewRef(msg));
    PyObject *exc = PyObject_CallOneArg(mp_failure_type(self->state, cause), msg);
    Py_DECREF(msg);
    return exc;
}

static PyObject *comm_close(CommObject *self, PyObject *Py_UNUSED(ignored))
{
    mp_comm_shutdown(self);
    Py_RETURN_NONE;
}

static PyObject *comm_enter(CommObject *self, PyObject *Py_UNUSED(ignored)) { return Py_NewRef(self); }

static PyObject *comm_exit(CommObject *self, PyObject *Py_UNUSED(args))
{
    mp_comm_shutdown(self);
    Py_RETURN_FALSE;
}

static PyMethodDef comm_methods[] = {
    {"exchange", (PyCFunction)(void (*)(void))mp_comm_exchange, METH_FASTCALL | METH_KEYWORDS,
     "exchange($self, /, send_next=None, recv_prev=None, send_prev=None, recv_next=None, *, mode='parity', "
     "prev_rank=None, next_rank=None, call=None)\n--\n\nPosts one pipeline exchange in one call and returns a dict of Requests, "
     "one per posted op, keyed by op name. mode='parity' issues the ops one by one in Megatron's "
     "parity order; 'batched' issues each lane's ops as one group. prev_rank / next_rank (global ranks) "
     "override the ring neighbours. call names the API call for reports and the flight recorder."},
    {"isend", (PyCFunction)(void (*)(void))mp_comm_isend, METH_VARARGS | METH_KEYWORDS,
     "isend($self, /, tensor, peer, *, call=None)\n--\n\nReturns the Request of a send to global rank `peer` on lane 0, after every op issued before."},
    {"irecv", (PyCFunction)(void (*)(void))mp_comm_irecv, METH_VARARGS | METH_KEYWORDS,
     "irecv($self, /, tensor, peer, *, call=None)\n--\n\nReturns the Request of a receive from global rank `peer` on lane 0, after every op issued before."},
    {"batch", (PyCFunction)(void (*)(void))mp_comm_batch, METH_VARARGS | METH_KEYWORDS,
     "batch($self, /, ops, *, lane=0, call=None)\n--\n\nPosts (is_send, tensor, peer) ops as one group on "
     "`lane`, after every op issued before on it, and returns their Requests in a list."},
    {"abort", (PyCFunction)(void (*)(void))comm_abort, METH_VARARGS | METH_KEYWORDS,
     "abort($self, /, *, rank=None, reason=None, peer_failed=False, deadlock=False)\n--\n\nFails every pending op here "
     "and at every peer (an abort that starts here is published to the peers first). Idempotent. rank: the global "
     "rank whose failure this abort passes on (default: this one; -1, with peer_failed: a cause outside the group, "
     "such as the store's host, so that reports name no rank), which reports name as the cause; reason: why, "
     "quoted by the failures it causes; peer_failed: the cause is that rank's process (or the store's host) gone, "
     "so the failures are PeerFailureError rather than P2PError; deadlock: the cause is a wait-for cycle this rank "
     "is in, so its failures here are DeadlockError."},
    {"close", (PyCFunction)comm_close, METH_NOARGS,
     "close($self, /)\n--\n\nStops the transport and releases its resources; ops still pending fail (and abort the peers). Idempotent."},
    {"stats", (PyCFunction)mp_comm_stats, METH_NOARGS,
     "stats($self, /)\n--\n\nA dict: messages and bytes posted, and seconds spent in wait(); shm also counts the messages received by each path: "
     "inline (in the descriptor), single_copy (process_vm_readv by the receiver), bounce (two copies through the "
     "segment) and arena (written into the receive buffer by the sender)."},
    {"empty", (PyCFunction)(void (*)(void))mp_comm_empty, METH_VARARGS | METH_KEYWORDS,
     "empty($self, /, shape, dtype)\n--\n\nAn uninitialised receive buffer (a Tensor). On shm it lies in this rank's "
     "arena, which its peers have mapped, so a send into it is one copy by the sender; it falls back "
     "to plain memory (logged once) when the arena is full. On nccl, torch.empty on the device."},
    {"recent_ops", (PyCFunction)mp_comm_recent_ops, METH_NOARGS,
     "recent_ops($self, /)\n--\n\nA list of dicts: the last ops this rank posted (up to 1024), oldest first: kind, label, peer "
     "(global rank), nbytes, dtype, lane, step (per lane), seq (per pair and lane), group_size, call (the k-th "
     "API call), call_name, state (posted, matched, completed or failed), error ('' or the failure class), "
     "t_posted and t_completed (wall-clock seconds; None while pending) and waited (wait() was called)."},
    {"watchdog_check", (PyCFunction)comm_watchdog_check, METH_NOARGS,
     "watchdog_check($self, /)\n--\n\nAn exception or None. For the process's watchdog (megatron_p2p._watchdog). NCCL: finishes "
     "the ops whose device work has completed; when device work has been pending longer than the timeout, or "
     "NCCL reports an asynchronous error, aborts the lane communicators and returns the exception (not raised) "
     "whose report the next call on this communicator raises. Always None on shm, whose waits time themselves."},
    {"check_tensor", (PyCFunction)mp_comm_check_tensor, METH_VARARGS,
     "check_tensor($self, tensor, name='tensor', /)\n--\n\nRaises the TypeError or ValueError that posting `tensor` on "
     "this communicator would raise, naming it `name`; posts nothing."},
    {"single_copy", (PyCFunction)mp_comm_single_copy, METH_O,
     "single_copy($self, peer, /)\n--\n\nWhether large messages from `peer` arrive with one copy (CMA)."},
    {"__enter__", (PyCFunction)comm_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)comm_exit, METH_VARARGS, NULL},
    {NULL},
};

static PyMemberDef comm_members[] = {
    {"__weaklistoffset__", T_PYSSIZET, offsetof(CommObject, weakrefs), READONLY, NULL},
    {NULL},
};

static PyType_Slot comm_slots[] = {
    {Py_tp_new, comm_new},
    {Py_tp_members, comm_members},
    {Py_tp_dealloc, comm_dealloc},
    {Py_tp_traverse, comm_traverse},
    {Py_tp_clear, comm_clear},
    {Py_tp_methods, comm_methods},
    {Py_tp_getset, mp_comm_getset},
    {Py_tp_doc, "Communicator(backend, unique_id, group_rank, ranks, *, lanes=2, eager_threshold=0, timeout=300.0, "
                "single_copy=True, device=-1, stream=None, high_priority=False, on_abort=None, check=False, pids=None, "
                "peer_failed=None, arena_bytes=0)\n--\n\nLow-level constructor, collective over the group; use "
                "megatron_p2p.init_communicator()."},
    {0, NULL},
};

PyType_Spec mp_communicator_spec = {
    .name = "megatron_p2p._C.Communicator",
    .basicsize = sizeof(CommObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .slots = comm_slots,
};
