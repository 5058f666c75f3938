#include "arena.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "segment.h"

#define PAGE (4ull << 10)
#define HUGE (2ull << 20) /* a transparent huge page, and the unit in which the arena is backed */

enum { BLOCK_FREE = 0, BLOCK_USED, BLOCK_HELD /* quarantined while used */, BLOCK_LOST /* quarantined */ };

typedef struct {
    uint64_t off, len;
    int state;
} block;

struct mp_arena {
    _Atomic int refs;
    char *base;
    uint64_t bytes;
    char name[80]; /* "" once unlinked */
    pthread_mutex_t lock; /* guards blocks and backed */
    block *blocks;        /* sorted by offset, covering [0, bytes) */
    size_t nblocks, cap;
    uint8_t *backed; /* per HUGE unit: committed to memory */
    _Atomic int refused; /* an allocation has been refused */
};

static uint64_t round_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

mp_result mp_arena_create(const char *name, uint64_t bytes, mp_arena **out, char *err, size_t errlen)
{
    bytes = round_up(bytes, HUGE);
    mp_arena *a = calloc(1, sizeof *a);
    size_t units = (size_t)(bytes / HUGE);
    if (a) {
        a->backed = calloc(units ? units : 1, 1);
        a->blocks = malloc(16 * sizeof *a->blocks);
    }
    if (!a || !a->backed || !a->blocks) {
        if (a) {
            free(a->backed);
            free(a->blocks);
        }
        free(a);
        snprintf(err, errlen, "out of memory");
        return MP_ERR_SYSTEM;
    }
    a->cap = 16;
    a->nblocks = 1;
    a->blocks[0] = (block){0, bytes, BLOCK_FREE};
    a->bytes = bytes;
    atomic_init(&a->refs, 1);
    pthread_mutex_init(&a->lock, NULL);
    snprintf(a->name, sizeof a->name, "%s", name);
    int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
    mp_result r = MP_OK;
    if (fd < 0) {
        r = shm_system_error(err, errlen, "cannot create receive arena", name, errno);
        a->name[0] = '\0';
    } else if (ftruncate(fd, (off_t)bytes) != 0) {
        r = shm_system_error(err, errlen, "cannot size receive arena", name, errno);
    } else {
        void *base = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (base == MAP_FAILED)
            r = shm_system_error(err, errlen, "cannot map receive arena", name, errno);
        else
            a->base = base;
    }
    if (fd >= 0)
        close(fd);
    if (r != MP_OK) {
        mp_arena_release(a);
        return r;
    }
    madvise(a->base, bytes, MADV_DONTFORK); /* the creating process's only: docs/api.md, "Fork" */
#ifdef MADV_HUGEPAGE
    madvise(a->base, bytes, MADV_HUGEPAGE); /* where the kernel allows it (shmem_enabled = advise) */
#endif
    *out = a;
    return MP_OK;
}

mp_result mp_arena_map_peer(const char *name, uint64_t bytes, char **base, char *err, size_t errlen)
{
    int fd = shm_open(name, O_RDWR, 0);
    if (fd < 0)
        return shm_system_error(err, errlen, "cannot open a peer's receive arena", name, errno);
    struct stat st;
    mp_result r = MP_OK;
    if (fstat(fd, &st) != 0) {
        r = shm_system_error(err, errlen, "cannot inspect a peer's receive arena", name, errno);
    } else if (st.st_uid != geteuid()) {
        snprintf(err, errlen, "receive arena %s belongs to uid %u, not to this process's uid %u: refusing to map it",
                 name, (unsigned)st.st_uid, (unsigned)geteuid());
        r = MP_ERR_SYSTEM;
    } else if ((uint64_t)st.st_size != bytes) {
        snprintf(err, errlen, "corrupt segment: receive arena %s has %lld bytes, its owner published %llu", name,
                 (long long)st.st_size, (unsigned long long)bytes);
        r = MP_ERR_SYSTEM;
    } else {
        void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED) {
            r = shm_system_error(err, errlen, "cannot map a peer's receive arena", name, errno);
        } else {
            madvise(p, bytes, MADV_DONTFORK);
            *base = p;
        }
    }
    close(fd);
    return r;
}

void mp_arena_unmap_peer(char *base, uint64_t bytes)
{
    if (base)
        munmap(base, bytes);
}

void mp_arena_unlink(mp_arena *a)
{
    pthread_mutex_lock(&a->lock);
    if (a->name[0])
        shm_unlink(a->name);
    a->name[0] = '\0';
    pthread_mutex_unlock(&a->lock);
}

uint64_t mp_arena_bytes(const mp_arena *a) { return a->bytes; }

int mp_arena_holds(const mp_arena *a, const void *p, uint64_t n, uint64_t *off)
{
    uintptr_t at = (uintptr_t)p, base = (uintptr_t)a->base;
    if (!a->base || at < base || at - base > a->bytes || n > a->bytes - (at - base))
        return 0;
    *off = at - base;
    return 1;
}

/* Room for two more entries, so that a split cannot fail halfway. Caller holds the lock. */
static int reserve(mp_arena *a)
{
    if (a->nblocks + 2 <= a->cap)
        return 0;
    block *grown = realloc(a->blocks, 2 * a->cap * sizeof *grown);
    if (!grown)
        return -1;
    a->blocks = grown;
    a->cap *= 2;
    return 0;
}

static void insert_at(mp_arena *a, size_t i, block b)
{
    memmove(&a->blocks[i + 1], &a->blocks[i], (a->nblocks - i) * sizeof *a->blocks);
    a->blocks[i] = b;
    a->nblocks++;
}

static void remove_at(mp_arena *a, size_t i)
{
    memmove(&a->blocks[i], &a->blocks[i + 1], (a->nblocks - i - 1) * sizeof *a->blocks);
    a->nblocks--;
}

/* Backs [off, off + len) in HUGE units not yet backed: 0, or the errno. Caller holds the lock. */
static int back(mp_arena *a, uint64_t off, uint64_t len)
{
    for (uint64_t u = off / HUGE; u * HUGE < off + len; u++) {
        if (a->backed[u])
            continue;
        int e = shm_segment_commit(a->base + u * HUGE, HUGE);
        if (e)
            return e;
        a->backed[u] = 1;
    }
    return 0;
}

void *mp_arena_alloc(mp_arena *a, uint64_t nbytes, char *why, size_t whylen)
{
    uint64_t len = round_up(nbytes ? nbytes : 1, PAGE);
    uint64_t align = len >= HUGE ? HUGE : PAGE;
    void *out = NULL;
    pthread_mutex_lock(&a->lock);
    size_t i = 0;
    uint64_t start = 0;
    for (; i < a->nblocks; i++) {
        block *b = &a->blocks[i];
        start = round_up(b->off, align);
        if (b->state == BLOCK_FREE && start + len <= b->off + b->len)
            break;
    }
    if (i == a->nblocks) {
        snprintf(why, whylen, "the receive arena (%llu MiB) has no free range of %llu bytes left",
                 (unsigned long long)(a->bytes >> 20), (unsigned long long)nbytes);
    } else {
        int e = reserve(a) ? -1 : back(a, start, len);
        if (e < 0) {
            snprintf(why, whylen, "out of memory");
        } else if (e) {
            snprintf(why, whylen, "/dev/shm has %.1f MiB free, too little to back %llu bytes of the receive arena (%s)",
                     shm_free_mib(), (unsigned long long)nbytes, strerror(e));
        } else {
            /* The free range becomes [free head][used][free tail]. */
            block b = a->blocks[i];
            if (b.off + b.len > start + len)
                insert_at(a, i + 1, (block){start + len, b.off + b.len - start - len, BLOCK_FREE});
            if (start > b.off) {
                insert_at(a, i + 1, (block){start, len, BLOCK_USED});
                a->blocks[i].len = start - b.off;
            } else {
                a->blocks[i] = (block){start, len, BLOCK_USED};
            }
            out = a->base + start;
            atomic_fetch_add(&a->refs, 1);
        }
    }
    pthread_mutex_unlock(&a->lock);
    return out;
}

/* The block starting at `off`, or the one holding it when `containing`: an index, or -1. */
static long find(const mp_arena *a, uint64_t off, int containing)
{
    size_t lo = 0, hi = a->nblocks;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        const block *b = &a->blocks[mid];
        if (off < b->off)
            hi = mid;
        else if (off >= b->off + b->len)
            lo = mid + 1;
        else
            return containing || off == b->off ? (long)mid : -1;
    }
    return -1;
}

void mp_arena_free(mp_arena *a, void *p)
{
    pthread_mutex_lock(&a->lock);
    long i = find(a, (uint64_t)((char *)p - a->base), 0);
    if (i >= 0 && a->blocks[i].state == BLOCK_HELD) {
        a->blocks[i].state = BLOCK_LOST;
    } else if (i >= 0 && a->blocks[i].state == BLOCK_USED) {
        a->blocks[i].state = BLOCK_FREE;
        if ((size_t)i + 1 < a->nblocks && a->blocks[i + 1].state == BLOCK_FREE) {
            a->blocks[i].len += a->blocks[i + 1].len;
            remove_at(a, (size_t)i + 1);
        }
        if (i > 0 && a->blocks[i - 1].state == BLOCK_FREE) {
            a->blocks[i - 1].len += a->blocks[i].len;
            remove_at(a, (size_t)i);
        }
    }
    pthread_mutex_unlock(&a->lock);
    mp_arena_release(a);
}

void mp_arena_quarantine(mp_arena *a, const void *p)
{
    pthread_mutex_lock(&a->lock);
    long i = find(a, (uint64_t)((const char *)p - a->base), 1);
    if (i >= 0 && a->blocks[i].state == BLOCK_USED)
        a->blocks[i].state = BLOCK_HELD;
    pthread_mutex_unlock(&a->lock);
}

int mp_arena_first_refusal(mp_arena *a) { return atomic_exchange(&a->refused, 1) == 0; }

void mp_arena_release(mp_arena *a)
{
    if (!a || atomic_fetch_sub(&a->refs, 1) != 1)
        return;
    if (a->name[0])
        shm_unlink(a->name);
    if (a->base)
        munmap(a->base, a->bytes);
    pthread_mutex_destroy(&a->lock);
    free(a->blocks);
    free(a->backed);
    free(a);
}
