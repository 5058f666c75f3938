/* One result code per failure class, one string per code (as NCCL's public header does). */
#ifndef MP_RESULT_H
#define MP_RESULT_H

typedef enum {
    MP_OK = 0,
    MP_ERR_SYSTEM,      /* an OS, CUDA or NCCL call failed; its own detail is in the message */
    MP_ERR_MISMATCH,    /* matched send and receive disagree on bytes or dtype */
    MP_ERR_TIMEOUT,     /* a wait passed its deadline on this rank */
    MP_ERR_ABORTED,     /* the communicator was aborted (by a rank's timeout or abort()) */
    MP_ERR_PEER_DEAD,   /* a member process exited */
    MP_ERR_CLOSED,      /* the communicator was closed with the op still pending */
    MP_ERR_CORRUPT,     /* shared memory held a value out of bounds */
    MP_ERR_DEADLOCK,    /* this rank is in a wait-for cycle that can never resolve */
    MP_ERR_CAPTURE,     /* not possible while the caller's stream captures a CUDA graph */
    MP_ERR_INTERRUPTED, /* a signal handler raised while the call blocked; the caller has its exception */
} mp_result;

const char *mp_result_str(mp_result r);

#endif
