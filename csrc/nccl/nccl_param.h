/* An NCCL parameter (NCCL_COMM_BLOCKING, ...) as NCCL will read it: from the environment or from
 * NCCL's conf files, in NCCL's order and line format (nccl_param.c says which, with the source it
 * follows). Pure C, no state: each call reads the environment and the files again. */
#ifndef MP_NCCL_PARAM_H
#define MP_NCCL_PARAM_H

/* The system-wide conf file NCCL reads last (src/misc/param.cc initEnvFunc); a parameter of
 * mp_nccl_param_read so that a test can name another. */
#define MP_NCCL_SYSTEM_CONF "/etc/nccl.conf"
/* NCCL builds each conf file's path in a buffer of this size, truncating longer ones. */
#define MP_NCCL_CONF_PATH_MAX 1024

/* Where the text NCCL parses comes from. */
typedef enum {
    MP_NCCL_PARAM_UNSET, /* nowhere: NCCL takes its default */
    MP_NCCL_PARAM_ENV,   /* the environment, which no conf file overrides */
    MP_NCCL_PARAM_FILE,  /* a line of `file` (NCCL copies it into the environment when it loads) */
} mp_nccl_param_from;

typedef struct {
    long long value;                  /* as NCCL parses the text; `unset` for none, an empty text or overflow */
    mp_nccl_param_from from;
    char file[MP_NCCL_CONF_PATH_MAX]; /* MP_NCCL_PARAM_FILE: the conf file's path, else "" */
} mp_nccl_param;

/* Reads NCCL's parameter `name` into *p as the NCCL of version code `version` (ncclGetVersion)
 * would, with `system_conf` as its system-wide file (MP_NCCL_SYSTEM_CONF). Values that an NCCL env
 * plugin supplies are not seen: they never enter the environment (nccl_param.c). */
void mp_nccl_param_read(mp_nccl_param *p, const char *name, long long unset, int version, const char *system_conf);

#endif
