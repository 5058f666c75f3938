/* Monotonic time and futex waits: the two primitives every deadline-bounded wait uses. */
#ifndef MP_CLOCK_H
#define MP_CLOCK_H

#include <linux/futex.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static inline double mp_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static inline void mp_cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Sleeps while *word == expected, at most `seconds`. `shared`: the word lives in memory mapped
 * by several processes (FUTEX_PRIVATE_FLAG would miss their wakes). */
static inline void mp_futex_wait(_Atomic uint32_t *word, uint32_t expected, double seconds, int shared)
{
    if (seconds <= 0)
        return;
    struct timespec ts;
    ts.tv_sec = (time_t)seconds;
    ts.tv_nsec = (long)((seconds - (double)ts.tv_sec) * 1e9);
    syscall(SYS_futex, (uint32_t *)word, shared ? FUTEX_WAIT : FUTEX_WAIT_PRIVATE, expected, &ts, NULL, 0);
}

static inline void mp_futex_wake(_Atomic uint32_t *word, int shared)
{
    syscall(SYS_futex, (uint32_t *)word, shared ? FUTEX_WAKE : FUTEX_WAKE_PRIVATE, 0x7fffffff, NULL, NULL, 0);
}

#endif
