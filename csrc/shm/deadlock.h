/* Wait-for cycles among the blocked ranks of one shared segment. Ranks blocked in a wait publish
 * their pending ops (shm_watch); the channels' counters say live which of those ops have a posted
 * partner. A cycle of ranks, all in a wait, each needing the next to post an op it has not
 * posted, can never resolve: it is confirmed over two rounds, reported once, and its ranks fenced. */
#ifndef MP_SHM_DEADLOCK_H
#define MP_SHM_DEADLOCK_H

#include <stdint.h>
#include <sys/types.h>

#include "segment.h"

typedef struct shm_cycle shm_cycle;

/* A cycle reachable from rank `me`'s wait, or NULL. A value no valid state holds stops the search
 * and is described in `corrupt` (left "" otherwise). */
shm_cycle *shm_cycle_find(const shm_view *v, int me, uint64_t eager_threshold, char *corrupt, size_t corrupt_len);
/* The same ranks, ops and waits: a cycle seen twice across a round is real (nothing in it moved). */
int shm_cycle_same(const shm_cycle *a, const shm_cycle *b);
/* Writes the report and fences the cycle's ranks, unless another rank is at it or one of them is
 * fenced already. Returns 1 when this call fenced them. */
int shm_cycle_fence(const shm_view *v, const shm_cycle *c, const pid_t *pids);
void shm_cycle_free(shm_cycle *c);

/* The report behind fence value `fence` (a shm_rank.fence), NUL-terminated. */
void shm_deadlock_report(const shm_view *v, uint32_t fence, char *buf, size_t len);

#endif
