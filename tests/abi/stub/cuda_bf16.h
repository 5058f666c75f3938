/* Empty: nccl.h includes it; the ABI check uses no bfloat16 type. */
