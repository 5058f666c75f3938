"""Security of the shm transport: who can reach a communicator's segment and a rank's memory.

- Segment names are 128 random bits (hex) after the creator's pid, made without a file (getrandom).
- A live segment is mode 0600, owned by the ranks' uid, and unlinked once every rank has attached.
- Another uid can neither open a live segment nor read a rank's memory (CMA, /proc/<pid>/mem);
  the ranks' own uid can, so each check can fail.
- No rank widens who may ptrace it: PR_SET_PTRACER, if ever called, names a peer rank's pid,
  never PR_SET_PTRACER_ANY.
- A rank refuses to attach to a segment that another uid planted under the expected name.
- A rank's receive arena, which its peers map, is mode 0600, owned by the ranks' uid, opened by
  no other uid, and unlinked once creation returns; a rank refuses to map a peer's arena that
  another uid planted under its name.

One two-rank job (workers/security.py) gives every observation of a live communicator; another
(workers/arena_security.py) every observation of the arenas."""
import errno
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import run_job

OTHER_UID = 65534  # nobody
AS_OTHER_UID = ["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups"]
STRACE_PRCTL = ["strace", "-f", "-qq", "--seccomp-bpf", "-e", "trace=prctl", "-e", "signal=none"]
NAME_BITS = 128
NAME_SAMPLES = 2000


def other_uid_runs_python() -> bool:
    """Whether this machine lets us run this interpreter as OTHER_UID: we are root, setpriv is
    installed, and OTHER_UID may execute the interpreter (its directories may be private)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return False
    done = subprocess.run([*AS_OTHER_UID, os.path.realpath(sys.executable), "-I", "-c", "pass"], cwd="/",
                          capture_output=True, timeout=60)
    return done.returncode == 0


can_switch_uid = other_uid_runs_python()
needs_other_uid = pytest.mark.skipif(not can_switch_uid, reason=f"needs root, setpriv, and an interpreter that uid "
                                     f"{OTHER_UID} may run, to run a process as another uid")
needs_strace = pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace to watch prctl calls")


# ---- names ------------------------------------------------------------------------------------


def name_flaws(names: list[str], pid: int) -> list[str]:
    """What makes `names` guessable: a shape other than /mp2p-<pid>-<hex>, fewer than NAME_BITS
    random bits, a repeat, a shared leading part (a clock or a counter), a bit that hardly
    changes. Empty when they look like independent draws of NAME_BITS random bits."""
    shape = re.compile(rf"/mp2p-{pid}-([0-9a-f]+)")
    matched = [m.group(1) if (m := shape.fullmatch(n)) else None for n in names]
    if None in matched:
        return [f"not /mp2p-{pid}-<hex>: {names[matched.index(None)]}"]
    parts = [p for p in matched if p is not None]
    flaws = []
    if min(len(p) for p in parts) * 4 < NAME_BITS:
        flaws.append(f"only {min(len(p) for p in parts) * 4} random bits")
    if len(set(parts)) < len(parts):
        flaws.append("a name repeats")
    if len({p[:12] for p in parts}) < len(parts):  # 48 bits: a chance repeat is ~1e-8 here
        flaws.append("names share their leading 48 bits")
    bits = [bin(int(p, 16))[2:].zfill(len(p) * 4) for p in parts]
    for i in range(min(len(b) for b in bits)):
        ones = sum(b[i] == "1" for b in bits) / len(bits)
        if not 0.4 < ones < 0.6:  # ~9 standard deviations for 2000 draws
            flaws.append(f"bit {i} is 1 in {ones:.0%} of names")
            break
    return flaws


def test_segment_names_are_128_random_bits_after_the_pid():
    from megatron_p2p import _C

    names = [_C.new_unique_id() for _ in range(NAME_SAMPLES)]
    assert name_flaws(names, os.getpid()) == [], names[:3]


def test_guessable_names_are_reported():
    pid = os.getpid()
    random_names = [f"/mp2p-{pid}-{os.urandom(16).hex()}" for _ in range(NAME_SAMPLES)]
    assert name_flaws(random_names, pid) == []
    counter = [f"/mp2p-{pid}-{i:032x}" for i in range(NAME_SAMPLES)]
    assert "names share their leading 48 bits" in name_flaws(counter, pid)
    clock = [f"/mp2p-{pid}-{int(time.time()):016x}{os.urandom(8).hex()}" for _ in range(NAME_SAMPLES)]
    assert "names share their leading 48 bits" in name_flaws(clock, pid)
    short = [f"/mp2p-{pid}-{os.urandom(12).hex()}" for _ in range(NAME_SAMPLES)]
    assert name_flaws(short, pid) == ["only 96 random bits"]
    assert name_flaws([f"/mp2p-{pid + 1}-{os.urandom(16).hex()}"], pid)


def test_a_name_needs_no_file_descriptor_so_it_is_made_from_getrandom():
    """With every descriptor in use (opening a file fails), a name is still made: it comes from
    getrandom, not from reading /dev/urandom."""
    from megatron_p2p import _C

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
    held: list[int] = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 8, hard))
    try:
        with pytest.raises(OSError, match="Too many open files"):
            while True:
                held.append(os.open(os.devnull, os.O_RDONLY))
        name = _C.new_unique_id()
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert name.startswith("/mp2p-"), name


# ---- a live communicator ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """workers/security.py on 2 ranks: [rank 0's result, rank 1's result]; `trace_dir` holds each
    rank's prctl calls when strace is installed."""
    trace_dir = tmp_path_factory.mktemp("prctl") if shutil.which("strace") else None
    params = {"other_uid": OTHER_UID if can_switch_uid else None,
              "trace_dir": str(trace_dir) if trace_dir else None, "strace": STRACE_PRCTL}
    ranks = run_job("security.py", 2, params=params, timeout=240).ok()
    return [r["value"] for r in ranks] + [trace_dir]


def test_a_live_segment_is_mode_0600_and_owned_by_the_ranks_uid(job):
    rank0, rank1, _ = job
    assert rank1["segment"].startswith(f"mp2p-{rank0['pid']}-")
    assert oct(rank1["mode"]) == oct(0o600)
    assert rank1["owner"] == rank0["uid"] == rank1["uid"]


def test_the_segment_is_unlinked_once_every_rank_has_attached(job):
    """It is there while rank 1 has not attached, and gone as soon as init returns on each rank."""
    rank0, rank1, _ = job
    assert rank1["segment_before_attach"] == [rank1["segment"]]
    assert rank0["segment_after_init"] == [] and rank1["segment_after_init"] == []


def test_the_communicator_works_after_its_name_is_gone(job):
    for res in job[:2]:
        assert res["exchanged_exactly"], res


@needs_other_uid
def test_another_uid_cannot_open_a_live_segment(job):
    rank1 = job[1]
    assert rank1["other_uid"]["uid"] == OTHER_UID
    assert rank1["other_uid"]["open_rw"] == "EACCES" and rank1["other_uid"]["open_ro"] == "EACCES"
    assert rank1["own_uid"]["open_rw"] == "ok" and rank1["own_uid"]["open_ro"] == "ok"


@needs_other_uid
def test_another_uid_cannot_read_a_rank_through_cma(job):
    rank1 = job[1]
    assert rank1["other_uid"]["cma"] == "EPERM"
    assert rank1["own_uid"]["cma"] == rank1["rank0"]["secret"]


@needs_other_uid
def test_another_uid_cannot_read_a_rank_through_proc_mem(job):
    rank1 = job[1]
    assert rank1["other_uid"]["proc_mem"] == "EACCES"
    assert rank1["own_uid"]["proc_mem"] == rank1["rank0"]["secret"]


# ---- ptrace permission ------------------------------------------------------------------------


PTRACER_CALL = re.compile(r"prctl\(PR_SET_PTRACER, ([^,)\s]+)")


def ptracer_grants(trace: str) -> list[str]:
    """The tracer each prctl(PR_SET_PTRACER) of an strace log names (a pid, 0, or
    PR_SET_PTRACER_ANY); "unreadable" for a call this cannot parse."""
    grants = []
    for line in trace.splitlines():
        if "PR_SET_PTRACER" in line:
            m = PTRACER_CALL.search(line)
            grants.append(m.group(1) if m else "unreadable")
    return grants


def wrong_grants(grants: list[str], peer_pids: set[int]) -> list[str]:
    """Grants to anything but a peer rank (0 revokes, which is always fine)."""
    return [g for g in grants if g != "0" and not (g.isdigit() and int(g) in peer_pids)]


@needs_strace
def test_no_rank_lets_anyone_but_a_peer_rank_ptrace_it(job):
    """Every rank ran under strace: any PR_SET_PTRACER call names a peer rank's pid, and none is
    PR_SET_PTRACER_ANY (today the package calls no prctl at all)."""
    ranks, trace_dir = job[:2], job[2]
    for rank, res in enumerate(ranks):
        trace = (trace_dir / f"rank{rank}.strace").read_text()
        # strace pads the pid column to the widest pid it has printed
        assert re.search(rf"^{res['pid']}\s+prctl\(PR_GET_DUMPABLE\)", trace, re.M), \
            f"rank {rank} was not traced to its end:\n{trace}"
        peers = {other["pid"] for other in ranks if other is not res}
        assert wrong_grants(ptracer_grants(trace), peers) == [], trace


GRANTS = """
import ctypes, sys
libc = ctypes.CDLL(None)
PR_SET_PTRACER = 0x59616D61
for tracer in (int(sys.argv[1]), 2**64 - 1, 0):  # a peer, PR_SET_PTRACER_ANY, none
    libc.prctl(PR_SET_PTRACER, ctypes.c_ulong(tracer), 0, 0, 0)
"""


@needs_strace
def test_a_grant_to_any_process_or_to_a_stranger_is_reported(tmp_path):
    """The same strace and parser see a process grant a peer (this one), then anyone, then no one."""
    log = tmp_path / "grants.strace"
    subprocess.run([*STRACE_PRCTL, "-o", str(log), sys.executable, "-I", "-c", GRANTS, str(os.getpid())], check=True,
                   timeout=60)
    grants = ptracer_grants(log.read_text())
    assert grants == [str(os.getpid()), "PR_SET_PTRACER_ANY", "0"], grants
    assert wrong_grants(grants, {os.getpid()}) == ["PR_SET_PTRACER_ANY"]
    assert wrong_grants(grants, set()) == [str(os.getpid()), "PR_SET_PTRACER_ANY"]


# ---- a planted segment ------------------------------------------------------------------------


PLANT = "import os, sys; os.close(os.open(sys.argv[1], os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o666))"


def attach_as_rank_1(name: str, timeout: float) -> tuple[BaseException, float]:
    from megatron_p2p import _C

    start = time.monotonic()
    with pytest.raises(Exception) as raised:
        _C.Communicator("shm", name, 1, [0, 1], timeout=timeout)
    return raised.value, time.monotonic() - start


@pytest.fixture
def segment_name():
    """A fresh name under this process's pid; whatever was made under it is removed afterwards."""
    from megatron_p2p import _C

    name = _C.new_unique_id()
    yield name
    Path("/dev/shm", name.lstrip("/")).unlink(missing_ok=True)


@needs_other_uid
def test_a_rank_refuses_a_segment_planted_by_another_uid(segment_name):
    """Another uid that learns the name (the store has no authentication) and creates the segment
    first must not receive this rank's attach: it is refused at once, naming the owner."""
    subprocess.run([*AS_OTHER_UID, os.path.realpath(sys.executable), "-I", "-c", PLANT, f"/dev/shm{segment_name}"],
                   check=True, timeout=60, cwd="/")
    error, elapsed = attach_as_rank_1(segment_name, timeout=20.0)
    assert "P2PTimeoutError" not in [c.__name__ for c in type(error).__mro__], error
    assert f"uid {OTHER_UID}" in str(error), error
    assert elapsed < 10.0


def test_a_rank_waits_for_a_segment_of_its_own_uid(segment_name):
    """The same unsized segment made by this uid is waited on (rank 0 may still be sizing it)."""
    os.close(os.open(f"/dev/shm{segment_name}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    error, _ = attach_as_rank_1(segment_name, timeout=1.0)
    assert type(error).__name__ == "P2PTimeoutError", error


# ---- receive arenas ---------------------------------------------------------------------------


ARENA_BYTES = 64 << 20


@pytest.fixture(scope="module")
def arena_job():
    """workers/arena_security.py on 2 ranks: [rank 0's result, rank 1's result]."""
    params = {"other_uid": OTHER_UID if can_switch_uid else None, "arena_bytes": ARENA_BYTES, "timeout": 60.0}
    job = run_job("arena_security.py", 2, params=params, timeout=240)
    ranks = [r["value"] for r in job.ok()]
    for name in Path("/dev/shm").glob(f"mp2p-{ranks[0]['pid']}-*"):  # what a failing run planted
        name.unlink(missing_ok=True)
    return ranks


def test_a_live_arena_is_mode_0600_and_owned_by_the_ranks_uid(arena_job):
    rank0, rank1 = arena_job
    observed = rank1["observed"]
    assert re.fullmatch(rf"mp2p-{rank0['pid']}-[0-9a-f]{{32}}-a0", observed["arena"]), observed["arena"]
    assert oct(observed["mode"]) == oct(0o600)
    assert observed["owner"] == rank0["uid"] == rank1["uid"]
    assert observed["size"] == ARENA_BYTES


def test_arenas_are_unlinked_once_creation_returns_and_still_carry_messages(arena_job):
    for rank, res in enumerate(arena_job):
        assert res["observed"]["arenas_after_init"] == [], rank
    assert arena_job[1]["observed"]["received"] == {"in_arena": True, "by_arena": 1, "exact": True}


@needs_other_uid
def test_another_uid_cannot_open_a_live_arena(arena_job):
    observed = arena_job[1]["observed"]
    assert observed["own_uid"] == {"open_rw": "ok", "open_ro": "ok"}
    denied = os.strerror(errno.EACCES)
    assert observed["other_uid"] == {"open_rw": denied, "open_ro": denied}


@needs_other_uid
def test_a_rank_refuses_a_peers_arena_planted_by_another_uid(arena_job):
    """Another uid that removes a rank's arena name (or gets there first) and puts its own
    object there does not receive this rank's messages: the peer refuses to map it, naming the
    owner, at once; the communicator over the ranks' own arenas (above) maps them."""
    planted = arena_job[1]["planted"]
    assert planted["planted_owner"] == OTHER_UID
    raised = planted["create"]
    assert "P2PError" in raised["mro"] and "P2PTimeoutError" not in raised["mro"], raised
    assert f"uid {OTHER_UID}" in raised["msg"] and "arena" in raised["msg"], raised
    assert raised["elapsed"] < 10.0, raised
