/* What the fake libcuda shares with the fake libnccl: the driver types, and the calls by which
 * NCCL's "kernels" run on a stream. Used by tests/fakes/ only. */
#ifndef MPFAKE_H
#define MPFAKE_H

#include <stddef.h>

typedef int CUresult;
typedef int CUdevice;
typedef struct mp_fake_ctx *CUcontext;
typedef struct mp_fake_stream *CUstream;
typedef struct mp_fake_event *CUevent;
typedef struct mp_fake_graph *CUgraph;
typedef struct mp_fake_graph_exec *CUgraphExec;
typedef unsigned long long CUdeviceptr;

/* As in cuda.h. */
typedef enum {
    CU_STREAM_CAPTURE_STATUS_NONE = 0,
    CU_STREAM_CAPTURE_STATUS_ACTIVE = 1,
    CU_STREAM_CAPTURE_STATUS_INVALIDATED = 2,
} CUstreamCaptureStatus;

typedef enum {
    CU_STREAM_CAPTURE_MODE_GLOBAL = 0,
    CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1,
    CU_STREAM_CAPTURE_MODE_RELAXED = 2,
} CUstreamCaptureMode;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_NOT_INITIALIZED 3
#define CUDA_ERROR_INVALID_DEVICE 101
#define CUDA_ERROR_INVALID_CONTEXT 201
#define CUDA_ERROR_INVALID_HANDLE 400
#define CUDA_ERROR_ILLEGAL_STATE 401
#define CUDA_ERROR_NOT_READY 600
#define CUDA_ERROR_CONTEXT_IS_DESTROYED 709
#define CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED 900
#define CUDA_ERROR_STREAM_CAPTURE_INVALIDATED 901
#define CUDA_ERROR_STREAM_CAPTURE_MERGE 902
#define CUDA_ERROR_STREAM_CAPTURE_UNMATCHED 903
#define CUDA_ERROR_STREAM_CAPTURE_UNJOINED 904
#define CUDA_ERROR_STREAM_CAPTURE_ISOLATION 905
#define CUDA_ERROR_STREAM_CAPTURE_IMPLICIT 906
#define CUDA_ERROR_CAPTURED_EVENT 907
#define CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD 908

CUresult cuDriverGetVersion(int *version);
CUresult cuMemAlloc_v2(CUdeviceptr *ptr, size_t bytes);
CUresult cuMemFree_v2(CUdeviceptr ptr);

/* The calling thread's current context (NULL when none). */
CUcontext mpfake_current_context(void);
/* The context `stream` belongs to; fails as the driver would for a call on it now. */
CUresult mpfake_stream_context(CUstream stream, CUcontext *ctx);
/* Runs fn(arg) on the worker thread of `stream` (a stream of `ctx`), in order with the rest of its
 * work. Needs no current context: NCCL launches from threads of its own. While the stream
 * captures, the call is captured instead and runs at each launch of the graph. */
CUresult mpfake_stream_enqueue(CUcontext ctx, CUstream stream, void (*fn)(void *), void *arg);
/* The same, and the driver owns `arg` once this succeeds: release(arg) is called when the work
 * can never run again (after its one run, or once its graph and every instance are gone). */
CUresult mpfake_stream_enqueue_owned(CUcontext ctx, CUstream stream, void (*fn)(void *), void *arg,
                                     void (*release)(void *));
/* Whether `stream` (of `ctx`) is capturing now, and the capture's id (0 when not); needs no
 * current context, as cuStreamGetCaptureInfo is what NCCL asks on its own threads. */
CUresult mpfake_stream_capture(CUcontext ctx, CUstream stream, CUstreamCaptureStatus *status,
                               unsigned long long *id);

#endif
