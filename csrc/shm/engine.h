/* The shm transport's engine. Posted ops belong to the engine: whoever holds `engine` matches,
 * copies and completes them. That is the progress thread, so ops progress while Python
 * computes, or the caller's own thread while it posts or waits, so a waiting rank reacts
 * without a futex wake on its critical path.
 * This is the engine's internal header, shared by its files in csrc/shm/ (match.c, copy.c,
 * failure.c, progress.c, wait.c, open.c); nothing outside csrc/shm/ includes it. */
#ifndef MP_SHM_ENGINE_H
#define MP_SHM_ENGINE_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "arena.h"
#include "core/op.h"
#include "core/result.h"
#include "core/transport.h"
#include "segment.h"
#include "shm_transport.h"

enum { PH_NEW = 0, PH_ARENA, PH_STREAM, PH_WAIT_DONE, PH_COPY_CMA, PH_COPY_BOUNCE, PH_SKIP };

/* This process's view of a channel: sender fields for (lane, me -> peer), receiver fields for
 * (lane, peer -> me). */
typedef struct {
    uint64_t published;  /* sends whose descriptor is out */
    uint64_t bounced;    /* sends published for the bounce buffer */
    uint64_t streamed;   /* of those, the ones fully written to it */
    uint64_t chunks_out; /* bounce chunks produced */
    uint64_t recv_next;  /* the next receive to serve: receives finish in order */
    uint64_t chunks_in;  /* bounce chunks consumed */
    uint64_t copy_addr;  /* the sender's buffer of the receive being copied (one at a time) */
    /* The peer's counters as last read: they never go back. */
    uint64_t done_seen, consumed_seen, posted_seen, produced_seen, active_seen;
    /* Sender side: the channel's inline slots and bounce chunks are backed by memory (the
     * segment is sparse; see shm_segment_commit). */
    uint8_t inline_committed, bounce_committed;
} chan_local;

typedef struct {
    mp_step *head, *tail;
} step_queue;

typedef struct {
    mp_transport base;
    shm_view v;
    uint64_t eager_threshold;
    int check; /* debug matching: descriptors carry shapes, and receivers compare them */
    int *pidfds;      /* per peer, -1 where pidfd_open is unavailable */
    pid_t *pids;
    chan_local *out;  /* [lane][peer] */
    chan_local *in;   /* [lane][peer] */
    step_queue *lanes;
    uint64_t probe_word;
    mp_arena *arena;          /* this rank's receive arena (a reference), or NULL */
    char **peer_arenas;       /* per peer: its arena as mapped here, or NULL */
    _Atomic uint64_t received[MP_SHM_NPATHS]; /* messages received by each path */
    uint64_t *peer_arena_bytes;

    pthread_t thread;
    int thread_started;
    pthread_mutex_t engine; /* guards lanes, out, in, failed: the engine state */
    pthread_mutex_t lock;   /* guards `incoming` and `stop` */
    step_queue incoming;
    int stop;

    _Atomic uint32_t completions; /* futex word for waiters in this process */
    _Atomic uint32_t waiters;
    _Atomic uint32_t watching; /* threads in a published wait (mirrors my shm_rank.waiting) */
    _Atomic uint32_t driving;  /* threads progressing from a wait (mirrors my shm_rank.driving) */
    _Atomic int corrupt;       /* 0; 1 while corrupt_why is written; 2 once it is final */
    char corrupt_why[MP_DETAIL_LEN]; /* the first impossible value this rank read from the segment */
    int failed; /* abort or own fence seen, everything failed */

    /* Guarded by `lock`. A rank whose ops come from several threads may post more while one
     * of them waits (another may be computing): its waits never count as blocked. */
    pthread_t poster;
    int posters; /* 0, 1, or 2 for several */
} shm_t;

static inline shm_t *as_shm(mp_transport *t) { return (shm_t *)t; }
static inline shm_rank *my_slot(shm_t *s) { return shm_rank_at(&s->v, s->base.rank); }

/* ---- match.c: completion, descriptors and offers, matching, the lanes ------------------- */

int shm_read_counter(shm_t *s, const mp_op *op, _Atomic uint64_t *word, const char *name, uint64_t *seen,
                     _Atomic uint64_t *limit_word, uint64_t limit, uint64_t *out);
void shm_finish(shm_t *s, mp_step *step, mp_op *op, mp_result r);
void shm_post_descriptor(shm_t *s, mp_op *op, uint32_t c, shm_chan *ch, chan_local *cl, uint32_t path);
void shm_recv_done(shm_t *s, mp_step *step, mp_op *op, shm_chan *ch, chan_local *cl, mp_result r);
void shm_answer(shm_t *s, mp_op *op, shm_chan *ch);
void shm_free_head(shm_t *s, step_queue *q);
int shm_progress_lane(shm_t *s, step_queue *q);
void shm_settle_answered_sends(shm_t *s);

/* ---- copy.c: the copies of matched messages --------------------------------------------- */

int shm_copy_to_arena(shm_t *s, mp_op *op, uint32_t c, shm_chan *ch, chan_local *cl);
int shm_stream_send(shm_t *s, mp_op *op, uint32_t c, shm_chan *ch, chan_local *cl);
int shm_copy_cma(shm_t *s, mp_step *step, mp_op *op, shm_chan *ch, chan_local *cl);
int shm_copy_bounce(shm_t *s, mp_step *step, mp_op *op, uint32_t c, shm_chan *ch, chan_local *cl, int skip);

/* ---- failure.c: corruption, aborts, fences, liveness ------------------------------------ */

int shm_found_corrupt(shm_t *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void shm_fail_queue(shm_t *s, step_queue *q, mp_result r, const char *why);
int shm_peer_exited(shm_t *s, int r);
mp_result shm_abort_cause(mp_transport *t, int *rank);
int shm_fail_unserved(shm_t *s, int departed);
bool shm_abort(mp_transport *t, mp_result cause, int rank, const char *why);
void shm_fail_everything(shm_t *s);
void shm_check_liveness(shm_t *s);
void shm_failure_report(mp_transport *t, const mp_op *op, char *buf, size_t len);
void shm_describe_peer(mp_transport *t, const mp_op *op, char *buf, size_t len);

/* ---- progress.c: the progress thread, posting, wakes ------------------------------------ */

void shm_ring(shm_t *s, int rank);
void shm_ring_peer(shm_t *s, const mp_op *op);
/* The wakes a posting thread holds until end(), sent now: before a copy that takes long, since a
 * peer waiting for this rank's offer would otherwise wait for the whole copy. */
void shm_send_deferred_wakes(shm_t *s);
int shm_engine_pass(shm_t *s);
void *shm_progress_main(void *arg);
mp_result shm_post(mp_transport *t, mp_step *step);
mp_result shm_begin(mp_transport *t, void *stream);
mp_result shm_end(mp_transport *t);

/* ---- wait.c ----------------------------------------------------------------------------- */

mp_result shm_wait(mp_transport *t, mp_op *op, double deadline, const mp_interrupt *interrupt);

#endif
