/* Lets a transport's long blocking call (creating a communicator, a host wait) give the caller a
 * turn to stop it: the extension checks Python's signal handlers there, so Ctrl-C ends a creation
 * that waits for a peer that never comes, or a wait on an op that never completes. */
#ifndef MP_INTERRUPT_H
#define MP_INTERRUPT_H

typedef struct {
    int (*raised)(void *arg); /* nonzero: stop waiting; the caller holds the reason */
    void *arg;
} mp_interrupt;

static inline int mp_interrupted(const mp_interrupt *i)
{
    return i && i->raised(i->arg);
}

#endif
