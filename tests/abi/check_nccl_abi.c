/* Compiled against the real nccl.h by tests/test_nccl_abi.py: every value, size, field offset
 * and prototype that csrc/nccl/nccl_abi.h declares must equal NCCL's, or this fails to compile. */
#include <assert.h>
#include <stddef.h>
#include <stdio.h>

#include <nccl.h>
/* nccl_device/core.h declares device helpers inline and defines them only for nvcc: as plain
 * declarations, C compiles the header for its host API and the properties struct. */
#include <nccl_device/utility.h>
#undef NCCL_HOST_DEVICE_INLINE
#define NCCL_HOST_DEVICE_INLINE
#include <nccl_device/core.h>

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

/* One-sided RMA: the window flags, the wait descriptor and the properties struct, field by field. */
SAME(MP_NCCL_WIN_DEFAULT, NCCL_WIN_DEFAULT);
SAME(MP_NCCL_WIN_COLL_SYMMETRIC, NCCL_WIN_COLL_SYMMETRIC);
SAME(MP_NCCL_WIN_REQUIRED_ALIGNMENT, NCCL_WIN_REQUIRED_ALIGNMENT);
SAME(sizeof(mp_ncclWindow_t), sizeof(ncclWindow_t));
#define DESC(f)                                                                                  \
    SAME(offsetof(mp_ncclWaitSignalDesc, f), offsetof(ncclWaitSignalDesc_t, f));                 \
    SAME(sizeof(((mp_ncclWaitSignalDesc *)0)->f), sizeof(((ncclWaitSignalDesc_t *)0)->f))
DESC(opCnt);
DESC(peer);
DESC(sigIdx);
DESC(ctx);
SAME(sizeof(mp_ncclWaitSignalDesc), sizeof(ncclWaitSignalDesc_t));
#define PROP(f)                                                                                  \
    SAME(offsetof(mp_ncclCommProperties, f), offsetof(ncclCommProperties_t, f));                 \
    SAME(sizeof(((mp_ncclCommProperties *)0)->f), sizeof(((ncclCommProperties_t *)0)->f))
PROP(size);
PROP(magic);
PROP(version);
PROP(rank);
PROP(nRanks);
PROP(cudaDev);
PROP(nvmlDev);
PROP(deviceApiSupport);
PROP(multimemSupport);
PROP(ginType);
PROP(nLsaTeams);
PROP(hostRmaSupport);
PROP(railedGinType);
SAME(sizeof(mp_ncclCommProperties), sizeof(ncclCommProperties_t));
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmissing-field-initializers" /* NCCL's initializer sets three fields */
static const ncclCommProperties_t made_by_nccl = NCCL_COMM_PROPERTIES_INITIALIZER;
#pragma GCC diagnostic pop

static mp_ncclResult_t alloc_shape(void **p, size_t n) { return (mp_ncclResult_t)ncclMemAlloc(p, n); }
static mp_ncclResult_t free_shape(void *p) { return (mp_ncclResult_t)ncclMemFree(p); }
static mp_ncclResult_t reg_shape(mp_ncclComm_t c, void *b, size_t n, mp_ncclWindow_t *w, int f)
{
    return (mp_ncclResult_t)ncclCommWindowRegister((ncclComm_t)c, b, n, (ncclWindow_t *)w, f);
}
static mp_ncclResult_t dereg_shape(mp_ncclComm_t c, mp_ncclWindow_t w)
{
    return (mp_ncclResult_t)ncclCommWindowDeregister((ncclComm_t)c, (ncclWindow_t)w);
}
static mp_ncclResult_t put_shape(const void *b, size_t n, mp_ncclDataType_t t, int p, mp_ncclWindow_t w, size_t o,
                                 int sig, int ctx, unsigned int f, mp_ncclComm_t c, void *s)
{
    return (mp_ncclResult_t)ncclPutSignal(b, n, (ncclDataType_t)t, p, (ncclWindow_t)w, o, sig, ctx, f, (ncclComm_t)c,
                                          (cudaStream_t)s);
}
static mp_ncclResult_t signal_shape(int p, int sig, int ctx, unsigned int f, mp_ncclComm_t c, void *s)
{
    return (mp_ncclResult_t)ncclSignal(p, sig, ctx, f, (ncclComm_t)c, (cudaStream_t)s);
}
static mp_ncclResult_t wait_shape(int n, mp_ncclWaitSignalDesc *d, mp_ncclComm_t c, void *s)
{
    return (mp_ncclResult_t)ncclWaitSignal(n, (ncclWaitSignalDesc_t *)d, (ncclComm_t)c, (cudaStream_t)s);
}
static mp_ncclResult_t props_shape(mp_ncclComm_t c, mp_ncclCommProperties *p)
{
    return (mp_ncclResult_t)ncclCommQueryProperties((ncclComm_t)c, (ncclCommProperties_t *)p);
}

int main(void)
{
    mp_ncclMemAlloc_fn rma[] = {alloc_shape};
    mp_ncclMemFree_fn mf = free_shape;
    mp_ncclCommWindowRegister_fn wr = reg_shape;
    mp_ncclCommWindowDeregister_fn wd = dereg_shape;
    mp_ncclPutSignal_fn ps = put_shape;
    mp_ncclSignal_fn sg = signal_shape;
    mp_ncclWaitSignal_fn ws = wait_shape;
    mp_ncclCommQueryProperties_fn qp = props_shape;
    if (made_by_nccl.size != sizeof(mp_ncclCommProperties) || made_by_nccl.magic != MP_NCCL_CONFIG_MAGIC ||
        made_by_nccl.version != NCCL_VERSION_CODE || !(rma[0] && mf && wr && wd && ps && sg && ws && qp))
        return 1;
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
