/* Just enough of the CUDA runtime header for nccl.h to compile on a machine without CUDA: the
 * ABI check needs NCCL's declarations, not CUDA's. */
#ifndef MP_STUB_CUDA_RUNTIME_H
#define MP_STUB_CUDA_RUNTIME_H
#define CUDART_VERSION 13000
typedef struct CUstream_st *cudaStream_t;
#endif
