/* How messages meet: by number. On a channel (src, dst, lane) the k-th send src issues to dst
 * meets the k-th receive dst issues from src, as NCCL pairs ncclSend with ncclRecv between two
 * ranks of one communicator (a lane is one). The bindings, the simulator and the C stress test
 * number their ops here; every report's "message #k" is this number. */
#ifndef MP_NUMBERING_H
#define MP_NUMBERING_H

#include <stddef.h>
#include <stdint.h>

#include "op.h"

/* One channel end's counters: the sends and the receives issued so far, by mp_kind. */
typedef struct {
    uint64_t issued[2];
} mp_channel_numbers;

/* The number of the next op of `kind` issued on the channel. */
static inline uint64_t mp_number_message(mp_channel_numbers *c, mp_kind kind) { return c->issued[kind]++; }

/* One rank's channel to `peer` on `lane`, among its size * nlanes channels ([lane][peer]). */
static inline size_t mp_channel_of(int size, int lane, int peer) { return (size_t)lane * (size_t)size + (size_t)peer; }

#endif
