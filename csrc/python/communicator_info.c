/* Introspection: stats(), check_tensor(), single_copy(), recent_ops() and the attributes. */
#include <stdatomic.h>
#include <string.h>

#include "arena_tensor.h"
#include "communicator.h"
#include "core/dtype.h"
#include "shm/shm_transport.h"

PyObject *mp_comm_stats(CommObject *self, PyObject *Py_UNUSED(ignored))
{
    if (mp_comm_check_owner(self) < 0)
        return NULL;
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

PyObject *mp_comm_check_tensor(CommObject *self, PyObject *args)
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

PyObject *mp_comm_single_copy(CommObject *self, PyObject *peer)
{
    if (mp_comm_check_owner(self) < 0)
        return NULL;
    if (!self->transport) /* a query: an aborted communicator still answers it */
        return PyErr_Format(self->state->P2PError, "communicator is closed");
    int r = mp_comm_group_rank(self, peer, "peer");
    if (r < 0)
        return NULL;
    return PyBool_FromLong(mp_transport_single_copy(self->transport, r));
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

PyObject *mp_comm_recent_ops(CommObject *self, PyObject *Py_UNUSED(ignored))
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
static PyObject *get_buffered(CommObject *self, void *Py_UNUSED(c)) { return PyLong_FromUnsignedLongLong(self->buffered_at_most); }
static PyObject *get_backend(CommObject *self, void *Py_UNUSED(c)) { return Py_NewRef(self->backend); }
static PyObject *get_closed(CommObject *self, void *Py_UNUSED(c)) { return PyBool_FromLong(self->transport == NULL); }
static PyObject *get_host_waiting(CommObject *self, void *Py_UNUSED(c)) { return PyBool_FromLong(self->host_waits > 0); }
static PyObject *get_device(CommObject *self, void *Py_UNUSED(c)) { return PyLong_FromLong(self->device); }
static PyObject *get_id(CommObject *self, void *Py_UNUSED(c)) { return PyUnicode_FromString(self->id); }
static PyObject *get_on_error(CommObject *self, void *Py_UNUSED(c)) { return Py_NewRef(self->on_error ? self->on_error : Py_None); }

static PyObject *get_group_picture(CommObject *self, void *Py_UNUSED(c))
{
    return Py_NewRef(self->group_picture ? self->group_picture : Py_None);
}

static int set_group_picture(CommObject *self, PyObject *value, void *Py_UNUSED(c))
{
    if (value && value != Py_None && !PyUnicode_Check(value)) {
        PyErr_Format(PyExc_TypeError, "group_picture must be a str or None, not %.100s", Py_TYPE(value)->tp_name);
        return -1;
    }
    Py_XSETREF(self->group_picture, value && value != Py_None ? Py_NewRef(value) : NULL);
    return 0;
}

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

PyGetSetDef mp_comm_getset[] = {
    {"rank", (getter)get_rank, NULL, "This process's rank in the group (its parity orders the parity mode).", NULL},
    {"global_rank", (getter)get_global_rank, NULL, "This process's global rank.", NULL},
    {"size", (getter)get_size, NULL, "Ranks in the group.", NULL},
    {"ranks", (getter)get_ranks, NULL, "Global rank of each group rank.", NULL},
    {"prev_rank", (getter)get_prev_rank, NULL, "Global rank of the previous stage (wraps around the ring).", NULL},
    {"next_rank", (getter)get_next_rank, NULL, "Global rank of the next stage (wraps around the ring).", NULL},
    {"lanes", (getter)get_lanes, NULL, "Independent ordered queues: 1, or 2 (forward, backward).", NULL},
    {"timeout", (getter)get_timeout, NULL, "Default deadline of a wait, in seconds.", NULL},
    {"eager_threshold", (getter)get_eager, NULL, "Sends up to this many bytes complete without a posted receive.", NULL},
    {"buffered_at_most", (getter)get_buffered, NULL,
     "The largest send that may complete without a posted receive; a larger one never does (shm: "
     "eager_threshold; NCCL: a bound from NCCL's buffer parameters).", NULL},
    {"backend", (getter)get_backend, NULL, "The transport: 'shm' or 'nccl'.", NULL},
    {"arena_bytes", (getter)mp_comm_arena_bytes, NULL,
     "Size of this rank's receive arena (shm; 0: none), from which empty() allocates.", NULL},
    {"device", (getter)get_device, NULL, "CUDA ordinal of the tensors it carries; -1 for CPU memory.", NULL},
    {"closed", (getter)get_closed, NULL, "True after close().", NULL},
    {"host_waiting", (getter)get_host_waiting, NULL,
     "True while a thread is blocked in a host wait (Request.synchronize) on it.", NULL},
    {"id", (getter)get_id, NULL, "Names this communicator: the same on all its ranks, different for every other.", NULL},
    {"group_picture", (getter)get_group_picture, (setter)set_group_picture,
     "None, or what the stalled ranks of the group have pending (NCCL's stall analysis sets it): a timeout's "
     "report ends with it.", NULL},
    {"on_error", (getter)get_on_error, (setter)set_on_error,
     "None, or a callable given each P2PError this communicator is about to raise (the flight recorder dumps).",
     NULL},
    {NULL},
};
