/* The hardware and scheduler floor of a small-message round trip, measured by the two ranks of
 * the latency benchmark themselves, between their own round trips: two counters in one shared
 * page, each side waiting by spinning, then yielding, as the shm transport's waits do. Measured
 * in the same processes, placement and moment as the transport it is the floor of: on a VM the
 * crossing between two vCPUs moves between 0.07 and 0.25 us from one 100 ms to the next
 * (benchmarks/PROFILE.md). */
#include "pingpong.h"

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "core/clock.h"

#define YIELD_AFTER_SECONDS 5e-6 /* as the shm transport's DRIVE_YIELD_AFTER */
#define OPEN_RETRY_SECONDS 50e-6

typedef struct {
    _Alignas(128) atomic_ulong ping; /* written by rank 0 */
    _Alignas(128) atomic_ulong pong; /* written by rank 1 */
    _Alignas(128) atomic_uint attached;
} page_t;

/* Busy for `seconds`, as a waiting rank is: the benchmark times rank 0's Python floor while
 * rank 1 waits here for the page, so that its core is as loaded as in a round trip. */
static void spin(double seconds)
{
    for (double end = mp_now() + seconds; mp_now() < end;)
        mp_cpu_relax();
}

/* Spins until *cell == want; 0, or ETIMEDOUT past `deadline`. */
static int await_value(atomic_ulong *cell, unsigned long want, double deadline)
{
    double start = 0;
    for (unsigned spins = 0; atomic_load_explicit(cell, memory_order_acquire) != want; spins++) {
        if ((spins & 255) != 255)
            continue;
        double now = mp_now();
        if (now > deadline)
            return ETIMEDOUT;
        if (!start)
            start = now;
        else if (now - start > YIELD_AFTER_SECONDS)
            sched_yield();
    }
    return 0;
}

static int failed(int e, char *why, size_t why_len, const char *what, const char *name)
{
    snprintf(why, why_len, "%s %s: %s", what, name, strerror(e));
    return e;
}

/* Rank 1 opens the page once rank 0 has created and sized it; 0, or an errno. */
static int open_page(const char *name, int rank, double deadline, page_t **out, char *why, size_t why_len)
{
    int fd;
    if (rank == 0) {
        fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
        if (fd < 0)
            return failed(errno, why, why_len, "creating", name);
        if (ftruncate(fd, sizeof(page_t)) != 0) {
            int e = errno;
            close(fd);
            shm_unlink(name);
            return failed(e, why, why_len, "sizing", name);
        }
    } else {
        /* Created and sized by rank 0: a page of size 0 is not sized yet. */
        for (;;) {
            fd = shm_open(name, O_RDWR, 0);
            off_t size = fd >= 0 ? lseek(fd, 0, SEEK_END) : -1;
            if (size >= (off_t)sizeof(page_t))
                break;
            int e = fd >= 0 ? 0 : errno;
            if (fd >= 0)
                close(fd);
            if (e && e != ENOENT)
                return failed(e, why, why_len, "opening", name);
            if (mp_now() > deadline)
                return failed(ETIMEDOUT, why, why_len, "waiting for rank 0 to create", name);
            spin(OPEN_RETRY_SECONDS);
        }
    }
    void *p = mmap(NULL, sizeof(page_t), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    int e = errno;
    close(fd);
    if (p == MAP_FAILED) {
        if (rank == 0)
            shm_unlink(name);
        return failed(e, why, why_len, "mapping", name);
    }
    *out = p;
    return 0;
}

int mp_pingpong(const char *name, int rank, size_t round_trips, double timeout, double *oneway, char *why,
                size_t why_len)
{
    double deadline = mp_now() + timeout;
    page_t *page = NULL;
    int e = open_page(name, rank, deadline, &page, why, why_len);
    if (e)
        return e;
    if (rank == 0) {
        /* Unlinked as soon as rank 1 has it mapped, or when it never comes. */
        while (!atomic_load(&page->attached) && mp_now() <= deadline)
            usleep(100);
        shm_unlink(name);
        if (!atomic_load(&page->attached)) {
            munmap(page, sizeof *page);
            return failed(ETIMEDOUT, why, why_len, "waiting for rank 1 to map", name);
        }
    } else {
        atomic_store(&page->attached, 1);
    }
    for (unsigned long i = 1; i <= round_trips && !e; i++) {
        if (rank == 0) {
            double start = mp_now();
            atomic_store_explicit(&page->ping, i, memory_order_release);
            e = await_value(&page->pong, i, deadline);
            oneway[i - 1] = (mp_now() - start) / 2 * 1e6;
        } else {
            e = await_value(&page->ping, i, deadline);
            atomic_store_explicit(&page->pong, i, memory_order_release);
        }
    }
    munmap(page, sizeof *page);
    if (e)
        return failed(e, why, why_len, "waiting for the other rank's reply through", name);
    return 0;
}
