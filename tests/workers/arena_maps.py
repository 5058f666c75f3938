"""Where a rank's arena buffers live, read from /proc/self/maps: a rank's arena is the mapping of
its shared-memory object "/mp2p-<owner's pid>-<random>-a<owner's rank>", which the owner and
every peer map."""
import os
import re
from pathlib import Path

MAPPING = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) .*/dev/shm/mp2p-(\d+)-[0-9a-f]+-a(\d+)(?: \(deleted\))?$")


def arena_mappings(pid=None):
    """[(start, end, owner pid, owner rank)] of the arenas this process maps; only those owned by
    `pid` when given."""
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        m = MAPPING.match(line)
        if m and (pid is None or int(m.group(3)) == pid):
            out.append((int(m.group(1), 16), int(m.group(2), 16), int(m.group(3)), int(m.group(4))))
    return out


def in_own_arena(t):
    """Whether every byte of t's storage lies in one of this process's own arenas."""
    start = t.untyped_storage().data_ptr()
    end = start + max(t.untyped_storage().nbytes(), 1)
    return any(lo <= start and end <= hi for lo, hi, _, _ in arena_mappings(os.getpid()))
