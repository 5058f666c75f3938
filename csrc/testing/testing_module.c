/* megatron_p2p._testing: hooks that only the tests and benchmarks need, kept out of the module
 * users import (as CPython keeps _testcapi apart). It reaches _C's Communicators only through
 * _C's capsule (python/capi.h). Built by the Makefile's test and benchmark targets alone. */
#include "python/capi.h"
#include "null_transport.h"
#include "pingpong.h"
#include "shm_corrupt.h"

typedef struct {
    const mp_capi *api;
    PyObject *communicator_type; /* megatron_p2p._C.Communicator */
} testing_state;

static testing_state *state_of(PyObject *mod) { return (testing_state *)PyModule_GetState(mod); }

static void append_line(void *list, const char *line)
{
    if (PyErr_Occurred())
        return;
    PyObject *text = PyUnicode_DecodeUTF8(line, (Py_ssize_t)strlen(line), "replace");
    if (text && PyList_Append((PyObject *)list, text) == 0)
        Py_DECREF(text);
    else
        Py_XDECREF(text);
}

static PyObject *corrupt_segment(PyObject *mod, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"comm", "seed", "fields", NULL};
    PyObject *comm;
    unsigned long long seed;
    int fields = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OK|i:corrupt_segment", kwlist, &comm, &seed, &fields))
        return NULL;
    const shm_view *v = state_of(mod)->api->shm_view_of(comm);
    if (!v)
        return NULL;
    if (fields < 1)
        return PyErr_Format(PyExc_ValueError, "fields must be at least 1, got %d", fields);
    PyObject *lines = PyList_New(0);
    if (!lines)
        return NULL;
    mp_shm_corrupt(v, (uint64_t)seed, fields, append_line, lines);
    if (PyErr_Occurred())
        Py_CLEAR(lines);
    return lines;
}

/* The benchmark-only transport: _C.Communicator's arguments, without the backend. */
static PyObject *null_communicator(PyObject *mod, PyObject *args, PyObject *kwargs)
{
    testing_state *st = state_of(mod);
    PyObject *name = PyUnicode_FromString("null");
    PyObject *head = name ? PyTuple_Pack(1, name) : NULL;
    PyObject *full = head ? PySequence_Concat(head, args) : NULL;
    PyObject *comm = full ? st->api->communicator_over((PyTypeObject *)st->communicator_type, "null", mp_null_open,
                                                       full, kwargs)
                          : NULL;
    Py_XDECREF(name);
    Py_XDECREF(head);
    Py_XDECREF(full);
    return comm;
}

/* The latency benchmark's C floor, run by both ranks between their round trips. */
static PyObject *pingpong(PyObject *mod, PyObject *args, PyObject *kwargs)
{
    (void)mod;
    static char *kwlist[] = {"name", "rank", "round_trips", "timeout", NULL};
    const char *name;
    int rank;
    Py_ssize_t trips;
    double timeout = 10.0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "sin|d:pingpong", kwlist, &name, &rank, &trips, &timeout))
        return NULL;
    if (name[0] != '/' || strchr(name + 1, '/') || strlen(name) > 200)
        return PyErr_Format(PyExc_ValueError, "name must be '/' and up to 200 characters without '/', got %R",
                            PyTuple_GET_ITEM(args, 0));
    if (rank != 0 && rank != 1)
        return PyErr_Format(PyExc_ValueError, "rank must be 0 or 1, got %d", rank);
    if (trips < 1)
        return PyErr_Format(PyExc_ValueError, "round_trips must be at least 1, got %zd", trips);
    if (!(timeout > 0))
        return PyErr_Format(PyExc_ValueError, "timeout must be positive, got %g", timeout);
    double *oneway = rank == 0 ? PyMem_RawMalloc(sizeof *oneway * (size_t)trips) : NULL;
    if (rank == 0 && !oneway)
        return PyErr_NoMemory();
    char why[300] = "";
    int e;
    Py_BEGIN_ALLOW_THREADS
    e = mp_pingpong(name, rank, (size_t)trips, timeout, oneway, why, sizeof why);
    Py_END_ALLOW_THREADS
    PyObject *out = NULL;
    if (e) {
        PyObject *exc = PyObject_CallFunction(PyExc_OSError, "is", e, why);
        if (exc) {
            PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
            Py_DECREF(exc);
        }
    } else if (!oneway) {
        out = PyList_New(0); /* rank 1 takes part and times nothing */
    } else if ((out = PyList_New(trips))) {
        for (Py_ssize_t i = 0; i < trips; i++) {
            PyObject *f = PyFloat_FromDouble(oneway[i]);
            if (!f) {
                Py_CLEAR(out);
                break;
            }
            PyList_SET_ITEM(out, i, f);
        }
    }
    PyMem_RawFree(oneway);
    return out;
}

static PyMethodDef testing_methods[] = {
    {"corrupt_segment", (PyCFunction)(void (*)(void))corrupt_segment, METH_VARARGS | METH_KEYWORDS,
     "corrupt_segment(comm, seed, fields=1) -> [str, ...]\n\n"
     "Overwrites `fields` fields of the live shm segment of `comm`, chosen by `seed`, with garbage (as a hostile "
     "or broken peer could), and describes each. Never call it on a communicator you need."},
    {"null_communicator", (PyCFunction)(void (*)(void))null_communicator, METH_VARARGS | METH_KEYWORDS,
     "null_communicator(unique_id, group_rank, ranks, **options) -> Communicator\n\n"
     "A Communicator over the null transport, which completes every op when it is posted, with no copy and no "
     "peer: what a call costs on it is the binding layer's own cost. For benchmarks and the binding-layer tests."},
    {"pingpong", (PyCFunction)(void (*)(void))pingpong, METH_VARARGS | METH_KEYWORDS,
     "pingpong(name, rank, round_trips, timeout=10.0) -> [float, ...]\n\n"
     "The latency benchmark's C floor, called by two processes at once, ranks 0 and 1: they bounce a counter "
     "`round_trips` times through the shared page `name` (rank 0 creates it and unlinks it once rank 1 has it "
     "mapped), each spinning then yielding as the shm transport waits. Rank 0 gets each trip's one-way time in "
     "microseconds, rank 1 an empty list. TimeoutError when the other side does not answer within `timeout` "
     "seconds of the call."},
    {NULL},
};

static int testing_exec(PyObject *mod)
{
    testing_state *st = state_of(mod);
    st->api = PyCapsule_Import(MP_CAPI_CAPSULE, 0);
    if (!st->api)
        return -1;
    PyObject *c = PyImport_ImportModule("megatron_p2p._C");
    if (!c)
        return -1;
    st->communicator_type = PyObject_GetAttrString(c, "Communicator");
    Py_DECREF(c);
    return st->communicator_type ? 0 : -1;
}

static int testing_traverse(PyObject *mod, visitproc visit, void *arg)
{
    Py_VISIT(state_of(mod)->communicator_type);
    return 0;
}

static int testing_clear(PyObject *mod)
{
    Py_CLEAR(state_of(mod)->communicator_type);
    return 0;
}

static void testing_free(void *mod) { testing_clear((PyObject *)mod); }

static PyModuleDef_Slot testing_slots[] = {
    {Py_mod_exec, testing_exec},
    {0, NULL},
};

static struct PyModuleDef testing_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "megatron_p2p._testing",
    .m_doc = "Test and benchmark hooks of megatron_p2p: never imported by the package itself.",
    .m_size = sizeof(testing_state),
    .m_methods = testing_methods,
    .m_slots = testing_slots,
    .m_traverse = testing_traverse,
    .m_clear = testing_clear,
    .m_free = testing_free,
};

PyMODINIT_FUNC PyInit__testing(void)
{
    return PyModuleDef_Init(&testing_def);
}
