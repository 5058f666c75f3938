#include "match_check.h"

#include <stdio.h>
#include <string.h>

#include "core/dtype.h"
#include "core/shape.h"

void mp_check_describe(const mp_op *op, mp_check_desc *out)
{
    memset(out, 0, sizeof *out);
    out->magic = MP_CHECK_MAGIC;
    out->label = (int32_t)op->label;
    out->dtype = op->dtype;
    out->ndim = op->ndim;
    out->nbytes = op->nbytes;
    out->seq = op->seq;
    for (int d = 0; d < op->ndim && d < MP_MAX_DIMS; d++)
        out->shape[d] = op->shape[d];
    memcpy(out->call_name, op->call_name, sizeof out->call_name);
    out->call_name[sizeof out->call_name - 1] = '\0';
}

int mp_check_compare(const mp_check_desc *sent, int sender, const mp_op *op, int receiver, char *detail, size_t len)
{
    int valid = sent->magic == MP_CHECK_MAGIC && sent->label >= 0 && sent->label < MP_NUM_LABELS &&
                sent->ndim <= MP_MAX_DIMS;
    if (valid && sent->nbytes == op->nbytes && sent->dtype == op->dtype && sent->seq == op->seq &&
        mp_same_shape(sent->ndim, sent->shape, op->ndim, op->shape))
        return 0;
    if (!valid) {
        snprintf(detail, len, "debug matching: rank %d's %s #%llu received no valid descriptor from rank %d: its op "
                 "there is not a send of this package's debug matching",
                 receiver, mp_label_name(op->label), (unsigned long long)op->seq, sender);
        return -1;
    }
    char theirs[160], mine[160];
    mp_format_shape(sent->ndim, sent->shape, theirs, sizeof theirs);
    mp_format_shape(op->ndim, op->shape, mine, sizeof mine);
    snprintf(detail, len, "debug matching: rank %d's %s #%llu (call %s) sends %llu bytes of %s, shape %s; rank %d's %s "
             "#%llu (call %s) receives %llu bytes of %s, shape %s",
             sender, mp_label_name((mp_label)sent->label), (unsigned long long)sent->seq,
             sent->call_name[0] ? sent->call_name : "?", (unsigned long long)sent->nbytes, mp_dtype_name(sent->dtype),
             theirs, receiver, mp_label_name(op->label), (unsigned long long)op->seq,
             op->call_name[0] ? op->call_name : "?", (unsigned long long)op->nbytes, mp_dtype_name(op->dtype), mine);
    return -1;
}
