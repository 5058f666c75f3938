/* Communicator: argument checking, the plan, and posting steps to a transport. Every check
 * runs before anything is posted, so a misuse leaves the communicator usable. */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "arena_tensor.h"
#include "bindings.h"
#include <structmember.h> /* after Python.h */
#include "clock.h"
#include "dtype.h"
#include "nccl.h"
#include "null_transport.h"
#include "plan.h"
#include "shm.h"

/* ---- life cycle -------------------------------------------------------------------------- */

static int parse_ranks(CommObject *self, PyObject *ranks)
{
    PyObject *seq = PySequence_Fast(ranks, "ranks must be a sequence of global ranks");
    if (!seq)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n < 1 || n > 4096) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "ranks must hold 1 to 4096 global ranks, got %zd", n);
        return -1;
    }
    self->global_ranks = PyMem_Calloc((size_t)n, sizeof(int));
    if (!self->global_ranks) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long g = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
        if (g == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return -1;
        }
        if (g < 0 || g > INT32_MAX) {
            Py_DECREF(seq);
            PyErr_Format(PyExc_ValueError, "ranks[%zd] = %ld is not a valid global rank", i, g);
            return -1;
        }
        for (Py_ssize_t j = 0; j < i; j++)
            if (self->global_ranks[j] == g) {
                Py_DECREF(seq);
                PyErr_Format(PyExc_ValueError, "global rank %ld appears twice in ranks", g);
                return -1;
            }
        self->global_ranks[i] = (int)g;
    }
    Py_DECREF(seq);
    self->size = (int)n;
    return 0;
}

/* FNV-1a of the unique id: names the communicator in trace dumps without revealing the id. */
static int set_id(CommObject *self, PyObject *unique_id)
{
    const char *bytes;
    Py_ssize_t len;
    if (PyUnicode_Check(unique_id)) {
        if (!(bytes = PyUnicode_AsUTF8AndSize(unique_id, &len)))
            return -1;
    } else if (PyBytes_Check(unique_id)) {
        bytes = PyBytes_AS_STRING(unique_id);
        len = PyBytes_GET_SIZE(unique_id);
    } else {
        PyErr_SetString(PyExc_TypeError, "unique_id must be str (shm) or bytes (nccl)");
        return -1;
    }
    uint64_t h = 0xcbf29ce484222325ull;
    for (Py_ssize_t i = 0; i < len; i++)
        h = (h ^ (unsigned char)bytes[i]) * 0x100000001b3ull;
    snprintf(self->id, sizeof self->id, "%016llx", (unsigned long long)h);
    return 0;
}

/* The NCCL transport's parts of construction: the libraries, then the collective creation. */
static mp_result open_nccl(CommObject *self, PyObject *unique_id, int high_priority, mp_blocking *wait,
                           mp_transport **t, char *err, size_t errlen, int *unavailable)
{
    char *ids;
    Py_ssize_t len;
    if (!PyBytes_Check(unique_id) || PyBytes_AsStringAndSize(unique_id, &ids, &len) < 0 ||
        len != (Py_ssize_t)(sizeof(mp_ncclUniqueId) * (size_t)self->nlanes)) {
        snprintf(err, errlen, "unique_id must be %zu bytes (one NCCL unique id per lane) from nccl_unique_id()",
                 sizeof(mp_ncclUniqueId) * (size_t)self->nlanes);
        PyErr_Clear();
        return MP_ERR_CORRUPT;
    }
    *unavailable = 1;
    const mp_nccl_lib *nccl = mp_nccl_loaded(err, errlen); /* one search order: nccl_version()'s */
    const mp_cuda_lib *cuda = nccl ? mp_cuda_load(err, errlen) : NULL;
    if (!cuda)
        return MP_ERR_SYSTEM;
    *unavailable = 0;
    mp_nccl_config cfg = {
        .rank = self->group_rank,
        .size = self->size,
        .nlanes = self->nlanes,
        .device = self->device,
        .ids = (const mp_ncclUniqueId *)ids,
        .timeout = self->timeout,
        .high_priority = high_priority,
        .check = self->check,
        .global_rank = self->global_ranks[self->group_rank],
    };
    mp_interrupt interrupt;
    cfg.interrupt = &interrupt;
    mp_blocking_begin(wait, &interrupt);
    mp_result r = mp_nccl_open(&cfg, nccl, cuda, t, err, errlen);
    mp_blocking_end(wait);
    return r;
}

/* The group's pids (from the store), or NULL when not given; -1 with an exception on bad input. */
static int parse_pids(CommObject *self, PyObject *obj, int **out)
{
    *out = NULL;
    if (obj == Py_None)
        return 0;
    PyObject *seq = PySequence_Fast(obj, "pids must be a sequence of process ids, one per group rank");
    if (!seq)
        return -1;
    int rc = -1;
    if (PySequence_Fast_GET_SIZE(seq) != self->size) {
        PyErr_Format(PyExc_ValueError, "pids must hold one process id per group rank (%d), got %zd", self->size,
                     PySequence_Fast_GET_SIZE(seq));
        goto out;
    }
    *out = PyMem_Calloc((size_t)self->size, sizeof(int));
    if (!*out) {
        PyErr_NoMemory();
        goto out;
    }
    for (int r = 0; r < self->size; r++) {
        long pid = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, r));
        if (pid == -1 && PyErr_Occurred())
            goto out;
        if (pid <= 0 || pid > INT32_MAX) {
            PyErr_Format(PyExc_ValueError, "pids[%d] must be a process id, got %ld", r, pid);
            goto out;
        }
        (*out)[r] = (int)pid;
    }
    rc = 0;
out:
    Py_DECREF(seq);
    if (rc < 0) {
        PyMem_Free(*out);
        *out = NULL;
    }
    return rc;
}

static mp_result open_shm(CommObject *self, PyObject *unique_id, int single_copy, const int *pids,
                          uint64_t arena_bytes, mp_blocking *wait, mp_transport **t, char *err, size_t errlen)
{
    const char *name = PyUnicode_Check(unique_id) ? PyUnicode_AsUTF8(unique_id) : NULL;
    if (!name || strlen(name) >= MP_SHM_NAME_LEN || name[0] != '/' || strchr(name + 1, '/')) {
        PyErr_Clear();
        snprintf(err, errlen, "unique_id must be a segment name from new_unique_id()");
        return MP_ERR_CORRUPT;
    }
    mp_shm_config cfg = {
        .name = name,
        .rank = self->group_rank,
        .size = self->size,
        .nlanes = self->nlanes,
        .create = self->group_rank == 0,
        .eager_threshold = self->eager_threshold,
        .timeout = self->timeout,
        .allow_cma = single_copy,
        .global_rank = self->global_ranks[self->group_rank],
        .pids = pids,
        .arena_bytes = arena_bytes,
    };
    mp_interrupt interrupt;
    cfg.interrupt = &interrupt;
    mp_blocking_begin(wait, &interrupt);
    mp_result r = mp_shm_open(&cfg, t, err, errlen);
    mp_blocking_end(wait);
    return r;
}

static PyObject *comm_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"backend", "unique_id", "group_rank", "ranks", "lanes", "eager_threshold", "timeout",
                             "single_copy", "device", "stream", "high_priority", "on_abort", "check", "pids",
                             "peer_failed", "arena_bytes", NULL};
    const char *backend;
    int group_rank, lanes = 2, single_copy = 1, device = -1, high_priority = 0, check = 0;
    PyObject *unique_id, *ranks, *stream_fn = Py_None, *on_abort = Py_None, *pids_obj = Py_None,
             *peer_failed = Py_None;
    unsigned long long eager = 0, arena_bytes = 0;
    double timeout = 300.0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "sOiO|$iKdpiOpOpOOK:Communicator", kwlist, &backend, &unique_id,
                                     &group_rank, &ranks, &lanes, &eager, &timeout, &single_copy, &device,
                                     &stream_fn, &high_priority, &on_abort, &check, &pids_obj, &peer_failed, &arena_bytes))
        return NULL;
    mp_state *st = mp_state_from_type(type);
    int is_nccl = strcmp(backend, "nccl") == 0;
    /* "null" is for benchmarks only (not one of init_communicator's backends): it completes every op
     * at once, so that a call on it costs the binding layer alone. */
    int is_null = strcmp(backend, "null") == 0;
    if (!is_nccl && !is_null && strcmp(backend, "shm") != 0)
        return PyErr_Format(PyExc_ValueError, "backend must be 'shm' or 'nccl', got %R", PyTuple_GET_ITEM(args, 0));
    if (lanes != 1 && lanes != 2)
        return PyErr_Format(PyExc_ValueError, "lanes must be 1 (one ordered queue) or 2 (one per direction), got %d",
                            lanes);
    if (eager > MP_SHM_MAX_EAGER)
        return PyErr_Format(PyExc_ValueError, "eager_threshold must be at most %u bytes, got %llu", MP_SHM_MAX_EAGER,
                            eager);
    if (is_nccl && eager)
        return PyErr_Format(PyExc_ValueError, "eager_threshold is a property of the shm backend; NCCL decides "
                            "its own buffering");
    if (!(timeout > 0))
        return PyErr_Format(PyExc_ValueError, "timeout must be a positive number of seconds, got %g", timeout);
    if (is_nccl ? (device < 0 || !PyCallable_Check(stream_fn)) : device != -1)
        return PyErr_Format(PyExc_ValueError, is_nccl ? "backend 'nccl' needs a CUDA device ordinal and a "
                                                        "stream callable"
                                                      : "backend 'shm' carries CPU tensors only (device=-1)");
    if (on_abort != Py_None && !PyCallable_Check(on_abort))
        return PyErr_Format(PyExc_TypeError, "on_abort must be callable or None");
    if (peer_failed != Py_None && !PyCallable_Check(peer_failed))
        return PyErr_Format(PyExc_TypeError, "peer_failed must be callable or None");
    if (arena_bytes && is_nccl)
        return PyErr_Format(PyExc_ValueError, "arena_bytes is a property of the shm backend: NCCL receives into "
                            "device memory");
    if (arena_bytes > MP_ARENA_MAX_BYTES)
        return PyErr_Format(PyExc_ValueError, "arena_bytes must be at most %llu (64 GiB), got %llu",
                            MP_ARENA_MAX_BYTES, arena_bytes);
    if (check && !is_nccl)
        return PyErr_Format(PyExc_ValueError, "check (debug matching) is for backend 'nccl'; shm always compares "
                            "bytes and dtype");

    CommObject *self = (CommObject *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    self->state = st;
    self->nlanes = lanes;
    self->timeout = timeout;
    self->eager_threshold = eager;
    self->group_rank = group_rank;
    self->device = device;
    self->check = check;
    self->stream_fn = is_nccl ? Py_NewRef(stream_fn) : NULL;
    self->on_abort = on_abort != Py_None ? Py_NewRef(on_abort) : NULL;
    if (parse_ranks(self, ranks) < 0)
        goto fail;
    if (group_rank < 0 || group_rank >= self->size) {
        PyErr_Format(PyExc_ValueError, "group_rank %d is outside a group of %d ranks", group_rank, self->size);
        goto fail;
    }
    size_t nchan = (size_t)lanes * (size_t)self->size;
    self->send_seq = PyMem_Calloc(nchan, sizeof(uint64_t));
    self->recv_seq = PyMem_Calloc(nchan, sizeof(uint64_t));
    self->lane_steps = PyMem_Calloc((size_t)lanes, sizeof(uint64_t));
    self->trace = PyMem_Calloc(1, sizeof(mp_trace));
    self->inflight = PyList_New(0);
    self->backend = PyUnicode_FromString(backend);
    if (!self->send_seq || !self->recv_seq || !self->lane_steps || !self->trace) {
        PyErr_NoMemory();
        goto fail;
    }
    if (!self->inflight || !self->backend)
        goto fail;
    if (set_id(self, unique_id) < 0)
        goto fail;

    int *pids;
    if (parse_pids(self, pids_obj, &pids) < 0)
        goto fail;
    char err[2048] = "";
    int unavailable = 0;
    mp_transport *t = NULL;
    /* Creation blocks until every rank has joined: Ctrl-C ends one whose peers never come, and
     * a member whose own creation failed ends it too, saying why, instead of at the timeout. */
    mp_blocking wait = {.peer_failed = peer_failed != Py_None ? peer_failed : NULL, .error = st->P2PError};
    mp_result r = is_nccl ? open_nccl(self, unique_id, high_priority, &wait, &t, err, sizeof err, &unavailable)
                : is_null ? mp_null_open(group_rank, self->size, lanes, &t)
                          : open_shm(self, unique_id, single_copy, pids, arena_bytes, &wait, &t, err, sizeof err);
    PyMem_Free(pids);
    if (r == MP_ERR_INTERRUPTED) /* a signal handler's exception, or a peer's failure, is set */
        goto fail;
    if (r != MP_OK) {
        PyObject *exc = unavailable ? st->BackendUnavailableError
                      : r == MP_ERR_CORRUPT ? PyExc_ValueError
                                            : mp_failure_type(st, r);
        PyErr_Format(exc, "%s communicator (rank %d of %d): %s", backend, group_rank, self->size, err);
        goto fail;
    }
    self->transport = t;
    return (PyObject *)self;
fail:
    Py_DECREF(self);
    return NULL;
}

/* The one release path of a transport, once no call is inside it. */
static void destroy_transport(CommObject *self, mp_transport *t)
{
    Py_BEGIN_ALLOW_THREADS
    t->ops->destroy(t);
    Py_END_ALLOW_THREADS
    mp_comm_prune(self);
}

/* Stops the transport; it finishes every op still pending (as closed), so no Request is left
 * pointing into a dead transport. */
static void comm_shutdown(CommObject *self)
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

static void comm_dealloc(CommObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    if (self->weakrefs)
        PyObject_ClearWeakRefs((PyObject *)self);
    comm_shutdown(self);
    Py_XDECREF(self->inflight);
    Py_XDECREF(self->backend);
    Py_XDECREF(self->stream_fn);
    Py_XDECREF(self->on_abort);
    Py_XDECREF(self->on_error);
    Py_XDECREF(self->abort_report);
    PyMem_Free(self->trace);
    PyMem_Free(self->global_ranks);
    PyMem_Free(self->send_seq);
    PyMem_Free(self->recv_seq);
    PyMem_Free(self->lane_steps);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

void mp_comm_prune(CommObject *self)
{
    mp_transport *t = self->transport;
    if (t && t->ops->progress)
        t->ops->progress(t);
    PyObject *list = self->inflight;
    Py_ssize_t keep = 0, n = PyList_GET_SIZE(list);
    double now = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(list, i);
        const mp_op *op = &((RequestObject *)item)->op;
        if (mp_op_done(op)) {
            mp_trace_entry *e = mp_trace_entry_of(self->trace, op->trace_id);
            if (e) {
                if (!now)
                    now = mp_wall_time();
                e->state = op->result == MP_OK ? MP_TRACE_COMPLETED : MP_TRACE_FAILED;
                e->result = op->result;
                e->t_completed = now;
            }
            continue;
        }
        /* Swap the live item forward; the slice deletion below releases the finished ones. */
        PyList_SET_ITEM(list, i, PyList_GET_ITEM(list, keep));
        PyList_SET_ITEM(list, keep, item);
        keep++;
    }
    PyList_SetSlice(list, keep, n, NULL);
}

/* ---- reports ----------------------------------------------------------------------------- */

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
    Py_XDECREF(head);
    Py_XDECREF(nl);
    Py_XDECREF(body);
    Py_DECREF(lines);
    return out;
}

/* ---- posting ----------------------------------------------------------------------------- */

static int check_usable(CommObject *self)
{
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
        if (self->transport->ops->failure_report)
            self->transport->ops->failure_report(self->transport, NULL, report, sizeof report);
        PyErr_Format(exc, "communicator was aborted (%s, caused by group rank %d); create a new one%s%s",
                     mp_result_str(cause), rank, report[0] ? "\n" : "", report);
        mp_comm_error_hook(self);
        return -1;
    }
    return 0;
}

static int group_rank_of(CommObject *self, PyObject *peer_obj, const char *what)
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

/* One op awaiting posting: validated, not yet numbered. */
typedef struct {
    PyObject *tensor;
    mp_buffer buf;
    mp_kind kind;
    mp_label label;
    int peer;
    int lane;
} pending_op;

/* NCCL's rule, kept here for every transport: a send to oneself needs its receive in the same
 * group, or it can never complete. */
static int check_self_pairs(CommObject *self, const pending_op *ops, int nops)
{
    int sends = 0, recvs = 0;
    for (int i = 0; i < nops; i++)
        if (ops[i].peer == self->group_rank)
            ops[i].kind == MP_SEND ? sends++ : recvs++;
    if (sends != recvs) {
        PyErr_Format(PyExc_ValueError,
                     "%d send(s) and %d receive(s) address this rank itself in one group: a self send needs its "
                     "matching self receive in the same group (batch_isend_irecv or one exchange)",
                     sends, recvs);
        return -1;
    }
    return 0;
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

/* Device transports order what one call posts after the caller's stream, and fence it after. */
static int begin_posting(CommObject *self)
{
    mp_transport *t = self->transport;
    if (!t->ops->begin)
        return 0;
    void *stream;
    if (mp_comm_stream(self, &stream) < 0)
        return -1;
    mp_result r = t->ops->begin(t, stream);
    if (r == MP_ERR_CAPTURE) {
        PyErr_SetString(self->state->P2PError, "debug matching (MEGATRON_P2P_CHECK=1) waits on the host before "
                        "every step, which CUDA graph capture forbids: unset it to capture this call");
        return -1;
    }
    if (r != MP_OK) {
        if (check_usable(self) == 0)
            PyErr_SetString(self->state->P2PError, "could not order the ops after the current stream");
        return -1;
    }
    return 0;
}

/* A failure here has failed the posted ops already; their Requests report it. */
static void end_posting(CommObject *self)
{
    mp_transport *t = self->transport;
    if (t && t->ops->end)
        t->ops->end(t);
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

/* Tells the other ranks (on_abort) that this rank aborted, and why. */
static void publish_abort(CommObject *self, PyObject *message)
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

void mp_comm_abort_for_timeout(CommObject *self, PyObject *message)
{
    self->transport->ops->abort(self->transport, MP_ERR_TIMEOUT, self->group_rank, NULL);
    publish_abort(self, message);
}

/* Debug matching compares shapes: the tensor's, read here (torch.Size is a tuple). */
static int read_shape(CommObject *self, PyObject *tensor, mp_op *op)
{
    PyObject *shape = mp_tensor_attr_get(self->state, tensor, MP_ATTR_SHAPE);
    if (!shape)
        return -1;
    Py_ssize_t ndim = PyTuple_Check(shape) ? PyTuple_GET_SIZE(shape) : -1;
    op->ndim = ndim >= 0 && ndim <= MP_MAX_DIMS ? (int)ndim : -1; /* beyond that, bytes and dtype decide */
    for (int d = 0; d < op->ndim; d++)
        op->shape[d] = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, d));
    Py_DECREF(shape);
    return PyErr_Occurred() ? -1 : 0;
}

/* One step of a call, before posting: its ops in issue order, on one lane. */
typedef struct {
    pending_op *ops;
    int nops;
    int lane;
} step_plan;

/* Makes the step's Requests (stored in `reqs`, new references); NULL with an error set when one
 * cannot be made. */
static mp_step *make_step(CommObject *self, const step_plan *sp, RequestObject **reqs)
{
    mp_step *step = malloc(sizeof(mp_step) + sizeof(mp_op *) * (size_t)(sp->nops ? sp->nops : 1));
    if (!step) {
        PyErr_NoMemory();
        return NULL;
    }
    for (int i = 0; i < sp->nops; i++) {
        reqs[i] = mp_request_new(self, sp->ops[i].tensor, &sp->ops[i].buf);
        if (!reqs[i] || (self->check && read_shape(self, sp->ops[i].tensor, &reqs[i]->op) < 0)) {
            for (int j = 0; j <= i; j++)
                Py_CLEAR(reqs[j]);
            free(step);
            return NULL;
        }
        step->ops[i] = &reqs[i]->op;
    }
    step->lane = sp->lane;
    step->nops = sp->nops;
    return step;
}

/* Numbers the step's ops in the communicator's sequences, for API call `call_name`. */
static void number_step(CommObject *self, const step_plan *sp, mp_step *step, const char *call_name, double now)
{
    size_t call_len = call_name ? strnlen(call_name, MP_CALL_NAME_LEN - 1) : 0;
    for (int i = 0; i < sp->nops; i++) {
        const pending_op *p = &sp->ops[i];
        mp_op *op = step->ops[i];
        size_t ch = (size_t)sp->lane * (size_t)self->size + (size_t)p->peer;
        op->kind = p->kind;
        op->label = p->label;
        op->peer = p->peer;
        op->peer_global = self->global_ranks[p->peer];
        op->lane = sp->lane;
        op->seq = p->kind == MP_SEND ? self->send_seq[ch]++ : self->recv_seq[ch]++;
        op->step = self->lane_steps[sp->lane];
        op->call = self->calls;
        if (call_name) /* the op starts zeroed: no name, nothing to copy */
            memcpy(op->call_name, call_name, call_len);
        if (op->kind == MP_SEND) {
            self->sends++;
            self->bytes_sent += op->nbytes;
        } else {
            self->recvs++;
            self->bytes_received += op->nbytes;
        }
    }
    self->lane_steps[sp->lane]++;
    mp_trace_step(self->trace, step, now);
}

/* Posts the steps of one call in order for API call `call_name` and stores each op's Request in
 * `reqs` (new references, in step order). Every Request is made first, so that a failure to make
 * one numbers and posts nothing, and the GIL is released once for all the steps. */
static int post_steps(CommObject *self, const step_plan *plans, int nsteps, const char *call_name,
                      RequestObject **reqs)
{
    mp_step *local[MP_NUM_SLOTS], **steps = nsteps > MP_NUM_SLOTS ? PyMem_Calloc((size_t)nsteps, sizeof *steps) : local;
    if (!steps) {
        PyErr_NoMemory();
        return -1;
    }
    int made = 0, nreqs = 0;
    while (made < nsteps && (steps[made] = make_step(self, &plans[made], reqs + nreqs)))
        nreqs += plans[made++].nops;
    mp_result r = MP_OK;
    int posted = 0; /* steps the transport took */
    if (made == nsteps) { /* numbered only once all can be posted: the sequences never skip */
        double now = mp_wall_time();
        for (int i = 0; i < nsteps; i++)
            number_step(self, &plans[i], steps[i], call_name, now);
        mp_transport *t = mp_comm_enter(self); /* open: the callers checked */
        if (!t) {
            r = MP_ERR_CLOSED;
        } else {
            Py_BEGIN_ALLOW_THREADS /* posting may progress (and copy) right away */
            while (posted < nsteps && (r = t->ops->post(t, steps[posted])) == MP_OK)
                posted++;
            Py_END_ALLOW_THREADS
            mp_comm_leave(self);
        }
    }
    for (int i = posted; i < made; i++)
        free(steps[i]);
    if (steps != local)
        PyMem_Free(steps);
    int kept = 0; /* Requests of the posted steps: in flight whatever else failed */
    for (int i = 0; i < posted; i++)
        kept += plans[i].nops;
    int rc = made == nsteps ? 0 : -1; /* else the error of the Request that could not be made is set */
    for (int i = 0; rc == 0 && i < kept; i++)
        rc = PyList_Append(self->inflight, (PyObject *)reqs[i]);
    if (rc == 0 && r != MP_OK) {
        check_usable(self);
        if (!PyErr_Occurred())
            PyErr_Format(self->state->P2PError, "posting failed: %s", mp_result_str(r));
        rc = -1;
    }
    if (rc < 0) {
        for (int i = 0; i < nreqs; i++)
            Py_CLEAR(reqs[i]);
        return -1;
    }
    /* Posting itself may have aborted (a launch that failed, a debug-matching disagreement): the
     * peers must hear of it, or their ops wait for ours until their timeout. */
    int cause_rank;
    mp_transport *t = self->transport; /* NULL: closed by another thread while posting */
    for (int i = 0; t && i < kept; i++) {
        const mp_op *op = &reqs[i]->op;
        if (mp_op_done(op) && op->result != MP_OK) {
            if (t->ops->abort_cause(t, &cause_rank) != MP_OK && cause_rank == self->group_rank) {
                PyObject *why = PyUnicode_FromString(op->detail);
                PyErr_Clear();
                publish_abort(self, why);
                Py_XDECREF(why);
            }
            break;
        }
    }
    return 0;
}

static int parse_mode(PyObject *mode, mp_mode *out)
{
    if (PyUnicode_Check(mode)) {
        if (PyUnicode_CompareWithASCIIString(mode, "parity") == 0) {
            *out = MP_MODE_PARITY;
            return 0;
        }
        if (PyUnicode_CompareWithASCIIString(mode, "batched") == 0) {
            *out = MP_MODE_BATCHED;
            return 0;
        }
    }
    PyErr_Format(PyExc_ValueError, "mode must be 'parity' or 'batched', got %R", mode);
    return -1;
}

/* Where keyword `kw` goes among exchange()'s arguments (the four slots, then the options), or -1.
 * Keywords written in source are interned, so identity almost always decides. */
static int exchange_argument(mp_state *st, PyObject *kw)
{
    for (int pass = 0; pass < 2; pass++)
        for (int i = 0; i < MP_NUM_SLOTS + MP_EXCHANGE_OPTIONS; i++) {
            PyObject *name = i < MP_NUM_SLOTS ? st->slot_names[i] : st->exchange_options[i - MP_NUM_SLOTS];
            if (pass ? PyUnicode_Compare(kw, name) == 0 : kw == name)
                return i;
        }
    return -1;
}

/* METH_FASTCALL: PyArg_ParseTupleAndKeywords' tuple and dict were a tenth of the binding's cost. */
static PyObject *comm_exchange(CommObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *given[MP_NUM_SLOTS + MP_EXCHANGE_OPTIONS] = {Py_None, Py_None, Py_None, Py_None,
                                                          NULL,    Py_None, Py_None, Py_None};
    if (nargs > MP_NUM_SLOTS)
        return PyErr_Format(PyExc_TypeError, "exchange() takes at most %d positional arguments (%zd given)",
                            MP_NUM_SLOTS, nargs);
    for (Py_ssize_t i = 0; i < nargs; i++)
        given[i] = args[i];
    for (Py_ssize_t k = 0; kwnames && k < PyTuple_GET_SIZE(kwnames); k++) {
        PyObject *kw = PyTuple_GET_ITEM(kwnames, k);
        int at = exchange_argument(self->state, kw);
        if (at < 0)
            return PyErr_Format(PyExc_TypeError, "exchange() got an unexpected keyword argument %R", kw);
        if (at < nargs)
            return PyErr_Format(PyExc_TypeError, "exchange() got multiple values for argument %R", kw);
        given[at] = args[nargs + k];
    }
    PyObject **tensors = given;
    PyObject *mode_obj = given[MP_NUM_SLOTS], *prev_obj = given[MP_NUM_SLOTS + 1], *next_obj = given[MP_NUM_SLOTS + 2];
    const char *call = NULL;
    if (given[MP_NUM_SLOTS + 3] != Py_None) {
        if (!PyUnicode_Check(given[MP_NUM_SLOTS + 3]))
            return PyErr_Format(PyExc_TypeError, "exchange() argument 'call' must be str or None, not %.100s",
                                Py_TYPE(given[MP_NUM_SLOTS + 3])->tp_name);
        if (!(call = PyUnicode_AsUTF8(given[MP_NUM_SLOTS + 3])))
            return NULL;
    }
    mp_mode mode = MP_MODE_PARITY;
    if (mode_obj && parse_mode(mode_obj, &mode) < 0)
        return NULL;
    if (check_usable(self) < 0)
        return NULL;
    int prev = (self->group_rank + self->size - 1) % self->size;
    int next = (self->group_rank + 1) % self->size;
    if (prev_obj != Py_None && (prev = group_rank_of(self, prev_obj, "prev_rank")) < 0)
        return NULL;
    if (next_obj != Py_None && (next = group_rank_of(self, next_obj, "next_rank")) < 0)
        return NULL;

    pending_op slot_ops[MP_NUM_SLOTS];
    mp_plan_input in = {.mode = mode, .nlanes = self->nlanes, .rank = self->group_rank,
                        .prev_is_self = prev == self->group_rank, .next_is_self = next == self->group_rank};
    for (int s = 0; s < MP_NUM_SLOTS; s++) {
        if (tensors[s] == Py_None)
            continue;
        pending_op *p = &slot_ops[s];
        if (mp_read_tensor(self->state, tensors[s], mp_slot_name((mp_slot)s), self->device, &p->buf) < 0)
            return NULL;
        p->tensor = tensors[s];
        p->kind = mp_slot_is_send((mp_slot)s) ? MP_SEND : MP_RECV;
        p->label = (mp_label)s; /* the first four labels are the slots */
        p->peer = (s == MP_SEND_NEXT || s == MP_RECV_NEXT) ? next : prev;
        p->lane = mp_slot_lane((mp_slot)s, self->nlanes);
        in.present |= 1u << s;
    }
    mp_plan plan;
    mp_plan_exchange(&in, &plan);
    pending_op steps[MP_NUM_SLOTS][MP_NUM_SLOTS];
    step_plan plans[MP_NUM_SLOTS];
    for (int i = 0; i < plan.nsteps; i++) {
        for (int j = 0; j < plan.steps[i].nops; j++)
            steps[i][j] = slot_ops[plan.steps[i].ops[j]];
        if (check_self_pairs(self, steps[i], plan.steps[i].nops) < 0)
            return NULL;
        plans[i] = (step_plan){.ops = steps[i], .nops = plan.steps[i].nops, .lane = plan.steps[i].lane};
    }

    mp_comm_prune(self);
    PyObject *result = PyDict_New();
    if (!result || begin_posting(self) < 0) {
        Py_XDECREF(result);
        return NULL;
    }
    RequestObject *reqs[MP_NUM_SLOTS];
    int rc = post_steps(self, plans, plan.nsteps, call, reqs);
    end_posting(self); /* also after a failure: what was posted must be fenced */
    self->calls++;
    if (rc < 0) {
        Py_DECREF(result);
        return NULL;
    }
    for (int i = 0, k = 0; i < plan.nsteps; i++)
        for (int j = 0; j < plan.steps[i].nops; j++, k++) {
            if (result && PyDict_SetItem(result, self->state->slot_names[plan.steps[i].ops[j]], (PyObject *)reqs[k]) < 0)
                Py_CLEAR(result);
            Py_DECREF(reqs[k]);
        }
    return result;
}

static int read_p2p_op(CommObject *self, PyObject *tensor, PyObject *peer, mp_kind kind, const char *what,
                       pending_op *out)
{
    if (mp_read_tensor(self->state, tensor, what, self->device, &out->buf) < 0)
        return -1;
    if ((out->peer = group_rank_of(self, peer, "peer")) < 0)
        return -1;
    out->tensor = tensor;
    out->kind = kind;
    out->label = kind == MP_SEND ? MP_LABEL_ISEND : MP_LABEL_IRECV;
    out->lane = 0;
    return 0;
}

static PyObject *single_op(CommObject *self, PyObject *args, PyObject *kwargs, mp_kind kind)
{
    static char *kwlist[] = {"tensor", "peer", "call", NULL};
    PyObject *tensor, *peer;
    const char *call = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, kind == MP_SEND ? "OO|$z:isend" : "OO|$z:irecv", kwlist, &tensor,
                                     &peer, &call))
        return NULL;
    if (check_usable(self) < 0)
        return NULL;
    pending_op op;
    if (read_p2p_op(self, tensor, peer, kind, "tensor", &op) < 0 || check_self_pairs(self, &op, 1) < 0)
        return NULL;
    mp_comm_prune(self);
    if (begin_posting(self) < 0)
        return NULL;
    RequestObject *req;
    step_plan plan = {.ops = &op, .nops = 1, .lane = 0};
    int rc = post_steps(self, &plan, 1, call, &req);
    end_posting(self);
    self->calls++;
    return rc < 0 ? NULL : (PyObject *)req;
}

static PyObject *comm_isend(CommObject *self, PyObject *args, PyObject *kwargs) { return single_op(self, args, kwargs, MP_SEND); }
static PyObject *comm_irecv(CommObject *self, PyObject *args, PyObject *kwargs) { return single_op(self, args, kwargs, MP_RECV); }

static PyObject *comm_batch(CommObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"ops", "lane", "call", NULL};
    PyObject *arg, *lane_obj = NULL;
    const char *call = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|$Oz:batch", kwlist, &arg, &lane_obj, &call))
        return NULL;
    int overflow = 0;
    long lane = lane_obj ? PyLong_AsLongAndOverflow(lane_obj, &overflow) : 0;
    if (lane == -1 && PyErr_Occurred())
        return NULL;
    if (overflow || lane < 0 || lane >= self->nlanes)
        return PyErr_Format(PyExc_ValueError, "lane must be 0%s for this communicator of %d lane(s), got %R",
                            self->nlanes > 1 ? " or 1" : "", self->nlanes, lane_obj);
    PyObject *seq = PySequence_Fast(arg, "batch() takes a sequence of (is_send, tensor, peer) tuples");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    pending_op *ops = PyMem_Calloc((size_t)(n ? n : 1), sizeof(pending_op));
    PyObject *reqs = NULL;
    if (!ops) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    if (n == 0) {
        PyErr_SetString(PyExc_ValueError, "batch() needs at least one op");
        goto done;
    }
    if (n > 65536) {
        PyErr_Format(PyExc_ValueError, "batch() takes at most 65536 ops, got %zd", n);
        goto done;
    }
    if (check_usable(self) < 0)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 3) {
            PyErr_Format(PyExc_TypeError, "batch()[%zd] must be an (is_send, tensor, peer) tuple", i);
            goto done;
        }
        int is_send = PyObject_IsTrue(PyTuple_GET_ITEM(item, 0));
        char what[48];
        snprintf(what, sizeof what, "ops[%zd].tensor", i);
        if (is_send < 0 || read_p2p_op(self, PyTuple_GET_ITEM(item, 1), PyTuple_GET_ITEM(item, 2),
                                       is_send ? MP_SEND : MP_RECV, what, &ops[i]) < 0)
            goto done;
    }
    if (check_self_pairs(self, ops, (int)n) < 0)
        goto done;
    mp_comm_prune(self);
    if (begin_posting(self) < 0)
        goto done;
    RequestObject **made = PyMem_Calloc((size_t)n, sizeof *made);
    step_plan plan = {.ops = ops, .nops = (int)n, .lane = (int)lane};
    int rc = made ? post_steps(self, &plan, 1, call, made) : (PyErr_NoMemory(), -1);
    end_posting(self);
    self->calls++;
    if (rc == 0 && (reqs = PyList_New(n)))
        for (Py_ssize_t i = 0; i < n; i++)
            PyList_SET_ITEM(reqs, i, (PyObject *)made[i]);
    else if (rc == 0)
        for (Py_ssize_t i = 0; i < n; i++)
            Py_DECREF(made[i]);
    PyMem_Free(made);
done:
    PyMem_Free(ops);
    Py_DECREF(seq);
    return reqs;
}

/* ---- control ----------------------------------------------------------------------------- */

static PyObject *comm_abort(CommObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"rank", "reason", NULL};
    PyObject *rank_obj = Py_None;
    const char *reason = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|$Oz:abort", kwlist, &rank_obj, &reason))
        return NULL;
    int cause = self->group_rank;
    if (rank_obj != Py_None && (cause = group_rank_of(self, rank_obj, "rank")) < 0)
        return NULL;
    if (self->transport)
        self->transport->ops->abort(self->transport, MP_ERR_ABORTED, cause, reason);
    Py_RETURN_NONE;
}

/* Called by the process's watchdog thread. The GIL stays held: the check is short (the transport
 * never waits on the peers in it), and a close() meanwhile cannot free the transport. */
static PyObject *comm_watchdog_check(CommObject *self, PyObject *Py_UNUSED(ignored))
{
    mp_transport *t = self->transport;
    char detail[256] = "";
    mp_result cause = t && t->ops->watch ? t->ops->watch(t, self->timeout, detail, sizeof detail) : MP_OK;
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
    t->ops->abort(t, cause, self->group_rank, detail);
    Py_XSETREF(self->abort_report, Py_NewRef(msg));
    PyObject *exc = PyObject_CallOneArg(mp_failure_type(self->state, cause), msg);
    Py_DECREF(msg);
    return exc;
}

static PyObject *comm_close(CommObject *self, PyObject *Py_UNUSED(ignored))
{
    comm_shutdown(self);
    Py_RETURN_NONE;
}

static PyObject *comm_enter(CommObject *self, PyObject *Py_UNUSED(ignored)) { return Py_NewRef(self); }

static PyObject *comm_exit(CommObject *self, PyObject *Py_UNUSED(args))
{
    comm_shutdown(self);
    Py_RETURN_FALSE;
}

static PyObject *comm_stats(CommObject *self, PyObject *Py_UNUSED(ignored))
{
    PyObject *stats = Py_BuildValue("{s:K,s:K,s:K,s:K,s:d}", "sends", (unsigned long long)self->sends, "recvs",
                                    (unsigned long long)self->recvs, "bytes_sent", (unsigned long long)self->bytes_sent,
                                    "bytes_received", (unsigned long long)self->bytes_received, "wait_seconds",
                                    self->wait_seconds);
    uint64_t paths[MP_SHM_NPATHS];
    if (!stats || !self->transport || !mp_shm_received_by_path(self->transport, paths))
        return stats;
    PyObject *by_path = Py_BuildValue("{s:K,s:K,s:K,s:K}", "inline", (unsigned long long)paths[SHM_PATH_INLINE],
                                      "single_copy", (unsigned long long)paths[SHM_PATH_CMA], "bounce",
                                      (unsigned long long)paths[SHM_PATH_BOUNCE], "arena",
                                      (unsigned long long)paths[SHM_PATH_ARENA]);
    if (!by_path || PyDict_SetItemString(stats, "received_by_path", by_path) < 0)
        Py_CLEAR(stats);
    Py_XDECREF(by_path);
    return stats;
}

static PyObject *comm_check_tensor(CommObject *self, PyObject *args)
{
    PyObject *tensor;
    const char *what = "tensor";
    if (!PyArg_ParseTuple(args, "O|s:check_tensor", &tensor, &what))
        return NULL;
    mp_buffer buf;
    if (mp_read_tensor(self->state, tensor, what, self->device, &buf) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *comm_single_copy(CommObject *self, PyObject *peer)
{
    if (!self->transport) /* a query: an aborted communicator still answers it */
        return PyErr_Format(self->state->P2PError, "communicator is closed");
    int r = group_rank_of(self, peer, "peer");
    if (r < 0)
        return NULL;
    if (strcmp(self->transport->ops->name, "shm") != 0)
        Py_RETURN_TRUE; /* NCCL moves data between devices with no host copy at all */
    return PyBool_FromLong(mp_shm_single_copy(self->transport, r));
}

static const char *result_key(int r)
{
    switch (r) {
    case MP_OK: return "";
    case MP_ERR_MISMATCH: return "mismatch";
    case MP_ERR_TIMEOUT: return "timeout";
    case MP_ERR_DEADLOCK: return "deadlock";
    case MP_ERR_PEER_DEAD: return "peer_dead";
    case MP_ERR_ABORTED: return "aborted";
    case MP_ERR_CLOSED: return "closed";
    case MP_ERR_CORRUPT: return "corrupt";
    default: return "system";
    }
}

static PyObject *trace_entry_dict(const mp_trace_entry *e, int matched)
{
    static const char *const states[] = {"posted", "completed", "failed"};
    PyObject *done = e->t_completed ? PyFloat_FromDouble(e->t_completed) : Py_NewRef(Py_None);
    if (!done)
        return NULL;
    const char *state = e->state == MP_TRACE_POSTED && matched ? "matched" : states[e->state % 3];
    return Py_BuildValue("{s:s,s:s,s:i,s:K,s:s,s:i,s:K,s:K,s:i,s:K,s:s,s:s,s:s,s:d,s:N,s:O}", "kind",
                         e->kind == MP_SEND ? "send" : "recv", "label", mp_label_name((mp_label)e->label), "peer",
                         e->peer_global, "nbytes", (unsigned long long)e->nbytes, "dtype", mp_dtype_name(e->dtype),
                         "lane", e->lane, "step", (unsigned long long)e->step, "seq", (unsigned long long)e->seq,
                         "group_size", e->group_size, "call", (unsigned long long)e->call, "call_name",
                         e->call_name, "state", state, "error", result_key(e->result), "t_posted", e->t_posted,
                         "t_completed", done, "waited", e->waited ? Py_True : Py_False);
}

static PyObject *comm_recent_ops(CommObject *self, PyObject *Py_UNUSED(ignored))
{
    mp_comm_prune(self); /* finished ops get their final state */
    mp_trace_entry *entries = PyMem_Malloc(sizeof(mp_trace_entry) * MP_TRACE_CAPACITY);
    if (!entries)
        return PyErr_NoMemory();
    size_t n = mp_trace_recent(self->trace, entries, MP_TRACE_CAPACITY);
    /* Ops still in flight: whether their partner has met them is the transport's live word. */
    uint64_t first = n ? entries[0].id : 0;
    unsigned char *matched = PyMem_Calloc(n ? n : 1, 1);
    PyObject *out = matched ? PyList_New((Py_ssize_t)n) : PyErr_NoMemory();
    for (Py_ssize_t i = 0; out && i < PyList_GET_SIZE(self->inflight); i++) {
        const mp_op *op = &((RequestObject *)PyList_GET_ITEM(self->inflight, i))->op;
        if (op->trace_id >= first && op->trace_id - first < n)
            matched[op->trace_id - first] = (unsigned char)atomic_load_explicit(&((mp_op *)op)->matched,
                                                                                memory_order_relaxed);
    }
    for (size_t i = 0; out && i < n; i++) {
        PyObject *d = trace_entry_dict(&entries[i], matched[i]);
        if (!d) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)i, d);
    }
    PyMem_Free(matched);
    PyMem_Free(entries);
    return out;
}

static PyObject *get_rank(CommObject *self, void *Py_UNUSED(c)) { return PyLong_FromLong(self->group_rank); }
static PyObject *get_global_rank(CommObject *self, void *Py_UNUSED(c)) { return PyLong_FromLong(self->global_ranks[self->group_rank]); }
static PyObject *get_size(CommObject *self, void *Py_UNUSED(c)) { return PyLong_FromLong(self->size); }
static PyObject *get_prev_rank(CommObject *self, void *Py_UNUSED(c)) { return PyLong_FromLong(self->global_ranks[(self->group_rank + self->size - 1) % self->size]); }
static PyObject *get_next_rank(CommObject *self, void *Py_UNUSED(c)) { return PyLong_FromLong(self->global_ranks[(self->group_rank + 1) % self->size]); }
static PyObject *get_lanes(CommObject *self, void *Py_UNUSED(c)) { return PyLong_FromLong(self->nlanes); }
static PyObject *get_timeout(CommObject *self, void *Py_UNUSED(c)) { return PyFloat_FromDouble(self->timeout); }
static PyObject *get_eager(CommObject *self, void *Py_UNUSED(c)) { return PyLong_FromUnsignedLongLong(self->eager_threshold); }
static PyObject *get_backend(CommObject *self, void *Py_UNUSED(c)) { return Py_NewRef(self->backend); }
static PyObject *get_closed(CommObject *self, void *Py_UNUSED(c)) { return PyBool_FromLong(self->transport == NULL); }
static PyObject *get_device(CommObject *self, void *Py_UNUSED(c)) { return PyLong_FromLong(self->device); }
static PyObject *get_id(CommObject *self, void *Py_UNUSED(c)) { return PyUnicode_FromString(self->id); }
static PyObject *get_on_error(CommObject *self, void *Py_UNUSED(c)) { return Py_NewRef(self->on_error ? self->on_error : Py_None); }

static int set_on_error(CommObject *self, PyObject *value, void *Py_UNUSED(c))
{
    if (value && value != Py_None && !PyCallable_Check(value)) {
        PyErr_Format(PyExc_TypeError, "on_error must be callable or None, not %.100s", Py_TYPE(value)->tp_name);
        return -1;
    }
    Py_XSETREF(self->on_error, value && value != Py_None ? Py_NewRef(value) : NULL);
    return 0;
}

static PyObject *get_ranks(CommObject *self, void *Py_UNUSED(c))
{
    PyObject *t = PyTuple_New(self->size);
    for (int r = 0; t && r < self->size; r++)
        PyTuple_SET_ITEM(t, r, PyLong_FromLong(self->global_ranks[r]));
    return t;
}

static PyGetSetDef comm_getset[] = {
    {"rank", (getter)get_rank, NULL, "This process's rank in the group (its parity orders the parity mode).", NULL},
    {"global_rank", (getter)get_global_rank, NULL, "This process's global rank.", NULL},
    {"size", (getter)get_size, NULL, "Ranks in the group.", NULL},
    {"ranks", (getter)get_ranks, NULL, "Global rank of each group rank.", NULL},
    {"prev_rank", (getter)get_prev_rank, NULL, "Global rank of the previous stage (wraps around the ring).", NULL},
    {"next_rank", (getter)get_next_rank, NULL, "Global rank of the next stage (wraps around the ring).", NULL},
    {"lanes", (getter)get_lanes, NULL, "Independent ordered queues: 1, or 2 (forward, backward).", NULL},
    {"timeout", (getter)get_timeout, NULL, "Default deadline of a wait, in seconds.", NULL},
    {"eager_threshold", (getter)get_eager, NULL, "Sends up to this many bytes complete without a posted receive.", NULL},
    {"backend", (getter)get_backend, NULL, "The transport: 'shm' or 'nccl'.", NULL},
    {"arena_bytes", (getter)mp_comm_arena_bytes, NULL,
     "Size of this rank's receive arena (shm; 0: none), from which empty() allocates.", NULL},
    {"device", (getter)get_device, NULL, "CUDA ordinal of the tensors it carries; -1 for CPU memory.", NULL},
    {"closed", (getter)get_closed, NULL, "True after close().", NULL},
    {"id", (getter)get_id, NULL, "Names this communicator: the same on all its ranks, different for every other.", NULL},
    {"on_error", (getter)get_on_error, (setter)set_on_error,
     "None, or a callable given each P2PError this communicator is about to raise (the flight recorder dumps).",
     NULL},
    {NULL},
};

static PyMethodDef comm_methods[] = {
    {"exchange", (PyCFunction)(void (*)(void))comm_exchange, METH_FASTCALL | METH_KEYWORDS,
     "exchange(send_next=None, recv_prev=None, send_prev=None, recv_next=None, *, mode='parity', "
     "prev_rank=None, next_rank=None, call=None) -> dict\n\nPosts one pipeline exchange in one call and returns a "
     "Request per posted op, keyed by op name. mode='parity' issues the ops one by one in Megatron's "
     "parity order; 'batched' issues each lane's ops as one group. prev_rank / next_rank (global ranks) "
     "override the ring neighbours. call names the API call for reports and the flight recorder."},
    {"isend", (PyCFunction)(void (*)(void))comm_isend, METH_VARARGS | METH_KEYWORDS,
     "isend(tensor, peer, *, call=None) -> Request\n\nPosts a send to global rank `peer` on lane 0, after every op issued before."},
    {"irecv", (PyCFunction)(void (*)(void))comm_irecv, METH_VARARGS | METH_KEYWORDS,
     "irecv(tensor, peer, *, call=None) -> Request\n\nPosts a receive from global rank `peer` on lane 0, after every op issued before."},
    {"batch", (PyCFunction)(void (*)(void))comm_batch, METH_VARARGS | METH_KEYWORDS,
     "batch(ops, *, lane=0, call=None) -> list[Request]\n\nPosts (is_send, tensor, peer) ops as one group on "
     "`lane`, after every op issued before on it."},
    {"abort", (PyCFunction)(void (*)(void))comm_abort, METH_VARARGS | METH_KEYWORDS,
     "abort(*, rank=None, reason=None) -> None\n\nFails every pending op here and at every peer. Idempotent. "
     "rank: the global rank whose failure this abort passes on (default: this one), which reports name as the "
     "cause; reason: why, quoted by the failures it causes."},
    {"close", (PyCFunction)comm_close, METH_NOARGS,
     "Stops the transport and releases its resources; ops still pending fail (and abort the peers). Idempotent."},
    {"stats", (PyCFunction)comm_stats, METH_NOARGS,
     "Messages and bytes posted, and seconds spent in wait(); shm also counts the messages received by each path: "
     "inline (in the descriptor), single_copy (process_vm_readv by the receiver), bounce (two copies through the "
     "segment) and arena (written into the receive buffer by the sender)."},
    {"empty", (PyCFunction)(void (*)(void))mp_comm_empty, METH_VARARGS | METH_KEYWORDS,
     "empty(shape, dtype) -> Tensor: an uninitialised receive buffer. On shm it lies in this rank's "
     "arena, which its peers have mapped, so a send into it is one copy by the sender; it falls back "
     "to plain memory (logged once) when the arena is full. On nccl, torch.empty on the device."},
    {"recent_ops", (PyCFunction)comm_recent_ops, METH_NOARGS,
     "recent_ops() -> list[dict]: the last ops this rank posted (up to 1024), oldest first: kind, label, peer "
     "(global rank), nbytes, dtype, lane, step (per lane), seq (per pair and lane), group_size, call (the k-th "
     "API call), call_name, state (posted, matched, completed or failed), error ('' or the failure class), "
     "t_posted and t_completed (wall-clock seconds; None while pending) and waited (wait() was called)."},
    {"watchdog_check", (PyCFunction)comm_watchdog_check, METH_NOARGS,
     "watchdog_check() -> exception or None\n\nFor the process's watchdog (megatron_p2p.watchdog). NCCL: finishes "
     "the ops whose device work has completed; when device work has been pending longer than the timeout, or "
     "NCCL reports an asynchronous error, aborts the lane communicators and returns the exception (not raised) "
     "whose report the next call on this communicator raises. Always None on shm, whose waits time themselves."},
    {"check_tensor", (PyCFunction)comm_check_tensor, METH_VARARGS,
     "check_tensor(tensor, name='tensor') -> None\n\nRaises the TypeError or ValueError that posting `tensor` on "
     "this communicator would raise, naming it `name`; posts nothing."},
    {"single_copy", (PyCFunction)comm_single_copy, METH_O,
     "single_copy(peer) -> bool: whether large messages from `peer` arrive with one copy (CMA)."},
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
    {Py_tp_methods, comm_methods},
    {Py_tp_getset, comm_getset},
    {Py_tp_doc, "Communicator(backend, unique_id, group_rank, ranks, *, lanes=2, eager_threshold=0, timeout=300.0, "
                "single_copy=True)\n\nLow-level constructor, collective over the group; use "
                "megatron_p2p.init_communicator()."},
    {0, NULL},
};

PyType_Spec mp_communicator_spec = {
    .name = "megatron_p2p._C.Communicator",
    .basicsize = sizeof(CommObject),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = comm_slots,
};
