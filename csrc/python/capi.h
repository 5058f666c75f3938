/* megatron_p2p._C's C API for megatron_p2p._testing, published as a capsule (as datetime
 * publishes its own): what the test and benchmark hooks need of a Communicator, so that the
 * hooks themselves stay out of the module users import. */
#ifndef MP_CAPI_H
#define MP_CAPI_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "core/transport.h"
#include "shm/segment.h"

#define MP_CAPI_CAPSULE "megatron_p2p._C._C_API"

/* Opens a transport that needs no peer and no store (the null transport). */
typedef mp_result (*mp_local_open_fn)(int rank, int size, int nlanes, mp_transport **out);

typedef struct {
    /* `type(backend, unique_id, group_rank, ranks, **kwargs)` for `type` = _C.Communicator, with
     * its checks, where backend `name` (which _C itself refuses) opens `open`. */
    PyObject *(*communicator_over)(PyTypeObject *type, const char *name, mp_local_open_fn open, PyObject *args,
                                   PyObject *kwargs);
    /* The segment of a live Communicator of the shm backend; NULL with TypeError or ValueError. */
    const shm_view *(*shm_view_of)(PyObject *comm);
} mp_capi;

#endif
