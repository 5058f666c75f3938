/* The session shared by Communicator and Request (session.h). */
#include "session.h"

#include <stdatomic.h>
#include <unistd.h>

#include "core/clock.h"
#include "core/dtype.h"
#include "errors.h"

/* After a destroy: the ops it failed as closed were pending on their peers too, which a device
 * transport's peers learn only through on_abort (shm's read the shared segment themselves). */
static void tell_peers_of_closed_ops(CommObject *self)
{
    Py_ssize_t closed = 0, n = PyList_GET_SIZE(self->inflight);
    for (Py_ssize_t i = 0; i < n; i++) {
        const mp_op *op = &((RequestObject *)PyList_GET_ITEM(self->inflight, i))->op;
        closed += mp_op_done(op) && op->result == MP_ERR_CLOSED;
    }
    if (!closed || !self->on_abort)
        return;
    PyObject *why = PyUnicode_FromFormat("rank %d closed the communicator with %zd op(s) pending",
                                         self->global_ranks[self->group_rank], closed);
    if (!why) {
        PyErr_WriteUnraisable((PyObject *)self);
        return;
    }
    mp_comm_publish_abort(self, why);
    Py_DECREF(why);
}

/* The one release path of a transport, once no call is inside it. */
static void destroy_transport(CommObject *self, mp_transport *t)
{
    Py_BEGIN_ALLOW_THREADS
    t->ops->destroy(t);
    Py_END_ALLOW_THREADS
    tell_peers_of_closed_ops(self);
    mp_comm_prune(self);
}

void mp_comm_shutdown(CommObject *self)
{
    mp_transport *t = self->transport;
    if (!t)
        return;
    self->transport = NULL;
    if (self->busy) {
        /* A call is inside the transport: its op is pending, so the peers fail as a destroy with
         * ops pending would make them; the call ends and the last to leave destroys it. */
        t->ops->abort(t, MP_ERR_CLOSED, t->rank, NULL);
        self->closing = t;
        return;
    }
    destroy_transport(self, t);
}

mp_transport *mp_comm_enter(CommObject *self)
{
    mp_transport *t = self->transport ? self->transport : self->closing; /* aborted: its ops end soon */
    if (t)
        self->busy++;
    return t;
}

void mp_comm_leave(CommObject *self)
{
    if (--self->busy || !self->closing)
        return;
    mp_transport *t = self->closing;
    self->closing = NULL;
    destroy_transport(self, t);
}

void mp_comm_prune(CommObject *self)
{
    mp_transport *t = self->transport;
    if (t)
        mp_transport_progress(t);
    PyObject *list = self->inflight;
    Py_ssize_t keep = 0, n = PyList_GET_SIZE(list);
    double now = 0;
    int failed_running = -1; /* asked of the transport once, when a failed op is found */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(list, i);
        const mp_op *op = &((RequestObject *)item)->op;
        if (mp_op_done(op)) {
            mp_trace_entry *e = mp_trace_entry_of(self->trace, op->trace_id);
            if (e && e->state == MP_TRACE_POSTED) {
                if (!now)
                    now = mp_wall_time();
                e->state = op->result == MP_OK ? MP_TRACE_COMPLETED : MP_TRACE_FAILED;
                e->result = op->result;
                e->t_completed = now;
            }
            if (op->result != MP_OK && failed_running < 0)
                failed_running = t && mp_transport_failed_ops_running(t);
            if (op->result == MP_OK || !failed_running)
                continue; /* released: nothing on the device touches its buffers any more */
        }
        /* Swap the live item forward; the slice deletion below releases the finished ones. */
        PyList_SET_ITEM(list, i, PyList_GET_ITEM(list, keep));
        PyList_SET_ITEM(list, keep, item);
        keep++;
    }
    PyList_SetSlice(list, keep, n, NULL);
}

PyObject *mp_comm_pending_report(CommObject *self)
{
    PyObject *lines = PyList_New(0);
    if (!lines)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(self->inflight);
    for (Py_ssize_t i = 0; i < n; i++) {
        RequestObject *req = (RequestObject *)PyList_GET_ITEM(self->inflight, i);
        const mp_op *op = &req->op;
        uint32_t state = atomic_load_explicit(&req->op.state, memory_order_acquire);
        if (state == MP_OP_DONE && op->result == MP_OK)
            continue;
        char peer[256] = "";
        if (self->transport)
            self->transport->ops->describe_peer(self->transport, op, peer, sizeof peer);
        const char *where = state == MP_OP_QUEUED  ? "queued behind an earlier step on its lane"
                          : state == MP_OP_ACTIVE ? "posted, waiting for the peer"
                                                  : "failed";
        PyObject *line = PyUnicode_FromFormat(
            "  %s %s rank %d: %llu bytes of %s, lane %d, message #%llu, step #%llu, %s; %s", mp_label_name(op->label),
            op->kind == MP_SEND ? "to" : "from", op->peer_global, (unsigned long long)op->nbytes,
            mp_dtype_name(op->dtype), op->lane, (unsigned long long)op->seq, (unsigned long long)op->step, where, peer);
        if (!line || PyList_Append(lines, line) < 0) {
            Py_XDECREF(line);
            Py_DECREF(lines);
            return NULL;
        }
        Py_DECREF(line);
    }
    PyObject *head = PyUnicode_FromFormat("pending ops of rank %d (group rank %d of %d, backend %U): %zd",
                                          self->global_ranks[self->group_rank], self->group_rank, self->size,
                                          self->backend, PyList_GET_SIZE(lines));
    PyObject *nl = PyUnicode_FromString("\n");
    PyObject *body = nl ? PyUnicode_Join(nl, lines) : NULL;
    PyObject *out = head && body ? PyUnicode_FromFormat(PyList_GET_SIZE(lines) ? "%U\n%U" : "%U%U", head, body)
                                 : NULL;
    if (out && self->group_picture) /* the peers' side, where a stall analysis has it */
        Py_SETREF(out, PyUnicode_FromFormat("%U\n%U", out, self->group_picture));
    Py_XDECREF(head);
    Py_XDECREF(nl);
    Py_XDECREF(body);
    Py_DECREF(lines);
    return out;
}

void mp_comm_disown(CommObject *self)
{
    self->forked = 1;
    self->transport = NULL;
    self->closing = NULL;
    self->busy = 0;
}

int mp_comm_check_owner(CommObject *self)
{
    if (!self->forked)
        return 0;
    PyErr_Format(self->state->P2PError, "this communicator was created by process %ld; a forked child cannot use "
                 "it (this is process %ld): create one in the child if it needs to communicate",
                 (long)self->owner, (long)getpid());
    return -1;
}

int mp_comm_check_usable(CommObject *self)
{
    if (mp_comm_check_owner(self) < 0)
        return -1;
    if (!self->transport) {
        PyErr_SetString(self->state->P2PError, "communicator is closed");
        return -1;
    }
    int rank;
    mp_result cause = self->transport->ops->abort_cause(self->transport, &rank);
    if (cause != MP_OK && self->abort_report) {
        PyErr_Format(mp_failure_type(self->state, cause), "communicator was aborted by the watchdog; create a new "
                     "one\n%U", self->abort_report);
        mp_comm_error_hook(self);
        return -1;
    }
    if (cause != MP_OK) {
        PyObject *exc = mp_failure_type(self->state, cause);
        char report[4096] = "";
        mp_transport_failure_report(self->transport, NULL, report, sizeof report);
        char by[32] = "outside the group";
        if (rank >= 0 && rank < self->size)
            snprintf(by, sizeof by, "by rank %d", self->global_ranks[rank]);
        PyErr_Format(exc, "communicator was aborted (%s, caused %s); create a new one%s%s", mp_result_str(cause), by,
                     report[0] ? "\n" : "", report);
        mp_comm_error_hook(self);
        return -1;
    }
    return 0;
}

int mp_comm_group_rank(CommObject *self, PyObject *peer_obj, const char *what)
{
    long g = PyLong_AsLong(peer_obj);
    if (g == -1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "%s must be an int global rank, not %.100s", what, Py_TYPE(peer_obj)->tp_name);
        } else if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "%s = %R is not a rank of this communicator", what, peer_obj);
        }
        return -1;
    }
    for (int r = 0; r < self->size; r++)
        if (self->global_ranks[r] == g)
            return r;
    PyObject *ranks = PyList_New(self->size);
    for (int r = 0; ranks && r < self->size; r++)
        PyList_SET_ITEM(ranks, r, PyLong_FromLong(self->global_ranks[r]));
    if (ranks) {
        PyErr_Format(PyExc_ValueError, "%s = %ld is not a rank of this communicator (global ranks %R)", what, g, ranks);
        Py_DECREF(ranks);
    }
    return -1;
}

int mp_comm_stream(CommObject *self, void **stream)
{
    *stream = NULL;
    if (!self->stream_fn)
        return 0;
    PyObject *s = PyObject_CallNoArgs(self->stream_fn);
    if (!s)
        return -1;
    uintptr_t v = (uintptr_t)PyLong_AsUnsignedLongLong(s);
    Py_DECREF(s);
    if (PyErr_Occurred())
        return -1;
    *stream = (void *)v;
    return 0;
}

void mp_comm_error_hook(CommObject *self)
{
    if (!self->on_error || !PyErr_Occurred())
        return;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    PyObject *r = PyObject_CallOneArg(self->on_error, value ? value : Py_None);
    if (!r)
        PyErr_WriteUnraisable(self->on_error); /* a dump that fails must not hide the real error */
    Py_XDECREF(r);
    PyErr_Restore(type, value, tb);
}

void mp_comm_trace_waited(CommObject *self, const mp_op *op)
{
    mp_trace_entry *e = mp_trace_entry_of(self->trace, op->trace_id);
    if (e)
        e->waited = 1;
}

void mp_comm_publish_abort(CommObject *self, PyObject *message)
{
    if (!self->on_abort)
        return;
    PyObject *type, *value, *tb; /* the caller may be raising already */
    PyErr_Fetch(&type, &value, &tb);
    PyObject *r = PyObject_CallOneArg(self->on_abort, message ? message : Py_None);
    if (!r)
        PyErr_WriteUnraisable(self->on_abort); /* telling the peers is best effort */
    Py_XDECREF(r);
    PyErr_Restore(type, value, tb);
}

bool mp_comm_abort(CommObject *self, mp_result cause, int rank, const char *why)
{
    mp_transport *t = self->transport ? mp_comm_enter(self) : NULL; /* closed: aborted already */
    if (!t)
        return false;
    bool first;
    Py_BEGIN_ALLOW_THREADS /* the transport's lock is not taken holding the GIL */
    first = t->ops->abort(t, cause, rank, why);
    Py_END_ALLOW_THREADS
    mp_comm_leave(self);
    return first;
}

void mp_comm_abort_for_timeout(CommObject *self, PyObject *message)
{
    mp_comm_publish_abort(self, message); /* the peers first: the local abort may take a while */
    mp_comm_abort(self, MP_ERR_TIMEOUT, self->group_rank, NULL);
}
