/* The most NCCL may buffer of one send: a send of more bytes never completes before its receive
 * is posted; one of fewer may. The stall analysis names a cycle only when no buffering could
 * resolve it, so it treats every send at or under this bound as buffered (nccl_buffering.c). */
#ifndef MP_NCCL_BUFFERING_H
#define MP_NCCL_BUFFERING_H

#include <stdint.h>

/* The bound for the NCCL of version code `version`, from NCCL's parameters as it reads them
 * (nccl_param.h), with `system_conf` as its system-wide conf file (MP_NCCL_SYSTEM_CONF). */
uint64_t mp_nccl_buffered_at_most(int version, const char *system_conf);

#endif
