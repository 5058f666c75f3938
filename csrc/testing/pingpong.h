/* The latency benchmark's C floor: two processes bounce a counter through one shared page. */
#ifndef MP_TESTING_PINGPONG_H
#define MP_TESTING_PINGPONG_H

#include <stddef.h>

/* Rank 0 creates the page `name`, waits for rank 1 to map it and unlinks it, so nothing is left
 * behind; rank 1 opens it. Then `round_trips` trips, each side spinning at most `timeout`
 * seconds for the other. Rank 0 writes each trip's one-way time in microseconds to `oneway`
 * (rank 1 may pass NULL). Returns 0, or an errno (ETIMEDOUT: the peer did not answer in time)
 * with `why` saying what failed. */
int mp_pingpong(const char *name, int rank, size_t round_trips, double timeout, double *oneway, char *why,
                size_t why_len);

#endif
