/* The part of NCCL's ABI this package uses, under its own names so that nothing from nccl.h is
 * needed at build time. tests/abi/check_nccl_abi.c compiles it against the real nccl.h and
 * checks every value, size, layout and prototype below. */
#ifndef MP_NCCL_ABI_H
#define MP_NCCL_ABI_H

#include <stddef.h>

typedef struct mp_nccl_comm_opaque *mp_ncclComm_t;

#define MP_NCCL_UNIQUE_ID_BYTES 128
typedef struct {
    char internal[MP_NCCL_UNIQUE_ID_BYTES];
} mp_ncclUniqueId;

typedef enum {
    MP_NCCL_SUCCESS = 0,
    MP_NCCL_UNHANDLED_CUDA_ERROR = 1,
    MP_NCCL_SYSTEM_ERROR = 2,
    MP_NCCL_INTERNAL_ERROR = 3,
    MP_NCCL_INVALID_ARGUMENT = 4,
    MP_NCCL_INVALID_USAGE = 5,
    MP_NCCL_REMOTE_ERROR = 6,
    MP_NCCL_IN_PROGRESS = 7,
    /* NCCL's ncclTimeout (2.30), which the package also returns when its own wait on an
     * in-progress communicator passes its deadline: either way a timeout. */
    MP_NCCL_TIMEOUT = 8,
    /* Not NCCL's: the package's own outcomes of that wait, far past NCCL's codes so that no
     * later NCCL result can be taken for them. */
    MP_NCCL_ABORTED = 1000,
    MP_NCCL_INTERRUPTED = 1001,
} mp_ncclResult_t;

typedef enum {
    MP_NCCL_INT8 = 0,
    MP_NCCL_UINT8 = 1,
    MP_NCCL_INT32 = 2,
    MP_NCCL_UINT32 = 3,
    MP_NCCL_INT64 = 4,
    MP_NCCL_UINT64 = 5,
    MP_NCCL_FLOAT16 = 6,
    MP_NCCL_FLOAT32 = 7,
    MP_NCCL_FLOAT64 = 8,
    MP_NCCL_BFLOAT16 = 9,
    MP_NCCL_FLOAT8E4M3 = 10,
    MP_NCCL_FLOAT8E5M2 = 11,
} mp_ncclDataType_t;

/* NCCL_VERSION(X, Y, Z) for releases after 2.8. */
#define MP_NCCL_VERSION(x, y, z) ((x) * 10000 + (y) * 100 + (z))
/* The first release with ncclConfig_t and nonblocking communicators. */
#define MP_NCCL_MIN_VERSION MP_NCCL_VERSION(2, 14, 0)
/* The first release with the float8 datatypes. */
#define MP_NCCL_FLOAT8_VERSION MP_NCCL_VERSION(2, 24, 0)
#define MP_NCCL_CONFIG_MAGIC 0xcafebeefu

/* The leading fields of ncclConfig_t, through `blocking`. NCCL copies min(size, sizeof) bytes of a
 * config over its defaults and then resets the fields newer than `version` (src/init.cc
 * parseCommConfig), but not every release resets every newer field (2.26 reads trafficClass
 * whatever the version), so `size` is MP_NCCL_CONFIG_PREFIX_SIZE: it covers the fields set and
 * not the struct's tail padding, which nothing sets. */
typedef struct {
    size_t size;
    unsigned int magic;
    unsigned int version;
    int blocking;
} mp_ncclConfigPrefix;
#define MP_NCCL_CONFIG_PREFIX_SIZE (offsetof(mp_ncclConfigPrefix, blocking) + sizeof(int))

typedef mp_ncclResult_t (*mp_ncclGetVersion_fn)(int *version);
typedef mp_ncclResult_t (*mp_ncclGetUniqueId_fn)(mp_ncclUniqueId *id);
typedef mp_ncclResult_t (*mp_ncclCommInitRankConfig_fn)(mp_ncclComm_t *comm, int nranks, mp_ncclUniqueId id,
                                                        int rank, void *config);
typedef mp_ncclResult_t (*mp_ncclCommGetAsyncError_fn)(mp_ncclComm_t comm, mp_ncclResult_t *error);
typedef mp_ncclResult_t (*mp_ncclComm_fn)(mp_ncclComm_t comm); /* ncclCommAbort, ncclCommDestroy */
typedef mp_ncclResult_t (*mp_ncclGroup_fn)(void);                /* ncclGroupStart, ncclGroupEnd */
typedef mp_ncclResult_t (*mp_ncclSend_fn)(const void *buf, size_t count, mp_ncclDataType_t type, int peer,
                                          mp_ncclComm_t comm, void *stream);
typedef mp_ncclResult_t (*mp_ncclRecv_fn)(void *buf, size_t count, mp_ncclDataType_t type, int peer,
                                          mp_ncclComm_t comm, void *stream);
typedef const char *(*mp_ncclGetErrorString_fn)(mp_ncclResult_t result);
typedef const char *(*mp_ncclGetLastError_fn)(mp_ncclComm_t comm);

#endif
