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

/* ---- one-sided RMA (2.29 and later; docs/nccl-model.md cites what each call does) ---------- */

typedef struct mp_nccl_window_opaque *mp_ncclWindow_t;
#define MP_NCCL_WIN_DEFAULT 0x00
#define MP_NCCL_WIN_COLL_SYMMETRIC 0x01
#define MP_NCCL_WIN_REQUIRED_ALIGNMENT 4096
/* The first release whose ncclCommQueryProperties fills hostRmaSupport is after this one. */
#define MP_NCCL_PROPERTIES_RMA_AFTER MP_NCCL_VERSION(2, 29, 3)

typedef struct {
    int opCnt; /* signals to wait for, beyond those earlier waits counted */
    int peer;
    int sigIdx; /* 0 in 2.30 */
    int ctx;    /* 0 in 2.30 */
} mp_ncclWaitSignalDesc;

/* ncclCommProperties_t (nccl_device/core.h), through the fields of 2.30; made as
 * NCCL_COMM_PROPERTIES_INITIALIZER makes it: size, magic, version, the rest 0. */
typedef struct {
    size_t size;
    unsigned int magic;
    unsigned int version;
    int rank;
    int nRanks;
    int cudaDev;
    int nvmlDev;
    _Bool deviceApiSupport;
    _Bool multimemSupport;
    int ginType;
    int nLsaTeams;
    _Bool hostRmaSupport;
    int railedGinType;
} mp_ncclCommProperties;

typedef mp_ncclResult_t (*mp_ncclMemAlloc_fn)(void **ptr, size_t size);
typedef mp_ncclResult_t (*mp_ncclMemFree_fn)(void *ptr);
typedef mp_ncclResult_t (*mp_ncclCommWindowRegister_fn)(mp_ncclComm_t comm, void *buff, size_t size,
                                                        mp_ncclWindow_t *win, int flags);
typedef mp_ncclResult_t (*mp_ncclCommWindowDeregister_fn)(mp_ncclComm_t comm, mp_ncclWindow_t win);
typedef mp_ncclResult_t (*mp_ncclPutSignal_fn)(const void *localbuff, size_t count, mp_ncclDataType_t type, int peer,
                                               mp_ncclWindow_t peer_win, size_t peer_win_offset, int sig_idx, int ctx,
                                               unsigned int flags, mp_ncclComm_t comm, void *stream);
typedef mp_ncclResult_t (*mp_ncclSignal_fn)(int peer, int sig_idx, int ctx, unsigned int flags, mp_ncclComm_t comm,
                                            void *stream);
typedef mp_ncclResult_t (*mp_ncclWaitSignal_fn)(int ndesc, mp_ncclWaitSignalDesc *descs, mp_ncclComm_t comm,
                                                void *stream);
typedef mp_ncclResult_t (*mp_ncclCommQueryProperties_fn)(mp_ncclComm_t comm, mp_ncclCommProperties *props);

#endif
