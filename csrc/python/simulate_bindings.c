/* Bindings of the offline simulator, _C.simulate(size, lanes, eager_threshold, streams, details=True,
 * serialize_lanes=False, timeline=False), and of the one deadlock report grammar, _C.cycle_report(ranks),
 * which the Python tools word their cycles with. */
#include <string.h>

#include "bindings.h"
#include "core/cycle_report.h"
#include "core/simulate.h"

static const char *const verdict_names[] = {"ok", "deadlock", "mismatch"};

/* (rank, call, step, index, seq, kind, peer, lane, bytes, dtype, slot, label, partner_state, partner_posted,
 *  posted_round, done_round) */
static PyObject *op_tuple(const mp_sim_op_info *o)
{
    return Py_BuildValue("(iiiiiiiiLiiiiLLL)", o->rank, o->call, o->step, o->index, o->seq, o->kind, o->peer, o->lane,
                         (long long)o->bytes, o->dtype, o->slot, o->label, o->partner_state,
                         (long long)o->partner_posted, (long long)o->posted_round, (long long)o->done_round);
}

static int append_op(void *ctx, const mp_sim_op_info *op)
{
    PyObject *t = op_tuple(op);
    if (!t)
        return -1;
    int rc = PyList_Append((PyObject *)ctx, t);
    Py_DECREF(t);
    return rc;
}

static PyObject *result_tuple(const mp_sim *sim, int details, int timeline)
{
    mp_sim_verdict v = mp_sim_result(sim);
    PyObject *mismatch = Py_None, *cycle = PyList_New(0), *pending = PyList_New(0), *ops = PyList_New(0);
    Py_INCREF(Py_None);
    if (!cycle || !pending || !ops)
        goto fail;
    if (v == MP_SIM_MISMATCH) {
        mp_sim_op_info send, recv;
        mp_sim_mismatch(sim, &send, &recv);
        Py_DECREF(mismatch);
        mismatch = Py_BuildValue("(NN)", op_tuple(&send), op_tuple(&recv));
        if (!mismatch)
            goto fail;
    }
    size_t n = 0;
    int closed = 0;
    const mp_sim_edge *edges = v == MP_SIM_DEADLOCK ? mp_sim_cycle(sim, &n, &closed) : NULL;
    for (size_t i = 0; i < n; i++) {
        PyObject *e = Py_BuildValue("(Ni)", op_tuple(&edges[i].op), edges[i].waits_for);
        if (!e || PyList_Append(cycle, e) < 0) {
            Py_XDECREF(e);
            goto fail;
        }
        Py_DECREF(e);
    }
    if (details && v != MP_SIM_OK && mp_sim_each_pending(sim, append_op, pending) != 0)
        goto fail;
    if (timeline && mp_sim_each_op(sim, append_op, ops) != 0)
        goto fail;
    return Py_BuildValue("(sLNNNNLN)", verdict_names[v], (long long)mp_sim_rounds(sim), mismatch, cycle,
                         PyBool_FromLong(closed), pending, (long long)mp_sim_num_pending(sim), ops);
fail:
    Py_XDECREF(ops);
    Py_XDECREF(mismatch);
    Py_XDECREF(cycle);
    Py_XDECREF(pending);
    return NULL;
}

static PyObject *simulate(PyObject *Py_UNUSED(mod), PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"size", "lanes", "eager_threshold", "streams", "details", "serialize_lanes", "timeline",
                             NULL};
    int size, lanes, details = 1, serialize_lanes = 0, timeline = 0;
    long long eager;
    PyObject *streams;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "iiLO|ppp:simulate", kwlist, &size, &lanes, &eager, &streams,
                                     &details, &serialize_lanes, &timeline))
        return NULL;
    if (size < 1 || size > 65536)
        return PyErr_Format(PyExc_ValueError, "size must be from 1 to 65536, got %d", size);
    if (lanes < 1 || lanes > MP_MAX_LANES)
        return PyErr_Format(PyExc_ValueError, "lanes must be 1 or 2, got %d", lanes);
    if (eager < 0)
        return PyErr_Format(PyExc_ValueError, "eager_threshold must be >= 0, got %lld", eager);
    if (!PyTuple_Check(streams) || PyTuple_GET_SIZE(streams) != size)
        return PyErr_Format(PyExc_TypeError, "streams must be a tuple of %d bytes objects (one int64 stream per rank)",
                            size);
    for (int r = 0; r < size; r++) {
        PyObject *s = PyTuple_GET_ITEM(streams, r);
        if (!PyBytes_Check(s))
            return PyErr_Format(PyExc_TypeError, "streams[%d] must be bytes, got %s", r, Py_TYPE(s)->tp_name);
        if (PyBytes_GET_SIZE(s) % (Py_ssize_t)sizeof(int64_t))
            return PyErr_Format(PyExc_ValueError, "streams[%d] holds %zd bytes, not a whole number of int64 values", r,
                                PyBytes_GET_SIZE(s));
    }

    /* Owned here, released below on every path. The bytes objects are immutable and held by
     * `streams`, so they are read without the GIL; a misaligned one is copied. */
    const int64_t **views = calloc((size_t)size, sizeof *views);
    size_t *lengths = calloc((size_t)size, sizeof *lengths);
    int64_t **copies = calloc((size_t)size, sizeof *copies);
    PyObject *result = NULL;
    mp_sim *sim = NULL;
    if (!views || !lengths || !copies) {
        PyErr_NoMemory();
        goto out;
    }
    /* gcc 12's analyzer loses a block stored at a variable index of a heap array (copies[r]) and
     * calls it leaked; `out` frees every one. */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wanalyzer-malloc-leak"
    for (int r = 0; r < size; r++) {
        PyObject *s = PyTuple_GET_ITEM(streams, r);
        const char *data = PyBytes_AS_STRING(s);
        lengths[r] = (size_t)PyBytes_GET_SIZE(s) / sizeof(int64_t);
        if ((uintptr_t)data % _Alignof(int64_t)) {
            copies[r] = malloc(lengths[r] ? lengths[r] * sizeof(int64_t) : 1);
            if (!copies[r]) {
                PyErr_NoMemory();
                goto out;
            }
            memcpy(copies[r], data, lengths[r] * sizeof(int64_t));
            views[r] = copies[r];
        } else {
            views[r] = (const int64_t *)(const void *)data;
        }
    }
#pragma GCC diagnostic pop
    mp_sim_program prog = {.size = size, .nlanes = lanes, .eager_threshold = (uint64_t)eager,
                           .streams = views, .lengths = lengths, .serialize_lanes = serialize_lanes,
                           .timeline = timeline};
    char err[256] = "";
    int oom = 0, rc = 0;
    Py_BEGIN_ALLOW_THREADS
    sim = mp_sim_new(&prog, err, sizeof err, &oom);
    if (sim)
        rc = mp_sim_run(sim);
    Py_END_ALLOW_THREADS
    if (!sim) {
        if (oom)
            PyErr_NoMemory();
        else
            PyErr_SetString(PyExc_ValueError, err);
        goto out;
    }
    if (rc != 0) {
        PyErr_NoMemory();
        goto out;
    }
    result = result_tuple(sim, details, timeline);
out:
    mp_sim_free(sim);
    if (copies)
        for (int r = 0; r < size; r++)
            free(copies[r]);
    free(copies);
    free(views);
    free(lengths);
    return result;
}

#define CYCLE_RANK_FIELDS "(rank, peer, pid, kind, what, nbytes, dtype, lane, message, call, label, partner_posted, " \
                          "lanes_serialized, partner_count)"

static PyObject *cycle_report(PyObject *Py_UNUSED(module), PyObject *arg)
{
    PyObject *seq = PySequence_Fast(arg, "cycle_report() takes a sequence of ranks, each " CYCLE_RANK_FIELDS);
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    mp_cycle_rank *ranks = n > 0 && n <= INT_MAX ? PyMem_Calloc((size_t)n, sizeof *ranks) : NULL;
    PyObject *out = NULL;
    if (n <= 0 || n > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "cycle_report() needs at least one rank");
        goto done;
    }
    if (!ranks) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        mp_cycle_rank *r = &ranks[i];
        const char *kind;
        int posted, serialized;
        unsigned long long nbytes, message, count;
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyTuple_Check(item)) {
            PyErr_Format(PyExc_TypeError, "cycle_report() rank %zd: expected a tuple " CYCLE_RANK_FIELDS ", got %.100s",
                         i, Py_TYPE(item)->tp_name);
            goto done;
        }
        if (!PyArg_ParseTuple(item, "iilssKsiKssppK;cycle_report() takes tuples " CYCLE_RANK_FIELDS, &r->rank, &r->peer,
                              &r->pid, &kind, &r->what, &nbytes, &r->dtype, &r->lane, &message, &r->call, &r->label,
                              &posted, &serialized, &count))
            goto done;
        if (strcmp(kind, "send") != 0 && strcmp(kind, "recv") != 0) {
            PyErr_Format(PyExc_ValueError, "cycle_report() rank %zd: kind must be 'send' or 'recv', not %R", i,
                         PyTuple_GET_ITEM(item, 3));
            goto done;
        }
        r->kind = kind[0] == 's' ? MP_SEND : MP_RECV;
        r->nbytes = nbytes, r->message = message, r->partner_count = count;
        r->partner_posted = posted, r->lanes_serialized = serialized;
    }
    size_t len = mp_cycle_report(ranks, (int)n, NULL, 0) + 1;
    char *text = PyMem_Malloc(len);
    if (!text) {
        PyErr_NoMemory();
        goto done;
    }
    mp_cycle_report(ranks, (int)n, text, len);
    out = PyUnicode_FromString(text);
    PyMem_Free(text);
done:
    PyMem_Free(ranks);
    Py_DECREF(seq);
    return out;
}

PyMethodDef mp_simulate_methods[] = {
    {"cycle_report", cycle_report, METH_O,
     "cycle_report(ranks, /)\n--\n\n"
     "The deadlock report of the wait-for cycle ranks[0] -> ranks[1] -> ... -> ranks[0], in the words shm's\n"
     "run-time detection uses (csrc/core/cycle_report.h). Each rank is a tuple " CYCLE_RANK_FIELDS ";\n"
     "kind is 'send' or 'recv', pid 0 when not known."},
    {"simulate", (PyCFunction)(void (*)(void))simulate, METH_VARARGS | METH_KEYWORDS,
     "simulate(size, lanes, eager_threshold, streams, details=True, serialize_lanes=False, timeline=False)\n--\n\n"
     "Returns (verdict, rounds, mismatch, cycle, cycle_closed, pending, num_pending, ops).\n"
     "Runs a packed program (csrc/core/simulate.h; megatron_p2p.program builds it) under the transport's\n"
     "semantics; serialize_lanes runs each rank's steps of all lanes in one queue in issue order (matching\n"
     "stays per lane). verdict: 'ok' | 'deadlock' | 'mismatch'. Ops are tuples (rank, call, step, index, seq,\n"
     "kind, peer, lane, bytes, dtype, slot, label, partner_state, partner_posted, posted_round, done_round;\n"
     "-1: never); mismatch: (send, recv) or None; cycle: [(op, waits_for_rank), ...]; pending: every op left\n"
     "pending (empty unless details); ops: every op, with the rounds it was posted and completed in (empty\n"
     "unless timeline)."},
    {NULL},
};
