/* Opening and closing a shm transport: the vtable, naming and attaching to the segment, mapping
 * the peers' arenas, starting the progress thread, destroy, and the accessors of the public
 * header (shm_transport.h). */
#include "engine.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/uio.h>
#include <unistd.h>

#include "core/clock.h"

static void shm_destroy(mp_transport *t)
{
    shm_t *s = as_shm(t);
    if (s->thread_started) {
        pthread_mutex_lock(&s->lock);
        s->stop = 1;
        pthread_mutex_unlock(&s->lock);
        shm_ring(s, t->rank);
        pthread_join(s->thread, NULL);
    }
    if (s->v.base) {
        pthread_mutex_lock(&s->engine);
        int pending = s->incoming.head != NULL;
        for (int l = 0; l < t->nlanes && !pending; l++)
            pending = s->lanes[l].head != NULL;
        if (pending && shm_abort_cause(t, NULL) == MP_OK)
            shm_abort(t, MP_ERR_CLOSED, t->rank, NULL); /* peers waiting on these ops fail fast */
        char why[MP_DETAIL_LEN];
        snprintf(why, sizeof why, "communicator closed with this op pending");
        shm_fail_queue(s, &s->incoming, MP_ERR_CLOSED, why);
        for (int l = 0; l < t->nlanes; l++)
            shm_fail_queue(s, &s->lanes[l], MP_ERR_CLOSED, why);
        pthread_mutex_unlock(&s->engine);
        /* Threads still in shm_wait see their op finished and leave; then `s` can go. */
        while (atomic_load(&s->driving) || atomic_load(&s->waiters)) /* the segment's copy may be garbage */
            usleep(100);
        atomic_store(&my_slot(s)->state, SHM_RANK_CLOSED);
        shm_segment_unmap(&s->v);
    }
    for (int r = 0; s->peer_arenas && r < t->size; r++)
        mp_arena_unmap_peer(s->peer_arenas[r], s->peer_arena_bytes[r]);
    mp_arena_release(s->arena); /* its blocks that tensors still hold keep it mapped */
    for (int r = 0; s->pidfds && r < t->size; r++)
        if (s->pidfds[r] >= 0)
            close(s->pidfds[r]);
    pthread_mutex_destroy(&s->lock);
    pthread_mutex_destroy(&s->engine);
    free(s->pidfds);
    free(s->pids);
    free(s->peer_arenas);
    free(s->peer_arena_bytes);
    free(s->out);
    free(s->in);
    free(s->lanes);
    free(s);
}

/* Whether `peer`'s messages are copied once (CMA), or staged through the segment. */
static int shm_single_copy(mp_transport *t, int peer)
{
    shm_t *s = as_shm(t);
    if (peer < 0 || peer >= t->size)
        return 0;
    return atomic_load(shm_cma_at(&s->v, t->rank, peer));
}

static const mp_transport_ops shm_ops = {
    .name = "shm",
    .post = shm_post,
    .wait = shm_wait,
    .abort = shm_abort,
    .abort_cause = shm_abort_cause,
    .describe_peer = shm_describe_peer,
    .destroy = shm_destroy,
    .begin = shm_begin,
    .end = shm_end,
    .failure_report = shm_failure_report,
    .single_copy = shm_single_copy,
};

/* ---- creation --------------------------------------------------------------------------- */

int mp_shm_new_name(char *buf, size_t len)
{
    /* 128 bits from getrandom: unguessable, and made even when every descriptor is in use. */
    unsigned char rnd[16];
    for (size_t have = 0; have < sizeof rnd;) {
        ssize_t got = getrandom(rnd + have, sizeof rnd - have, 0);
        if (got < 0 && errno != EINTR)
            return -1;
        have += got > 0 ? (size_t)got : 0;
    }
    int n = snprintf(buf, len, "/mp2p-%d-", (int)getpid());
    for (size_t i = 0; i < sizeof rnd && n + 2 < (int)len; i++)
        n += snprintf(buf + n, len - (size_t)n, "%02x", rnd[i]);
    return 0;
}

/* Waits until `counter` reaches the group size; names the missing ranks when it does not. */
static mp_result wait_all(shm_t *s, _Atomic uint32_t *counter, uint32_t min_state, double deadline,
                          const mp_shm_config *cfg, const char *what, char *err, size_t errlen)
{
    for (unsigned polls = 0; atomic_load(counter) < (uint32_t)s->base.size; polls++) {
        if (mp_interrupted(cfg->interrupt))
            return MP_ERR_INTERRUPTED;
        for (int r = 0; polls % 64 == 0 && r < s->base.size; r++) {
            pid_t pid = (pid_t)atomic_load(&shm_rank_at(&s->v, r)->pid);
            if (pid <= 0 && cfg->pids)
                pid = cfg->pids[r];
            if (pid > 0 && kill(pid, 0) != 0 && errno == ESRCH) {
                snprintf(err, errlen, "rank %d (pid %d) exited before every rank could %s the shared-memory segment",
                         r, (int)pid, what);
                return MP_ERR_PEER_DEAD;
            }
        }
        if (mp_now() > deadline) {
            int n = snprintf(err, errlen, "timed out waiting for ranks to %s the shared-memory segment; missing:",
                             what);
            for (int r = 0; r < s->base.size && n < (int)errlen; r++)
                if (atomic_load(&shm_rank_at(&s->v, r)->state) < min_state)
                    n += snprintf(err + n, errlen - (size_t)n, " %d", r);
            return MP_ERR_TIMEOUT;
        }
        usleep(200);
    }
    return MP_OK;
}

static void probe_single_copy(shm_t *s, int allow)
{
    for (int r = 0; r < s->base.size; r++) {
        shm_rank *peer = shm_rank_at(&s->v, r);
        uint64_t got = 0;
        struct iovec local = {&got, sizeof got};
        struct iovec remote = {(void *)(uintptr_t)peer->probe_addr, sizeof got};
        int ok = allow && r != s->base.rank &&
                 process_vm_readv(s->pids[r], &local, 1, &remote, 1, 0) == (ssize_t)sizeof got &&
                 got == peer->probe_value;
        atomic_store(shm_cma_at(&s->v, s->base.rank, r), (uint8_t)ok);
    }
}

/* "/mp2p-<owner's pid>-<the segment's random part>-a<rank>": unguessable like the segment's
 * name, and the stale sweep knows the owner. */
static void arena_name(const char *segment, pid_t owner, int rank, char *buf, size_t len)
{
    const char *random = strrchr(segment, '-');
    snprintf(buf, len, "/mp2p-%d%s-a%d", (int)owner, random ? random : "-", rank);
}

/* Maps every peer's receive arena, whose size each published before attaching. */
static mp_result map_peer_arenas(shm_t *s, const char *segment, char *err, size_t errlen)
{
    for (int r = 0; r < s->base.size; r++) {
        uint64_t bytes = shm_rank_at(&s->v, r)->arena_bytes;
        if (r == s->base.rank || !bytes)
            continue;
        char name[MP_SHM_NAME_LEN + 32];
        arena_name(segment, s->pids[r], r, name, sizeof name);
        mp_result res = mp_arena_map_peer(name, bytes, &s->peer_arenas[r], err, errlen);
        if (res != MP_OK)
            return res;
        s->peer_arena_bytes[r] = bytes;
    }
    return MP_OK;
}

/* Once every rank is ready, every arena is mapped by all (or the job failed): each rank removes
 * every name, so that none is left when any rank's creation returns. */
static void unlink_arenas(shm_t *s, const char *segment)
{
    if (s->arena)
        mp_arena_unlink(s->arena);
    for (int r = 0; r < s->base.size; r++) {
        if (r == s->base.rank || !shm_rank_at(&s->v, r)->arena_bytes)
            continue;
        char name[MP_SHM_NAME_LEN + 32];
        arena_name(segment, s->pids[r], r, name, sizeof name);
        shm_unlink(name);
    }
}

static int open_pidfd(pid_t pid)
{
#ifdef SYS_pidfd_open
    return (int)syscall(SYS_pidfd_open, pid, 0);
#else
    (void)pid;
    return -1;
#endif
}

mp_result mp_shm_open(const mp_shm_config *cfg, mp_transport **out, char *err, size_t errlen)
{
    double deadline = mp_now() + cfg->timeout;
    shm_t *s = calloc(1, sizeof *s);
    if (!s) {
        snprintf(err, errlen, "out of memory");
        return MP_ERR_SYSTEM;
    }
    s->base.ops = &shm_ops;
    s->base.rank = cfg->rank;
    s->base.size = cfg->size;
    s->base.nlanes = cfg->nlanes;
    s->base.buffered_at_most = cfg->eager_threshold;
    s->eager_threshold = cfg->eager_threshold;
    s->check = cfg->check;
    pthread_mutex_init(&s->lock, NULL);
    pthread_mutex_init(&s->engine, NULL);
    size_t nchan = (size_t)cfg->nlanes * (size_t)cfg->size;
    s->pidfds = malloc(sizeof(int) * (size_t)cfg->size);
    s->pids = calloc((size_t)cfg->size, sizeof(pid_t));
    s->out = calloc(nchan, sizeof(chan_local));
    s->in = calloc(nchan, sizeof(chan_local));
    s->lanes = calloc((size_t)cfg->nlanes, sizeof(step_queue));
    s->peer_arenas = calloc((size_t)cfg->size, sizeof(char *));
    s->peer_arena_bytes = calloc((size_t)cfg->size, sizeof(uint64_t));
    mp_result res = MP_ERR_SYSTEM;
    if (!s->pidfds || !s->pids || !s->out || !s->in || !s->lanes || !s->peer_arenas || !s->peer_arena_bytes) {
        free(s->pidfds);
        s->pidfds = NULL; /* not yet -1 each: shm_destroy would close them */
        snprintf(err, errlen, "out of memory");
        goto fail;
    }
    for (int r = 0; r < cfg->size; r++)
        s->pidfds[r] = -1;

    res = shm_segment_map(cfg->name, cfg->create, cfg->size, cfg->nlanes, cfg->eager_threshold, deadline,
                          cfg->interrupt, &s->v, err, errlen);
    if (res != MP_OK)
        goto fail;
    shm_header *h = shm_hdr(&s->v);
    shm_rank *me = my_slot(s);
    int32_t none = 0;
    if (!atomic_compare_exchange_strong(&me->pid, &none, (int32_t)getpid())) {
        snprintf(err, errlen, "rank %d is already attached to shared-memory segment %s (pid %d): two processes "
                 "claim the same group rank", cfg->rank, cfg->name, (int)none);
        res = MP_ERR_MISMATCH;
        goto fail;
    }
    s->probe_word = ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)s ^ 0x9e3779b97f4a7c15ull;
    me->probe_addr = (uint64_t)(uintptr_t)&s->probe_word;
    me->probe_value = s->probe_word;
    me->global_rank = cfg->global_rank;
    if (cfg->arena_bytes) {
        char name[MP_SHM_NAME_LEN + 32];
        arena_name(cfg->name, getpid(), cfg->rank, name, sizeof name);
        res = mp_arena_create(name, cfg->arena_bytes, &s->arena, err, errlen);
        if (res != MP_OK)
            goto fail;
        me->arena_bytes = mp_arena_bytes(s->arena);
    }
    atomic_store(&me->state, SHM_RANK_ATTACHED);
    atomic_fetch_add(&h->attached, 1);

    res = wait_all(s, &h->attached, SHM_RANK_ATTACHED, deadline, cfg, "attach to", err, errlen);
    shm_unlink(cfg->name); /* everyone is in (or the job failed): the name is no longer needed */
    if (res != MP_OK)
        goto fail;
    for (int r = 0; r < cfg->size; r++) {
        s->pids[r] = (pid_t)atomic_load(&shm_rank_at(&s->v, r)->pid);
        if (r != cfg->rank)
            s->pidfds[r] = open_pidfd(s->pids[r]);
    }
    probe_single_copy(s, cfg->allow_cma);
    res = map_peer_arenas(s, cfg->name, err, errlen);
    if (res != MP_OK)
        goto fail;
    atomic_store(&me->state, SHM_RANK_READY);
    atomic_fetch_add(&h->ready, 1);
    res = wait_all(s, &h->ready, SHM_RANK_READY, deadline, cfg, "finish connecting to", err, errlen);
    unlink_arenas(s, cfg->name);
    if (res != MP_OK)
        goto fail;
    if (pthread_create(&s->thread, NULL, shm_progress_main, s) != 0) {
        snprintf(err, errlen, "cannot start the progress thread: %s", strerror(errno));
        res = MP_ERR_SYSTEM;
        goto fail;
    }
    s->thread_started = 1;
    *out = &s->base;
    return MP_OK;

fail: /* the one release path of a half-made transport */
    shm_destroy(&s->base);
    return res;
}

int mp_shm_received_by_path(mp_transport *t, uint64_t out[MP_SHM_NPATHS])
{
    if (!t || t->ops != &shm_ops)
        return 0;
    for (int p = 0; p < MP_SHM_NPATHS; p++)
        out[p] = atomic_load_explicit(&as_shm(t)->received[p], memory_order_relaxed);
    return 1;
}

mp_arena *mp_shm_arena(mp_transport *t)
{
    return t && t->ops == &shm_ops ? as_shm(t)->arena : NULL;
}

const shm_view *mp_shm_view(mp_transport *t)
{
    return t && t->ops == &shm_ops ? &as_shm(t)->v : NULL;
}

