/* Module functions of the NCCL backend: loading the library, making unique ids, and showing the
 * NCCL calls a step becomes (the check that the NCCL transport issues what the plan says). */
#include <string.h>

#include "bindings.h"
#include "nccl/nccl_transport.h"

static PyObject *nccl_load(PyObject *mod, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"env_path", "bundled", NULL};
    const char *env_path = NULL;
    PyObject *bundled = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "zO:nccl_load", kwlist, &env_path, &bundled))
        return NULL;
    PyObject *seq = PySequence_Fast(bundled, "bundled must be a sequence of paths");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    const char **paths = PyMem_Calloc((size_t)(n ? n : 1), sizeof(char *));
    PyObject *out = NULL;
    if (!paths) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (!(paths[i] = PyUnicode_AsUTF8(PySequence_Fast_GET_ITEM(seq, i))))
            goto done;
    char err[2048];
    const mp_nccl_lib *lib = mp_nccl_load(env_path, paths, (int)n, err, sizeof err);
    if (!lib) {
        PyErr_Format(((mp_state *)PyModule_GetState(mod))->BackendUnavailableError, "libnccl could not be loaded: %s",
                     err);
        goto done;
    }
    out = Py_BuildValue("(iss)", lib->version, lib->path, lib->source);
done:
    PyMem_Free(paths);
    Py_DECREF(seq);
    return out;
}

static PyObject *nccl_unique_id(PyObject *mod, PyObject *Py_UNUSED(ignored))
{
    char err[2048];
    const mp_nccl_lib *lib = mp_nccl_loaded(err, sizeof err);
    if (!lib)
        return PyErr_Format(((mp_state *)PyModule_GetState(mod))->BackendUnavailableError, "%s", err);
    mp_ncclUniqueId id;
    mp_ncclResult_t r;
    Py_BEGIN_ALLOW_THREADS /* it may probe network interfaces */
    r = lib->GetUniqueId(&id);
    Py_END_ALLOW_THREADS
    if (r != MP_NCCL_SUCCESS)
        return PyErr_Format(((mp_state *)PyModule_GetState(mod))->P2PError, "ncclGetUniqueId failed: %s",
                            lib->GetErrorString(r));
    return PyBytes_FromStringAndSize(id.internal, sizeof id.internal);
}

/* ---- the recorder ---------------------------------------------------------------------------- */

static mp_ncclResult_t append(void *ctx, PyObject *call)
{
    int rc = call ? PyList_Append((PyObject *)ctx, call) : -1;
    Py_XDECREF(call);
    return rc == 0 ? MP_NCCL_SUCCESS : MP_NCCL_SYSTEM_ERROR;
}

static mp_ncclResult_t rec_group_start(void *ctx) { return append(ctx, Py_BuildValue("(s)", "group_start")); }
static mp_ncclResult_t rec_group_end(void *ctx, int lane) { return append(ctx, Py_BuildValue("(si)", "group_end", lane)); }

static mp_ncclResult_t rec_op(void *ctx, const char *name, const mp_op *op, size_t count, mp_ncclDataType_t type)
{
    return append(ctx, Py_BuildValue("(siinii)", name, op->lane, op->peer, (Py_ssize_t)count, (int)type, op->index));
}

static mp_ncclResult_t rec_send(void *ctx, const mp_op *op, size_t count, mp_ncclDataType_t type) { return rec_op(ctx, "send", op, count, type); }
static mp_ncclResult_t rec_recv(void *ctx, const mp_op *op, size_t count, mp_ncclDataType_t type) { return rec_op(ctx, "recv", op, count, type); }

static const mp_nccl_calls recorder = {rec_group_start, rec_group_end, rec_send, rec_recv};

/* steps: [(lane, [(is_send, peer, nbytes, dtype_code), ...]), ...] */
static PyObject *nccl_issue_trace(PyObject *Py_UNUSED(mod), PyObject *args)
{
    PyObject *steps;
    int version;
    if (!PyArg_ParseTuple(args, "Oi:_nccl_issue_trace", &steps, &version))
        return NULL;
    PyObject *calls = PyList_New(0);
    PyObject *it = calls ? PyObject_GetIter(steps) : NULL, *item;
    if (!it) {
        Py_XDECREF(calls);
        return NULL;
    }
    while (calls && (item = PyIter_Next(it))) {
        int lane;
        PyObject *ops;
        mp_step *step = NULL;
        mp_op *storage = NULL;
        Py_ssize_t n = 0;
        if (!PyArg_ParseTuple(item, "iO", &lane, &ops) || (n = PySequence_Size(ops)) < 0)
            goto fail;
        step = PyMem_Calloc(1, sizeof(mp_step) + sizeof(mp_op *) * (size_t)(n ? n : 1));
        storage = PyMem_Calloc((size_t)(n ? n : 1), sizeof(mp_op));
        if (!step || !storage) {
            PyErr_NoMemory();
            goto fail;
        }
        step->lane = lane;
        step->nops = (int)n;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *o = PySequence_GetItem(ops, i);
            int is_send;
            unsigned long long nbytes;
            mp_op *op = &storage[i];
            int ok = o && PyArg_ParseTuple(o, "piKi", &is_send, &op->peer, &nbytes, &op->dtype);
            Py_XDECREF(o);
            if (!ok)
                goto fail;
            op->kind = is_send ? MP_SEND : MP_RECV;
            op->nbytes = nbytes;
            op->lane = lane;
            op->index = (int)i;
            step->ops[i] = op;
        }
        if (mp_nccl_issue(&recorder, calls, step, version) != MP_NCCL_SUCCESS)
            goto fail;
        PyMem_Free(step);
        PyMem_Free(storage);
        Py_DECREF(item);
        continue;
    fail:
        PyMem_Free(step);
        PyMem_Free(storage);
        Py_DECREF(item);
        Py_CLEAR(calls);
    }
    Py_DECREF(it);
    if (PyErr_Occurred())
        Py_CLEAR(calls);
    return calls;
}

PyMethodDef mp_nccl_methods[] = {
    {"nccl_load", (PyCFunction)(void (*)(void))nccl_load, METH_VARARGS | METH_KEYWORDS,
     "nccl_load(env_path, bundled)\n--\n\nReturns (version, path, source). Loads libnccl once per process: env_path "
     "alone when given, else a copy already loaded, else the bundled paths in order, else libnccl.so.2 "
     "from the system. Raises BackendUnavailableError naming every attempt."},
    {"nccl_unique_id", nccl_unique_id, METH_NOARGS, "nccl_unique_id()\n--\n\nA new 128-byte ncclUniqueId, from the libnccl nccl_load() loaded."},
    {"_nccl_issue_trace", nccl_issue_trace, METH_VARARGS,
     "_nccl_issue_trace(steps, nccl_version, /)\n--\n\nA list of calls. Runs the NCCL transport's issuing code on "
     "steps [(lane, [(is_send, peer, nbytes, dtype_code), ...]), ...] against a recorder instead of libnccl: "
     "('group_start',), ('send'|'recv', lane, peer, count, nccl_datatype, index), ('group_end', lane)."},
    {NULL},
};
