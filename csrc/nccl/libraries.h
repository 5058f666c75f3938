/* The loaded-library table: libnccl and libcuda, found at run time. It is the one piece of
 * process-wide mutable state in the package, because one process can hold one libnccl only.
 * Callers hold the GIL, which serialises loading. */
#ifndef MP_LIBRARIES_H
#define MP_LIBRARIES_H

#include <stddef.h>

#include "cuda_abi.h"
#include "nccl_abi.h"

#define MP_NCCL_LIBRARY_ENV "MEGATRON_P2P_NCCL_LIBRARY"
/* The CUDA driver to load instead of libcuda.so.1 (and nothing else when it is set). */
#define MP_CUDA_LIBRARY_ENV "MEGATRON_P2P_CUDA_LIBRARY"
#define MP_LIB_PATH_LEN 4096

typedef struct {
    char path[MP_LIB_PATH_LEN];
    const char *source;   /* "env", "loaded", "bundled" or "system": how it was found */
    int version;          /* ncclGetVersion */
    mp_ncclGetVersion_fn GetVersion;
    mp_ncclGetUniqueId_fn GetUniqueId;
    mp_ncclCommInitRankConfig_fn CommInitRankConfig;
    mp_ncclCommGetAsyncError_fn CommGetAsyncError;
    mp_ncclComm_fn CommAbort;
    mp_ncclGroup_fn GroupStart;
    mp_ncclGroup_fn GroupEnd;
    mp_ncclSend_fn Send;
    mp_ncclRecv_fn Recv;
    mp_ncclGetErrorString_fn GetErrorString;
    mp_ncclGetLastError_fn GetLastError; /* may be NULL */
} mp_nccl_lib;

typedef struct {
    char path[MP_LIB_PATH_LEN];
    mp_cuInit_fn Init;
    mp_cuDeviceGet_fn DeviceGet;
    mp_cuDevicePrimaryCtxRetain_fn DevicePrimaryCtxRetain;
    mp_cuDevicePrimaryCtxRelease_fn DevicePrimaryCtxRelease;
    mp_cuCtxGetCurrent_fn CtxGetCurrent;
    mp_cuCtxSetCurrent_fn CtxSetCurrent;
    mp_cuCtxGetStreamPriorityRange_fn CtxGetStreamPriorityRange;
    mp_cuStreamCreateWithPriority_fn StreamCreateWithPriority;
    mp_cuStreamDestroy_fn StreamDestroy;
    mp_cuStreamWaitEvent_fn StreamWaitEvent;
    mp_cuStreamSynchronize_fn StreamSynchronize;
    mp_cuEventCreate_fn EventCreate;
    mp_cuEventDestroy_fn EventDestroy;
    mp_cuEventRecord_fn EventRecord;
    mp_cuEventQuery_fn EventQuery;
    mp_cuMemAlloc_fn MemAlloc;
    mp_cuMemFree_fn MemFree;
    mp_cuMemAllocHost_fn MemAllocHost;
    mp_cuMemFreeHost_fn MemFreeHost;
    mp_cuMemcpyHtoDAsync_fn MemcpyHtoDAsync;
    mp_cuMemcpyDtoHAsync_fn MemcpyDtoHAsync;
    mp_cuStreamGetCaptureInfo_fn StreamGetCaptureInfo;
    mp_cuThreadExchangeStreamCaptureMode_fn ThreadExchangeStreamCaptureMode;
    mp_cuGetErrorString_fn GetErrorString;
} mp_cuda_lib;

/* Loads libnccl once, trying in order: the environment variable (and nothing else when it is
 * set), a copy already in the process, the `bundled` files (nvidia/nccl/lib of the Python
 * environment), then libnccl.so.2 on the system path. NULL with `err` naming every attempt. */
const mp_nccl_lib *mp_nccl_load(const char *env_path, const char *const *bundled, int nbundled, char *err,
                                size_t errlen);
/* The table mp_nccl_load filled; NULL with `err` saying how to load it when it has not been. */
const mp_nccl_lib *mp_nccl_loaded(char *err, size_t errlen);
/* Loads the CUDA driver once: $MEGATRON_P2P_CUDA_LIBRARY when set (and nothing else), else
 * libcuda.so.1 on the system path. NULL with `err` when there is none. */
const mp_cuda_lib *mp_cuda_load(char *err, size_t errlen);

#endif
