/* One point-to-point op and the step (group) it is issued in: what the bindings hand to a
 * transport. The op is owned by its Python Request; the transport may touch it only until it
 * stores MP_OP_DONE. */
#ifndef MP_OP_H
#define MP_OP_H

#include <stdatomic.h>
#include <stdint.h>

#include "plan.h"
#include "result.h"

typedef enum { MP_SEND = 0, MP_RECV = 1 } mp_kind;

/* Who issued the op; both sides name each other's op in a mismatch report. Labels below
 * MP_NUM_SLOTS are the mp_slot values (plan.h): an exchange's op is labelled by its slot. */
typedef enum {
    MP_LABEL_ISEND = MP_NUM_SLOTS,
    MP_LABEL_IRECV,
    MP_NUM_LABELS,
} mp_label;

typedef enum { MP_OP_QUEUED = 0, MP_OP_ACTIVE = 1, MP_OP_DONE = 2 } mp_op_state;

#define MP_DETAIL_LEN 320
#define MP_CALL_NAME_LEN 40 /* the API call that posted an op, e.g. send_forward_recv_backward */
#define MP_MAX_DIMS 8       /* shape dimensions debug matching compares */

typedef struct mp_op {
    /* Fixed when posted. */
    mp_kind kind;
    mp_label label;
    int peer;             /* group rank */
    int peer_global;      /* global rank, for messages */
    int lane;
    uint64_t seq;         /* k-th op of its kind between this pair on this lane */
    uint64_t step;        /* k-th step on its lane */
    void *buf;
    uint64_t nbytes;
    int dtype;
    uint64_t call;        /* k-th API call on the communicator */
    char call_name[MP_CALL_NAME_LEN];
    int ndim;             /* the tensor's shape, for debug matching only; -1 when not read */
    int64_t shape[MP_MAX_DIMS];
    uint64_t trace_id;    /* its entry in the flight recorder */
    /* Written by the transport; readable by anyone once state is DONE (acquire). */
    _Atomic uint32_t state;
    mp_result result;
    char detail[MP_DETAIL_LEN];
    _Atomic uint32_t matched; /* its partner is posted and data moves (the flight recorder shows it) */
    /* Transport-private progress. */
    uint64_t progress;
    uint64_t skip_total;  /* receive: bytes of a mismatched bounce message to drain */
    uint64_t stream_index;/* send: its place among the bounce-buffer sends of its channel */
    int phase;
    int index;            /* position in its step's ops */
    void *fence;          /* device transports: what completes it */
    struct mp_op *next_settled; /* shm: the next op of its step done but not yet shown done */
    unsigned long long captured; /* device transports: the id of the CUDA graph capture it was posted
                                  * into, 0 for none; stream-ordered only */
    void *remote;         /* shm send: the receiver's arena buffer, as mapped here */
    int offered;          /* shm receive: whether its sender knows where its buffer is (and may write it) */
} mp_op;

/* A group of ops issued together on one lane. Owned by the transport once posted; an op's
 * entry is cleared when the op finishes, because its Request may be freed from then on. */
typedef struct mp_step {
    int lane;
    int nops;
    int remaining;
    int activated;
    int more_follow; /* the same call posts further steps right after this one */
    struct mp_op *settled; /* shm: its ops whose own work is done, shown done with the last one */
    struct mp_step *next;
    mp_op *ops[];
} mp_step;

const char *mp_label_name(mp_label l);

/* Once true, the op's result and detail are final and the transport no longer touches it. */
static inline int mp_op_done(const mp_op *op)
{
    return atomic_load_explicit(&((mp_op *)op)->state, memory_order_acquire) == MP_OP_DONE;
}

#endif
