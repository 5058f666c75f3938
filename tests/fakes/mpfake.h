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
typedef unsigned long long CUdeviceptr;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_NOT_INITIALIZED 3
#define CUDA_ERROR_INVALID_DEVICE 101
#define CUDA_ERROR_INVALID_CONTEXT 201
#define CUDA_ERROR_INVALID_HANDLE 400
#define CUDA_ERROR_NOT_READY 600
#define CUDA_ERROR_CONTEXT_IS_DESTROYED 709

/* The calling thread's current context (NULL when none). */
CUcontext mpfake_current_context(void);
/* The context `stream` belongs to; fails as the driver would for a call on it now. */
CUresult mpfake_stream_context(CUstream stream, CUcontext *ctx);
/* Runs fn(arg) on the worker thread of `stream` (a stream of `ctx`), in order with the rest of its
 * work. Needs no current context: NCCL launches from threads of its own. */
CUresult mpfake_stream_enqueue(CUcontext ctx, CUstream stream, void (*fn)(void *), void *arg);

#endif
