/* Test-only: garbage written into a live shm segment, as a hostile or broken peer could write it,
 * so that tests can show every rank reads the segment defensively
 * (megatron_p2p._testing.corrupt_segment). Nothing else calls it. */
#ifndef MP_SHM_CORRUPT_H
#define MP_SHM_CORRUPT_H

#include <stddef.h>
#include <stdint.h>

#include "shm/segment.h"

/* Overwrites `count` fields of the segment chosen by `seed` (headers of every rank, channel
 * counters, descriptors, receive offers, published waits) with garbage that no valid state
 * holds: random bits, all ones, or a high bit flipped. Payload bytes are left alone: a peer can always send
 * wrong data, and no check can tell. `describe(ctx, line)` gets one line per field written. */
void mp_shm_corrupt(const shm_view *v, uint64_t seed, int count, void (*describe)(void *ctx, const char *line),
                    void *ctx);

#endif
