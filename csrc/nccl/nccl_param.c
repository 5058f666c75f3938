/* NCCL's parameters as NCCL reads them, so that a check made before NCCL's first read (the
 * NCCL_COMM_BLOCKING refusal of mp_nccl_open) sees the value NCCL will use, on every rank.
 *
 * What NCCL does (2.30.7 unless said; older releases where they differ):
 *  - When. Once per process NCCL copies its conf files into the environment: at the first
 *    ncclInitEnv (src/init.cc, a call_once of src/plugin/env.cc ncclEnvPluginInit, which calls
 *    src/misc/param.cc initEnv). ncclGetUniqueId and the ncclCommInitRank* calls run it first, and
 *    so does every parameter read (src/misc/param.cc ncclGetEnv); ncclGetVersion does not. So
 *    rank 0, which made the unique ids, has the files' values in its environment, and the other
 *    ranks do not yet: they get them inside their first ncclCommInitRankConfig, too late for a
 *    check that reads only the environment. (Before 2.28.7, src/init.cc ncclInit and, from 2.19,
 *    src/misc/param.cc ncclGetEnv called initEnv.)
 *  - Which files, in order (src/misc/param.cc initEnvFunc): the file NCCL_CONF_FILE names when it
 *    is set and not empty in the environment (since 2.23), else $HOME/.nccl.conf (userHomeDir;
 *    before 2.30 the home directory of the user's password entry, getpwuid(getuid())); then
 *    /etc/nccl.conf. Each path is built in a 1024-byte buffer; a file that cannot be opened is
 *    skipped (a NCCL_CONF_FILE that cannot be opened does not bring ~/.nccl.conf back).
 *  - Precedence. Each line is set with setenv(name, value, 0) (src/os/linux.cc ncclOsSetEnv;
 *    before 2.30 src/misc/param.cc setEnvFile itself), which never overwrites: a variable in the
 *    environment wins over every file, even when empty; the first file wins over /etc/nccl.conf;
 *    within a file the first line for a name wins.
 *  - Line format (src/misc/param.cc setEnvFile): read with fgets into 4096 bytes, so a longer
 *    line is taken as several (before 2.30 getline: whole lines); a trailing '\n', then a
 *    trailing '\r', is removed (before 2.30 only '\n'); a line starting with '#' is skipped
 *    (since 2.26), and so is a line without '='; the name is everything before the first '=',
 *    untrimmed ("NAME = 1" names "NAME ") and cut to 1023 bytes; the value is everything after
 *    it, untrimmed, cut to 1023 bytes.
 *  - Parsing (src/misc/param.cc ncclLoadParam): an empty value is the default; otherwise strtoll
 *    in base 0 with no end pointer ("1x" reads 1, "yes" 0, " 1" 1), the default on overflow.
 *  - Env plugins: ncclGetEnv answers through the env plugin (src/plugin/env.cc
 *    ncclEnvPluginGetEnv). The internal one is getenv (src/plugin/env/default_env.cc); an external
 *    one (libnccl-env.so wherever dlopen finds it, or the one NCCL_ENV_PLUGIN names, which a conf
 *    file may set too since the files are loaded first; NCCL_ENV_PLUGIN=none for none:
 *    src/plugin/env.cc ncclEnvPluginInit, ncclEnvPluginLoad; src/plugin/plugin_open.cc
 *    openPluginLib) answers what it likes, and nothing it answers enters the environment. NCCL's
 *    parameter API (ncclParamGetParameter, 2.30: src/param/c_api.cc) knows only the parameters of
 *    its registry (DEFINE_NCCL_PARAM), and NCCL_COMM_BLOCKING is a plain NCCL_PARAM (src/init.cc):
 *    NCCL exports no way to read it. So a plugin's values are not seen here.
 *
 * Where NCCL has already loaded its files in this process, their values are in the environment
 * too: a value in the environment equal to the files' is attributed to the file. The files are
 * read as they are now; one changed since NCCL loaded it, or a NCCL_CONF_FILE set by a conf file
 * (NCCL read the variable before loading any file), could make this differ from NCCL. */
#include <errno.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

#include "nccl_abi.h"
#include "nccl_param.h"

#define CONF_FILE_VERSION MP_NCCL_VERSION(2, 23, 0) /* NCCL_CONF_FILE */
#define COMMENT_VERSION MP_NCCL_VERSION(2, 26, 0)   /* '#' lines */
#define LINE_CHUNK_VERSION MP_NCCL_VERSION(2, 30, 0) /* fgets, '\r', $HOME */
#define LINE_CHUNK 4096
#define FIELD_MAX 1023 /* NCCL's name and value buffers hold 1023 bytes and a NUL */

/* A conf file's value for `name`, as NCCL would set it: 1 with the value in `value`, 0 where the
 * file is missing or has no line for the name. */
static int file_value(const char *path, const char *name, int version, char value[FIELD_MAX + 1])
{
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    const int chunked = version >= LINE_CHUNK_VERSION;
    size_t want = strlen(name);
    char chunk[LINE_CHUNK];
    char *whole = NULL;
    size_t whole_size = 0;
    int found = 0;
    for (;;) {
        char *line;
        if (chunked) {
            if (!fgets(chunk, (int)sizeof chunk, f))
                break;
            line = chunk;
        } else {
            if (getline(&whole, &whole_size, f) < 0)
                break;
            line = whole;
        }
        size_t len = strlen(line);
        if (len > 0 && line[len - 1] == '\n')
            line[--len] = '\0';
        if (chunked && len > 0 && line[len - 1] == '\r')
            line[--len] = '\0';
        if (version >= COMMENT_VERSION && line[0] == '#')
            continue;
        const char *eq = strchr(line, '=');
        if (!eq)
            continue;
        size_t name_len = (size_t)(eq - line);
        if (name_len > FIELD_MAX)
            name_len = FIELD_MAX;
        if (name_len != want || memcmp(line, name, want) != 0)
            continue;
        snprintf(value, FIELD_MAX + 1, "%s", eq + 1);
        found = 1;
        break;
    }
    free(whole);
    fclose(f);
    return found;
}

/* The home directory NCCL puts .nccl.conf in, or NULL; `buf` holds a password entry's strings. */
static const char *home_dir(int version, char *buf, size_t buflen)
{
    if (version >= LINE_CHUNK_VERSION)
        return getenv("HOME");
    struct passwd entry, *found = NULL;
    if (getpwuid_r(getuid(), &entry, buf, buflen, &found) != 0 || !found)
        return NULL;
    return found->pw_dir;
}

/* The first of NCCL's conf files with a line for `name`: its value into `value`, its path into
 * `path`; 0 where none has one. */
static int files_value(const char *name, int version, const char *system_conf, char value[FIELD_MAX + 1],
                       char path[MP_NCCL_CONF_PATH_MAX])
{
    const char *user = version >= CONF_FILE_VERSION ? getenv("NCCL_CONF_FILE") : NULL;
    if (user && user[0]) {
        snprintf(path, MP_NCCL_CONF_PATH_MAX, "%s", user);
        if (file_value(path, name, version, value))
            return 1;
    } else {
        char buf[16384];
        const char *home = home_dir(version, buf, sizeof buf);
        if (home) { /* cut to NCCL's buffer, as NCCL's snprintf cuts it */
            snprintf(path, MP_NCCL_CONF_PATH_MAX, "%s/.nccl.conf", home);
            if (file_value(path, name, version, value))
                return 1;
        }
    }
    snprintf(path, MP_NCCL_CONF_PATH_MAX, "%s", system_conf);
    return file_value(path, name, version, value);
}

void mp_nccl_param_read(mp_nccl_param *p, const char *name, long long unset, int version, const char *system_conf)
{
    char in_file[FIELD_MAX + 1], path[MP_NCCL_CONF_PATH_MAX];
    int from_file = files_value(name, version, system_conf, in_file, path);
    const char *text = getenv(name);
    p->value = unset;
    p->file[0] = '\0';
    if (text && !(from_file && strcmp(text, in_file) == 0)) {
        p->from = MP_NCCL_PARAM_ENV;
    } else if (from_file) {
        p->from = MP_NCCL_PARAM_FILE;
        snprintf(p->file, sizeof p->file, "%s", path);
        text = in_file;
    } else {
        p->from = MP_NCCL_PARAM_UNSET;
        return;
    }
    if (!text[0]) /* set, but empty: NCCL's default */
        return;
    errno = 0;
    long long value = strtoll(text, NULL, 0);
    if (!errno)
        p->value = value;
}
