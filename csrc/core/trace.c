#include "trace.h"

#include <string.h>
#include <time.h>

void mp_trace_step(mp_trace *t, mp_step *step, double now)
{
    for (int i = 0; i < step->nops; i++) {
        mp_op *op = step->ops[i];
        op->trace_id = t->total;
        mp_trace_entry *e = &t->ring[t->total % MP_TRACE_CAPACITY];
        *e = (mp_trace_entry){
            .id = t->total, .step = op->step, .seq = op->seq, .nbytes = op->nbytes, .call = op->call,
            .t_posted = now, .lane = op->lane, .group_size = step->nops, .kind = op->kind, .label = op->label,
            .peer_global = op->peer_global, .dtype = op->dtype, .state = MP_TRACE_POSTED,
        };
        memcpy(e->call_name, op->call_name, sizeof e->call_name);
        t->total++;
    }
}

mp_trace_entry *mp_trace_entry_of(mp_trace *t, uint64_t id)
{
    mp_trace_entry *e = &t->ring[id % MP_TRACE_CAPACITY];
    return id < t->total && e->id == id ? e : NULL;
}

size_t mp_trace_recent(const mp_trace *t, mp_trace_entry *out, size_t max)
{
    size_t n = t->total < MP_TRACE_CAPACITY ? (size_t)t->total : MP_TRACE_CAPACITY;
    if (n > max)
        n = max;
    for (size_t i = 0; i < n; i++)
        out[i] = t->ring[(t->total - n + i) % MP_TRACE_CAPACITY];
    return n;
}

double mp_wall_time(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}
