/* Debug matching (MEGATRON_P2P_CHECK=1): before its data moves, every send tells its receiver
 * what it carries, and the receiver compares that with its own op. NCCL checks nothing: a count
 * or dtype that disagrees truncates, hangs or corrupts, and a shape that disagrees with the same
 * bytes is silently accepted. The descriptor's layout is fixed: it travels between processes. */
#ifndef MP_MATCH_CHECK_H
#define MP_MATCH_CHECK_H

#include <stddef.h>
#include <stdint.h>

#include "core/op.h"

#define MP_CHECK_MAGIC 0x4b43504du /* "MPCK" */

typedef struct {
    uint32_t magic;
    int32_t label;    /* the sender's mp_label */
    int32_t dtype;
    int32_t ndim;     /* -1: shape unknown */
    uint64_t nbytes;
    uint64_t seq;     /* message number between the pair on the lane */
    int64_t shape[MP_MAX_DIMS];
    char call_name[MP_CALL_NAME_LEN];
} mp_check_desc;

/* What the send `op` tells its receiver. */
void mp_check_describe(const mp_op *op, mp_check_desc *out);

/* 0 when `sent` (from global rank `sender`) matches the receive `op` of global rank `receiver`;
 * otherwise -1 and a report naming both ranks and both ops in `detail`. */
int mp_check_compare(const mp_check_desc *sent, int sender, const mp_op *op, int receiver, char *detail, size_t len);

#endif
