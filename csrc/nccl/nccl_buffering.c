/* How much of a send NCCL can hold before its receiver takes any: an upper bound over every
 * topology, from the parameters NCCL sizes its buffers with (2.30.7; older releases have the
 * same defaults and at most as many channels, so the bound holds for them too).
 *
 *  - A send kernel runs up to NCCL_STEPS (8) steps ahead of its receiver's head, and no further
 *    (src/device/prims_simple.h waitPeer; src/include/device.h NCCL_STEPS), on each channel.
 *  - A step of the Simple protocol is p2pChunkSize bytes (src/enqueue.cc, the p2p plan's
 *    stepSize): NCCL_P2P_NVL_CHUNKSIZE (512 KiB) on all-NVLink nodes, NCCL_P2P_PCI_CHUNKSIZE
 *    (128 KiB) on other single nodes, NCCL_P2P_NET_CHUNKSIZE (128 KiB), doubled on Arm GB
 *    systems, across nodes; never above NCCL_BUFFSIZE (4 MiB) / NCCL_STEPS (src/init.cc
 *    computeBuffSizes).
 *  - A send of up to nChannels * NCCL_P2P_LL_THRESHOLD (16 KiB) bytes may use the LL protocol,
 *    whose step holds NCCL_LL_BUFFSIZE / NCCL_STEPS bytes of lines, half of them data (src/enqueue.cc,
 *    protoLL; src/init.cc DEFAULT_LL_BUFFSIZE).
 *  - A send is split over at most p2pnChannelsPerPeer channels, which is at most p2pnChannels:
 *    NCCL_MAX_P2P_NCHANNELS (MAXCHANNELS, 64) raised to NCCL_MIN_P2P_NCHANNELS and to a power of
 *    two, within MAXCHANNELS (src/graph/paths.cc ncclTopoComputeP2pChannels).
 * So a send of more than channels * NCCL_STEPS * step bytes waits for its receiver on some
 * channel. The channel count and the chunk actually chosen depend on the topology, which no API
 * reports, so the bound takes the largest of each. */
#include "nccl_buffering.h"
#include "nccl_param.h"

#define STEPS 8           /* src/include/device.h NCCL_STEPS */
#define MAX_CHANNELS 64   /* src/include/device.h MAXCHANNELS */
#define LL_LINE_BYTES 16  /* union ncclLLFifoLine: 8 bytes of data, 8 of flags */
#define LL_BUFFSIZE_DEFAULT (8 * 512 * STEPS * LL_LINE_BYTES) /* NCCL_LL_LINES_PER_THREAD * NCCL_LL_MAX_NTHREADS */

typedef struct {
    int version;
    const char *system_conf;
} reader;

/* A parameter NCCL reads as a size or count, or its default where unset or not positive. */
static uint64_t param(const reader *r, const char *name, uint64_t fallback)
{
    mp_nccl_param p;
    mp_nccl_param_read(&p, name, -1, r->version, r->system_conf);
    return p.value > 0 ? (uint64_t)p.value : fallback;
}

static uint64_t max_u64(uint64_t a, uint64_t b) { return a > b ? a : b; }
static uint64_t min_u64(uint64_t a, uint64_t b) { return a < b ? a : b; }

static uint64_t pow2_up(uint64_t v)
{
    uint64_t p = 1;
    while (p < v)
        p <<= 1;
    return p;
}

uint64_t mp_nccl_buffered_at_most(int version, const char *system_conf)
{
    reader r = {version, system_conf};
    uint64_t channels = min_u64(param(&r, "NCCL_MAX_P2P_NCHANNELS", MAX_CHANNELS), MAX_CHANNELS);
    channels = min_u64(pow2_up(max_u64(channels, param(&r, "NCCL_MIN_P2P_NCHANNELS", 1))), MAX_CHANNELS);

    uint64_t chunk = max_u64(param(&r, "NCCL_P2P_NVL_CHUNKSIZE", 1 << 19),
                             max_u64(param(&r, "NCCL_P2P_PCI_CHUNKSIZE", 1 << 17),
                                     2 * param(&r, "NCCL_P2P_NET_CHUNKSIZE", 1 << 17)));
    chunk = min_u64(chunk, param(&r, "NCCL_BUFFSIZE", 1 << 22) / STEPS);
    uint64_t simple = channels * STEPS * chunk;

    uint64_t ll_step_data = param(&r, "NCCL_LL_BUFFSIZE", LL_BUFFSIZE_DEFAULT) / STEPS / 2;
    uint64_t ll = channels * min_u64(param(&r, "NCCL_P2P_LL_THRESHOLD", 16384), STEPS * ll_step_data);
    return max_u64(simple, ll);
}
