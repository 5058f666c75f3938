/* Communicator.empty(): receive buffers from the rank's arena as ordinary torch tensors, built
 * through DLPack, whose deleter returns the block when torch frees the tensor's storage. */
#include "arena_tensor.h"

#include <string.h>
#include <unistd.h>

#include "shm/shm_transport.h"

/* DLPack's ABI (dlpack.h, version 0.8: what torch.from_dlpack takes as a "dltensor" capsule). */
typedef struct {
    int32_t device_type; /* 1: CPU */
    int32_t device_id;
} dl_device;
typedef struct {
    uint8_t code; /* 1: unsigned int */
    uint8_t bits;
    uint16_t lanes;
} dl_dtype;
typedef struct {
    void *data;
    dl_device device;
    int32_t ndim;
    dl_dtype dtype;
    int64_t *shape;
    int64_t *strides;
    uint64_t byte_offset;
} dl_tensor;
typedef struct dl_managed {
    dl_tensor tensor;
    void *manager_ctx;
    void (*deleter)(struct dl_managed *self);
} dl_managed;

typedef struct {
    dl_managed managed;
    int64_t length;
    mp_arena *arena;
    pid_t owner;      /* the process that allocated it: a fork child's copy is never returned */
} arena_block;

/* Called by torch, with or without the GIL, when the tensor's storage is freed. In a fork child
 * the arena is the parent's (its lock may be held by a thread that does not exist here, and its
 * memory is not mapped here): only the child's copy of the bookkeeping goes. */
static void release_block(dl_managed *m)
{
    arena_block *b = (arena_block *)m;
    if (b->owner == getpid())
        mp_arena_free(b->arena, m->tensor.data);
    PyMem_RawFree(b);
}

/* A capsule torch has not consumed still owns its block. */
static void capsule_destructor(PyObject *capsule)
{
    if (PyCapsule_IsValid(capsule, "dltensor"))
        release_block(PyCapsule_GetPointer(capsule, "dltensor"));
}

/* A 1-d uint8 tensor over a new block of `nbytes`, or NULL: with an exception set when Python
 * failed, without one (and `why` filled) when the arena refused. */
static PyObject *block_tensor(mp_state *st, mp_arena *a, uint64_t nbytes, char *why, size_t whylen)
{
    arena_block *b = PyMem_RawCalloc(1, sizeof *b);
    if (!b)
        return PyErr_NoMemory();
    void *data = mp_arena_alloc(a, nbytes, why, whylen);
    if (!data) {
        PyMem_RawFree(b);
        return NULL;
    }
    b->arena = a;
    b->owner = getpid();
    b->length = (int64_t)nbytes;
    b->managed.tensor = (dl_tensor){.data = data, .device = {1, 0}, .ndim = 1, .dtype = {1, 8, 1},
                                    .shape = &b->length, .strides = NULL, .byte_offset = 0};
    b->managed.deleter = release_block;
    PyObject *capsule = PyCapsule_New(&b->managed, "dltensor", capsule_destructor);
    if (!capsule) {
        release_block(&b->managed);
        return NULL;
    }
    PyObject *out = PyObject_CallOneArg(st->from_dlpack, capsule);
    Py_DECREF(capsule);
    return out;
}

/* The element count of `shape`, a sequence of non-negative ints; -1 with an exception set. */
static int64_t numel_of(PyObject *shape)
{
    PyObject *seq = PySequence_Fast(shape, "shape must be a sequence of ints (a tuple, list or torch.Size)");
    if (!seq)
        return -1;
    int64_t numel = 1;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq) && numel >= 0; i++) {
        PyObject *dim = PySequence_Fast_GET_ITEM(seq, i);
        long long d = PyLong_Check(dim) ? PyLong_AsLongLong(dim) : -1;
        if (d < 0 || (d && numel > INT64_MAX / d)) {
            if (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_OverflowError)) {
                PyErr_Clear();
                PyErr_Format(PyExc_ValueError, "shape must hold non-negative ints of a size that fits, got %R", shape);
            }
            numel = -1;
        } else {
            numel *= d;
        }
    }
    Py_DECREF(seq);
    return numel;
}

/* Said once per arena, on the logger the Python layer uses. */
static int warn_fallback(const char *why)
{
    PyObject *logging = PyImport_ImportModule("logging");
    PyObject *log = logging ? PyObject_CallMethod(logging, "getLogger", "s", "megatron_p2p.communicator") : NULL;
    PyObject *done = log ? PyObject_CallMethod(log, "warning", "ss", "megatron_p2p: %s; receive buffers fall back "
                                               "to plain memory (single copy by the receiver)", why)
                         : NULL;
    Py_XDECREF(done);
    Py_XDECREF(log);
    Py_XDECREF(logging);
    return done ? 0 : -1;
}

PyObject *mp_comm_empty(CommObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"shape", "dtype", NULL};
    PyObject *shape, *dtype;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO:empty", kwlist, &shape, &dtype) ||
        mp_comm_check_owner(self) < 0)
        return NULL;
    mp_state *st = self->state;
    if (strcmp(Py_TYPE(dtype)->tp_name, "torch.dtype") != 0)
        return PyErr_Format(PyExc_TypeError, "dtype must be a torch.dtype, not %.100s", Py_TYPE(dtype)->tp_name);
    if (!PyDict_GetItemWithError(st->dtype_codes, dtype))
        return PyErr_Occurred() ? NULL
                                : PyErr_Format(PyExc_ValueError, "dtype %R has no plain-bytes wire format", dtype);
    int64_t numel = numel_of(shape);
    if (numel < 0)
        return NULL;
    PyObject *itemsize_obj = PyObject_GetAttrString(dtype, "itemsize");
    long itemsize = itemsize_obj ? PyLong_AsLong(itemsize_obj) : -1;
    Py_XDECREF(itemsize_obj);
    if (itemsize <= 0)
        return PyErr_Occurred() ? NULL : PyErr_Format(PyExc_ValueError, "dtype %R has no item size", dtype);
    if (numel > INT64_MAX / itemsize)
        return PyErr_Format(PyExc_ValueError, "shape %R of %R is too large", shape, dtype);
    uint64_t nbytes = (uint64_t)numel * (uint64_t)itemsize;

    mp_arena *a = self->transport ? mp_shm_arena(self->transport) : NULL;
    /* Messages that fit a descriptor slot travel inline: the arena would not save their copy. */
    if (a && nbytes > SHM_INLINE_BYTES && nbytes > self->eager_threshold) {
        char why[256] = "";
        PyObject *bytes = block_tensor(st, a, nbytes, why, sizeof why);
        if (bytes) {
            PyObject *typed = PyObject_CallMethod(bytes, "view", "O", dtype);
            Py_DECREF(bytes);
            PyObject *out = typed ? PyObject_CallMethod(typed, "view", "O", shape) : NULL;
            Py_XDECREF(typed);
            return out;
        }
        if (PyErr_Occurred())
            return NULL;
        if (mp_arena_first_refusal(a) && warn_fallback(why) < 0)
            return NULL;
    }
    PyObject *device = self->device >= 0 ? PyUnicode_FromFormat("cuda:%d", self->device) : Py_NewRef(Py_None);
    PyObject *kw = device ? Py_BuildValue("{s:O,s:O}", "dtype", dtype, "device", device) : NULL;
    PyObject *pos = kw ? PyTuple_Pack(1, shape) : NULL;
    PyObject *out = pos ? PyObject_Call(st->torch_empty, pos, kw) : NULL;
    Py_XDECREF(pos);
    Py_XDECREF(kw);
    Py_XDECREF(device);
    return out;
}

PyObject *mp_comm_arena_bytes(CommObject *self, void *Py_UNUSED(closure))
{
    mp_arena *a = self->transport ? mp_shm_arena(self->transport) : NULL;
    return PyLong_FromUnsignedLongLong(a ? mp_arena_bytes(a) : 0);
}
