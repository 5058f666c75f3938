/* The flight recorder: a ring of the ops a communicator posted most recently, in issue order,
 * each with the step (group) and call it belongs to and what became of it. It answers "what did
 * this rank issue, and what is still pending" after the fact, whichever transport ran it. */
#ifndef MP_TRACE_H
#define MP_TRACE_H

#include <stddef.h>
#include <stdint.h>

#include "op.h"

#define MP_TRACE_CAPACITY 1024

typedef enum { MP_TRACE_POSTED = 0, MP_TRACE_COMPLETED, MP_TRACE_FAILED } mp_trace_state;

typedef struct {
    uint64_t id;     /* its index among every entry ever recorded: a Request finds its entry by it */
    uint64_t step;
    uint64_t seq;
    uint64_t nbytes;
    uint64_t call;
    double t_posted;    /* wall-clock seconds, comparable across ranks */
    double t_completed; /* when this rank saw it finish; 0 while pending */
    int lane;
    int group_size;
    int kind;
    int label;
    int peer_global;
    int dtype;
    int state;
    int result;
    int waited;
    char call_name[MP_CALL_NAME_LEN];
} mp_trace_entry;

typedef struct {
    mp_trace_entry ring[MP_TRACE_CAPACITY];
    uint64_t total;  /* entries ever recorded; the ring keeps the last MP_TRACE_CAPACITY */
} mp_trace;

/* Records the step's ops (stamping each op with its trace id). */
void mp_trace_step(mp_trace *t, mp_step *step, double now);
/* The entry of trace id `id`, or NULL once the ring has overwritten it. */
mp_trace_entry *mp_trace_entry_of(mp_trace *t, uint64_t id);
/* Copies up to `max` of the most recent entries, oldest first; returns how many. */
size_t mp_trace_recent(const mp_trace *t, mp_trace_entry *out, size_t max);
/* Wall-clock seconds. */
double mp_wall_time(void);

#endif
