#include "bindings.h"

/* obj.name, or obj.name() when `call`: a new reference, or NULL with the error set. */
static PyObject *get(PyObject *obj, PyObject *name, int call)
{
    return call ? PyObject_CallMethodNoArgs(obj, name) : PyObject_GetAttr(obj, name);
}

static int get_true(PyObject *obj, PyObject *name, int call)
{
    PyObject *v = get(obj, name, call);
    int r = v ? PyObject_IsTrue(v) : -1;
    Py_XDECREF(v);
    return r;
}

static int get_u64(PyObject *obj, PyObject *name, int call, uint64_t *out)
{
    PyObject *v = get(obj, name, call);
    if (!v)
        return -1;
    *out = PyLong_AsUnsignedLongLong(v);
    Py_DECREF(v);
    return PyErr_Occurred() ? -1 : 0;
}

/* Only a dense tensor's bytes are its values: sparse and mkldnn layouts keep them elsewhere, a
 * nested tensor's data_ptr() may be 0, and a conjugate or negative view applies its bit lazily,
 * so its bytes are not the values it reads as. */
static int check_dense(mp_state *st, PyObject *obj, const char *what)
{
    PyObject *layout = PyObject_GetAttr(obj, st->str_layout);
    if (!layout)
        return -1;
    if (layout != st->strided) {
        PyErr_Format(PyExc_ValueError, "%s has layout %R; only dense (torch.strided) tensors have a plain-bytes wire "
                     "format: pass tensor.to_dense()", what, layout);
        Py_DECREF(layout);
        return -1;
    }
    Py_DECREF(layout);
    const struct {
        PyObject *name;
        int call;
        const char *fix;
    } views[] = {
        {st->str_is_nested, 0, "a nested tensor has no single buffer: send its components"},
        {st->str_is_conj, 1, "its conjugate bit is not applied to its bytes: pass tensor.resolve_conj()"},
        {st->str_is_neg, 1, "its negative bit is not applied to its bytes: pass tensor.resolve_neg()"},
    };
    for (size_t i = 0; i < sizeof views / sizeof views[0]; i++) {
        int set = get_true(obj, views[i].name, views[i].call);
        if (set < 0)
            return -1;
        if (set) {
            PyErr_Format(PyExc_ValueError, "%s: %s", what, views[i].fix);
            return -1;
        }
    }
    return 0;
}

int mp_read_tensor(mp_state *st, PyObject *obj, const char *what, int device, mp_buffer *out)
{
    if (!PyObject_TypeCheck(obj, (PyTypeObject *)st->tensor_type)) {
        PyErr_Format(PyExc_TypeError, "%s must be a torch.Tensor, not %.100s", what, Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (check_dense(st, obj, what) < 0)
        return -1;
    PyObject *dtype = PyObject_GetAttr(obj, st->str_dtype);
    if (!dtype)
        return -1;
    PyObject *code = PyDict_GetItemWithError(st->dtype_codes, dtype);
    if (!code) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "%s has dtype %R, which has no plain-bytes wire format", what, dtype);
        Py_DECREF(dtype);
        return -1;
    }
    Py_DECREF(dtype);
    out->dtype = (int)PyLong_AsLong(code);

    int here = get_true(obj, device < 0 ? st->str_is_cpu : st->str_is_cuda, 0);
    if (here < 0)
        return -1;
    if (here && device >= 0) {
        PyObject *where = get(obj, st->str_get_device, 1);
        long on = where ? PyLong_AsLong(where) : -1;
        Py_XDECREF(where);
        if (on == -1 && PyErr_Occurred())
            return -1;
        here = on == device;
    }
    if (!here) {
        PyObject *dev = PyObject_GetAttr(obj, st->str_device);
        if (dev) {
            if (device < 0)
                PyErr_Format(PyExc_ValueError, "%s is on device '%S'; this communicator carries CPU tensors "
                             "(backend 'shm'); use backend 'nccl' for CUDA tensors", what, dev);
            else
                PyErr_Format(PyExc_ValueError, "%s is on device '%S'; this communicator carries tensors on "
                             "cuda:%d", what, dev, device);
            Py_DECREF(dev);
        }
        return -1;
    }
    int contiguous = get_true(obj, st->str_is_contiguous, 1);
    if (contiguous < 0)
        return -1;
    if (!contiguous) {
        PyErr_Format(PyExc_ValueError, "%s is not contiguous; pass tensor.contiguous() (the wire format is its bytes)",
                     what);
        return -1;
    }
    uint64_t ptr;
    if (get_u64(obj, st->str_nbytes, 0, &out->nbytes) < 0 || get_u64(obj, st->str_data_ptr, 1, &ptr) < 0)
        return -1;
    if (!ptr && out->nbytes) {
        PyErr_Format(PyExc_ValueError, "%s has %llu bytes but no data pointer", what, (unsigned long long)out->nbytes);
        return -1;
    }
    out->ptr = (void *)(uintptr_t)ptr;
    return 0;
}
