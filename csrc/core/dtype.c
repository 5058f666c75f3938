#include "dtype.h"

static const char *const names[MP_NUM_DTYPES] = {
    "float64", "float32", "float16", "bfloat16",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64",
    "bool", "complex64", "complex128",
};

const char *mp_dtype_name(int code)
{
    return (code >= 0 && code < MP_NUM_DTYPES) ? names[code] : "unknown dtype";
}
