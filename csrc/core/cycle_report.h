/* The one grammar of a deadlock's report. shm's run-time detection, the offline checker and
 * simulator, `trace` and NCCL's stall analysis each find a wait-for cycle their own way, and
 * all of them word it here (the Python layer through _C.cycle_report), so that one cycle reads
 * the same wherever it was found. */
#ifndef MP_CYCLE_REPORT_H
#define MP_CYCLE_REPORT_H

#include <stddef.h>
#include <stdint.h>

#include "op.h"

/* One rank of the cycle: the op it is blocked on, which needs the op's peer, the cycle's next rank. */
typedef struct {
    int rank, peer;          /* as the report names ranks (global ranks at run time) */
    long pid;                /* 0: not known (the simulator) */
    mp_kind kind;
    const char *what;        /* who posted it, a slot or call kind: "send_next", "isend" */
    uint64_t nbytes;
    const char *dtype;       /* torch's name: "float32" */
    int lane;
    uint64_t message;        /* its number among its kind's ops on its channel (src, dst, lane) */
    const char *call;        /* the API call that posted it, or "" */
    const char *label;       /* the program's label for it, or "" */
    /* 1: the peer has posted the partner, but it is queued behind the peer's own blocked op (on
     * the op's lane, or on the peer's one queue when its lanes are serialized); 0: it has posted
     * `partner_count` ops of the partner's kind on the channel, not this one's partner. */
    int partner_posted;
    int lanes_serialized;
    uint64_t partner_count;
} mp_cycle_rank;

/* What an op of a rank in the cycle fails with; the report follows it in the error's message. */
#define MP_CYCLE_FAILURE "this rank is in a wait-for cycle that can never resolve (the deadlock report follows)"

/* Writes the report of the cycle ranks[0] -> ranks[1] -> ... -> ranks[0] into buf (cut to fit,
 * NUL-terminated), starting at its lowest rank so that every rank words one cycle alike, with
 * a last line of the ranks' processes when every pid is known. Returns the length it needed. */
size_t mp_cycle_report(const mp_cycle_rank *ranks, int n, char *buf, size_t len);

#endif
