#include "shm_corrupt.h"

#include <stdio.h>
#include <string.h>

typedef struct {
    const char *name;
    size_t offset;
    size_t width; /* 1, 4 or 8: a number; anything else: text */
} field;

#define FIELD(type, member) {#member, offsetof(type, member), sizeof(((type *)0)->member)}

static const field header_fields[] = {
    FIELD(shm_header, magic),        FIELD(shm_header, version),       FIELD(shm_header, size),
    FIELD(shm_header, nlanes),       FIELD(shm_header, slot_bytes),    FIELD(shm_header, chunk_bytes),
    FIELD(shm_header, eager_threshold), FIELD(shm_header, total_bytes), FIELD(shm_header, attached),
    FIELD(shm_header, ready),        FIELD(shm_header, abort_cause),   FIELD(shm_header, abort_rank),
    FIELD(shm_header, abort_why_ready), FIELD(shm_header, abort_why),  FIELD(shm_header, fenced),
    FIELD(shm_header, detect_lock),  FIELD(shm_header, reports_used),
};
static const field rank_fields[] = {
    FIELD(shm_rank, pid),        FIELD(shm_rank, state),       FIELD(shm_rank, bell),
    FIELD(shm_rank, sleeping),   FIELD(shm_rank, driving),     FIELD(shm_rank, probe_addr),
    FIELD(shm_rank, probe_value), FIELD(shm_rank, global_rank), FIELD(shm_rank, waiting),
    FIELD(shm_rank, wait_epoch), FIELD(shm_rank, fence),       FIELD(shm_rank, arena_bytes),
};
static const field watch_fields[] = {
    FIELD(shm_watch, version), FIELD(shm_watch, epoch), FIELD(shm_watch, nops),
    FIELD(shm_watch, wait_index), FIELD(shm_watch, wait_lane),
};
static const field watch_op_fields[] = {
    FIELD(shm_watch_op, seq),  FIELD(shm_watch_op, nbytes), FIELD(shm_watch_op, step),
    FIELD(shm_watch_op, kind), FIELD(shm_watch_op, peer),   FIELD(shm_watch_op, lane),
    FIELD(shm_watch_op, dtype), FIELD(shm_watch_op, label), FIELD(shm_watch_op, count),
    FIELD(shm_watch_op, call),
};
static const field counter_fields[] = {
    FIELD(shm_chan, posted),      FIELD(shm_chan, produced), FIELD(shm_chan, send_issued),
    FIELD(shm_chan, done),        FIELD(shm_chan, recv_posted), FIELD(shm_chan, consumed),
    FIELD(shm_chan, recv_issued),
};
static const field slot_fields[] = {
    FIELD(shm_slot, nbytes), FIELD(shm_slot, addr),        FIELD(shm_slot, dtype),
    FIELD(shm_slot, label),  FIELD(shm_slot, path),        FIELD(shm_slot, result),
    FIELD(shm_slot, recv_nbytes), FIELD(shm_slot, recv_dtype), FIELD(shm_slot, recv_label),
};

static const field offer_fields[] = {
    FIELD(shm_offer, seq), FIELD(shm_offer, offset), FIELD(shm_offer, nbytes), FIELD(shm_offer, dtype),
};

#define COUNT(a) (sizeof a / sizeof *a)

/* splitmix64: a seed names one sequence of choices on every machine. */
static uint64_t next_random(uint64_t *state)
{
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t load(const char *at, size_t width)
{
    switch (width) {
    case 1: return __atomic_load_n((const uint8_t *)at, __ATOMIC_RELAXED);
    case 4: return __atomic_load_n((const uint32_t *)at, __ATOMIC_RELAXED);
    default: return __atomic_load_n((const uint64_t *)at, __ATOMIC_RELAXED);
    }
}

static void store(char *at, size_t width, uint64_t value)
{
    switch (width) {
    case 1: __atomic_store_n((uint8_t *)at, (uint8_t)value, __ATOMIC_RELAXED); break;
    case 4: __atomic_store_n((uint32_t *)at, (uint32_t)value, __ATOMIC_RELAXED); break;
    default: __atomic_store_n((uint64_t *)at, value, __ATOMIC_RELAXED); break;
    }
}

/* Garbage of the shapes memory errors leave: random bits, all ones, or one of the upper half
 * of the bits flipped (a huge or negative number where a small one belongs). */
static uint64_t garbage(uint64_t *rng, uint64_t old, size_t width)
{
    unsigned bits = (unsigned)width * 8;
    uint64_t mask = bits == 64 ? ~0ull : (1ull << bits) - 1;
    switch (next_random(rng) % 3) {
    case 0: return next_random(rng) & mask;
    case 1: return mask;
    default: return (old ^ (1ull << (bits - 1 - next_random(rng) % (bits / 2)))) & mask;
    }
}

static void overwrite(char *base, const field *f, const char *where, uint64_t *rng,
                      void (*describe)(void *ctx, const char *line), void *ctx)
{
    char *at = base + f->offset;
    char line[200];
    if (f->width != 1 && f->width != 4 && f->width != 8) {
        for (size_t i = 0; i < f->width; i++)
            at[i] = (char)(next_random(rng) | 0x80); /* no terminating NUL anywhere */
        snprintf(line, sizeof line, "%s.%s: %zu bytes of random text", where, f->name, f->width);
    } else {
        uint64_t old = load(at, f->width), value = garbage(rng, old, f->width);
        store(at, f->width, value);
        snprintf(line, sizeof line, "%s.%s: %#llx -> %#llx", where, f->name, (unsigned long long)old,
                 (unsigned long long)value);
    }
    describe(ctx, line);
}

/* A channel between two different ranks: a rank's channel to itself carries only self sends. */
static uint32_t pick_channel(const shm_view *v, uint64_t *rng, char *where, size_t len)
{
    int lane = (int)(next_random(rng) % (uint64_t)v->nlanes);
    int src = (int)(next_random(rng) % (uint64_t)v->size);
    int dst = v->size > 1 ? (src + 1 + (int)(next_random(rng) % (uint64_t)(v->size - 1))) % v->size : src;
    snprintf(where, len, "channel(lane %d, %d->%d)", lane, src, dst);
    return shm_chan_index(v, lane, src, dst);
}

static void corrupt_one(const shm_view *v, uint64_t *rng, void (*describe)(void *ctx, const char *line), void *ctx)
{
    char where[96];
    int rank = (int)(next_random(rng) % (uint64_t)v->size);
    uint64_t region = next_random(rng) % 11; /* weights: the engine's own words first */
    if (region < 2) {
        const field *f = &header_fields[next_random(rng) % COUNT(header_fields)];
        overwrite((char *)shm_hdr(v), f, "header", rng, describe, ctx);
    } else if (region < 4) {
        snprintf(where, sizeof where, "ranks[%d]", rank);
        const field *f = &rank_fields[next_random(rng) % COUNT(rank_fields)];
        overwrite((char *)shm_rank_at(v, rank), f, where, rng, describe, ctx);
    } else if (region < 5) {
        int owner = (int)(next_random(rng) % (uint64_t)v->size);
        snprintf(where, sizeof where, "single_copy[reader %d]", rank);
        char name[32];
        snprintf(name, sizeof name, "owner_%d", owner);
        field f = {name, 0, 1};
        overwrite((char *)shm_cma_at(v, rank, owner), &f, where, rng, describe, ctx);
    } else if (region < 6) {
        shm_watch *w = shm_watch_at(v, rank);
        if (next_random(rng) % 2) {
            snprintf(where, sizeof where, "watch[%d]", rank);
            overwrite((char *)w, &watch_fields[next_random(rng) % COUNT(watch_fields)], where, rng, describe, ctx);
        } else {
            uint64_t i = next_random(rng) % SHM_WATCH_OPS;
            snprintf(where, sizeof where, "watch[%d].ops[%llu]", rank, (unsigned long long)i);
            overwrite((char *)&w->ops[i], &watch_op_fields[next_random(rng) % COUNT(watch_op_fields)], where, rng,
                      describe, ctx);
        }
    } else if (region < 8) {
        shm_chan *ch = shm_chan_at(v, pick_channel(v, rng, where, sizeof where));
        overwrite((char *)ch, &counter_fields[next_random(rng) % COUNT(counter_fields)], where, rng, describe, ctx);
    } else {
        shm_chan *ch = shm_chan_at(v, pick_channel(v, rng, where, sizeof where));
        /* Half the time the newest entry: the offer a sender, or the descriptor a receiver, may
         * be about to read. */
        int offers = region < 9;
        uint64_t newest = atomic_load_explicit(offers ? &ch->recv_posted : &ch->posted, memory_order_relaxed);
        uint64_t i = (next_random(rng) % 2 && newest ? newest - 1 : next_random(rng)) % SHM_NSLOTS;
        size_t n = strlen(where);
        snprintf(where + n, sizeof where - n, offers ? ".offers[%llu]" : ".slots[%llu]", (unsigned long long)i);
        if (offers)
            overwrite((char *)&ch->offers[i], &offer_fields[next_random(rng) % COUNT(offer_fields)], where, rng,
                      describe, ctx);
        else
            overwrite((char *)&ch->slots[i], &slot_fields[next_random(rng) % COUNT(slot_fields)], where, rng,
                      describe, ctx);
    }
}

void mp_shm_corrupt(const shm_view *v, uint64_t seed, int count, void (*describe)(void *ctx, const char *line),
                    void *ctx)
{
    uint64_t rng = seed;
    for (int i = 0; i < count; i++)
        corrupt_one(v, &rng, describe, ctx);
}
