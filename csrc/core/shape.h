/* Tensor shapes as debug matching compares and reports them, on every transport. */
#ifndef MP_SHAPE_H
#define MP_SHAPE_H

#include <stddef.h>
#include <stdint.h>

/* 1 when the shapes agree, or when either side does not know its shape (ndim < 0): then bytes
 * and dtype alone decide. */
int mp_same_shape(int ndim_a, const int64_t *a, int ndim_b, const int64_t *b);

/* "[10, 20]", or "?" for an unknown shape (ndim < 0). */
void mp_format_shape(int ndim, const int64_t *shape, char *buf, size_t len);

#endif
