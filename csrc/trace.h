/* The flight recorder: a ring of the ops a communicator posted most recently, in issue order,
 * each with the step (group) it belongs to. It answers "what did this rank issue, in which
 * groups and lanes" after the fact, whichever transport ran it. */
#ifndef MP_TRACE_H
#define MP_TRACE_H

#include <stddef.h>
#include <stdint.h>

#include "op.h"

#define MP_TRACE_CAPACITY 1024

typedef struct {
    uint64_t step;
    uint64_t seq;
    uint64_t nbytes;
    int lane;
    int group_size;
    int kind;
    int label;
    int peer_global;
    int dtype;
} mp_trace_entry;

typedef struct {
    mp_trace_entry ring[MP_TRACE_CAPACITY];
    uint64_t total;  /* entries ever recorded; the ring keeps the last MP_TRACE_CAPACITY */
} mp_trace;

void mp_trace_step(mp_trace *t, const mp_step *step);
/* Copies up to `max` of the most recent entries, oldest first; returns how many. */
size_t mp_trace_recent(const mp_trace *t, mp_trace_entry *out, size_t max);

#endif
