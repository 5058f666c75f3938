/* The failure mapping: which exception class a transport result raises. */
#ifndef MP_ERRORS_H
#define MP_ERRORS_H

#include "bindings.h"
#include "core/result.h"

/* The exception class of a failure. */
PyObject *mp_failure_type(mp_state *st, mp_result r);

#endif
