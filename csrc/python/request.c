/* Request: one posted op. It keeps its tensor (and so the buffer the transport uses) alive; the
 * communicator keeps the Request alive until the transport is done with it, so dropping a
 * Request cancels nothing. */
#include <string.h>

#include "request.h"

#include "core/clock.h"
#include "core/dtype.h"
#include "core/plan.h"
#include "core/shape.h"
#include "errors.h"

RequestObject *mp_request_new(CommObject *comm, PyObject *tensor, const mp_buffer *buf)
{
    /* Megatron's deallocate_output_tensor swaps `out.data` while its send may be in flight
     * (Megatron-LM PR #4047): holding the storage keeps the bytes being sent alive. */
    PyObject *storage = mp_tensor_attr_get(comm->state, tensor, MP_ATTR_UNTYPED_STORAGE);
    if (!storage)
        return NULL;
    RequestObject *req = PyObject_GC_New(RequestObject, comm->state->RequestType);
    if (!req) {
        Py_DECREF(storage);
        return NULL;
    }
    req->storage = storage;
    memset(&req->op, 0, sizeof req->op);
    req->op.ndim = -1;
    Py_INCREF(comm);
    req->comm = comm;
    Py_INCREF(tensor);
    req->tensor = tensor;
    req->op.buf = buf->ptr;
    req->op.nbytes = buf->nbytes;
    req->op.dtype = buf->dtype;
    PyObject_GC_Track(req);
    return req;
}

/* No tp_clear: a Request's tensor must outlive its op, so the Communicator breaks their cycle. */
static int request_traverse(RequestObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->comm);
    Py_VISIT(self->tensor);
    Py_VISIT(self->storage);
    return 0;
}

static void request_dealloc(RequestObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    Py_XDECREF(self->tensor);
    Py_XDECREF(self->storage);
    Py_XDECREF(self->comm);
    PyObject_GC_Del(self);
    Py_DECREF(tp);
}

/* Raises the exception that describes a finished op's failure. */
static void raise_op_failure(CommObject *comm, const mp_op *op)
{
    const char *peer_dir = op->kind == MP_SEND ? "to" : "from";
    /* The shape where it was read (debug matching), and the API call that posted the op (a
     * megatron-core method, say), as the deadlock reports name it. */
    char shape[80] = "", posted_by[MP_CALL_NAME_LEN + 16] = "";
    if (op->ndim >= 0) {
        char dims[64];
        mp_format_shape(op->ndim, op->shape, dims, sizeof dims);
        snprintf(shape, sizeof shape, " in shape %s", dims);
    }
    if (op->call_name[0])
        snprintf(posted_by, sizeof posted_by, ", posted by %s", op->call_name);
    PyObject *msg = PyUnicode_FromFormat("rank %d: %s %s rank %d (%llu bytes of %s%s, lane %d, message #%llu%s) failed: %s",
                                         comm->global_ranks[comm->group_rank], mp_label_name(op->label), peer_dir,
                                         op->peer_global, (unsigned long long)op->nbytes, mp_dtype_name(op->dtype),
                                         shape, op->lane, (unsigned long long)op->seq, posted_by, op->detail);
    if (!msg)
        return;
    mp_transport *t = comm->transport;
    char cycle[8192] = "";
    if (t && (op->result == MP_ERR_DEADLOCK || op->result == MP_ERR_ABORTED))
        mp_transport_failure_report(t, op, cycle, sizeof cycle);
    if (cycle[0]) {
        PyObject *joined = PyUnicode_FromFormat("%U\n%s", msg, cycle);
        Py_SETREF(msg, joined);
        if (!msg)
            return;
    }
    if (op->result == MP_ERR_TIMEOUT || op->result == MP_ERR_PEER_DEAD || op->result == MP_ERR_ABORTED ||
        op->result == MP_ERR_DEADLOCK) {
        /* After a watchdog abort, its report: the ops as they stood, before the abort failed them. */
        PyObject *report = comm->abort_report ? Py_NewRef(comm->abort_report) : mp_comm_pending_report(comm);
        if (report) {
            PyObject *joined = PyUnicode_FromFormat("%U\n%U", msg, report);
            Py_DECREF(report);
            Py_SETREF(msg, joined);
        }
        if (!msg)
            return;
    }
    PyErr_SetObject(mp_failure_type(comm->state, op->result), msg);
    Py_DECREF(msg);
    mp_comm_error_hook(comm);
}

/* Blocks (GIL released) until the request's op is done, then raises its failure if any. */
static int request_complete(RequestObject *req, double timeout)
{
    CommObject *comm = req->comm;
    mp_op *op = &req->op;
    mp_comm_trace_waited(comm, op);
    if (!mp_op_done(op)) {
        if (timeout < 0)
            timeout = comm->timeout;
        double start = mp_now(), deadline = start + timeout;
        mp_transport *t = mp_comm_enter(comm); /* non-NULL while the op is pending: destroying finishes it */
        mp_result r = MP_OK;
        if (t) {
            /* Python's signal handlers run while it blocks (a SIGUSR1 trace dump, Ctrl-C); an
             * exception from one leaves the op pending, for a later wait. */
            mp_blocking blocking = {0};
            mp_interrupt interrupt;
            comm->host_waits++; /* what the NCCL stall analysis asks: this host posts nothing now */
            mp_blocking_begin(&blocking, &interrupt);
            r = t->ops->wait(t, op, deadline, &interrupt);
            mp_blocking_end(&blocking);
            comm->host_waits--;
            mp_comm_leave(comm);
        }
        comm->wait_seconds += mp_now() - start;
        if (r == MP_ERR_INTERRUPTED)
            return -1;
        if (r == MP_ERR_TIMEOUT && !mp_op_done(op)) {
            PyObject *report = mp_comm_pending_report(comm);
            PyObject *msg = NULL;
            if (report) {
                char seconds[32]; /* PyUnicode_FromFormat has no float conversion */
                snprintf(seconds, sizeof seconds, "%.1f", timeout);
                msg = PyUnicode_FromFormat("rank %d: %s %s rank %d did not complete within %s s; the communicator is "
                                           "aborted so that its peers fail too.\n%U",
                                           comm->global_ranks[comm->group_rank], mp_label_name(op->label),
                                           op->kind == MP_SEND ? "to" : "from", op->peer_global, seconds, report);
                Py_DECREF(report);
            }
            mp_comm_abort_for_timeout(comm, msg);
            if (msg) {
                PyErr_SetObject(comm->state->P2PTimeoutError, msg);
                Py_DECREF(msg);
            }
            mp_comm_error_hook(comm);
            return -1;
        }
    }
    if (op->result != MP_OK)
        raise_op_failure(comm, op); /* before pruning: the report lists the other failed ops */
    mp_comm_prune(comm);
    return op->result == MP_OK ? 0 : -1;
}

static int parse_timeout(PyObject *args, PyObject *kwargs, const char *format, double *timeout)
{
    static char *kwlist[] = {"timeout", NULL};
    PyObject *timeout_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, format, kwlist, &timeout_obj))
        return -1;
    *timeout = -1;
    if (timeout_obj == Py_None)
        return 0;
    *timeout = PyFloat_AsDouble(timeout_obj);
    if (*timeout == -1 && PyErr_Occurred())
        return -1;
    if (!(*timeout >= 0)) {
        PyErr_Format(PyExc_ValueError, "timeout must be a non-negative number of seconds, got %R", timeout_obj);
        return -1;
    }
    return 0;
}

/* On a device transport the caller's stream waits; the host goes on. */
static int stream_wait(RequestObject *self)
{
    CommObject *comm = self->comm;
    mp_transport *t;
    mp_comm_trace_waited(comm, &self->op);
    if (self->op.captured || !mp_op_done(&self->op)) {
        void *stream;
        if (mp_comm_stream(comm, &stream) < 0)
            return -1;
        mp_result r = MP_ERR_CLOSED;
        if ((t = mp_comm_enter(comm))) { /* a close meanwhile leaves the transport to our leave */
            Py_BEGIN_ALLOW_THREADS /* the transport's lock is not taken holding the GIL */
            r = mp_transport_stream_wait(t, &self->op, stream);
            Py_END_ALLOW_THREADS
            mp_comm_leave(comm);
        }
        if (r == MP_ERR_CAPTURE) {
            PyErr_SetString(comm->state->P2PError,
                            self->op.captured
                                ? "wait(): this op was posted during a CUDA graph capture, and its completion is an "
                                  "event of that graph: only a stream in the same capture can wait on it; after the "
                                  "capture, synchronize the stream the graph is replayed on"
                                : "wait(): this op was posted before the current stream's CUDA graph capture began "
                                  "and is still pending; a capturing stream cannot wait on work outside its capture "
                                  "(CUDA would invalidate it): synchronize() the op before beginning the capture");
            return -1;
        }
        if (r != MP_OK && !mp_op_done(&self->op)) {
            PyErr_SetString(comm->state->P2PError, "could not make the current stream wait for the op");
            return -1;
        }
    }
    if (mp_op_done(&self->op) && self->op.result != MP_OK) {
        raise_op_failure(comm, &self->op);
        return -1;
    }
    return 0;
}

static PyObject *request_wait(RequestObject *self, PyObject *args, PyObject *kwargs)
{
    double timeout;
    if (parse_timeout(args, kwargs, "|O:wait", &timeout) < 0 || mp_comm_check_owner(self->comm) < 0)
        return NULL;
    mp_transport *t = self->comm->transport;
    int rc = t && (mp_transport_caps(t) & MP_CAP_DEVICE_STREAMS) ? stream_wait(self) : request_complete(self, timeout);
    if (rc < 0)
        return NULL;
    Py_RETURN_TRUE;
}

/* A captured op runs at each replay of its graph, never at a time the host could wait for. */
static int refuse_captured(RequestObject *self, const char *what)
{
    if (!self->op.captured)
        return 0;
    PyErr_Format(self->comm->state->P2PError, "%s: this op was posted during CUDA graph capture and runs at each "
                 "replay of the graph, so it is stream-ordered only: wait() orders the current stream after it; "
                 "synchronize the stream the graph is replayed on to wait for it on the host", what);
    return -1;
}

static PyObject *request_synchronize(RequestObject *self, PyObject *args, PyObject *kwargs)
{
    double timeout;
    if (parse_timeout(args, kwargs, "|O:synchronize", &timeout) < 0 || mp_comm_check_owner(self->comm) < 0 ||
        refuse_captured(self, "synchronize()") < 0 ||
        request_complete(self, timeout) < 0)
        return NULL;
    Py_RETURN_TRUE;
}

static PyObject *request_is_completed(RequestObject *self, PyObject *Py_UNUSED(ignored))
{
    if (mp_comm_check_owner(self->comm) < 0 || refuse_captured(self, "is_completed()") < 0)
        return NULL;
    mp_transport *t = self->comm->transport;
    if (!mp_op_done(&self->op) && t)
        mp_transport_progress(t);
    return PyBool_FromLong(mp_op_done(&self->op));
}

static PyObject *request_repr(RequestObject *self)
{
    const mp_op *op = &self->op;
    return PyUnicode_FromFormat("<megatron_p2p.Request %s %s rank %d, %llu bytes, lane %d, message #%llu, %s>",
                                mp_label_name(op->label), op->kind == MP_SEND ? "to" : "from", op->peer_global,
                                (unsigned long long)op->nbytes, op->lane, (unsigned long long)op->seq,
                                mp_op_done(op) ? (op->result == MP_OK ? "done" : "failed") : "pending");
}

static PyObject *get_label(RequestObject *self, void *Py_UNUSED(c)) { return PyUnicode_FromString(mp_label_name(self->op.label)); }
static PyObject *get_peer(RequestObject *self, void *Py_UNUSED(c)) { return PyLong_FromLong(self->op.peer_global); }
static PyObject *get_nbytes(RequestObject *self, void *Py_UNUSED(c)) { return PyLong_FromUnsignedLongLong(self->op.nbytes); }
static PyObject *get_lane(RequestObject *self, void *Py_UNUSED(c)) { return PyLong_FromLong(self->op.lane); }
static PyObject *get_seq(RequestObject *self, void *Py_UNUSED(c)) { return PyLong_FromUnsignedLongLong(self->op.seq); }
static PyObject *get_is_send(RequestObject *self, void *Py_UNUSED(c)) { return PyBool_FromLong(self->op.kind == MP_SEND); }
static PyObject *get_tensor(RequestObject *self, void *Py_UNUSED(c)) { return Py_NewRef(self->tensor); }

static PyGetSetDef request_getset[] = {
    {"label", (getter)get_label, NULL, "Which op: send_next, recv_prev, send_prev, recv_next, isend or irecv.", NULL},
    {"peer", (getter)get_peer, NULL, "The peer's global rank.", NULL},
    {"nbytes", (getter)get_nbytes, NULL, "Bytes carried.", NULL},
    {"lane", (getter)get_lane, NULL, "The lane the op runs on.", NULL},
    {"seq", (getter)get_seq, NULL, "Its index among the ops of its kind between this pair on this lane.", NULL},
    {"is_send", (getter)get_is_send, NULL, "True for a send.", NULL},
    {"tensor", (getter)get_tensor, NULL, "The tensor sent from or received into.", NULL},
    {NULL},
};

static PyMethodDef request_methods[] = {
    {"wait", (PyCFunction)(void (*)(void))request_wait, METH_VARARGS | METH_KEYWORDS,
     "wait($self, /, timeout=None)\n--\n\nReturns True. CPU ops: blocks the host until the op completes. CUDA ops: makes the "
     "current stream wait for the op and returns at once, like torch's Work.wait() (also for an op captured into a "
     "CUDA graph, whose lane it joins back into the capturing stream). Raises "
     "P2PTimeoutError past the timeout (default: the communicator's) and aborts the communicator, "
     "MismatchError, PeerFailureError or P2PError when the op failed."},
    {"synchronize", (PyCFunction)(void (*)(void))request_synchronize, METH_VARARGS | METH_KEYWORDS,
     "synchronize($self, /, timeout=None)\n--\n\nReturns True. Blocks the host until the op has completed, on any backend, with "
     "wait()'s deadline and errors."},
    {"is_completed", (PyCFunction)request_is_completed, METH_NOARGS, "is_completed($self, /)\n--\n\nTrue once the op has finished (or failed)."},
    {NULL},
};

static PyType_Slot request_slots[] = {
    {Py_tp_dealloc, request_dealloc},
    {Py_tp_traverse, request_traverse},
    {Py_tp_repr, request_repr},
    {Py_tp_methods, request_methods},
    {Py_tp_getset, request_getset},
    {Py_tp_doc, "A posted point-to-point op. wait() completes it; dropping it does not cancel it."},
    {0, NULL},
};

PyType_Spec mp_request_spec = {
    .name = "megatron_p2p._C.Request",
    .basicsize = sizeof(RequestObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION | Py_TPFLAGS_HAVE_GC,
    .slots = request_slots,
};
