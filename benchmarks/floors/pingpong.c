/* The hardware and scheduler floor of a small-message round trip: two processes bounce a
 * counter through one shared page, each waiting by spinning (then yielding, as the shm
 * transport does). No Python, no transport: what any shared-memory transport on this machine
 * and placement can at best do. Prints one JSON object: one-way microseconds, median, p99, min.
 *
 *   pingpong ROUND_TRIPS [CPU_PARENT CPU_CHILD]
 *
 * With two CPUs each process is pinned to one, the child's pin set before the fork so that a
 * pin that fails cannot leave one process waiting for the other. */
#define _GNU_SOURCE
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define YIELD_AFTER_NS 5000 /* the shm transport's wait spins about this long before yielding */

typedef struct {
    _Alignas(128) atomic_ulong ping; /* written by the parent */
    _Alignas(128) atomic_ulong pong; /* written by the child */
} page_t;

static long long now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000LL + t.tv_nsec;
}

static void await_value(atomic_ulong *cell, unsigned long want)
{
    long long start = 0;
    for (unsigned spins = 0; atomic_load_explicit(cell, memory_order_acquire) != want; spins++) {
        if ((spins & 255) != 255)
            continue;
        if (!start)
            start = now_ns();
        else if (now_ns() - start > YIELD_AFTER_NS)
            sched_yield();
    }
}

static int pin(int cpu)
{
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    return sched_setaffinity(0, sizeof set, &set);
}

static int by_value(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
    if (argc != 2 && argc != 4) {
        fprintf(stderr, "usage: %s ROUND_TRIPS [CPU_PARENT CPU_CHILD]\n", argv[0]);
        return 2;
    }
    long trips = strtol(argv[1], NULL, 10);
    if (trips < 1) {
        fprintf(stderr, "pingpong: ROUND_TRIPS must be a positive integer, not %s\n", argv[1]);
        return 2;
    }
    int pinned = argc == 4;
    if (pinned && pin(atoi(argv[3])) != 0) { /* inherited by the child */
        perror("pingpong: pinning to CPU_CHILD");
        return 2;
    }
    page_t *page = mmap(NULL, sizeof *page, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    double *oneway = malloc(sizeof *oneway * (size_t)trips);
    if (page == MAP_FAILED || !oneway) {
        perror("pingpong: memory");
        return 2;
    }
    atomic_init(&page->ping, 0);
    atomic_init(&page->pong, 0);
    pid_t child = fork();
    if (child < 0) {
        perror("pingpong: fork");
        return 2;
    }
    if (child == 0) {
        for (unsigned long i = 1; i <= (unsigned long)trips; i++) {
            await_value(&page->ping, i);
            atomic_store_explicit(&page->pong, i, memory_order_release);
        }
        _exit(0);
    }
    if (pinned && pin(atoi(argv[2])) != 0) {
        perror("pingpong: pinning to CPU_PARENT");
        kill(child, SIGKILL);
        waitpid(child, NULL, 0);
        return 2;
    }
    for (unsigned long i = 1; i <= (unsigned long)trips; i++) {
        long long start = now_ns();
        atomic_store_explicit(&page->ping, i, memory_order_release);
        await_value(&page->pong, i);
        oneway[i - 1] = (double)(now_ns() - start) / 2e3;
    }
    int status = 0;
    waitpid(child, &status, 0);
    qsort(oneway, (size_t)trips, sizeof *oneway, by_value);
    long p99 = (long)((double)trips * 0.99 + 0.999999) - 1;
    printf("{\"round_trips\": %ld, \"median_us\": %.4f, \"p99_us\": %.4f, \"min_us\": %.4f}\n", trips,
           oneway[trips / 2], oneway[p99 < trips ? p99 : trips - 1], oneway[0]);
    free(oneway);
    return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}
