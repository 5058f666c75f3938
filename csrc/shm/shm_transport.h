/* The CPU transport: processes on one host exchange through one shared-memory segment, with
 * NCCL's semantics (strict rendezvous unless under the eager threshold) and a progress thread. */
#ifndef MP_SHM_H
#define MP_SHM_H

#include <stddef.h>
#include <stdint.h>

#include "arena.h"
#include "core/interrupt.h"
#include "segment.h"
#include "core/transport.h"

typedef struct {
    const char *name;         /* from mp_shm_new_name() on the group's rank 0 */
    int rank;
    int size;
    int nlanes;
    int create;               /* this rank creates the segment; the others attach */
    uint64_t eager_threshold; /* sends up to this many bytes complete without a posted receive */
    double timeout;           /* for the other ranks to attach */
    int allow_cma;            /* 0: always copy through shared memory (two copies) */
    int global_rank;          /* this rank's, for reports other ranks write */
    const mp_interrupt *interrupt; /* checked while waiting for the other ranks; may be NULL */
    const int *pids;          /* each rank's pid, known before it attaches (may be NULL): a rank
                               * that dies before attaching is then reported, not waited for */
    uint64_t arena_bytes;     /* of this rank's receive arena, which its peers map; 0: none */
    int check;                /* debug matching: shapes are compared too (bytes and dtype always are) */
} mp_shm_config;

#define MP_SHM_NAME_LEN 64
#define MP_SHM_MAX_EAGER (1u << 20)
/* A send of at least this many bytes to a rank with an arena waits for its receive's answer
 * (whether its buffer lies in the arena), since one memcpy into the arena beats the receiver's
 * process_vm_readv by more than the wake-up the wait may cost; a smaller send takes the arena
 * only when the answer is already there. */
#define MP_SHM_OFFER_WAIT_BYTES (2u << 20)

/* "/mp2p-<pid>-<random>": unguessable, and the pid lets a later job remove a segment left by a
 * creator killed before every rank attached. */
int mp_shm_new_name(char *buf, size_t len);

/* Collective over the group: returns once every rank has attached and the name is unlinked. */
mp_result mp_shm_open(const mp_shm_config *cfg, mp_transport **out, char *err, size_t errlen);

/* Whether single-copy reads from `peer` work (for tests and reports). */

/* Messages this rank received by each path (SHM_PATH_*), for stats and tests; 0 for another
 * transport. */
int mp_shm_received_by_path(mp_transport *t, uint64_t out[MP_SHM_NPATHS]);

/* This rank's receive arena, or NULL (another transport, or none). */
mp_arena *mp_shm_arena(mp_transport *t);

/* The segment's mapping of a shm transport, or NULL for another transport (for shm_corrupt.c). */
const shm_view *mp_shm_view(mp_transport *t);

#endif
