/* Posting and matching in the shm engine: completing ops, sends publishing descriptors (or taking
 * an arena offer), receives matching them and offering their buffers, activating steps and
 * progressing each lane's steps in order. The copies themselves are in copy.c. */
#include "engine.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/clock.h"
#include "core/dtype.h"
#include "core/shape.h"

/* mp_op.offered of a receive: whether it has told its sender where its buffer is. */
enum { OFFER_NONE = 0, OFFER_MADE, OFFER_DECLINED };
#define NO_OFFER UINT64_MAX /* shm_offer.offset of a receive whose buffer is not in the arena */
/* No process's buffer reaches past this address (x86-64's and arm64's user space): a sender's
 * [addr, addr + nbytes) beyond it is garbage, not a message. */
#define USER_SPACE_END (1ull << 48)

/* Reads a counter the peer of `op` advances on their channel: it never goes back, and never
 * passes `limit`, what this rank has made possible (or, with `limit_word`, what the peer has
 * issued, read after it). Returns 0, or -1 once the segment is reported corrupt. */
int shm_read_counter(shm_t *s, const mp_op *op, _Atomic uint64_t *word, const char *name, uint64_t *seen,
                     _Atomic uint64_t *limit_word, uint64_t limit, uint64_t *out)
{
    uint64_t v = atomic_load_explicit(word, memory_order_acquire);
    if (limit_word)
        limit = atomic_load_explicit(limit_word, memory_order_acquire);
    if (v < *seen || v > limit) {
        shm_found_corrupt(s, "%s = %llu on lane %d %s rank %d, outside [%llu, %llu]", name, (unsigned long long)v,
                          op->lane, op->kind == MP_SEND ? "to" : "from", op->peer_global, (unsigned long long)*seen,
                          (unsigned long long)limit);
        return -1;
    }
    *seen = v;
    *out = v;
    return 0;
}

/* ---- completion ---------------------------------------------------------------------- */

/* An op's own work is over. The host sees a step's ops complete together, as NCCL completes a
 * group's (a receive whose group still sends is not done): a success waits for the step's last
 * op; a failure shows at once. Once DONE a Request may be freed at any moment. */
void shm_finish(shm_t *s, mp_step *step, mp_op *op, mp_result r)
{
    if (op->offered == OFFER_MADE && r != MP_OK)
        mp_arena_quarantine(s->arena, op->buf); /* its sender may still be writing into it */
    step->ops[op->index] = NULL;
    op->result = r;
    if (--step->remaining > 0 && r == MP_OK) {
        op->next_settled = step->settled;
        step->settled = op;
        return;
    }
    atomic_store_explicit(&op->state, MP_OP_DONE, memory_order_release);
    if (step->remaining == 0)
        for (mp_op *o = step->settled, *next; o; o = next) {
            next = o->next_settled; /* read before DONE: the op may be freed from then on */
            atomic_store_explicit(&o->state, MP_OP_DONE, memory_order_release);
        }
    atomic_fetch_add(&s->completions, 1);
    if (atomic_load(&s->waiters))
        mp_futex_wake(&s->completions, 0);
}

/* ---- sends ------------------------------------------------------------------------------ */


/* Backs a region of the channel with memory before its first write; a /dev/shm without room is
 * an error of this send (and an abort, so that its receiver fails too), not a SIGBUS. */
static int commit_region(shm_t *s, mp_step *step, mp_op *op, uint8_t *committed, char *addr, uint64_t len,
                         const char *what)
{
    if (*committed)
        return 0;
    int e = shm_segment_commit(addr, len);
    if (!e) {
        *committed = 1;
        return 0;
    }
    snprintf(op->detail, sizeof op->detail, "/dev/shm has %.1f MiB free, too little for the %s of the channel to "
             "rank %d (%.1f MiB; %s); give /dev/shm more space (in a container, --shm-size)", shm_free_mib(), what,
             op->peer_global, (double)len / 1048576.0, e == EFAULT ? "the kernel could not back it" : strerror(e));
    shm_abort(&s->base, MP_ERR_SYSTEM, s->base.rank, op->detail);
    shm_finish(s, step, op, MP_ERR_SYSTEM);
    return -1;
}

/* Fills message op->seq's descriptor and publishes it to the receiver. */
void shm_post_descriptor(shm_t *s, mp_op *op, uint32_t c, shm_chan *ch, chan_local *cl, uint32_t path)
{
    shm_slot *sl = &ch->slots[op->seq % SHM_NSLOTS];
    sl->nbytes = op->nbytes;
    sl->dtype = op->dtype;
    sl->label = (uint32_t)op->label;
    sl->addr = (uint64_t)(uintptr_t)op->buf;
    sl->result = MP_OK;
    sl->path = path;
    sl->ndim = s->check ? op->ndim : -1;
    for (int d = 0; d < sl->ndim; d++)
        sl->shape[d] = op->shape[d];
    sl->recv_ndim = -1;
    if (path == SHM_PATH_INLINE && op->nbytes)
        memcpy(shm_inline_at(&s->v, c, op->seq), op->buf, op->nbytes);
    atomic_store_explicit(&ch->posted, op->seq + 1, memory_order_release);
    cl->published = op->seq + 1;
    /* A receiver that has not issued this receive yet finds the descriptor when it does (its
     * post passes the engine after raising recv_issued; the fences pair), so it needs no wake:
     * a futex wake costs microseconds, and a peer that is computing has no use for it. */
    atomic_thread_fence(memory_order_seq_cst);
    if (atomic_load_explicit(&ch->recv_issued, memory_order_relaxed) > op->seq)
        shm_ring_peer(s, op);
}

/* What a send too large for its slot, to a peer with an arena, does about the receiver's offer. */
typedef enum {
    TAKE_CORRUPT = -2,      /* the segment is reported corrupt */
    TAKE_AWAIT_ANSWER = -1, /* wait for the receive's answer */
    TAKE_USUAL_PATH = 0,    /* take the usual path */
    TAKE_OFFERED = 1,       /* the receiver offered a buffer for exactly this message: op->remote is set */
} offer_taken;

static offer_taken take_offer(shm_t *s, mp_op *op, shm_chan *ch, chan_local *cl)
{
    uint64_t active; /* read first: a receive answers before it is made active */
    if (shm_read_counter(s, op, &ch->recv_posted, "recv_posted", &cl->active_seen, &ch->recv_issued, 0, &active) < 0)
        return TAKE_CORRUPT;
    shm_offer *o = &ch->offers[op->seq % SHM_NSLOTS];
    atomic_thread_fence(memory_order_seq_cst); /* after send_issued, before the answer: see shm_answer() */
    if (atomic_load_explicit(&o->seq, memory_order_acquire) != op->seq + 1)
        return active > op->seq || op->nbytes < MP_SHM_OFFER_WAIT_BYTES ? TAKE_USUAL_PATH : TAKE_AWAIT_ANSWER;
    /* A versioned read (see shm_answer()): fields read while another answer rewrote the slot
     * are told by seq, which that answer cleared before touching them. */
    uint64_t offset = atomic_load_explicit(&o->offset, memory_order_relaxed);
    uint64_t nbytes = atomic_load_explicit(&o->nbytes, memory_order_relaxed);
    int32_t dtype = atomic_load_explicit(&o->dtype, memory_order_relaxed);
    atomic_thread_fence(memory_order_acquire);
    if (atomic_load_explicit(&o->seq, memory_order_relaxed) != op->seq + 1 || offset == NO_OFFER ||
        nbytes != op->nbytes || dtype != op->dtype)
        return TAKE_USUAL_PATH; /* rewritten meanwhile, declined, or the receiver expects another message: it says so */
    uint64_t limit = s->peer_arena_bytes[op->peer];
    if (offset > limit || nbytes > limit - offset) {
        shm_found_corrupt(s, "arena offer for message #%llu to rank %d: offset %#llx + nbytes %llu is beyond its arena "
                          "of %llu bytes", (unsigned long long)op->seq, op->peer_global, (unsigned long long)offset,
                          (unsigned long long)nbytes, (unsigned long long)limit);
        return TAKE_CORRUPT;
    }
    op->remote = s->peer_arenas[op->peer] + offset;
    return TAKE_OFFERED;
}

static int publish_send(shm_t *s, mp_step *step, mp_op *op, uint32_t c, shm_chan *ch, chan_local *cl)
{
    if (cl->published != op->seq)
        return 0; /* an earlier send on this channel goes first */
    uint64_t done;
    if (shm_read_counter(s, op, &ch->done, "done", &cl->done_seen, NULL, cl->published, &done) < 0)
        return 1;
    if (done + SHM_NSLOTS <= op->seq)
        return 0; /* every descriptor slot still holds an unfinished message */
    int large = op->nbytes > s->v.lay.slot_bytes;
    if (large && s->peer_arenas[op->peer]) {
        offer_taken offered = take_offer(s, op, ch, cl);
        if (offered == TAKE_CORRUPT)
            return 1;
        if (offered == TAKE_AWAIT_ANSWER)
            return 0;
        if (offered == TAKE_OFFERED) {
            atomic_store_explicit(&op->matched, 1, memory_order_relaxed);
            op->phase = PH_ARENA;
            op->progress = 0;
            return 1;
        }
    }
    uint8_t single_copy =
        large ? atomic_load_explicit(shm_cma_at(&s->v, op->peer, s->base.rank), memory_order_relaxed) : 0;
    if (single_copy > 1)
        return shm_found_corrupt(s, "single-copy flag of rank %d for this rank = %u", op->peer_global, single_copy);
    int backed = !large ? !op->nbytes || commit_region(s, step, op, &cl->inline_committed, shm_inline_at(&s->v, c, 0),
                                                       (uint64_t)SHM_NSLOTS * s->v.lay.slot_bytes, "inline slots") == 0
                        : single_copy || commit_region(s, step, op, &cl->bounce_committed, shm_chunk_at(&s->v, c, 0),
                                                       (uint64_t)SHM_NCHUNKS * s->v.lay.chunk_bytes, "bounce buffer") == 0;
    if (!backed)
        return 1;
    uint32_t path = !large ? SHM_PATH_INLINE : single_copy ? SHM_PATH_CMA : SHM_PATH_BOUNCE;
    shm_post_descriptor(s, op, c, ch, cl, path);
    if (path == SHM_PATH_INLINE && op->nbytes <= s->eager_threshold) {
        shm_finish(s, step, op, MP_OK); /* buffered: completes without the receive */
        return 1;
    }
    if (path == SHM_PATH_BOUNCE) {
        op->stream_index = cl->bounced++;
        op->phase = PH_STREAM;
    } else {
        op->phase = PH_WAIT_DONE;
    }
    return 1;
}

/* A send waiting on its receiver's answer: finishes it with the outcome the receiver wrote, once it
 * has. Returns whether anything happened. */
static int settle_send(shm_t *s, mp_step *step, mp_op *op, shm_chan *ch, chan_local *cl)
{
    uint64_t done = 0;
    if (shm_read_counter(s, op, &ch->done, "done", &cl->done_seen, NULL, cl->published, &done) < 0)
        return 1;
    if (done <= op->seq)
        return 0;
    shm_slot *sl = &ch->slots[op->seq % SHM_NSLOTS];
    uint32_t result = sl->result;
    int32_t recv_dtype = sl->recv_dtype;
    uint32_t recv_label = sl->recv_label;
    /* What a receiver writes: its copy's outcome, and on a mismatch what it expected. */
    if (result != MP_OK && result != MP_ERR_MISMATCH && result != MP_ERR_SYSTEM && result != MP_ERR_PEER_DEAD)
        return shm_found_corrupt(s, "result of message #%llu to rank %d = %u", (unsigned long long)op->seq,
                                 op->peer_global, result);
    if (result == MP_ERR_MISMATCH && (recv_dtype < 0 || recv_dtype >= MP_NUM_DTYPES || recv_label >= MP_NUM_LABELS))
        return shm_found_corrupt(s, "receiver's dtype %d / label %u of message #%llu to rank %d", recv_dtype,
                                 recv_label, (unsigned long long)op->seq, op->peer_global);
    int32_t recv_ndim = sl->recv_ndim;
    if (result == MP_ERR_MISMATCH && (recv_ndim < -1 || recv_ndim > MP_MAX_DIMS))
        return shm_found_corrupt(s, "receiver's ndim %d of message #%llu to rank %d", recv_ndim,
                                 (unsigned long long)op->seq, op->peer_global);
    int64_t recv_shape[MP_MAX_DIMS] = {0};
    for (int d = 0; d < recv_ndim; d++)
        recv_shape[d] = sl->recv_shape[d];
    int shapes_differ = recv_ndim >= 0 && !mp_same_shape(s->check ? op->ndim : -1, op->shape, recv_ndim, recv_shape);
    /* A receiver that expects exactly what was sent saw another descriptor than this rank wrote. */
    if (result == MP_ERR_MISMATCH && sl->recv_nbytes == op->nbytes && recv_dtype == op->dtype && !shapes_differ)
        return shm_found_corrupt(s, "descriptor of message #%llu to rank %d: nbytes or dtype changed after this "
                                 "rank wrote %llu bytes of %s (the receiver expects those, and read others)",
                                 (unsigned long long)op->seq, op->peer_global, (unsigned long long)op->nbytes,
                                 mp_dtype_name(op->dtype));
    mp_result r = (mp_result)result;
    if (r == MP_ERR_MISMATCH && shapes_differ && sl->recv_nbytes == op->nbytes) {
        char theirs[64], mine[64]; /* a longer shape is cut: the report stays one line */
        mp_format_shape(recv_ndim, recv_shape, theirs, sizeof theirs);
        mp_format_shape(op->ndim, op->shape, mine, sizeof mine);
        snprintf(op->detail, sizeof op->detail, "rank %d's %s expects shape %s; this rank sent shape %s (both %llu "
                 "bytes of %s; debug matching compares shapes)", op->peer_global,
                 mp_label_name((mp_label)recv_label), theirs, mine, (unsigned long long)op->nbytes,
                 mp_dtype_name(op->dtype));
    } else if (r == MP_ERR_MISMATCH)
        snprintf(op->detail, sizeof op->detail,
                 "rank %d's %s expects %llu bytes of %s; this rank sent %llu bytes of %s", op->peer_global,
                 mp_label_name((mp_label)recv_label), (unsigned long long)sl->recv_nbytes,
                 mp_dtype_name(recv_dtype), (unsigned long long)op->nbytes, mp_dtype_name(op->dtype));
    else if (r != MP_OK)
        snprintf(op->detail, sizeof op->detail, "%s to rank %d failed at the receiver: %s",
                 mp_label_name(op->label), op->peer_global, mp_result_str(r));
    shm_finish(s, step, op, r);
    return 1;
}

/* Before an abort fails what is left, the sends whose receivers have already answered take their
 * answer: a receiver that reports a mismatch and then closes with ops pending would otherwise
 * turn its sender's MismatchError into the close's abort. */
/* The channel `op` sends on, and this rank's side of it: its index, *ch and *cl. */
static uint32_t send_channel(shm_t *s, const mp_op *op, shm_chan **ch, chan_local **cl)
{
    uint32_t c = shm_chan_index(&s->v, op->lane, s->base.rank, op->peer);
    *ch = shm_chan_at(&s->v, c);
    *cl = &s->out[op->lane * s->base.size + op->peer];
    return c;
}

void shm_settle_answered_sends(shm_t *s)
{
    for (int l = 0; l < s->base.nlanes; l++) {
        step_queue *q = &s->lanes[l];
        mp_step *step = q->head;
        if (!step || !step->activated)
            continue;
        for (int i = 0; i < step->nops; i++) {
            mp_op *op = step->ops[i];
            if (op && op->kind == MP_SEND && op->phase == PH_WAIT_DONE) {
                shm_chan *ch;
                chan_local *cl;
                send_channel(s, op, &ch, &cl);
                settle_send(s, step, op, ch, cl);
            }
        }
        if (step->remaining == 0)
            shm_free_head(s, q);
    }
}

static int progress_send(shm_t *s, mp_step *step, mp_op *op)
{
    shm_chan *ch;
    chan_local *cl;
    uint32_t c = send_channel(s, op, &ch, &cl);
    int moved = 0;
    if (op->phase == PH_NEW) {
        int index = op->index;
        moved = publish_send(s, step, op, c, ch, cl);
        if (!step->ops[index])
            return moved; /* finished as an eager send */
    }
    if (op->phase == PH_ARENA)
        moved |= shm_copy_to_arena(s, op, c, ch, cl);
    if (op->phase == PH_STREAM)
        moved |= shm_stream_send(s, op, c, ch, cl);
    if (op->phase == PH_WAIT_DONE)
        moved |= settle_send(s, step, op, ch, cl);
    return moved;
}

/* ---- receives --------------------------------------------------------------------------- */

void shm_recv_done(shm_t *s, mp_step *step, mp_op *op, shm_chan *ch, chan_local *cl, mp_result r)
{
    shm_slot *sl = &ch->slots[op->seq % SHM_NSLOTS];
    sl->result = (uint32_t)r;
    cl->recv_next++;
    atomic_store_explicit(&ch->done, cl->recv_next, memory_order_release);
    shm_ring_peer(s, op);
    shm_finish(s, step, op, r);
}

static int start_recv(shm_t *s, mp_step *step, mp_op *op, uint32_t c, shm_chan *ch, chan_local *cl)
{
    if (cl->recv_next != op->seq)
        return 0;
    uint64_t posted;
    if (shm_read_counter(s, op, &ch->posted, "posted", &cl->posted_seen, &ch->send_issued, 0, &posted) < 0)
        return 1;
    if (posted <= op->seq)
        return 0;
    shm_slot *sl = &ch->slots[op->seq % SHM_NSLOTS];
    /* Everything in the slot is the peer's word, read once and checked before it sizes a copy. */
    uint64_t nbytes = sl->nbytes, addr = sl->addr;
    int32_t dtype = sl->dtype;
    uint32_t path = sl->path, label = sl->label;
    int32_t ndim = sl->ndim;
    int offered = op->offered == OFFER_MADE;
    op->offered = OFFER_NONE; /* the sender has chosen: it writes into the buffer no more */
    int copies = path == SHM_PATH_CMA || path == SHM_PATH_BOUNCE;
    const char *bad = path > SHM_PATH_ARENA                                            ? "path"
                    : dtype < 0 || dtype >= MP_NUM_DTYPES                               ? "dtype"
                    : label >= MP_NUM_LABELS                                            ? "label"
                    : (path == SHM_PATH_INLINE) != (nbytes <= s->v.lay.slot_bytes) || nbytes >= USER_SPACE_END
                        ? "nbytes"
                    : path == SHM_PATH_ARENA && (!offered || nbytes != op->nbytes || dtype != op->dtype)
                        ? "path (the arena holds no message of this receive)"
                    : copies && (addr >= USER_SPACE_END || nbytes > USER_SPACE_END - addr) ? "addr"
                    : ndim < -1 || ndim > MP_MAX_DIMS                                   ? "ndim"
                                                                                          : NULL;
    if (bad)
        return shm_found_corrupt(s, "descriptor of message #%llu from rank %d: %s (path %u, %llu bytes of dtype %d at "
                                 "%#llx, label %u)", (unsigned long long)op->seq, op->peer_global, bad, path,
                                 (unsigned long long)nbytes, dtype, (unsigned long long)addr, label);
    int64_t shape[MP_MAX_DIMS]; /* the sender's shape, read (once) only where shapes are checked */
    int shapes_differ = 0;
    if (s->check) {
        for (int d = 0; d < ndim; d++)
            shape[d] = sl->shape[d];
        shapes_differ = !mp_same_shape(ndim, shape, op->ndim, op->shape);
    }
    if (nbytes != op->nbytes || dtype != op->dtype || shapes_differ) {
        sl->recv_nbytes = op->nbytes;
        sl->recv_dtype = op->dtype;
        sl->recv_label = (uint32_t)op->label;
        sl->recv_ndim = shapes_differ ? op->ndim : -1;
        for (int d = 0; d < sl->recv_ndim; d++)
            sl->recv_shape[d] = op->shape[d];
        if (shapes_differ && nbytes == op->nbytes && dtype == op->dtype) {
            char theirs[64], mine[64]; /* a longer shape is cut: the report stays one line */
            mp_format_shape(ndim, shape, theirs, sizeof theirs);
            mp_format_shape(op->ndim, op->shape, mine, sizeof mine);
            snprintf(op->detail, sizeof op->detail, "rank %d's %s sent shape %s; this rank expects shape %s (both %llu "
                     "bytes of %s; debug matching compares shapes)", op->peer_global, mp_label_name((mp_label)label),
                     theirs, mine, (unsigned long long)nbytes, mp_dtype_name(dtype));
        } else {
            snprintf(op->detail, sizeof op->detail, "rank %d's %s sent %llu bytes of %s; this rank expects %llu bytes "
                     "of %s", op->peer_global, mp_label_name((mp_label)label), (unsigned long long)nbytes,
                     mp_dtype_name(dtype), (unsigned long long)op->nbytes, mp_dtype_name(op->dtype));
        }
        if (path == SHM_PATH_BOUNCE) {
            op->phase = PH_SKIP; /* drain the sender's chunks so the channel stays in step */
            op->progress = 0;
            op->skip_total = nbytes;
            return 1;
        }
        shm_recv_done(s, step, op, ch, cl, MP_ERR_MISMATCH);
        return 1;
    }
    atomic_store_explicit(&op->matched, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&s->received[path], 1, memory_order_relaxed);
    if (path == SHM_PATH_INLINE || path == SHM_PATH_ARENA) {
        if (path == SHM_PATH_INLINE && nbytes)
            memcpy(op->buf, shm_inline_at(&s->v, c, op->seq), nbytes);
        shm_recv_done(s, step, op, ch, cl, MP_OK);
        return 1;
    }
    op->phase = path == SHM_PATH_CMA ? PH_COPY_CMA : PH_COPY_BOUNCE;
    op->progress = 0;
    cl->copy_addr = addr;
    return 1;
}

static int progress_recv(shm_t *s, mp_step *step, mp_op *op)
{
    uint32_t c = shm_chan_index(&s->v, op->lane, op->peer, s->base.rank);
    shm_chan *ch = shm_chan_at(&s->v, c);
    chan_local *cl = &s->in[op->lane * s->base.size + op->peer];
    if (op->phase == PH_NEW)
        return start_recv(s, step, op, c, ch, cl);
    if (op->phase == PH_SKIP)
        return shm_copy_bounce(s, step, op, c, ch, cl, 1);
    if (op->phase == PH_COPY_CMA)
        return shm_copy_cma(s, step, op, ch, cl);
    return shm_copy_bounce(s, step, op, c, ch, cl, 0);
}

/* ---- the progress loop ------------------------------------------------------------------ */

/* A large receive on a rank with an arena tells its sender whether its buffer lies there, in
 * the channel's offer slot for its message: when it is posted if the slot is free (the sender
 * has published the message that used it last), else when it becomes active. With more than
 * SHM_NSLOTS receives outstanding, receives k and k + SHM_NSLOTS answer into one slot, and the
 * two answers may come from two threads: the posting thread and the engine's holder activating
 * a step. Publishing is atomic in two ways. The writers, all in this process, hold `lock` (the
 * caller takes it), so one answer never interleaves with another. The reader, the sender in its
 * own process, cannot share that lock: seq is cleared before the other fields are written and set
 * last, so take_offer() rechecks it after reading them and drops a read that met a rewrite (a
 * seqlock whose versions are the messages' seqs). An answer never replaces a later receive's:
 * that one was made only once this receive's message was published, which has no use for it. */
void shm_answer(shm_t *s, mp_op *op, shm_chan *ch)
{
    if (!s->arena || op->nbytes <= s->v.lay.slot_bytes)
        return;
    uint64_t offset;
    int in_arena = mp_arena_holds(s->arena, op->buf, op->nbytes, &offset);
    shm_offer *o = &ch->offers[op->seq % SHM_NSLOTS];
    if (atomic_load_explicit(&o->seq, memory_order_relaxed) > op->seq + 1) {
        op->offered = OFFER_DECLINED;
        return;
    }
    atomic_store_explicit(&o->seq, 0, memory_order_relaxed);
    atomic_thread_fence(memory_order_release); /* the clearing before the fields, for take_offer's recheck */
    atomic_store_explicit(&o->offset, in_arena ? offset : NO_OFFER, memory_order_relaxed);
    atomic_store_explicit(&o->nbytes, op->nbytes, memory_order_relaxed);
    atomic_store_explicit(&o->dtype, op->dtype, memory_order_relaxed);
    op->offered = in_arena ? OFFER_MADE : OFFER_DECLINED;
    atomic_store_explicit(&o->seq, op->seq + 1, memory_order_release);
    /* Wake the sender only when its send waits for this: it is issued and not published. The
     * fence pairs with take_offer's, so either it sees this answer or this sees its send. */
    atomic_thread_fence(memory_order_seq_cst);
    if (op->nbytes >= MP_SHM_OFFER_WAIT_BYTES && atomic_load_explicit(&ch->send_issued, memory_order_relaxed) > op->seq &&
        atomic_load_explicit(&ch->posted, memory_order_relaxed) <= op->seq)
        shm_ring_peer(s, op);
}

static void activate(shm_t *s, mp_step *step)
{
    for (int i = 0; i < step->nops; i++) {
        mp_op *op = step->ops[i];
        atomic_store_explicit(&op->state, MP_OP_ACTIVE, memory_order_relaxed);
        if (op->kind == MP_RECV) {
            shm_chan *ch = shm_chan_at(&s->v, shm_chan_index(&s->v, op->lane, op->peer, s->base.rank));
            if (op->offered == OFFER_NONE && atomic_load_explicit(&ch->posted, memory_order_acquire) <= op->seq) {
                pthread_mutex_lock(&s->lock); /* the posting thread may answer into the same slot */
                shm_answer(s, op, ch);
                pthread_mutex_unlock(&s->lock);
            }
            /* Release: a peer that reads it then reads recv_issued, which must not look smaller,
             * and the answer, which must be there. */
            if (atomic_load_explicit(&ch->recv_posted, memory_order_relaxed) < op->seq + 1)
                atomic_store_explicit(&ch->recv_posted, op->seq + 1, memory_order_release);
        }
    }
    step->activated = 1;
}

/* Frees a lane's head step once its ops have all finished: a lane holds only steps with an op
 * still to finish, which is what a closing rank counts as pending. */
void shm_free_head(shm_t *s, step_queue *q)
{
    mp_step *step = q->head;
    q->head = step->next;
    if (!q->head)
        q->tail = NULL;
    free(step);
    atomic_fetch_sub(&my_slot(s)->unfinished, 1);
}

int shm_progress_lane(shm_t *s, step_queue *q)
{
    int moved = 0;
    while (q->head) {
        mp_step *step = q->head;
        if (!step->activated) {
            activate(s, step);
            moved = 1;
        }
        for (int i = 0; i < step->nops; i++) {
            mp_op *op = step->ops[i];
            if (!op)
                continue;
            moved |= op->kind == MP_SEND ? progress_send(s, step, op) : progress_recv(s, step, op);
        }
        if (step->remaining > 0)
            break;
        shm_free_head(s, q);
        moved = 1;
    }
    return moved;
}
