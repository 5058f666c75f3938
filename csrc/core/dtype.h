/* The plain-bytes tensor dtypes a transport carries. The codes travel in shared memory, so
 * they are fixed; NCCL's own datatype codes are mapped from these in the NCCL transport. */
#ifndef MP_DTYPE_H
#define MP_DTYPE_H

typedef enum {
    MP_DT_FLOAT64 = 0, MP_DT_FLOAT32, MP_DT_FLOAT16, MP_DT_BFLOAT16,
    MP_DT_FLOAT8_E4M3FN, MP_DT_FLOAT8_E5M2, MP_DT_FLOAT8_E4M3FNUZ, MP_DT_FLOAT8_E5M2FNUZ, MP_DT_FLOAT8_E8M0FNU,
    MP_DT_INT8, MP_DT_INT16, MP_DT_INT32, MP_DT_INT64,
    MP_DT_UINT8, MP_DT_UINT16, MP_DT_UINT32, MP_DT_UINT64,
    MP_DT_BOOL, MP_DT_COMPLEX64, MP_DT_COMPLEX128,
    MP_NUM_DTYPES,
} mp_dtype;

/* torch's attribute name for each code (torch.<name>). */
const char *mp_dtype_name(int code);

#endif
