#include "segment.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include "core/clock.h"

#define SHM_PREFIX "mp2p-"
#define BOUNCE_BUDGET (64ull << 20) /* virtual bytes for all bounce buffers of one segment */

static uint64_t round_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

void shm_layout_compute(int size, int nlanes, uint64_t eager_threshold, shm_layout *out)
{
    uint64_t n = (uint64_t)size;
    out->nchans = (uint32_t)((uint64_t)nlanes * n * n);
    out->slot_bytes = round_up(eager_threshold > SHM_INLINE_BYTES ? eager_threshold : SHM_INLINE_BYTES, 64);
    uint64_t chunk = BOUNCE_BUDGET / ((uint64_t)out->nchans * SHM_NCHUNKS);
    if (chunk > (256u << 10))
        chunk = 256u << 10;
    if (chunk < (16u << 10))
        chunk = 16u << 10;
    out->chunk_bytes = chunk / 4096 * 4096;

    uint64_t off = round_up(sizeof(shm_header), 64);
    out->ranks = off;
    off = round_up(off + n * sizeof(shm_rank), 64);
    out->cma = off;
    off = round_up(off + n * n, 64);
    out->watch = off;
    off = round_up(off + n * sizeof(shm_watch), 64);
    out->reports = off;
    off = round_up(off + (uint64_t)SHM_REPORTS * SHM_REPORT_BYTES, 64);
    out->chans = off;
    off = round_up(off + out->nchans * sizeof(shm_chan), 4096);
    out->inline_data = off;
    off = round_up(off + (uint64_t)out->nchans * SHM_NSLOTS * out->slot_bytes, 4096);
    out->bounce = off;
    off += (uint64_t)out->nchans * SHM_NCHUNKS * out->chunk_bytes;
    out->total = round_up(off, 4096);
}

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14 */
#endif

int shm_segment_commit(char *addr, uint64_t len)
{
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t start = (uintptr_t)addr / page * page;
    uintptr_t end = ((uintptr_t)addr + len + page - 1) / page * page;
    if (madvise((void *)start, end - start, MADV_POPULATE_WRITE) == 0)
        return 0;
    return errno == EINVAL ? 0 : errno; /* EINVAL: an older kernel; the first write backs it */
}

double shm_free_mib(void)
{
    struct statvfs fs;
    return statvfs("/dev/shm", &fs) == 0 ? (double)fs.f_bavail * (double)fs.f_frsize / 1048576.0 : 0;
}

mp_result shm_system_error(char *err, size_t errlen, const char *what, const char *name, int e)
{
    snprintf(err, errlen, "%s %s: %s%s", what, name, strerror(e),
             e == EMFILE ? " (the process's RLIMIT_NOFILE is exhausted: raise it with `ulimit -n`)" : "");
    return MP_ERR_SYSTEM;
}

static mp_result create_segment(const char *name, uint64_t total, int *fd_out, char *err, size_t errlen)
{
    shm_segment_sweep_stale();
    int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0)
        return shm_system_error(err, errlen, "cannot create shared-memory segment", name, errno);
    struct statvfs fs;
    if (fstatvfs(fd, &fs) == 0 && (uint64_t)fs.f_bavail * fs.f_frsize < total / 8) {
        /* The segment is sparse, but a /dev/shm far smaller than it would SIGBUS later. */
        snprintf(err, errlen,
                 "/dev/shm has %llu MiB free; the shm transport needs up to %llu MiB for this group "
                 "(in a container, raise --shm-size)",
                 (unsigned long long)((uint64_t)fs.f_bavail * fs.f_frsize >> 20),
                 (unsigned long long)(total >> 20));
        close(fd);
        shm_unlink(name);
        return MP_ERR_SYSTEM;
    }
    if (ftruncate(fd, (off_t)total) != 0) {
        int e = errno;
        close(fd);
        shm_unlink(name);
        return shm_system_error(err, errlen, "cannot size shared-memory segment", name, e);
    }
    *fd_out = fd;
    return MP_OK;
}

/* The pid in the name ("/mp2p-<pid>-..."): rank 0's, the creator's. */
static pid_t creator_of(const char *name)
{
    if (strncmp(name + 1, SHM_PREFIX, sizeof SHM_PREFIX - 1) != 0)
        return 0;
    char *end;
    long pid = strtol(name + sizeof SHM_PREFIX, &end, 10);
    return pid > 0 && *end == '-' ? (pid_t)pid : 0;
}

/* Between polls for rank 0's segment: whether to stop (interrupted, or rank 0 is gone). */
static mp_result keep_waiting(const char *name, double deadline, const mp_interrupt *interrupt, const char *what,
                              char *err, size_t errlen)
{
    if (mp_interrupted(interrupt))
        return MP_ERR_INTERRUPTED;
    pid_t creator = creator_of(name);
    if (creator && kill(creator, 0) != 0 && errno == ESRCH) {
        snprintf(err, errlen, "rank 0 (pid %d) exited before it could %s shared-memory segment %s", (int)creator,
                 what, name);
        shm_unlink(name); /* its creator cannot any more */
        return MP_ERR_PEER_DEAD;
    }
    if (mp_now() > deadline) {
        snprintf(err, errlen, "timed out waiting for rank 0 to %s shared-memory segment %s", what, name);
        return MP_ERR_TIMEOUT;
    }
    return MP_OK;
}

static mp_result attach_segment(const char *name, uint64_t total, double deadline, const mp_interrupt *interrupt,
                                int *fd_out, char *err, size_t errlen)
{
    for (;;) {
        int fd = shm_open(name, O_RDWR, 0);
        if (fd >= 0) {
            struct stat st;
            int ok = fstat(fd, &st) == 0;
            if (ok && st.st_uid != geteuid()) { /* planted by someone who learnt the name */
                snprintf(err, errlen,
                         "shared-memory segment %s belongs to uid %u, not to this process's uid %u: refusing "
                         "to attach",
                         name, (unsigned)st.st_uid, (unsigned)geteuid());
                close(fd);
                return MP_ERR_SYSTEM;
            }
            if (ok && (uint64_t)st.st_size == total) {
                *fd_out = fd;
                return MP_OK;
            }
            close(fd);
            if (ok && st.st_size != 0) { /* 0: rank 0 has not sized it yet */
                snprintf(err, errlen,
                         "shared-memory segment %s has %lld bytes where this rank expects %llu: the ranks "
                         "disagree on the group size, lanes or eager_threshold",
                         name, (long long)st.st_size, (unsigned long long)total);
                return MP_ERR_CORRUPT;
            }
        } else if (errno != ENOENT) {
            return shm_system_error(err, errlen, "cannot open shared-memory segment", name, errno);
        }
        mp_result r = keep_waiting(name, deadline, interrupt, "create", err, errlen);
        if (r != MP_OK)
            return r;
        usleep(1000);
    }
}

mp_result shm_segment_map(const char *name, int create, int size, int nlanes, uint64_t eager_threshold,
                          double deadline, const mp_interrupt *interrupt, shm_view *v, char *err, size_t errlen)
{
    shm_layout lay;
    shm_layout_compute(size, nlanes, eager_threshold, &lay);
    int fd = -1;
    mp_result r = create ? create_segment(name, lay.total, &fd, err, errlen)
                         : attach_segment(name, lay.total, deadline, interrupt, &fd, err, errlen);
    if (r != MP_OK)
        return r;
    void *base = mmap(NULL, lay.total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    int e = errno;
    close(fd);
    if (base == MAP_FAILED) {
        if (create)
            shm_unlink(name);
        return shm_system_error(err, errlen, "cannot map shared-memory segment", name, e);
    }
    madvise(base, lay.total, MADV_DONTFORK); /* the creating process's only: docs/api.md, "Fork" */
    v->base = base;
    v->lay = lay;
    v->size = size;
    v->nlanes = nlanes;
    shm_header *h = shm_hdr(v);
    if (create) {
        int no_room = shm_segment_commit(base, lay.inline_data); /* the header, ranks and channels */
        if (no_room) {
            snprintf(err, errlen, "/dev/shm has %llu MiB free; shared-memory segment %s needs %llu MiB for its "
                     "control part alone (%s; in a container, raise --shm-size)", (unsigned long long)shm_free_mib(),
                     name, (unsigned long long)((lay.inline_data + (1u << 20) - 1) >> 20), strerror(no_room));
            shm_segment_unmap(v);
            shm_unlink(name);
            return MP_ERR_SYSTEM;
        }
        h->version = SHM_VERSION;
        h->size = (uint32_t)size;
        h->nlanes = (uint32_t)nlanes;
        h->slot_bytes = lay.slot_bytes;
        h->chunk_bytes = lay.chunk_bytes;
        h->eager_threshold = eager_threshold;
        h->total_bytes = lay.total;
        __atomic_store_n(&h->magic, SHM_MAGIC, __ATOMIC_RELEASE);
        return MP_OK;
    }
    while (__atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) != SHM_MAGIC) {
        r = keep_waiting(name, deadline, interrupt, "initialise", err, errlen);
        if (r != MP_OK) {
            shm_segment_unmap(v);
            return r;
        }
        usleep(1000);
    }
    if (h->version != SHM_VERSION || h->size != (uint32_t)size || h->nlanes != (uint32_t)nlanes ||
        h->eager_threshold != eager_threshold || h->total_bytes != lay.total) {
        snprintf(err, errlen,
                 "ranks disagree on the communicator: rank 0 made size=%u lanes=%u eager_threshold=%llu, "
                 "this rank asks for size=%d lanes=%d eager_threshold=%llu",
                 h->size, h->nlanes, (unsigned long long)h->eager_threshold, size, nlanes,
                 (unsigned long long)eager_threshold);
        shm_segment_unmap(v);
        return MP_ERR_MISMATCH;
    }
    return MP_OK;
}

void shm_segment_unmap(shm_view *v)
{
    if (v->base)
        munmap(v->base, v->lay.total);
    v->base = NULL;
}

void shm_segment_sweep_stale(void)
{
    DIR *d = opendir("/dev/shm");
    if (!d)
        return;
    struct dirent *ent;
    /* cppcheck-suppress readdirCalled ; readdir_r is deprecated: readdir is thread-safe on a stream of one's own */
    while ((ent = readdir(d)) != NULL) {
        if (strncmp(ent->d_name, SHM_PREFIX, sizeof SHM_PREFIX - 1) != 0)
            continue;
        char *end;
        long pid = strtol(ent->d_name + sizeof SHM_PREFIX - 1, &end, 10);
        if (pid <= 0 || *end != '-')
            continue;
        struct stat st; /* only our own: /dev/shm may be shared with other users' jobs */
        if (fstatat(dirfd(d), ent->d_name, &st, 0) != 0 || st.st_uid != geteuid())
            continue;
        if (kill((pid_t)pid, 0) != 0 && errno == ESRCH) {
            char path[300];
            snprintf(path, sizeof path, "/%s", ent->d_name);
            shm_unlink(path);
        }
    }
    closedir(d);
}
