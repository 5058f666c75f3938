/* The shm engine's copy paths, once a send and its receive are matched: into the receiver's
 * arena, streaming through the channel's bounce buffer, and single-copy reads of the sender's
 * memory (process_vm_readv). Each pass copies a bounded slice, so other lanes interleave. */
#include "engine.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#include "core/clock.h"

#define CMA_CHUNK (4u << 20)   /* one process_vm_readv call; large single calls are slow */
#define COPY_CHUNK (16u << 20) /* bytes one op copies per pass, so ops on other lanes interleave */
#define EXIT_GRACE 0.2 /* seconds from a process unmapping its memory to its exit, at most */
/* A slice this large takes long enough (100 us and more) that the wakes a posting thread holds
 * go out first (shm_send_deferred_wakes): in an exchange, the peer's copy waits for this rank's
 * offer, and held until end() the two copies ran one after the other. */
#define LONG_COPY (1u << 20)

/* The one copy of an arena send: straight into the receiver's buffer, a slice per pass so that
 * ops on other lanes interleave; then the descriptor says the bytes are there. */
int shm_copy_to_arena(shm_t *s, mp_op *op, uint32_t c, shm_chan *ch, chan_local *cl)
{
    uint64_t n = op->nbytes - op->progress < COPY_CHUNK ? op->nbytes - op->progress : COPY_CHUNK;
    if (n >= LONG_COPY)
        shm_send_deferred_wakes(s);
    memcpy((char *)op->remote + op->progress, (const char *)op->buf + op->progress, n);
    op->progress += n;
    if (op->progress == op->nbytes) {
        shm_post_descriptor(s, op, c, ch, cl, SHM_PATH_ARENA);
        op->phase = PH_WAIT_DONE;
    }
    return 1;
}

int shm_stream_send(shm_t *s, mp_op *op, uint32_t c, shm_chan *ch, chan_local *cl)
{
    if (cl->streamed != op->stream_index)
        return 0; /* the bounce buffer carries one message at a time, in order */
    uint64_t chunk = s->v.lay.chunk_bytes;
    int moved = 0;
    uint64_t consumed;
    while (op->progress < op->nbytes) {
        if (shm_read_counter(s, op, &ch->consumed, "consumed", &cl->consumed_seen, NULL, cl->chunks_out, &consumed) < 0)
            return 1;
        if (cl->chunks_out - consumed >= SHM_NCHUNKS)
            break;
        uint64_t n = op->nbytes - op->progress < chunk ? op->nbytes - op->progress : chunk;
        memcpy(shm_chunk_at(&s->v, c, cl->chunks_out), (char *)op->buf + op->progress, n);
        op->progress += n;
        cl->chunks_out++;
        atomic_store_explicit(&ch->produced, cl->chunks_out, memory_order_release);
        moved = 1;
    }
    if (moved)
        shm_ring_peer(s, op);
    if (op->progress == op->nbytes) {
        cl->streamed++;
        op->phase = PH_WAIT_DONE;
        moved = 1;
    }
    return moved;
}

/* A single-copy read that failed: ESRCH (the sender is gone) and EFAULT (its buffer is no longer
 * mapped, as while it exits) are the sender's failure, and the communicator is aborted when
 * it has exited; anything else is this rank's own. */
static mp_result cma_failure(shm_t *s, const mp_op *op, int err, char *detail, size_t len)
{
    if (err != ESRCH && err != EFAULT) {
        snprintf(detail, len, "%s from rank %d: single-copy read failed: %s", mp_label_name(op->label),
                 op->peer_global, err ? strerror(err) : "no bytes");
        return MP_ERR_SYSTEM;
    }
    int exited = err == ESRCH || shm_peer_exited(s, op->peer);
    snprintf(detail, len, "the sender, rank %d (pid %d), %s during the single-copy read (%s)", op->peer_global,
             (int)s->pids[op->peer], exited ? "exited" : "unmapped its buffer, as a process does while it exits",
             strerror(err));
    if (exited)
        shm_abort(&s->base, MP_ERR_PEER_DEAD, op->peer, NULL);
    return MP_ERR_PEER_DEAD;
}

/* Whether peer `r` exits within EXIT_GRACE: a process unmaps its memory just before it is gone,
 * so a read that faults on a live peer's buffer is told from one that raced its exit. */
static int exits_soon(shm_t *s, int r)
{
    for (double until = mp_now() + EXIT_GRACE; !shm_peer_exited(s, r); usleep(1000))
        if (mp_now() > until)
            return 0;
    return 1;
}

int shm_copy_cma(shm_t *s, mp_step *step, mp_op *op, shm_chan *ch, chan_local *cl)
{
    uint64_t budget = COPY_CHUNK;
    if (op->nbytes - op->progress >= LONG_COPY)
        shm_send_deferred_wakes(s);
    while (op->progress < op->nbytes && budget) {
        uint64_t n = op->nbytes - op->progress;
        if (n > CMA_CHUNK)
            n = CMA_CHUNK;
        struct iovec local = {(char *)op->buf + op->progress, n};
        struct iovec remote = {(void *)(uintptr_t)(cl->copy_addr + op->progress), n};
        ssize_t got = process_vm_readv(s->pids[op->peer], &local, 1, &remote, 1, 0);
        int err = got < 0 ? errno : 0;
        if (err == EFAULT && !exits_soon(s, op->peer))
            return shm_found_corrupt(s, "descriptor of message #%llu from rank %d: addr %#llx (%llu bytes) is not "
                                     "mapped in its process, which lives on", (unsigned long long)op->seq,
                                     op->peer_global, (unsigned long long)cl->copy_addr,
                                     (unsigned long long)op->nbytes);
        if (got <= 0) {
            mp_result r = cma_failure(s, op, err, op->detail, sizeof op->detail);
            shm_recv_done(s, step, op, ch, cl, r);
            return 1;
        }
        op->progress += (uint64_t)got;
        budget = budget > (uint64_t)got ? budget - (uint64_t)got : 0;
    }
    if (op->progress == op->nbytes)
        shm_recv_done(s, step, op, ch, cl, MP_OK);
    return 1;
}

int shm_copy_bounce(shm_t *s, mp_step *step, mp_op *op, uint32_t c, shm_chan *ch, chan_local *cl, int skip)
{
    uint64_t chunk = s->v.lay.chunk_bytes;
    uint64_t total = skip ? op->skip_total : op->nbytes;
    int moved = 0;
    uint64_t produced;
    while (op->progress < total) {
        if (shm_read_counter(s, op, &ch->produced, "produced", &cl->produced_seen, NULL, cl->chunks_in + SHM_NCHUNKS,
                             &produced) < 0)
            return 1;
        if (produced <= cl->chunks_in)
            break;
        uint64_t n = total - op->progress < chunk ? total - op->progress : chunk;
        if (!skip)
            memcpy((char *)op->buf + op->progress, shm_chunk_at(&s->v, c, cl->chunks_in), n);
        op->progress += n;
        cl->chunks_in++;
        atomic_store_explicit(&ch->consumed, cl->chunks_in, memory_order_release);
        moved = 1;
    }
    if (moved)
        shm_ring_peer(s, op);
    if (op->progress == total) {
        shm_recv_done(s, step, op, ch, cl, skip ? MP_ERR_MISMATCH : MP_OK);
        moved = 1;
    }
    return moved;
}
