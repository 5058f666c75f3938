/* A cycle's ranks are fenced one by one (shm_cycle_fence). A member that wakes between its
 * peer's fence and its own must still be reported as a member (MP_ERR_DEADLOCK), not as a rank
 * that merely needs a member (MP_ERR_ABORTED); and a fence, once written, is final. This stages
 * the fencing by hand (and, in one case, a peer's word the search reads), on a 2-rank
 * communicator whose ranks are threads of this process:
 *
 *   shm_fence_order member [rounds]        rank 1's fence comes before the lock is released:
 *                                          DEADLOCK
 *   shm_fence_order waiter [rounds]        the lock is released without it: ABORTED
 *   shm_fence_order abort_after [rounds]   both fences written, then rank 0 aborts the
 *                                          communicator before rank 1 waits: still DEADLOCK
 *   shm_fence_order unpublished [rounds]   no fencing: rank 0, which never waited, has its
 *                                          `waiting` count set (garbage a peer may write, but a
 *                                          value a valid state holds) while rank 1 waits on it
 *                                          for UNPUBLISHED_WAIT_S: TIMEOUT, and no corrupt
 *                                          segment (rank 0's never-published wait area, all
 *                                          zeros, is no snapshot of a wait)
 *
 * In every case rank 1 then closes its side at once, its ops all finished; that must leave the
 * communicator unaborted. Whether its failed step is still on its lane then depends on rank 1's
 * progress thread, so a case can run several rounds, each on a new communicator.
 *
 * Prints one line "<case>: <result> after <s> s ..." for the first round whose outcome is not
 * the expected one (exit 1), or else for the last round (exit 0). */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/clock.h"
#include "core/dtype.h"
#include "shm/shm_transport.h"
#include "shm/segment.h"

#define HELD_S 0.2 /* how long the fencing stays half-done: ten of rank 1's watch rounds */
#define UNPUBLISHED_WAIT_S 0.2 /* ten of rank 1's watch rounds */

typedef struct {
    const char *name;
    mp_transport *t;
    mp_result r;
    char err[256];
    _Atomic int opened;  /* rank 0's open has returned: r and t are set */
    _Atomic int release; /* rank 0 keeps its side open until the test is done */
} rank0_ctx;

static mp_shm_config config(const char *name, int rank)
{
    return (mp_shm_config){.name = name, .rank = rank, .size = 2, .nlanes = 1, .create = rank == 0,
                           .eager_threshold = 0, .timeout = 10.0, .allow_cma = 1, .global_rank = rank};
}

static void *rank0_main(void *arg)
{
    rank0_ctx *c = arg;
    mp_shm_config cfg = config(c->name, 0);
    c->r = mp_shm_open(&cfg, &c->t, c->err, sizeof c->err);
    atomic_store(&c->opened, 1);
    while (c->r == MP_OK && !atomic_load(&c->release))
        usleep(1000);
    return NULL;
}

typedef struct {
    mp_transport *t;
    mp_op *op;
    double timeout;
    mp_result r;
} waiter_ctx;

static void *wait_main(void *arg)
{
    waiter_ctx *w = arg;
    w->r = w->t->ops->wait(w->t, w->op, mp_now() + w->timeout, NULL);
    return NULL;
}

/* What rank 0's watch round writes when it finds the cycle 0 -> 1 -> 0, stopped after rank 0's
 * own fence. */
static void fence_rank0(const shm_view *v)
{
    shm_header *h = shm_hdr(v);
    atomic_store(&h->detect_lock, 1);
    snprintf(shm_report_at(v, 0), SHM_REPORT_BYTES, "deadlock: ranks 0 -> 1 -> 0 (written by shm_fence_order)");
    atomic_store(&h->reports_used, 1);
    atomic_store(&shm_rank_at(v, 0)->fence, 1);
}

static void finish_fencing(const shm_view *v, int with_rank1)
{
    shm_header *h = shm_hdr(v);
    if (with_rank1)
        atomic_store(&shm_rank_at(v, 1)->fence, 1);
    atomic_fetch_add(&h->fenced, with_rank1 ? 2 : 1);
    atomic_store(&h->detect_lock, 0);
}

/* One round of a case on a new communicator; prints its line when it fails or `print`. Returns
 * 0 when the outcome is the expected one, 1 when not, 2 when the communicator cannot be set up. */
static int play(const char *which, int print)
{
    int member = strcmp(which, "waiter") != 0, abort_after = strcmp(which, "abort_after") == 0;
    int unpublished = strcmp(which, "unpublished") == 0;
    char name[MP_SHM_NAME_LEN];
    if (mp_shm_new_name(name, sizeof name) != 0) {
        perror("mp_shm_new_name");
        return 2;
    }
    rank0_ctx r0 = {.name = name};
    pthread_t t0;
    if (pthread_create(&t0, NULL, rank0_main, &r0) != 0)
        return 2;
    mp_shm_config cfg = config(name, 1);
    mp_transport *t = NULL;
    char err[256] = "";
    mp_result r = mp_shm_open(&cfg, &t, err, sizeof err);
    while (!atomic_load(&r0.opened))
        usleep(1000);
    float buf[16];
    mp_op op = {.kind = MP_RECV, .label = MP_LABEL_IRECV, .peer = 0, .peer_global = 0, .buf = buf,
                .nbytes = sizeof buf, .dtype = MP_DT_FLOAT32, .ndim = -1, .call_name = "recv_forward"};
    mp_step *step = calloc(1, sizeof *step + sizeof(mp_op *));
    int res = 2;
    if (r != MP_OK || r0.r != MP_OK || !step) {
        fprintf(stderr, "mp_shm_open: rank 0: %s: %s; rank 1: %s: %s\n", mp_result_str(r0.r), r0.err,
                mp_result_str(r), err);
        free(step);
        goto out;
    }
    step->nops = 1;
    step->ops[0] = &op;
    mp_transport_begin(t, NULL);
    r = t->ops->post(t, step); /* the transport owns the step from here */
    mp_transport_end(t);
    if (r != MP_OK) {
        fprintf(stderr, "rank 1: post: %s\n", mp_result_str(r));
        goto out;
    }

    const shm_view *v = mp_shm_view(t);
    double start = mp_now();
    int early = 0;
    waiter_ctx w = {.t = t, .op = &op, .timeout = unpublished ? UNPUBLISHED_WAIT_S : 10.0};
    pthread_t tw;
    if (unpublished)
        atomic_store(&shm_rank_at(v, 0)->waiting, 1);
    if (abort_after) {
        fence_rank0(v);
        finish_fencing(v, 1);
        r0.t->ops->abort(r0.t, MP_ERR_CLOSED, 0, "rank 0 closed it with ops pending (written by shm_fence_order)");
    }
    if (unpublished) {
        wait_main(&w); /* on the posting thread: a wait the search counts as blocked */
    } else {
        if (pthread_create(&tw, NULL, wait_main, &w) != 0)
            goto out;
        if (!abort_after) {
            fence_rank0(v);
            usleep((useconds_t)(HELD_S * 1e6));
            early = mp_op_done(&op);
            finish_fencing(v, member);
        }
        pthread_join(tw, NULL);
    }
    double elapsed = mp_now() - start;
    if (unpublished) {
        mp_result cause = (mp_result)atomic_load(&shm_hdr(v)->abort_cause);
        atomic_store(&shm_rank_at(v, 0)->waiting, 0);
        res = w.r == MP_ERR_TIMEOUT && cause == MP_OK ? 0 : 1;
        if (res || print)
            printf("%s: %s after %.3f s (expected %s), communicator %s%s\n", which, mp_result_str(w.r), elapsed,
                   mp_result_str(MP_ERR_TIMEOUT), cause == MP_OK ? "not aborted" : "aborted: ",
                   cause == MP_OK ? "" : atomic_load(&shm_hdr(v)->abort_why_ready) ? shm_hdr(v)->abort_why : "");
        goto out; /* closing with the receive pending aborts the communicator: nothing to check */
    }
    t->ops->destroy(t);
    t = NULL;
    mp_result closed = abort_after ? MP_OK : (mp_result)atomic_load(&shm_hdr(mp_shm_view(r0.t))->abort_cause);

    mp_result expected = member ? MP_ERR_DEADLOCK : MP_ERR_ABORTED;
    res = !early && w.r == MP_OK && op.result == expected && closed == MP_OK ? 0 : 1;
    if (res || print)
        printf("%s: %s after %.3f s%s (expected %s): %s%s%s\n", which, mp_result_str(op.result), elapsed,
               early ? ", decided while the fencing was half-done" : "", mp_result_str(expected), op.detail,
               closed != MP_OK ? "; rank 1's close then aborted the communicator: " : "",
               closed != MP_OK ? mp_result_str(closed) : "");
out:
    if (t)
        t->ops->destroy(t);
    atomic_store(&r0.release, 1);
    pthread_join(t0, NULL);
    if (r0.t)
        r0.t->ops->destroy(r0.t);
    return res;
}

int main(int argc, char **argv)
{
    const char *cases[] = {"member", "waiter", "abort_after", "unpublished"};
    int known = 0;
    for (int i = 0; argc >= 2 && i < 4; i++)
        known |= strcmp(argv[1], cases[i]) == 0;
    int rounds = argc == 3 ? atoi(argv[2]) : 1;
    if (!known || argc > 3 || rounds < 1) {
        fprintf(stderr, "usage: %s member|waiter|abort_after|unpublished [rounds >= 1]\n", argv[0]);
        return 2;
    }
    for (int i = 0; i < rounds; i++) {
        int res = play(argv[1], i == rounds - 1);
        if (res)
            return res;
    }
    return 0;
}
