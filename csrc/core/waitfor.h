/* The one wait-for cycle search. shm's run-time detection (csrc/shm/deadlock.c) and the
 * simulator (simulate_report.c) each describe their state as a graph of nodes, each waiting on
 * others for a reason the caller names (`via`: an op, an edge of its own), and ask this search
 * for a cycle in it. Edges are asked for lazily, once per node and only for the nodes the search
 * reaches, so that shm reads no more of a live segment than the cycle needs. */
#ifndef MP_WAITFOR_H
#define MP_WAITFOR_H

#include <stddef.h>
#include <stdint.h>

typedef struct mp_waitfor_sink mp_waitfor_sink;

/* Adds an edge of the node being asked about: it waits on node `to`, for reason `via`. Returns
 * 0, or -1 when memory runs out. */
int mp_waitfor_add(mp_waitfor_sink *sink, int32_t to, int32_t via);

/* A graph of `nnodes` nodes (0 .. nnodes-1). `edges` adds node's edges in the order the search
 * should take them; it returns 0, or non-zero to stop the search (memory, or a value that no
 * valid state holds; the caller knows which). */
typedef struct {
    int32_t nnodes;
    int (*edges)(void *ctx, int32_t node, mp_waitfor_sink *sink);
    void *ctx;
} mp_waitfor_graph;

/* nodes[i] waits on nodes[i + 1] for reason via[i]; in a cycle (closed) nodes[n - 1] waits on
 * nodes[0]. Owned by the caller: mp_waitfor_path_free. */
typedef struct {
    int32_t *nodes, *via;
    size_t n;
    int closed;
} mp_waitfor_path;

/* Depth first from each of starts[0 .. nstarts-1] in turn; the first cycle met, with each node's
 * edges taken in their order. Returns 1 (the cycle in *out), 0 (no cycle reachable), or -1
 * (memory ran out, or `edges` stopped the search). */
int mp_waitfor_cycle(const mp_waitfor_graph *g, const int32_t *starts, size_t nstarts, mp_waitfor_path *out);

/* Without a cycle, the chain of first edges from `start` (open): its last node, via -1, is where
 * it ends, a node with no edge or one met before. Returns 0, or -1 as above. */
int mp_waitfor_chain(const mp_waitfor_graph *g, int32_t start, mp_waitfor_path *out);

void mp_waitfor_path_free(mp_waitfor_path *p);

#endif
