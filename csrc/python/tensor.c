/* Reading a tensor: its pointer, byte count and dtype, after the checks that its bytes are its
 * values. A read takes about ten attributes, which is most of the cost of posting, so for a
 * tensor of exactly torch.Tensor or torch.nn.Parameter the reads call torch's own C descriptors,
 * found once: what attribute lookup would call, without the lookup and the bound method it makes.
 * A subclass may override any attribute (a fake CUDA tensor overrides is_cuda): it is looked up. */
#include "bindings.h"
#include "core/dtype.h"

static const char *const attr_names[MP_NUM_TENSOR_ATTRS] = {
    [MP_ATTR_LAYOUT] = "layout",
    [MP_ATTR_IS_NESTED] = "is_nested",
    [MP_ATTR_DTYPE] = "dtype",
    [MP_ATTR_IS_CPU] = "is_cpu",
    [MP_ATTR_IS_CUDA] = "is_cuda",
    [MP_ATTR_DEVICE] = "device",
    [MP_ATTR_NBYTES] = "nbytes",
    [MP_ATTR_SHAPE] = "shape",
    [MP_ATTR_IS_CONJ] = "is_conj",
    [MP_ATTR_IS_NEG] = "is_neg",
    [MP_ATTR_GET_DEVICE] = "get_device",
    [MP_ATTR_IS_CONTIGUOUS] = "is_contiguous",
    [MP_ATTR_DATA_PTR] = "data_ptr",
    [MP_ATTR_UNTYPED_STORAGE] = "untyped_storage",
};

static int is_method(mp_tensor_attr a) { return a >= MP_FIRST_METHOD_ATTR; }

/* What torch.Tensor's attribute is, if it is the C descriptor expected (NULL otherwise). */
static PyObject *c_descriptor(PyObject *type, PyObject *name, mp_tensor_attr a)
{
    PyObject *d = PyObject_GetAttr(type, name); /* on the class, a descriptor returns itself */
    if (!d) {
        PyErr_Clear();
        return NULL;
    }
    if (Py_IS_TYPE(d, is_method(a) ? &PyMethodDescr_Type : &PyGetSetDescr_Type))
        return d;
    Py_DECREF(d);
    return NULL;
}

int mp_tensor_attrs_load(mp_state *st, PyObject *torch)
{
    PyObject *nn = PyObject_GetAttrString(torch, "nn");
    PyObject *parameter = nn ? PyObject_GetAttrString(nn, "Parameter") : NULL;
    Py_XDECREF(nn);
    PyErr_Clear(); /* without torch.nn.Parameter, only torch.Tensor reads fast */
    int parameter_same = parameter && PyType_Check(parameter);
    for (int a = 0; a < MP_NUM_TENSOR_ATTRS; a++) {
        if (!(st->attr_names[a] = PyUnicode_InternFromString(attr_names[a]))) {
            Py_XDECREF(parameter);
            return -1;
        }
        st->attr_descrs[a] = c_descriptor(st->tensor_type, st->attr_names[a], (mp_tensor_attr)a);
        if (parameter_same) {
            PyObject *p = PyObject_GetAttr(parameter, st->attr_names[a]);
            parameter_same = p == st->attr_descrs[a];
            Py_XDECREF(p);
            PyErr_Clear();
        }
    }
    st->parameter_type = parameter_same ? parameter : NULL;
    if (!parameter_same)
        Py_XDECREF(parameter);
    return 0;
}

static int exact_type(mp_state *st, PyObject *obj)
{
    return Py_IS_TYPE(obj, (PyTypeObject *)st->tensor_type) ||
           (st->parameter_type && Py_IS_TYPE(obj, (PyTypeObject *)st->parameter_type));
}

static PyObject *attr(mp_state *st, PyObject *obj, int exact, mp_tensor_attr a)
{
    PyObject *d = exact ? st->attr_descrs[a] : NULL;
    if (d)
        return is_method(a) ? PyObject_Vectorcall(d, &obj, 1, NULL)
                            : Py_TYPE(d)->tp_descr_get(d, obj, (PyObject *)Py_TYPE(obj));
    return is_method(a) ? PyObject_CallMethodNoArgs(obj, st->attr_names[a]) : PyObject_GetAttr(obj, st->attr_names[a]);
}

PyObject *mp_tensor_attr_get(mp_state *st, PyObject *obj, mp_tensor_attr a)
{
    return attr(st, obj, exact_type(st, obj), a);
}

static int attr_true(mp_state *st, PyObject *obj, int exact, mp_tensor_attr a)
{
    PyObject *v = attr(st, obj, exact, a);
    int r = v == Py_True ? 1 : v == Py_False ? 0 : v ? PyObject_IsTrue(v) : -1;
    Py_XDECREF(v);
    return r;
}

static int attr_u64(mp_state *st, PyObject *obj, int exact, mp_tensor_attr a, uint64_t *out)
{
    PyObject *v = attr(st, obj, exact, a);
    if (!v)
        return -1;
    *out = PyLong_AsUnsignedLongLong(v);
    Py_DECREF(v);
    return *out == (uint64_t)-1 && PyErr_Occurred() ? -1 : 0;
}

/* Only a dense tensor's bytes are its values: sparse and mkldnn layouts keep them elsewhere, and
 * a nested tensor's data_ptr() may be 0. */
static int check_dense(mp_state *st, PyObject *obj, int exact, const char *what)
{
    PyObject *layout = attr(st, obj, exact, MP_ATTR_LAYOUT);
    if (!layout)
        return -1;
    if (layout != st->strided) {
        PyErr_Format(PyExc_ValueError, "%s has layout %R; only dense (torch.strided) tensors have a plain-bytes wire "
                     "format: pass tensor.to_dense()", what, layout);
        Py_DECREF(layout);
        return -1;
    }
    Py_DECREF(layout);
    int nested = attr_true(st, obj, exact, MP_ATTR_IS_NESTED);
    if (nested > 0)
        PyErr_Format(PyExc_ValueError, "%s: a nested tensor has no single buffer: send its components", what);
    return nested ? -1 : 0;
}

/* A conjugate or negative view applies its bit lazily, so its bytes are not the values it reads
 * as. The conjugate of a real value is itself: only a complex tensor's conjugate bit matters. */
static int check_no_lazy_bit(mp_state *st, PyObject *obj, int exact, int complex, const char *what)
{
    if (complex) {
        int conj = attr_true(st, obj, exact, MP_ATTR_IS_CONJ);
        if (conj > 0)
            PyErr_Format(PyExc_ValueError, "%s: its conjugate bit is not applied to its bytes: pass "
                         "tensor.resolve_conj()", what);
        if (conj)
            return -1;
    }
    int neg = attr_true(st, obj, exact, MP_ATTR_IS_NEG);
    if (neg > 0)
        PyErr_Format(PyExc_ValueError, "%s: its negative bit is not applied to its bytes: pass tensor.resolve_neg()",
                     what);
    return neg ? -1 : 0;
}

/* Whether the tensor lives where the communicator carries tensors (-1: CPU, else that CUDA
 * ordinal); 0 with the error that says where it is instead, -1 on a failed read. */
static int check_device(mp_state *st, PyObject *obj, int exact, const char *what, int device)
{
    int here = attr_true(st, obj, exact, device < 0 ? MP_ATTR_IS_CPU : MP_ATTR_IS_CUDA);
    if (here < 0)
        return -1;
    if (here && device >= 0) {
        PyObject *where = attr(st, obj, exact, MP_ATTR_GET_DEVICE);
        long on = where ? PyLong_AsLong(where) : -1;
        Py_XDECREF(where);
        if (on == -1 && PyErr_Occurred())
            return -1;
        here = on == device;
    }
    if (here)
        return 1;
    PyObject *dev = attr(st, obj, exact, MP_ATTR_DEVICE);
    if (!dev)
        return -1;
    if (device < 0)
        PyErr_Format(PyExc_ValueError, "%s is on device '%S'; this communicator carries CPU tensors "
                     "(backend 'shm'); use backend 'nccl' for CUDA tensors", what, dev);
    else
        PyErr_Format(PyExc_ValueError, "%s is on device '%S'; this communicator carries tensors on "
                     "cuda:%d", what, dev, device);
    Py_DECREF(dev);
    return 0;
}

int mp_read_tensor(mp_state *st, PyObject *obj, const char *what, int device, mp_buffer *out)
{
    if (!PyObject_TypeCheck(obj, (PyTypeObject *)st->tensor_type)) {
        PyErr_Format(PyExc_TypeError, "%s must be a torch.Tensor, not %.100s", what, Py_TYPE(obj)->tp_name);
        return -1;
    }
    int exact = exact_type(st, obj);
    if (check_dense(st, obj, exact, what) < 0)
        return -1;
    PyObject *dtype = attr(st, obj, exact, MP_ATTR_DTYPE);
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
    if (check_no_lazy_bit(st, obj, exact, out->dtype == MP_DT_COMPLEX64 || out->dtype == MP_DT_COMPLEX128, what) < 0)
        return -1;
    if (check_device(st, obj, exact, what, device) <= 0)
        return -1;
    int contiguous = attr_true(st, obj, exact, MP_ATTR_IS_CONTIGUOUS);
    if (contiguous < 0)
        return -1;
    if (!contiguous) {
        PyErr_Format(PyExc_ValueError, "%s is not contiguous; pass tensor.contiguous() (the wire format is its bytes)",
                     what);
        return -1;
    }
    uint64_t ptr;
    if (attr_u64(st, obj, exact, MP_ATTR_NBYTES, &out->nbytes) < 0 || attr_u64(st, obj, exact, MP_ATTR_DATA_PTR, &ptr) < 0)
        return -1;
    if (!ptr && out->nbytes) {
        PyErr_Format(PyExc_ValueError, "%s has %llu bytes but no data pointer", what, (unsigned long long)out->nbytes);
        return -1;
    }
    out->ptr = (void *)(uintptr_t)ptr;
    return 0;
}
