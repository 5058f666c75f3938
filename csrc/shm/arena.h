/* A rank's receive arena: shared memory that every peer of its communicator maps once, at
 * creation, so that a sender writes a message straight into the receiver's buffer with one
 * user-space copy. Blocks handed out become torch tensors; the arena outlives the communicator
 * while any of them lives. */
#ifndef MP_ARENA_H
#define MP_ARENA_H

#include <stddef.h>
#include <stdint.h>

#include "core/result.h"

typedef struct mp_arena mp_arena;

#define MP_ARENA_DEFAULT_BYTES (1ull << 30) /* virtual: only the blocks handed out are backed */
#define MP_ARENA_MAX_BYTES (64ull << 30)

/* Creates (mode 0600, exclusive) and maps the shared-memory object `name` of `bytes`. The name
 * stays linked until mp_arena_unlink(), so that peers can map it. One reference, the caller's. */
mp_result mp_arena_create(const char *name, uint64_t bytes, mp_arena **out, char *err, size_t errlen);

/* Maps a peer's arena read-write: it must be ours (same uid) and of `bytes`. */
mp_result mp_arena_map_peer(const char *name, uint64_t bytes, char **base, char *err, size_t errlen);
void mp_arena_unmap_peer(char *base, uint64_t bytes);

/* Removes the arena's name (once every peer has mapped it, or creation failed). Idempotent. */
void mp_arena_unlink(mp_arena *a);

uint64_t mp_arena_bytes(const mp_arena *a);

/* A block of at least `nbytes`, backed by memory (each page once in the arena's life), with a
 * reference on the arena; NULL when no free range is large enough or /dev/shm cannot back it
 * (`why` then says which). 2 MiB blocks and larger are 2 MiB aligned, for huge pages. */
void *mp_arena_alloc(mp_arena *a, uint64_t nbytes, char *why, size_t whylen);

/* Returns a block from mp_arena_alloc and drops its reference. Safe from any thread. */
void mp_arena_free(mp_arena *a, void *block);

/* The block holding [p, p + n) never returns to the free list: a peer may still write into it
 * (its receive failed before the sender said it was done). */
void mp_arena_quarantine(mp_arena *a, const void *p);

/* Whether [p, p + n) lies inside the arena (so inside one of its blocks, which a tensor keeps
 * allocated); its offset in *off. */
int mp_arena_holds(const mp_arena *a, const void *p, uint64_t n, uint64_t *off);

/* 1 the first time it is called on the arena: whoever falls back to plain memory says so once. */
int mp_arena_first_refusal(mp_arena *a);

/* Drops a reference; the last one unmaps the arena. */
void mp_arena_release(mp_arena *a);

#endif
