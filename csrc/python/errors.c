/* Which exception class each transport result raises (errors.h). */
#include "errors.h"

PyObject *mp_failure_type(mp_state *st, mp_result r)
{
    switch (r) {
    case MP_ERR_MISMATCH: return st->MismatchError;
    case MP_ERR_TIMEOUT: return st->P2PTimeoutError;
    case MP_ERR_DEADLOCK: return st->DeadlockError;
    case MP_ERR_PEER_DEAD: return st->PeerFailureError;
    default: return st->P2PError;
    }
}
