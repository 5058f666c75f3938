"""Who can reach a rank's receive arena, observed on two ranks, with two communicators made
directly (like security.py, so that rank 1 can look at rank 0's arena before it attaches):

- observed: rank 0 creates the communicator (with an arena) and waits for rank 1; rank 1 finds
  rank 0's arena in /dev/shm, records its mode and owner and whether its own uid and, when
  `other_uid` is given, that uid can open it; then rank 1 attaches. After creation both list
  what is left in /dev/shm, and rank 0 sends 1 MiB into a buffer from rank 1's arena.
- planted (only with `other_uid`): rank 0 creates a second communicator; rank 1 removes rank 0's
  arena name and creates an object of `other_uid` of the same size under it, then attaches:
  its creation must refuse to map it. Rank 1 then exits, which ends rank 0's wait.

params: other_uid (None: no other-uid probe, no plant), arena_bytes, timeout."""
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import harness
from arena_maps import in_own_arena
from security import find_shm, shm_names

OPEN = """
import json, os, sys
out = {}
for name, flags in (("open_rw", os.O_RDWR), ("open_ro", os.O_RDONLY)):
    try:
        os.close(os.open(sys.argv[1], flags))
        out[name] = "ok"
    except OSError as exc:
        out[name] = os.strerror(exc.errno)
print(json.dumps(out))
"""
PLANT = ("import os, sys; fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600); "
         "os.ftruncate(fd, int(sys.argv[2]))")


def as_uid(uid):
    return [] if uid is None else ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]


def run_python(uid, source, *args):
    done = subprocess.run([*as_uid(uid), os.path.realpath(sys.executable), "-I", "-c", source, *args],
                          capture_output=True, text=True, cwd="/", timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"python as uid {uid} failed: {done.stderr}")
    return done.stdout


def observed(mp, torch, store, me, params):
    out: dict[str, Any] = {}
    if me == 0:
        name = mp._C.new_unique_id()
        store.set("arena-security/observed", json.dumps({"pid": os.getpid(), "name": name}))
        comm = mp._C.Communicator("shm", name, 0, [0, 1], timeout=params["timeout"], arena_bytes=params["arena_bytes"])
    else:
        rank0 = json.loads(store.get("arena-security/observed"))
        arena = find_shm(rank0["pid"], arenas=True)
        st = arena.stat()
        out.update(rank0_pid=rank0["pid"], arena=arena.name, mode=st.st_mode & 0o7777, owner=st.st_uid,
                   size=st.st_size, own_uid=json.loads(run_python(None, OPEN, str(arena))))
        if params["other_uid"] is not None:
            out["other_uid"] = json.loads(run_python(params["other_uid"], OPEN, str(arena)))
        comm = mp._C.Communicator("shm", rank0["name"], 1, [0, 1], timeout=params["timeout"],
                                  arena_bytes=params["arena_bytes"])
    store.set(f"arena-security/pid{me}", str(os.getpid()))
    pids = [int(store.get(f"arena-security/pid{r}")) for r in (0, 1)]
    out["arenas_after_init"] = [n for pid in pids for n in shm_names(pid, arenas=True)]
    n = mp._C.ARENA_WAIT_BYTES // 4  # its sender waits for the answer, whichever rank posts first
    if me == 0:
        comm.isend(torch.arange(n, dtype=torch.float32), 1).wait()
    else:
        buf = comm.empty((n,), torch.float32)
        before = comm.stats()["received_by_path"]["arena"]
        comm.irecv(buf, 0).wait()
        by_arena = comm.stats()["received_by_path"]["arena"] - before
        out["received"] = {"in_arena": in_own_arena(buf), "by_arena": by_arena,
                           "exact": bool(torch.equal(buf, torch.arange(n, dtype=torch.float32)))}
    comm.close()
    return out


def planted(mp, store, me, params):
    if me == 0:
        name = mp._C.new_unique_id()
        store.set("arena-security/planted", json.dumps({"pid": os.getpid(), "name": name}))
        return {"create": harness.caught(lambda: mp._C.Communicator(
            "shm", name, 0, [0, 1], timeout=params["timeout"], arena_bytes=params["arena_bytes"]).close())}
    rank0 = json.loads(store.get("arena-security/planted"))
    arena = find_shm(rank0["pid"], arenas=True)
    arena.unlink()
    run_python(params["other_uid"], PLANT, str(arena), str(params["arena_bytes"]))
    st = arena.stat()
    out: dict[str, Any] = {"planted": arena.name, "planted_owner": st.st_uid}
    out["create"] = harness.caught(lambda: mp._C.Communicator(
        "shm", rank0["name"], 1, [0, 1], timeout=params["timeout"], arena_bytes=params["arena_bytes"]).close())
    out["left"] = shm_names(rank0["pid"], arenas=True)
    for name in out["left"]:  # the planted object, if creation kept it
        (Path("/dev/shm") / name).unlink(missing_ok=True)
    return out


def body(params):
    import torch

    import megatron_p2p as mp
    from megatron_p2p.communicator import _env_rendezvous

    store = _env_rendezvous()[0]
    me = int(os.environ["RANK"])
    out = {"pid": os.getpid(), "uid": os.getuid(), "observed": observed(mp, torch, store, me, params)}
    if params["other_uid"] is not None:
        out["planted"] = planted(mp, store, me, params)
    return out


harness.run(body)
