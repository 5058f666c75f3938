/* A cycle's ranks are fenced one by one (shm_cycle_fence). A member that wakes between its
 * peer's fence and its own must still be reported as a member (MP_ERR_DEADLOCK), not as a rank
 * that merely needs a member (MP_ERR_ABORTED). This holds the fencing half-done by hand, on a
 * 2-rank communicator whose ranks are threads of this process, and checks both outcomes:
 *
 *   shm_fence_order member   rank 1's fence comes before the lock is released: DEADLOCK
 *   shm_fence_order waiter   the lock is released without it: ABORTED
 *
 * Prints one line "<case>: <result> after <s> s" and exits 0 when the outcome is the expected
 * one, 1 otherwise. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "clock.h"
#include "dtype.h"
#include "shm.h"
#include "shm_segment.h"

#define HELD_S 0.5 /* how long the fencing stays half-done: many of rank 1's watch rounds */

typedef struct {
    const char *name;
    mp_transport *t;
    mp_result r;
    char err[256];
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
    while (c->r == MP_OK && !atomic_load(&c->release))
        usleep(1000);
    return NULL;
}

typedef struct {
    mp_transport *t;
    mp_op *op;
    mp_result r;
} waiter_ctx;

static void *wait_main(void *arg)
{
    waiter_ctx *w = arg;
    w->r = w->t->ops->wait(w->t, w->op, mp_now() + 10.0);
    return NULL;
}

/* What rank 0's watch round writes when it finds the cycle 0 -> 1 -> 0, stopped after rank 0's
 * own fence. */
static void fence_rank0(const shm_view *v)
{
    shm_header *h = shm_hdr(v);
    atomic_store(&h->detect_lock, 1);
    snprintf(shm_report_at(v, 0), SHM_REPORT_BYTES, "deadlock: ranks 0 -> 1 -> 0 (written by shm_fence_order)");
    h->reports_used = 1;
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

int main(int argc, char **argv)
{
    int member = argc == 2 && strcmp(argv[1], "member") == 0;
    if (argc != 2 || (!member && strcmp(argv[1], "waiter") != 0)) {
        fprintf(stderr, "usage: %s member|waiter\n", argv[0]);
        return 2;
    }
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
    if (r != MP_OK) {
        fprintf(stderr, "rank 1: mp_shm_open: %s: %s\n", mp_result_str(r), err);
        atomic_store(&r0.release, 1);
        pthread_join(t0, NULL);
        return 2;
    }

    float buf[16];
    mp_op op = {.kind = MP_RECV, .label = MP_LABEL_IRECV, .peer = 0, .peer_global = 0, .buf = buf,
                .nbytes = sizeof buf, .dtype = MP_DT_FLOAT32, .ndim = -1, .call_name = "recv_forward"};
    mp_step *step = malloc(sizeof *step + sizeof(mp_op *));
    memset(step, 0, sizeof *step);
    step->nops = 1;
    step->ops[0] = &op;
    if (t->ops->begin)
        t->ops->begin(t, NULL);
    r = t->ops->post(t, step);
    if (t->ops->end)
        t->ops->end(t);
    if (r != MP_OK) {
        fprintf(stderr, "rank 1: post: %s\n", mp_result_str(r));
        return 2;
    }
    waiter_ctx w = {.t = t, .op = &op};
    pthread_t tw;
    if (pthread_create(&tw, NULL, wait_main, &w) != 0)
        return 2;

    const shm_view *v = mp_shm_view(t);
    double start = mp_now();
    fence_rank0(v);
    usleep((useconds_t)(HELD_S * 1e6));
    int early = mp_op_done(&op);
    finish_fencing(v, member);
    pthread_join(tw, NULL);
    double elapsed = mp_now() - start;

    mp_result expected = member ? MP_ERR_DEADLOCK : MP_ERR_ABORTED;
    int ok = !early && w.r == MP_OK && op.result == expected;
    printf("%s: %s after %.3f s%s (expected %s): %s\n", argv[1], mp_result_str(op.result), elapsed,
           early ? ", decided while the fencing was half-done" : "", mp_result_str(expected), op.detail);

    t->ops->destroy(t);
    atomic_store(&r0.release, 1);
    pthread_join(t0, NULL);
    if (r0.t)
        r0.t->ops->destroy(r0.t);
    return ok ? 0 : 1;
}
