/* Receive buffers from a communicator's arena, as torch tensors. */
#ifndef MP_ARENA_TENSOR_H
#define MP_ARENA_TENSOR_H

#include "session.h"

/* Communicator.empty(shape, dtype) */
PyObject *mp_comm_empty(CommObject *self, PyObject *args, PyObject *kwargs);
/* Communicator.arena_bytes */
PyObject *mp_comm_arena_bytes(CommObject *self, void *closure);

#endif
