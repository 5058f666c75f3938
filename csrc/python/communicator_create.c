/* Communicator creation: the arguments checked up front, then the transport opened
 * collectively, with the GIL released and Python's signal handlers given their turns. */
#include <stdlib.h>
#include <string.h>

#include <unistd.h>

#include "communicator.h"
#include "errors.h"
#include "nccl/nccl_transport.h"
#include "shm/shm_transport.h"

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
        .global_ranks = self->global_ranks,
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
        .check = self->check,
    };
    mp_interrupt interrupt;
    cfg.interrupt = &interrupt;
    mp_blocking_begin(wait, &interrupt);
    mp_result r = mp_shm_open(&cfg, t, err, errlen);
    mp_blocking_end(wait);
    return r;
}

PyObject *mp_comm_create(PyTypeObject *type, PyObject *args, PyObject *kwargs, const char *local_name,
                         mp_local_open_fn local_open)
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
    /* A backend of megatron_p2p._testing (the null transport), never one of _C's own. */
    int is_local = local_open && strcmp(backend, local_name) == 0;
    if (!is_nccl && !is_local && strcmp(backend, "shm") != 0)
        return PyErr_Format(PyExc_ValueError, "backend must be 'shm' or 'nccl', got '%s'", backend);
    if (lanes < 1 || lanes > MP_MAX_LANES)
        return PyErr_Format(PyExc_ValueError, "lanes must be 1 (one ordered queue) or %d (one per direction), got %d",
                            MP_MAX_LANES, lanes);
    if (eager > MP_SHM_MAX_EAGER)
        return PyErr_Format(PyExc_ValueError, "eager_threshold must be an int in [0, %u], got %llu", MP_SHM_MAX_EAGER,
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
        return PyErr_Format(PyExc_ValueError, "arena_bytes must be an int in [0, %llu], got %llu",
                            MP_ARENA_MAX_BYTES, arena_bytes);

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
    self->numbers = PyMem_Calloc(nchan, sizeof *self->numbers);
    self->lane_steps = PyMem_Calloc((size_t)lanes, sizeof(uint64_t));
    self->trace = PyMem_Calloc(1, sizeof(mp_trace));
    self->inflight = PyList_New(0);
    self->backend = PyUnicode_FromString(backend);
    if (!self->numbers || !self->lane_steps || !self->trace) {
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
                : is_local ? local_open(group_rank, self->size, lanes, &t)
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
    self->buffered_at_most = t->buffered_at_most;
    self->owner = getpid();
    PyObject *added = PyObject_CallMethod(st->live, "add", "O", (PyObject *)self); /* for the fork hook */
    if (!added) {
        mp_comm_shutdown(self);
        goto fail;
    }
    Py_DECREF(added);
    return (PyObject *)self;
fail:
    Py_DECREF(self);
    return NULL;
}
