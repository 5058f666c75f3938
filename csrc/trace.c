#include "trace.h"

void mp_trace_step(mp_trace *t, const mp_step *step)
{
    for (int i = 0; i < step->nops; i++) {
        const mp_op *op = step->ops[i];
        t->ring[t->total % MP_TRACE_CAPACITY] = (mp_trace_entry){
            .step = op->step, .seq = op->seq, .nbytes = op->nbytes, .lane = op->lane, .group_size = step->nops,
            .kind = op->kind, .label = op->label, .peer_global = op->peer_global, .dtype = op->dtype,
        };
        t->total++;
    }
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
