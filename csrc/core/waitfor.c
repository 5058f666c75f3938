#include "waitfor.h"

#include <stdlib.h>

typedef struct {
    int32_t to, via;
} edge;

/* Each node's edges, asked for once: edges[first[v] .. first[v] + count[v]), count -1 not asked. */
struct mp_waitfor_sink {
    const mp_waitfor_graph *g;
    edge *edges;
    size_t n, cap;
    size_t *first;
    int32_t *count;
};

int mp_waitfor_add(mp_waitfor_sink *s, int32_t to, int32_t via)
{
    if (s->n == s->cap) {
        size_t cap = s->cap ? 2 * s->cap : 64;
        edge *grown = realloc(s->edges, cap * sizeof *grown);
        if (!grown)
            return -1;
        s->edges = grown, s->cap = cap;
    }
    s->edges[s->n++] = (edge){to, via};
    return 0;
}

static int sink_open(mp_waitfor_sink *s, const mp_waitfor_graph *g)
{
    size_t n = g->nnodes > 0 ? (size_t)g->nnodes : 1;
    *s = (mp_waitfor_sink){.g = g, .first = calloc(n, sizeof *s->first), .count = malloc(n * sizeof *s->count)};
    if (!s->first || !s->count)
        return -1;
    for (size_t v = 0; v < n; v++)
        s->count[v] = -1;
    return 0;
}

static void sink_close(mp_waitfor_sink *s)
{
    free(s->edges);
    free(s->first);
    free(s->count);
}

/* Node v's edges asked for, once. Returns 0, or -1 when the search must stop. */
static int ask(mp_waitfor_sink *s, int32_t v)
{
    if (s->count[v] >= 0)
        return 0;
    s->first[v] = s->n;
    if (s->g->edges(s->g->ctx, v, s) != 0)
        return -1;
    for (size_t i = s->first[v]; i < s->n; i++)
        if (s->edges[i].to < 0 || s->edges[i].to >= s->g->nnodes)
            return -1; /* a caller's bug: stop rather than read outside the tables */
    s->count[v] = (int32_t)(s->n - s->first[v]);
    return 0;
}

static int path_alloc(mp_waitfor_path *p, size_t n)
{
    *p = (mp_waitfor_path){.nodes = malloc((n ? n : 1) * sizeof *p->nodes), .via = malloc((n ? n : 1) * sizeof *p->via)};
    if (p->nodes && p->via)
        return 0;
    mp_waitfor_path_free(p);
    return -1;
}

int mp_waitfor_cycle(const mp_waitfor_graph *g, const int32_t *starts, size_t nstarts, mp_waitfor_path *out)
{
    *out = (mp_waitfor_path){0};
    size_t nnodes = g->nnodes > 0 ? (size_t)g->nnodes : 1;
    mp_waitfor_sink s;
    uint8_t *color = calloc(nnodes, 1); /* 0 unseen, 1 on the stack, 2 done */
    int32_t *stack = malloc(nnodes * sizeof *stack);
    size_t *cursor = malloc(nnodes * sizeof *cursor); /* per stack entry: its next edge */
    int rc = -1;
    if (sink_open(&s, g) != 0 || !color || !stack || !cursor)
        goto done;
    rc = 0;
    for (size_t k = 0; k < nstarts && rc == 0; k++) {
        int32_t start = starts[k];
        if (start < 0 || start >= g->nnodes || color[start])
            continue;
        if (ask(&s, start) != 0) {
            rc = -1;
            break;
        }
        size_t depth = 1;
        stack[0] = start;
        cursor[0] = s.first[start];
        color[start] = 1;
        while (depth && rc == 0) {
            int32_t v = stack[depth - 1];
            if (cursor[depth - 1] == s.first[v] + (size_t)s.count[v]) {
                color[v] = 2;
                depth--;
                continue;
            }
            edge e = s.edges[cursor[depth - 1]++];
            if (color[e.to] == 1) { /* a back edge: the cycle is the stack from e.to up */
                size_t from = 0;
                while (stack[from] != e.to)
                    from++;
                if (path_alloc(out, depth - from) != 0) {
                    rc = -1;
                    break;
                }
                for (size_t i = from; i < depth; i++) {
                    out->nodes[out->n] = stack[i];
                    out->via[out->n++] = i + 1 < depth ? s.edges[cursor[i] - 1].via : e.via;
                }
                out->closed = 1;
                rc = 1;
            } else if (color[e.to] == 0) {
                if (ask(&s, e.to) != 0) {
                    rc = -1;
                    break;
                }
                color[e.to] = 1;
                stack[depth] = e.to;
                cursor[depth++] = s.first[e.to];
            }
        }
    }
done:
    sink_close(&s);
    free(color);
    free(stack);
    free(cursor);
    return rc;
}

int mp_waitfor_chain(const mp_waitfor_graph *g, int32_t start, mp_waitfor_path *out)
{
    *out = (mp_waitfor_path){0};
    size_t nnodes = g->nnodes > 0 ? (size_t)g->nnodes : 1;
    mp_waitfor_sink s;
    uint8_t *seen = calloc(nnodes, 1);
    int rc = -1;
    if (sink_open(&s, g) != 0 || !seen || path_alloc(out, nnodes + 1) != 0)
        goto done;
    int32_t v = start;
    rc = 0;
    while (v >= 0 && v < g->nnodes) {
        out->nodes[out->n] = v;
        if (seen[v]) { /* met before: the chain ends where it turns back */
            out->via[out->n++] = -1;
            break;
        }
        if (ask(&s, v) != 0) {
            rc = -1;
            break;
        }
        seen[v] = 1;
        if (s.count[v] == 0) { /* the chain ends here: this node waits on nothing */
            out->via[out->n++] = -1;
            break;
        }
        out->via[out->n++] = s.edges[s.first[v]].via;
        v = s.edges[s.first[v]].to;
    }
done:
    if (rc != 0)
        mp_waitfor_path_free(out);
    sink_close(&s);
    free(seen);
    return rc;
}

void mp_waitfor_path_free(mp_waitfor_path *p)
{
    free(p->nodes);
    free(p->via);
    *p = (mp_waitfor_path){0};
}
