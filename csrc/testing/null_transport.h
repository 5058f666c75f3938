/* A transport for benchmarks only (megatron_p2p._testing.null_communicator): every posted op
 * is done when post() returns, with no copy and no peer. What a call costs on it is the binding
 * layer's own cost (the plan, the tensor reads, the Requests), which is also the host cost the
 * bindings add on the NCCL path. */
#ifndef MP_NULL_TRANSPORT_H
#define MP_NULL_TRANSPORT_H

#include "core/transport.h"

/* Never fails but for memory; no other rank takes part. */
mp_result mp_null_open(int rank, int size, int nlanes, mp_transport **out);

#endif
