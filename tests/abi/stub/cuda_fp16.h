/* Empty: nccl.h includes it; the ABI check uses no half-precision type. */
