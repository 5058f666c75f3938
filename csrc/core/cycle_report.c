#include "cycle_report.h"

#include <stdarg.h>
#include <stdio.h>

typedef struct {
    char *buf;
    size_t len, used; /* used: what the whole text needs, also past len */
} text;

static void add(text *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void add(text *t, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(t->used < t->len ? t->buf + t->used : NULL, t->used < t->len ? t->len - t->used : 0, fmt, ap);
    va_end(ap);
    if (k > 0)
        t->used += (size_t)k;
}

static void add_rank(text *t, const mp_cycle_rank *r)
{
    int send = r->kind == MP_SEND;
    add(t, "\n  rank %d is blocked on %s %s rank %d: %llu bytes of %s, lane %d, message #%llu", r->rank, r->what,
        send ? "to" : "from", r->peer, (unsigned long long)r->nbytes, r->dtype, r->lane, (unsigned long long)r->message);
    if (r->call && r->call[0])
        add(t, ", posted by %s", r->call);
    if (r->label && r->label[0])
        add(t, ", label '%s'", r->label);
    const char *partner = send ? "receive" : "send";
    if (r->partner_posted && r->lanes_serialized)
        add(t, "; rank %d has posted the matching %s, but it is queued behind rank %d's own blocked op (its lanes "
            "run in one queue)", r->peer, partner, r->peer);
    else if (r->partner_posted)
        add(t, "; rank %d has posted the matching %s, but it is queued on lane %d behind rank %d's own blocked op",
            r->peer, partner, r->lane, r->peer);
    else
        add(t, "; rank %d has posted only %llu %s%s %s rank %d on lane %d", r->peer,
            (unsigned long long)r->partner_count, partner, r->partner_count == 1 ? "" : "s", send ? "from" : "to",
            r->rank, r->lane);
}

size_t mp_cycle_report(const mp_cycle_rank *ranks, int n, char *buf, size_t len)
{
    text t = {buf, len, 0};
    if (len)
        buf[0] = '\0';
    if (n <= 0)
        return 0;
    int first = 0, pids = 1;
    for (int i = 0; i < n; i++) {
        if (ranks[i].rank < ranks[first].rank)
            first = i;
        pids &= ranks[i].pid != 0;
    }
    add(&t, "deadlock: ranks");
    for (int i = 0; i < n; i++)
        add(&t, " %d ->", ranks[(first + i) % n].rank);
    add(&t, " %d are each blocked on an op that needs the next one, which has not posted its partner or has it "
        "queued behind its own blocked op; this wait-for cycle can never resolve:", ranks[first].rank);
    for (int i = 0; i < n; i++)
        add_rank(&t, &ranks[(first + i) % n]);
    if (pids) {
        add(&t, "\n  processes:");
        for (int i = 0; i < n; i++)
            add(&t, "%s rank %d (pid %ld)", i ? "," : "", ranks[(first + i) % n].rank, ranks[(first + i) % n].pid);
    }
    return t.used;
}
