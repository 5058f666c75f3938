/* Request: one posted op, and the host wait that completes it (request.c). */
#ifndef MP_REQUEST_H
#define MP_REQUEST_H

#include "session.h"

RequestObject *mp_request_new(CommObject *comm, PyObject *tensor, const mp_buffer *buf);

#endif
