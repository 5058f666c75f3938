/* Compiled against the real nccl.h by tests/test_nccl_abi.py: every value, size, field offset
 * and prototype that csrc/nccl/nccl_abi.h declares must equal NCCL's, or this fails to compile. */
#include <assert.h>
#include <stddef.h>
#include <stdio.h>

#include <nccl.h>

#include "nccl_abi.h"

#define SAME(a, b) static_assert((long long)(a) == (long long)(b), #a " != " #b)

SAME(MP_NCCL_SUCCESS, ncclSuccess);
SAME(MP_NCCL_UNHANDLED_CUDA_ERROR, ncclUnhandledCudaError);
SAME(MP_NCCL_SYSTEM_ERROR, ncclSystemError);
SAME(MP_NCCL_INTERNAL_ERROR, ncclInternalError);
SAME(MP_NCCL_INVALID_ARGUMENT, ncclInvalidArgument);
SAME(MP_NCCL_INVALID_USAGE, ncclInvalidUsage);
SAME(MP_NCCL_REMOTE_ERROR, ncclRemoteError);
SAME(MP_NCCL_IN_PROGRESS, ncclInProgress);
SAME(MP_NCCL_TIMEOUT, ncclTimeout);

SAME(MP_NCCL_INT8, ncclInt8);
SAME(MP_NCCL_UINT8, ncclUint8);
SAME(MP_NCCL_INT32, ncclInt32);
SAME(MP_NCCL_UINT32, ncclUint32);
SAME(MP_NCCL_INT64, ncclInt64);
SAME(MP_NCCL_UINT64, ncclUint64);
SAME(MP_NCCL_FLOAT16, ncclFloat16);
SAME(MP_NCCL_FLOAT32, ncclFloat32);
SAME(MP_NCCL_FLOAT64, ncclFloat64);
SAME(MP_NCCL_BFLOAT16, ncclBfloat16);
SAME(MP_NCCL_FLOAT8E4M3, ncclFloat8e4m3);
SAME(MP_NCCL_FLOAT8E5M2, ncclFloat8e5m2);

SAME(MP_NCCL_UNIQUE_ID_BYTES, NCCL_UNIQUE_ID_BYTES);
SAME(sizeof(mp_ncclUniqueId), sizeof(ncclUniqueId));
SAME(sizeof(mp_ncclComm_t), sizeof(ncclComm_t));
SAME(MP_NCCL_CONFIG_MAGIC, NCCL_API_MAGIC);
SAME(MP_NCCL_VERSION(2, 14, 0), NCCL_VERSION(2, 14, 0));
SAME(MP_NCCL_VERSION(NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH), NCCL_VERSION_CODE);

/* The config prefix: same offsets and sizes as ncclConfig_t's first fields. */
#define FIELD(f)                                                                                 \
    SAME(offsetof(mp_ncclConfigPrefix, f), offsetof(ncclConfig_t, f));                           \
    SAME(sizeof(((mp_ncclConfigPrefix *)0)->f), sizeof(((ncclConfig_t *)0)->f))
FIELD(size);
FIELD(magic);
FIELD(version);
FIELD(blocking);
static_assert(sizeof(mp_ncclConfigPrefix) <= sizeof(ncclConfig_t), "the prefix is longer than ncclConfig_t");

/* The size the transport passes covers exactly the fields it sets, up to `blocking`. */
SAME(MP_NCCL_CONFIG_PREFIX_SIZE, offsetof(ncclConfig_t, blocking) + sizeof(int));

/* Prototypes: each typedef must accept the real function with only pointer-type renaming. A
 * wrong arity or a wrong scalar type fails to compile under -Werror. */
static mp_ncclResult_t send_shape(const void *b, size_t n, mp_ncclDataType_t t, int p, mp_ncclComm_t c, void *s)
{
    return (mp_ncclResult_t)ncclSend(b, n, (ncclDataType_t)t, p, (ncclComm_t)c, (cudaStream_t)s);
}
static mp_ncclResult_t recv_shape(void *b, size_t n, mp_ncclDataType_t t, int p, mp_ncclComm_t c, void *s)
{
    return (mp_ncclResult_t)ncclRecv(b, n, (ncclDataType_t)t, p, (ncclComm_t)c, (cudaStream_t)s);
}
static mp_ncclResult_t init_shape(mp_ncclComm_t *c, int n, mp_ncclUniqueId id, int r, void *cfg)
{
    ncclUniqueId real;
    __builtin_memcpy(&real, &id, sizeof real);
    return (mp_ncclResult_t)ncclCommInitRankConfig((ncclComm_t *)c, n, real, r, (ncclConfig_t *)cfg);
}
static mp_ncclResult_t async_shape(mp_ncclComm_t c, mp_ncclResult_t *e)
{
    return (mp_ncclResult_t)ncclCommGetAsyncError((ncclComm_t)c, (ncclResult_t *)e);
}
static mp_ncclResult_t abort_shape(mp_ncclComm_t c) { return (mp_ncclResult_t)ncclCommAbort((ncclComm_t)c); }
static mp_ncclResult_t uid_shape(mp_ncclUniqueId *id) { return (mp_ncclResult_t)ncclGetUniqueId((ncclUniqueId *)id); }
static const char *str_shape(mp_ncclResult_t r) { return ncclGetErrorString((ncclResult_t)r); }
static const char *last_shape(mp_ncclComm_t c) { return ncclGetLastError((ncclComm_t)c); }

int main(void)
{
    mp_ncclSend_fn s = send_shape;
    mp_ncclRecv_fn r = recv_shape;
    mp_ncclCommInitRankConfig_fn i = init_shape;
    mp_ncclCommGetAsyncError_fn a = async_shape;
    mp_ncclComm_fn ab = abort_shape;
    mp_ncclGetUniqueId_fn u = uid_shape;
    mp_ncclGetErrorString_fn es = str_shape;
    mp_ncclGetLastError_fn le = last_shape;
    mp_ncclGroup_fn gs = (mp_ncclGroup_fn)0, ge = (mp_ncclGroup_fn)0;
    mp_ncclGetVersion_fn v = (mp_ncclGetVersion_fn)0;
    ncclResult_t (*real_group)(void) = ncclGroupStart;
    ncclResult_t (*real_version)(int *) = ncclGetVersion;
    (void)gs, (void)ge, (void)v, (void)real_group, (void)real_version;
    printf("nccl_abi.h matches nccl.h %d.%d.%d (%zu-byte config prefix of %zu)\n", NCCL_MAJOR, NCCL_MINOR,
           NCCL_PATCH, MP_NCCL_CONFIG_PREFIX_SIZE, sizeof(ncclConfig_t));
    return !(s && r && i && a && ab && u && es && le);
}
