/* Layout of the shared segment, and creating, attaching to and removing it. Everything here is
 * read by processes that trust each other only as far as bounds checks go. */
#ifndef MP_SHM_SEGMENT_H
#define MP_SHM_SEGMENT_H

#include <stdalign.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "core/interrupt.h"
#include "core/op.h"
#include "core/result.h"

#define SHM_MAGIC 0x6d70327073686d31ULL /* "mp2pshm1" */
#define SHM_VERSION 5u
#define SHM_NSLOTS 8u          /* descriptors in flight per channel (NCCL-like buffering depth) */
#define SHM_NCHUNKS 4u         /* bounce-buffer chunks per channel (two-copy path) */
#define SHM_INLINE_BYTES 4096u /* messages up to this size travel inside the descriptor slot */
#define SHM_WATCH_OPS 16u      /* runs of pending ops a blocked rank publishes for deadlock detection */
#define SHM_REPORTS 4u         /* deadlock reports a segment keeps (one per cycle found) */
#define SHM_REPORT_BYTES 8192u

enum { SHM_RANK_EMPTY = 0, SHM_RANK_ATTACHED = 1, SHM_RANK_READY = 2, SHM_RANK_CLOSED = 3 };
/* ARENA: the sender has written the message into the receive buffer the receiver offered. */
enum { SHM_PATH_INLINE = 0, SHM_PATH_CMA = 1, SHM_PATH_BOUNCE = 2, SHM_PATH_ARENA = 3, MP_SHM_NPATHS };

typedef struct {
    alignas(64) _Atomic int32_t pid;
    _Atomic uint32_t state;
    _Atomic uint32_t bell;     /* futex word: bumped by anyone who has news for this rank */
    _Atomic uint32_t sleeping; /* the rank's progress thread waits on `bell` */
    _Atomic uint32_t driving;  /* threads of the rank progressing from a wait: no wake needed */
    _Atomic uint32_t unfinished; /* steps the rank posted and its engine has not retired */
    uint64_t probe_addr;       /* address of a word peers read to test single-copy access */
    uint64_t probe_value;
    int32_t global_rank;       /* for reports other ranks write */
    _Atomic uint32_t waiting;  /* threads of the rank blocked in a wait for a while */
    _Atomic uint32_t wait_epoch; /* bumped whenever one enters or leaves such a wait, or the rank posts */
    _Atomic uint32_t fence;    /* 0, or 1 + the report of the deadlock this rank is in */
    uint64_t arena_bytes;      /* of the rank's receive arena, which peers map; 0: none */
} shm_rank;

/* A run of pending ops, as a blocked rank publishes them for the others' cycle search: `count`
 * ops of one group, alike but for their seqs, seq to seq + count - 1 (a batch of 40 sends of
 * one shape to one peer is one run). Per channel, whether an op is complete, has a posted
 * partner, or has an issued one turns at one seq, so a run's edges are those of its ops. */
typedef struct {
    uint64_t seq;
    uint64_t nbytes;
    uint64_t step; /* k-th step on its lane: ops of one group share it */
    int32_t kind;
    int32_t peer;
    int32_t lane;
    int32_t dtype;
    int32_t label;
    uint32_t count; /* 1 or more */
    char call[40];
} shm_watch_op;

/* What a blocked rank has pending, in lane order: rewritten by its waiting thread under a
 * sequence count, read by any rank looking for a cycle. */
typedef struct {
    _Atomic uint32_t version; /* odd while being rewritten */
    uint32_t epoch;           /* the shm_rank.wait_epoch it describes */
    uint32_t nops;            /* runs in ops[] */
    int32_t wait_index;       /* ops[] run holding the op the rank waits on; -1 beyond them, -2 several waits */
    int32_t wait_lane;
    int32_t reserved;
    shm_watch_op ops[SHM_WATCH_OPS];
} shm_watch;

/* A send descriptor. The sender fills the first part before publishing it; the receiver fills
 * the second part before bumping `done`. */
typedef struct {
    uint64_t nbytes;
    uint64_t addr; /* sender's buffer, for single-copy reads */
    int32_t dtype;
    uint32_t label;
    uint32_t path;
    uint32_t result;
    uint64_t recv_nbytes;
    int32_t recv_dtype;
    uint32_t recv_label;
    /* Debug matching (MEGATRON_P2P_CHECK=1) only: the sender's shape, and on a mismatch the
     * receiver's; ndim -1 when that side does not compare shapes. */
    int32_t ndim;
    int32_t recv_ndim;
    int64_t shape[MP_MAX_DIMS];
    int64_t recv_shape[MP_MAX_DIMS];
} shm_slot;

/* A receive buffer in the receiver's arena, offered to the sender of message seq - 1. Rewritten
 * under a version: seq is cleared first and written last (see shm_answer()). */
typedef struct {
    _Atomic uint64_t seq; /* 0: none, or being rewritten */
    _Atomic uint64_t offset;
    _Atomic uint64_t nbytes;
    _Atomic int32_t dtype;
    int32_t reserved;
} shm_offer;

/* Channel (lane, src -> dst). Sender-written and receiver-written words sit on separate lines. */
typedef struct {
    alignas(64) _Atomic uint64_t posted; /* descriptors published by the sender */
    _Atomic uint64_t produced;           /* bounce chunks written, cumulative */
    _Atomic uint64_t send_issued;        /* sends the sender has posted, active or queued */
    alignas(64) _Atomic uint64_t done;   /* receives finished by the receiver */
    _Atomic uint64_t recv_posted;        /* receives the receiver has made active */
    _Atomic uint64_t consumed;           /* bounce chunks read, cumulative */
    _Atomic uint64_t recv_issued;        /* receives the receiver has posted, active or queued */
    alignas(64) shm_offer offers[SHM_NSLOTS]; /* receiver-written, indexed by seq */
    alignas(64) shm_slot slots[SHM_NSLOTS];
} shm_chan;

typedef struct {
    uint64_t magic; /* written last by the creator */
    uint32_t version;
    uint32_t size;
    uint32_t nlanes;
    uint32_t reserved;
    uint64_t slot_bytes;
    uint64_t chunk_bytes;
    uint64_t eager_threshold;
    uint64_t total_bytes;
    _Atomic uint32_t attached;
    _Atomic uint32_t ready;
    _Atomic uint32_t abort_cause; /* mp_result; the first cause wins */
    _Atomic int32_t abort_rank;
    _Atomic uint32_t abort_why_ready; /* abort_rank and abort_why are written and final */
    char abort_why[240];           /* the aborting rank's reason, when it gave one */
    _Atomic uint32_t fenced;       /* ranks fenced as deadlocked: engines look closer when nonzero */
    _Atomic uint32_t detect_lock;  /* 1 + the rank writing a deadlock report, or 0 */
    _Atomic uint32_t reports_used; /* written under detect_lock; read by anyone (a fence names a report) */
} shm_header;

typedef struct {
    uint64_t ranks, cma, watch, reports, chans, inline_data, bounce, total; /* byte offsets */
    uint64_t slot_bytes, chunk_bytes;
    uint32_t nchans;
} shm_layout;

/* Views of a mapped segment; every index is checked by the caller against size / nlanes. */
typedef struct {
    char *base;
    shm_layout lay;
    int size;
    int nlanes;
} shm_view;

static inline shm_header *shm_hdr(const shm_view *v) { return (shm_header *)v->base; }
static inline shm_rank *shm_rank_at(const shm_view *v, int r) { return (shm_rank *)(v->base + v->lay.ranks) + r; }
/* Group rank `r`'s global rank, by which every report names it. */
static inline int shm_global_rank(const shm_view *v, int r) { return shm_rank_at(v, r)->global_rank; }
static inline _Atomic uint8_t *shm_cma_at(const shm_view *v, int reader, int owner)
{
    return (_Atomic uint8_t *)(v->base + v->lay.cma) + (size_t)reader * (size_t)v->size + (size_t)owner;
}
static inline shm_watch *shm_watch_at(const shm_view *v, int r) { return (shm_watch *)(v->base + v->lay.watch) + r; }
static inline char *shm_report_at(const shm_view *v, uint32_t i) { return v->base + v->lay.reports + (uint64_t)i * SHM_REPORT_BYTES; }
static inline uint32_t shm_chan_index(const shm_view *v, int lane, int src, int dst)
{
    return ((uint32_t)lane * (uint32_t)v->size + (uint32_t)src) * (uint32_t)v->size + (uint32_t)dst;
}
static inline shm_chan *shm_chan_at(const shm_view *v, uint32_t c) { return (shm_chan *)(v->base + v->lay.chans) + c; }
static inline char *shm_inline_at(const shm_view *v, uint32_t c, uint64_t seq)
{
    return v->base + v->lay.inline_data + ((uint64_t)c * SHM_NSLOTS + seq % SHM_NSLOTS) * v->lay.slot_bytes;
}
static inline char *shm_chunk_at(const shm_view *v, uint32_t c, uint64_t chunk)
{
    return v->base + v->lay.bounce + ((uint64_t)c * SHM_NCHUNKS + chunk % SHM_NCHUNKS) * v->lay.chunk_bytes;
}

void shm_layout_compute(int size, int nlanes, uint64_t eager_threshold, shm_layout *out);

/* Backs [addr, addr + len) of the mapping with memory now. The segment is sparse, so a full
 * /dev/shm would otherwise SIGBUS the first write to a page; this says so as an error instead:
 * 0, or the errno (ENOMEM / EFAULT: no room). Writers call it before first touching a region. */
int shm_segment_commit(char *addr, uint64_t len);

/* MiB free in /dev/shm (0 when it cannot be read), for errors that say how much room is missing. */
double shm_free_mib(void);

/* Fills `err` with "<what> <name>: <strerror(e)>", and how to fix a descriptor shortage: MP_ERR_SYSTEM. */
mp_result shm_system_error(char *err, size_t errlen, const char *what, const char *name, int e);

/* Creates (mode 0600, exclusive) or attaches to `name` and maps it into `v`. Attaching retries
 * until the creator has published the header or `deadline` passes, then checks that the header
 * agrees with this rank's arguments. */
mp_result shm_segment_map(const char *name, int create, int size, int nlanes, uint64_t eager_threshold,
                          double deadline, const mp_interrupt *interrupt, shm_view *v, char *err, size_t errlen);
void shm_segment_unmap(shm_view *v);
/* Removes segments whose creating process no longer exists. */
void shm_segment_sweep_stale(void);

#endif
