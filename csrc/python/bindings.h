/* Shared by the binding files: the module state, tensor reading and the GIL-released blocking
 * call. No transport logic lives in the bindings. */
#ifndef MP_BINDINGS_H
#define MP_BINDINGS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "core/interrupt.h"
#include "core/op.h"
#include "core/plan.h"

/* The torch.Tensor attributes the bindings read: properties first, then the methods they call
 * with no arguments. */
typedef enum {
    MP_ATTR_LAYOUT = 0,
    MP_ATTR_IS_NESTED,
    MP_ATTR_DTYPE,
    MP_ATTR_IS_CPU,
    MP_ATTR_IS_CUDA,
    MP_ATTR_DEVICE,
    MP_ATTR_NBYTES,
    MP_ATTR_SHAPE,
    MP_ATTR_IS_CONJ,
    MP_FIRST_METHOD_ATTR = MP_ATTR_IS_CONJ,
    MP_ATTR_IS_NEG,
    MP_ATTR_GET_DEVICE,
    MP_ATTR_IS_CONTIGUOUS,
    MP_ATTR_DATA_PTR,
    MP_ATTR_UNTYPED_STORAGE,
    MP_NUM_TENSOR_ATTRS,
} mp_tensor_attr;

#define MP_EXCHANGE_OPTIONS 4 /* mode, prev_rank, next_rank, call */

typedef struct {
    PyObject *P2PError;
    PyObject *P2PTimeoutError;
    PyObject *DeadlockError;
    PyObject *MismatchError;
    PyObject *PeerFailureError;
    PyObject *BackendUnavailableError;
    PyObject *tensor_type;   /* torch.Tensor */
    PyObject *strided;       /* torch.strided: the one layout whose bytes are its values */
    PyObject *torch_empty, *from_dlpack; /* torch.empty, torch.from_dlpack: Communicator.empty() */
    PyObject *dtype_codes;   /* {torch.dtype: mp_dtype code} */
    PyObject *attr_names[MP_NUM_TENSOR_ATTRS];  /* interned */
    /* The C descriptor (getset or method) each attribute resolves to on torch.Tensor, or NULL
     * where it is something else: called directly on tensors of exactly those two types. */
    PyObject *attr_descrs[MP_NUM_TENSOR_ATTRS];
    PyObject *slot_names[MP_NUM_SLOTS]; /* interned: the keys of exchange()'s result, by mp_slot */
    PyObject *exchange_options[MP_EXCHANGE_OPTIONS]; /* interned: exchange()'s keyword-only names */
    PyObject *parameter_type; /* torch.nn.Parameter where it resolves them as torch.Tensor does, or NULL */
    PyTypeObject *CommunicatorType;
    PyTypeObject *RequestType;
    PyObject *live; /* weakref.WeakSet of this process's Communicators, which a fork child disowns */
} mp_state;

typedef struct {
    void *ptr;
    uint64_t nbytes;
    int dtype;
} mp_buffer;

mp_state *mp_state_from_type(PyTypeObject *tp);

/* Finds the attributes' descriptors on torch.Tensor (module setup); -1 with an error set. */
int mp_tensor_attrs_load(mp_state *st, PyObject *torch);
/* obj.<attr>, or obj.<attr>() for a method: a new reference, or NULL with the error set. */
PyObject *mp_tensor_attr_get(mp_state *st, PyObject *obj, mp_tensor_attr attr);

/* Reads pointer, bytes and dtype of a contiguous tensor on `device` (-1: CPU); on a misuse
 * sets TypeError or ValueError naming `what` and returns -1. */
int mp_read_tensor(mp_state *st, PyObject *obj, const char *what, int device, mp_buffer *out);

/* A blocking transport call (creation, a host wait) with the GIL released between begin and end;
 * `interrupt`, handed to the transport, gives Python's signal handlers a turn every 50 ms and
 * asks `peer_failed` (may be NULL: callable -> None or the failure's text, raised as `error`).
 * When it stops the call, the transport returns MP_ERR_INTERRUPTED and the exception is set. */
typedef struct {
    PyThreadState *saved;
    double next_check;
    PyObject *peer_failed;
    PyObject *error;
} mp_blocking;

void mp_blocking_begin(mp_blocking *b, mp_interrupt *interrupt);
void mp_blocking_end(mp_blocking *b);

extern PyType_Spec mp_communicator_spec;
extern PyType_Spec mp_request_spec;

/* Adds _C_API, the capsule of capi.h, to the module. */
int mp_capi_add(PyObject *mod);

#endif
