#include "shape.h"

#include <stdio.h>

#include "op.h"

int mp_same_shape(int ndim_a, const int64_t *a, int ndim_b, const int64_t *b)
{
    if (ndim_a < 0 || ndim_b < 0)
        return 1;
    if (ndim_a != ndim_b)
        return 0;
    for (int d = 0; d < ndim_a && d < MP_MAX_DIMS; d++)
        if (a[d] != b[d])
            return 0;
    return 1;
}

void mp_format_shape(int ndim, const int64_t *shape, char *buf, size_t len)
{
    if (ndim < 0) {
        snprintf(buf, len, "?");
        return;
    }
    size_t used = (size_t)snprintf(buf, len, "[");
    for (int d = 0; d < ndim && d < MP_MAX_DIMS && used < len; d++)
        used += (size_t)snprintf(buf + used, len - used, d ? ", %lld" : "%lld", (long long)shape[d]);
    if (used < len)
        snprintf(buf + used, len - used, "]");
}
