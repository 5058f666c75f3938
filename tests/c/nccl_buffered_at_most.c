/* csrc/nccl/nccl_buffering.c from the command line, for tests/test_nccl_params.py:
 *
 *   nccl_buffered_at_most VERSION SYSTEM_CONF
 *
 * prints the most bytes NCCL of version code VERSION may buffer of one send, with this process's
 * environment and SYSTEM_CONF in place of /etc/nccl.conf. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>

#include "nccl/nccl_buffering.h"

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: %s VERSION SYSTEM_CONF\n", argv[0]);
        return 2;
    }
    printf("%" PRIu64 "\n", mp_nccl_buffered_at_most(atoi(argv[1]), argv[2]));
    return 0;
}
