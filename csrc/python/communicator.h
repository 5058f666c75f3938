/* The Communicator type, one file per role: creation (communicator_create.c), posting
 * (communicator_post.c), introspection (communicator_info.c); communicator.c holds the type
 * itself and its life cycle. Only those files and capi.c include this header. */
#ifndef MP_COMMUNICATOR_H
#define MP_COMMUNICATOR_H

#include "capi.h"
#include "session.h"

/* Communicator(backend, unique_id, group_rank, ranks, **options), collective over the group.
 * `local_name` and `local_open` (NULL for _C.Communicator itself) serve one more backend. */
PyObject *mp_comm_create(PyTypeObject *type, PyObject *args, PyObject *kwargs, const char *local_name,
                         mp_local_open_fn local_open);

/* Posting */
PyObject *mp_comm_exchange(CommObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *mp_comm_isend(CommObject *self, PyObject *args, PyObject *kwargs);
PyObject *mp_comm_irecv(CommObject *self, PyObject *args, PyObject *kwargs);
PyObject *mp_comm_batch(CommObject *self, PyObject *args, PyObject *kwargs);

/* Introspection */
PyObject *mp_comm_stats(CommObject *self, PyObject *ignored);
PyObject *mp_comm_check_tensor(CommObject *self, PyObject *args);
PyObject *mp_comm_single_copy(CommObject *self, PyObject *peer);
PyObject *mp_comm_recent_ops(CommObject *self, PyObject *ignored);
extern PyGetSetDef mp_comm_getset[];

#endif
