#include "result.h"

const char *mp_result_str(mp_result r)
{
    switch (r) {
    case MP_OK: return "success";
    case MP_ERR_SYSTEM: return "a system or library call failed";
    case MP_ERR_MISMATCH: return "send and receive disagree on size or dtype";
    case MP_ERR_TIMEOUT: return "wait timed out";
    case MP_ERR_ABORTED: return "communicator aborted";
    case MP_ERR_PEER_DEAD: return "peer process died";
    case MP_ERR_CLOSED: return "communicator closed";
    case MP_ERR_CORRUPT: return "shared memory corrupt";
    case MP_ERR_DEADLOCK: return "deadlock";
    case MP_ERR_CAPTURE: return "not possible during CUDA graph capture";
    case MP_ERR_INTERRUPTED: return "interrupted";
    }
    return "unknown result";
}
