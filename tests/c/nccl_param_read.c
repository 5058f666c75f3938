/* csrc/nccl/nccl_param.c from the command line, for tests/test_nccl_params.py:
 *
 *   nccl_param_read NAME VERSION SYSTEM_CONF
 *
 * reads NCCL's parameter NAME as NCCL of version code VERSION would, with SYSTEM_CONF in place of
 * /etc/nccl.conf, from this process's environment, and prints one line: the value (-1 for
 * unset), then where it came from (unset, env or file) and the file's path, tab-separated. */
#include <stdio.h>
#include <stdlib.h>

#include "nccl/nccl_param.h"

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: %s NAME VERSION SYSTEM_CONF\n", argv[0]);
        return 2;
    }
    mp_nccl_param p;
    mp_nccl_param_read(&p, argv[1], -1, atoi(argv[2]), argv[3]);
    const char *from = p.from == MP_NCCL_PARAM_ENV ? "env" : p.from == MP_NCCL_PARAM_FILE ? "file" : "unset";
    printf("%lld\t%s\t%s\n", p.value, from, p.file);
    return 0;
}
