/* Finding libnccl and libcuda at run time. The driver API is used rather than the CUDA
 * runtime: libcuda.so.1 has one soname and a stable ABI across CUDA releases, whereas the
 * runtime torch loaded is versioned by soname (libcudart.so.12, .13, ...), and NCCL needs the
 * driver anyway. */
#include <dlfcn.h>
#include <link.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "libraries.h"

static mp_nccl_lib nccl_table;
static int nccl_loaded;
static mp_cuda_lib cuda_table;
static int cuda_loaded;

static void append(char *err, size_t errlen, const char *fmt, const char *a, const char *b)
{
    size_t used = strlen(err);
    if (used < errlen)
        snprintf(err + used, errlen - used, fmt, a, b);
}

/* Resolves every symbol of `names` into `slots`; the names marked optional may be missing. */
typedef struct {
    const char *name;
    size_t offset;
    int optional;
} symbol;

static int resolve(void *handle, void *table, const symbol *syms, size_t n, char *err, size_t errlen,
                   const char *path)
{
    for (size_t i = 0; i < n; i++) {
        void *fn = dlsym(handle, syms[i].name);
        if (!fn && !syms[i].optional) {
            append(err, errlen, "%s has no symbol %s", path, syms[i].name);
            return -1;
        }
        memcpy((char *)table + syms[i].offset, &fn, sizeof fn);
    }
    return 0;
}

#define NCCL_SYM(field, name, opt) {name, offsetof(mp_nccl_lib, field), opt}
static const symbol nccl_symbols[] = {
    NCCL_SYM(GetVersion, "ncclGetVersion", 0),
    NCCL_SYM(GetUniqueId, "ncclGetUniqueId", 0),
    NCCL_SYM(CommInitRankConfig, "ncclCommInitRankConfig", 0),
    NCCL_SYM(CommGetAsyncError, "ncclCommGetAsyncError", 0),
    NCCL_SYM(CommAbort, "ncclCommAbort", 0),
    NCCL_SYM(GroupStart, "ncclGroupStart", 0),
    NCCL_SYM(GroupEnd, "ncclGroupEnd", 0),
    NCCL_SYM(Send, "ncclSend", 0),
    NCCL_SYM(Recv, "ncclRecv", 0),
    NCCL_SYM(GetErrorString, "ncclGetErrorString", 0),
    NCCL_SYM(GetLastError, "ncclGetLastError", 1),
};

/* The path of the first libnccl already mapped into this process, if any. */
static int find_loaded(struct dl_phdr_info *info, size_t size, void *out)
{
    (void)size;
    const char *name = info->dlpi_name;
    const char *base = name ? strrchr(name, '/') : NULL;
    base = base ? base + 1 : name;
    if (base && strncmp(base, "libnccl.so", 10) == 0) {
        snprintf((char *)out, MP_LIB_PATH_LEN, "%s", name);
        return 1;
    }
    return 0;
}

/* Opens `path`, resolves the symbols and reads the version into nccl_table. */
static int try_nccl(const char *path, const char *source, int flags, char *err, size_t errlen)
{
    void *handle = dlopen(path, flags);
    if (!handle) {
        const char *why = dlerror();
        append(err, errlen, "%s: %s; ", source, why ? why : path);
        return -1;
    }
    mp_nccl_lib lib = {0};
    if (resolve(handle, &lib, nccl_symbols, sizeof nccl_symbols / sizeof *nccl_symbols, err, errlen, path) < 0) {
        append(err, errlen, "%s%s", "; ", "");
        dlclose(handle);
        return -1;
    }
    if (lib.GetVersion(&lib.version) != MP_NCCL_SUCCESS) {
        append(err, errlen, "%s: ncclGetVersion failed; ", path, "");
        dlclose(handle);
        return -1;
    }
    if (lib.version < MP_NCCL_MIN_VERSION) {
        char v[32];
        snprintf(v, sizeof v, "%d", lib.version);
        append(err, errlen, "%s is NCCL %s, older than 2.14 (nonblocking communicators); ", path, v);
        dlclose(handle);
        return -1;
    }
    struct link_map *map = NULL;
    if (dlinfo(handle, RTLD_DI_LINKMAP, &map) == 0 && map && map->l_name && map->l_name[0])
        snprintf(lib.path, sizeof lib.path, "%s", map->l_name);
    else
        snprintf(lib.path, sizeof lib.path, "%s", path);
    lib.source = source;
    nccl_table = lib; /* the handle stays open for the life of the process */
    nccl_loaded = 1;
    return 0;
}

const mp_nccl_lib *mp_nccl_load(const char *env_path, const char *const *bundled, int nbundled, char *err,
                                size_t errlen)
{
    if (nccl_loaded)
        return &nccl_table;
    err[0] = '\0';
    if (env_path && env_path[0]) {
        /* An explicit choice is never silently replaced by another copy. */
        if (try_nccl(env_path, "env", RTLD_NOW | RTLD_GLOBAL, err, errlen) == 0)
            return &nccl_table;
        append(err, errlen, "%s names a library that cannot be used; fix or unset it", MP_NCCL_LIBRARY_ENV, "");
        return NULL;
    }
    char loaded[MP_LIB_PATH_LEN] = "";
    if (dl_iterate_phdr(find_loaded, loaded) &&
        try_nccl(loaded, "loaded", RTLD_NOW | RTLD_NOLOAD, err, errlen) == 0)
        return &nccl_table;
    for (int i = 0; i < nbundled; i++)
        if (try_nccl(bundled[i], "bundled", RTLD_NOW | RTLD_GLOBAL, err, errlen) == 0)
            return &nccl_table;
    if (try_nccl("libnccl.so.2", "system", RTLD_NOW | RTLD_GLOBAL, err, errlen) == 0)
        return &nccl_table;
    append(err, errlen, "install NCCL (pip install nvidia-nccl-cu13, or torch with CUDA) or set %s to "
           "the path of libnccl.so.2%s", MP_NCCL_LIBRARY_ENV, "");
    return NULL;
}

const mp_nccl_lib *mp_nccl_loaded(char *err, size_t errlen)
{
    if (nccl_loaded)
        return &nccl_table;
    snprintf(err, errlen, "libnccl is not loaded yet: megatron_p2p.nccl_version() loads it (init_communicator "
             "does so for backend 'nccl')");
    return NULL;
}

#define CU_SYM(field, name) {name, offsetof(mp_cuda_lib, field), 0}
static const symbol cuda_symbols[] = {
    CU_SYM(Init, "cuInit"),
    CU_SYM(DeviceGet, "cuDeviceGet"),
    CU_SYM(DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain"),
    CU_SYM(DevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2"),
    CU_SYM(CtxGetCurrent, "cuCtxGetCurrent"),
    CU_SYM(CtxSetCurrent, "cuCtxSetCurrent"),
    CU_SYM(CtxGetStreamPriorityRange, "cuCtxGetStreamPriorityRange"),
    CU_SYM(StreamCreateWithPriority, "cuStreamCreateWithPriority"),
    CU_SYM(StreamDestroy, "cuStreamDestroy_v2"),
    CU_SYM(StreamWaitEvent, "cuStreamWaitEvent"),
    CU_SYM(StreamSynchronize, "cuStreamSynchronize"),
    CU_SYM(EventCreate, "cuEventCreate"),
    CU_SYM(EventDestroy, "cuEventDestroy_v2"),
    CU_SYM(EventRecord, "cuEventRecord"),
    CU_SYM(EventQuery, "cuEventQuery"),
    CU_SYM(MemAlloc, "cuMemAlloc_v2"),
    CU_SYM(MemFree, "cuMemFree_v2"),
    CU_SYM(MemAllocHost, "cuMemAllocHost_v2"),
    CU_SYM(MemFreeHost, "cuMemFreeHost"),
    CU_SYM(MemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2"),
    CU_SYM(MemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2"),
    CU_SYM(StreamGetCaptureInfo, "cuStreamGetCaptureInfo_v2"),
    CU_SYM(ThreadExchangeStreamCaptureMode, "cuThreadExchangeStreamCaptureMode"),
    CU_SYM(GetErrorString, "cuGetErrorString"),
};

const mp_cuda_lib *mp_cuda_load(char *err, size_t errlen)
{
    if (cuda_loaded)
        return &cuda_table;
    err[0] = '\0';
    const char *env_path = getenv(MP_CUDA_LIBRARY_ENV);
    const char *path = env_path && env_path[0] ? env_path : "libcuda.so.1";
    void *handle = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
    if (!handle) {
        const char *why = dlerror();
        if (path == env_path) /* an explicit choice is never silently replaced by the system's */
            append(err, errlen, "%s names a CUDA driver that cannot be loaded (%s); fix or unset it",
                   MP_CUDA_LIBRARY_ENV, why ? why : path);
        else
            append(err, errlen, "no CUDA driver (%s): this machine has no usable NVIDIA GPU%s", why ? why : "", "");
        return NULL;
    }
    mp_cuda_lib lib = {0};
    if (resolve(handle, &lib, cuda_symbols, sizeof cuda_symbols / sizeof *cuda_symbols, err, errlen, path) < 0) {
        if (path == env_path)
            append(err, errlen, "; %s names a library that cannot be used%s", MP_CUDA_LIBRARY_ENV, "");
        dlclose(handle);
        return NULL;
    }
    snprintf(lib.path, sizeof lib.path, "%s", path);
    cuda_table = lib;
    cuda_loaded = 1;
    return &cuda_table;
}
