/* Shared by the binding files: module state, the Communicator and Request objects, tensor
 * reading. No transport logic lives in the bindings. */
#ifndef MP_BINDINGS_H
#define MP_BINDINGS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "interrupt.h"
#include "op.h"
#include "plan.h"
#include "trace.h"
#include "transport.h"

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
} mp_state;

typedef struct {
    PyObject_HEAD
    mp_transport *transport; /* NULL once closed */
    /* Transport calls running with the GIL released (posts, waits). A close meanwhile, from
     * another thread or from a signal handler that a wait runs, aborts the transport and leaves
     * it in `closing` for the last of them to destroy. */
    int busy;
    mp_transport *closing;
    int group_rank;
    int size;
    int nlanes;
    int *global_ranks;       /* group rank -> global rank */
    double timeout;
    uint64_t eager_threshold;
    uint64_t *send_seq;      /* [lane][peer]: sends issued so far */
    uint64_t *recv_seq;      /* [lane][peer] */
    uint64_t *lane_steps;    /* [lane] */
    PyObject *inflight;      /* list of Requests the transport may still touch */
    PyObject *backend;       /* str */
    int device;              /* CUDA ordinal of the tensors it carries; -1: CPU memory */
    int check;               /* debug matching: ops carry their tensor's shape */
    PyObject *stream_fn;     /* device transports: () -> the caller's current stream, as an int */
    PyObject *on_abort;      /* called with a message when this rank aborts the communicator */
    PyObject *on_error;      /* called with each P2PError about to be raised (the flight recorder dumps) */
    PyObject *abort_report;  /* str: what the watchdog found when it aborted the communicator, or NULL */
    mp_trace *trace;
    uint64_t calls;          /* API calls that posted ops: exchange, isend, irecv, batch */
    char id[20];             /* the same on every rank of this communicator: hex of its unique id */
    uint64_t sends, recvs, bytes_sent, bytes_received;
    double wait_seconds;
    mp_state *state;
    PyObject *weakrefs;
} CommObject;

typedef struct {
    PyObject_HEAD
    CommObject *comm;  /* strong */
    PyObject *tensor;  /* strong: what the caller passed */
    PyObject *storage; /* strong: the memory itself, which outlives a `tensor.data = ...` swap */
    mp_op op;
} RequestObject;

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

RequestObject *mp_request_new(CommObject *comm, PyObject *tensor, const mp_buffer *buf);
/* Blocks (GIL released) until the request's op is done, then raises its failure if any. */
int mp_request_complete(RequestObject *req, double timeout);
/* The exception class of a failure. */
PyObject *mp_failure_type(mp_state *st, mp_result r);
/* Raises the exception that describes a finished op's failure. */
void mp_raise_op_failure(CommObject *comm, const mp_op *op);
/* The pending-op report used by timeouts and aborts. */
PyObject *mp_comm_pending_report(CommObject *comm);
void mp_comm_prune(CommObject *comm);
/* The caller's current stream on the communicator's device (NULL on the CPU transport). */
int mp_comm_stream(CommObject *comm, void **stream);
/* Aborts after a local timeout and tells the other ranks (on_abort). */
void mp_comm_abort_for_timeout(CommObject *comm, PyObject *message);
/* Around a transport call made with the GIL released: returns the transport to call (NULL once
 * closed and destroyed), and ends the call, destroying the transport if it was closed meanwhile
 * and this was the last call inside it. */
mp_transport *mp_comm_enter(CommObject *comm);
void mp_comm_leave(CommObject *comm);
/* Hands the exception being raised to the communicator's on_error hook, if any. */
void mp_comm_error_hook(CommObject *comm);
/* Marks the op's flight-recorder entry: waited on, or finished with its result. */
void mp_comm_trace_waited(CommObject *comm, const mp_op *op);

#endif
