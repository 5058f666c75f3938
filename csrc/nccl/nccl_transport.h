/* The GPU transport: one NCCL communicator and one CUDA stream per lane, libnccl and libcuda
 * loaded at run time. Every step is one NCCL group; every begin()/end() pair ends in one CUDA
 * event per lane that completes its ops. */
#ifndef MP_NCCL_H
#define MP_NCCL_H

#include <stddef.h>

#include "libraries.h"
#include "core/interrupt.h"
#include "core/transport.h"

typedef struct {
    int rank;
    int size;
    int nlanes;
    int device;                   /* CUDA device ordinal */
    const mp_ncclUniqueId *ids;   /* one per lane, from rank 0 */
    double timeout;               /* for creation and warm-up */
    int high_priority;            /* lane streams at the device's greatest priority */
    int check;                    /* debug matching: every step is preceded by descriptors */
    const int *global_ranks;      /* the group's, `size` of them (copied): reports name ranks by these */
    const mp_interrupt *interrupt; /* checked while creation waits for the other ranks; may be NULL */
} mp_nccl_config;

/* Collective over the group: creates and warms up every lane's communicator. */
mp_result mp_nccl_open(const mp_nccl_config *cfg, const mp_nccl_lib *nccl, const mp_cuda_lib *cuda,
                       mp_transport **out, char *err, size_t errlen);

/* How one step becomes NCCL calls: a group holding the step's ops in order. The transport
 * passes calls into libnccl; tests pass a recorder, to check the calls against the plan. */
typedef struct {
    mp_ncclResult_t (*group_start)(void *ctx);
    mp_ncclResult_t (*group_end)(void *ctx, int lane);
    mp_ncclResult_t (*send)(void *ctx, const mp_op *op, size_t count, mp_ncclDataType_t type);
    mp_ncclResult_t (*recv)(void *ctx, const mp_op *op, size_t count, mp_ncclDataType_t type);
} mp_nccl_calls;

mp_ncclResult_t mp_nccl_issue(const mp_nccl_calls *calls, void *ctx, const mp_step *step, int nccl_version);

/* NCCL's datatype for a package dtype, and the element count of `nbytes` in it: the native
 * type where the library has one, otherwise bytes. */
mp_ncclDataType_t mp_nccl_datatype(int dtype, uint64_t nbytes, int nccl_version, size_t *count);

#endif
