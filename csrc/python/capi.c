/* The capsule of capi.h: what megatron_p2p._testing may do with _C's Communicators. */
#include "communicator.h"
#include "shm/shm_transport.h"

static PyObject *communicator_over(PyTypeObject *type, const char *name, mp_local_open_fn open, PyObject *args,
                                   PyObject *kwargs)
{
    if (!mp_state_from_type(type))
        return NULL;
    return mp_comm_create(type, args, kwargs, name, open);
}

static const shm_view *shm_view_of(PyObject *comm)
{
    if (!mp_state_from_type(Py_TYPE(comm))) {
        PyErr_Format(PyExc_TypeError, "comm must be a Communicator, not %.100s", Py_TYPE(comm)->tp_name);
        return NULL;
    }
    mp_transport *t = ((CommObject *)comm)->transport;
    const shm_view *v = t ? mp_shm_view(t) : NULL;
    if (!v)
        PyErr_Format(PyExc_ValueError, "comm must be a live communicator of the shm backend");
    return v;
}

static const mp_capi capi = {
    .communicator_over = communicator_over,
    .shm_view_of = shm_view_of,
};

int mp_capi_add(PyObject *mod)
{
    PyObject *capsule = PyCapsule_New((void *)&capi, MP_CAPI_CAPSULE, NULL);
    if (!capsule)
        return -1;
    int rc = PyModule_AddObjectRef(mod, "_C_API", capsule);
    Py_DECREF(capsule);
    return rc;
}
