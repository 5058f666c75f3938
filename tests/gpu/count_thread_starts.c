/* Counts the threads a process starts, for the GPU checks: loaded with LD_PRELOAD, this
 * pthread_create is found before libc's, counts the call and hands it on. A sampler of
 * /proc/self/task misses threads that live a few microseconds (NCCL's thread per nonblocking
 * group end lives about as long as the launch); a count at the call misses none. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>

typedef int (*create_fn)(pthread_t *, const pthread_attr_t *, void *(*)(void *), void *);

static _Atomic long starts;

int pthread_create(pthread_t *thread, const pthread_attr_t *attr, void *(*start)(void *), void *arg)
{
    create_fn real = (create_fn)dlsym(RTLD_NEXT, "pthread_create");
    if (!real)
        return 11; /* EAGAIN: the next definition is missing, which libc always has */
    atomic_fetch_add(&starts, 1);
    return real(thread, attr, start, arg);
}

/* The calls to pthread_create so far, in this process. */
long thread_starts(void) { return atomic_load(&starts); }
