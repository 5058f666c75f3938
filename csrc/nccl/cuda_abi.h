/* The few CUDA driver API types and calls this package uses, under its own names: the driver
 * library (libcuda.so.1) is loaded at run time, so nothing from CUDA is needed to build. */
#ifndef MP_CUDA_ABI_H
#define MP_CUDA_ABI_H

#include <stddef.h>

typedef int mp_CUresult;
typedef int mp_CUdevice;
typedef struct mp_cu_ctx_opaque *mp_CUcontext;
typedef struct mp_cu_stream_opaque *mp_CUstream;
typedef struct mp_cu_event_opaque *mp_CUevent;
typedef unsigned long long mp_CUdeviceptr;

#define MP_CUDA_SUCCESS 0
#define MP_CUDA_ERROR_OUT_OF_MEMORY 2
#define MP_CUDA_ERROR_NOT_READY 600
#define MP_CU_EVENT_DISABLE_TIMING 0x2u
#define MP_CU_STREAM_NON_BLOCKING 0x1u
#define MP_CU_STREAM_CAPTURE_STATUS_NONE 0
#define MP_CU_STREAM_CAPTURE_STATUS_ACTIVE 1
#define MP_CU_STREAM_CAPTURE_MODE_THREAD_LOCAL 1
#define MP_CU_STREAM_CAPTURE_MODE_RELAXED 2

typedef mp_CUresult (*mp_cuInit_fn)(unsigned int flags);
typedef mp_CUresult (*mp_cuDeviceGet_fn)(mp_CUdevice *dev, int ordinal);
typedef mp_CUresult (*mp_cuDevicePrimaryCtxRetain_fn)(mp_CUcontext *ctx, mp_CUdevice dev);
typedef mp_CUresult (*mp_cuDevicePrimaryCtxRelease_fn)(mp_CUdevice dev);
typedef mp_CUresult (*mp_cuCtxGetCurrent_fn)(mp_CUcontext *ctx);
typedef mp_CUresult (*mp_cuCtxSetCurrent_fn)(mp_CUcontext ctx);
typedef mp_CUresult (*mp_cuCtxGetStreamPriorityRange_fn)(int *least, int *greatest);
typedef mp_CUresult (*mp_cuStreamCreateWithPriority_fn)(mp_CUstream *stream, unsigned int flags, int priority);
typedef mp_CUresult (*mp_cuStreamDestroy_fn)(mp_CUstream stream);
typedef mp_CUresult (*mp_cuStreamWaitEvent_fn)(mp_CUstream stream, mp_CUevent event, unsigned int flags);
typedef mp_CUresult (*mp_cuStreamSynchronize_fn)(mp_CUstream stream);
typedef mp_CUresult (*mp_cuEventCreate_fn)(mp_CUevent *event, unsigned int flags);
typedef mp_CUresult (*mp_cuEventDestroy_fn)(mp_CUevent event);
typedef mp_CUresult (*mp_cuEventRecord_fn)(mp_CUevent event, mp_CUstream stream);
typedef mp_CUresult (*mp_cuEventQuery_fn)(mp_CUevent event);
typedef mp_CUresult (*mp_cuMemAlloc_fn)(mp_CUdeviceptr *ptr, size_t bytes);
typedef mp_CUresult (*mp_cuMemFree_fn)(mp_CUdeviceptr ptr);
typedef mp_CUresult (*mp_cuMemAllocHost_fn)(void **ptr, size_t bytes);
typedef mp_CUresult (*mp_cuMemFreeHost_fn)(void *ptr);
typedef mp_CUresult (*mp_cuMemcpyHtoDAsync_fn)(mp_CUdeviceptr dst, const void *src, size_t bytes, mp_CUstream stream);
typedef mp_CUresult (*mp_cuMemcpyDtoHAsync_fn)(void *dst, mp_CUdeviceptr src, size_t bytes, mp_CUstream stream);
/* The _v2 entry point (CUDA 11.3+): status and capture id; the graph and dependency outputs may be NULL. */
typedef mp_CUresult (*mp_cuStreamGetCaptureInfo_fn)(mp_CUstream stream, int *status, unsigned long long *id,
                                                    void **graph, const void **deps, size_t *ndeps);
typedef mp_CUresult (*mp_cuThreadExchangeStreamCaptureMode_fn)(int *mode);
typedef mp_CUresult (*mp_cuGetErrorString_fn)(mp_CUresult error, const char **text);

#endif
