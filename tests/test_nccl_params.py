"""NCCL's parameters from NCCL's conf files, not only the environment. NCCL 2.30.7 copies
NCCL_CONF_FILE's file (else $HOME/.nccl.conf), then /etc/nccl.conf, into the environment with
setenv(..., 0) at its first ncclInitEnv (src/misc/param.cc initEnvFunc, setEnvFile; src/init.cc),
which rank 0's ncclGetUniqueId runs and the other ranks' first ncclCommInitRankConfig runs. So a
check of the environment alone passes on ranks != 0 when a conf file sets NCCL_COMM_BLOCKING=1, and
their init then blocks for good (csrc/nccl/nccl_param.c says the rest).

Two layers: the backend over the model (tests/fakes/libnccl.c loads the conf files as NCCL does),
and the parser alone (tests/c/nccl_param_read.c over csrc/nccl/nccl_param.c), for the line format,
the order of the files and the releases that differ."""
from __future__ import annotations

import os
import pwd
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, run_job

FAKES = ROOT / "build" / "fakes"
FAKE_ENV = {
    "MEGATRON_P2P_NCCL_LIBRARY": str(FAKES / "libnccl.so.2"),
    "MEGATRON_P2P_CUDA_LIBRARY": str(FAKES / "libcuda.so.1"),
    "MEGATRON_P2P_ASYNC_ERROR_HANDLING": "raise",
}
BLOCKING = "NCCL_COMM_BLOCKING"
REFUSED = "NCCL_COMM_BLOCKING=1 in NCCL's conf file {} makes NCCL's communicators blocking"
JOB_LIMIT = 60.0  # a rank whose init blocks would hold the job until this kills it
CREATE_TIMEOUT = 30.0


@pytest.fixture
def clean_env(monkeypatch, tmp_path) -> Path:
    """No NCCL parameter from the caller's environment, and a HOME of the test's own (no
    ~/.nccl.conf unless the test writes one); returns that HOME."""
    for name in [k for k in os.environ if k.startswith("NCCL_")]:
        monkeypatch.delenv(name)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    return home


def job(env: dict[str, str]) -> list[dict[str, Any]]:
    if not (FAKES / "libnccl.so.2").exists():
        pytest.fail(f"the fake libraries are not built in {FAKES}: run `make fakes`")
    done = run_job("nccl_model_conf.py", 2, {"timeout": CREATE_TIMEOUT}, timeout=JOB_LIMIT, env={**FAKE_ENV, **env})
    return [r["value"] for r in done.ok()]


def write(path: Path, text: str) -> str:
    path.write_bytes(text.encode())
    return str(path)


# ---- the backend over the model ---------------------------------------------------------------

@pytest.mark.parametrize("where", ["NCCL_CONF_FILE", "home"])
def test_a_conf_file_that_makes_nccl_blocking_is_refused_on_every_rank(clean_env, tmp_path, where):
    """Rank 0 has loaded the file (its ncclGetUniqueId) and rank 1 has not: both must refuse, and
    name the file. Before the check read the files, rank 1 passed it and its init blocked."""
    if where == "home":
        conf, text, env = write(clean_env / ".nccl.conf", "NCCL_COMM_BLOCKING=1x\n"), "1x", {}
    else:
        conf = write(tmp_path / "nccl.conf", "# the test's\r\nNCCL_DEBUG=WARN\r\nNCCL_COMM_BLOCKING=1\r\n")
        text, env = "1", {"NCCL_CONF_FILE": conf}
    ranks = job(env)
    for v in ranks:
        assert v["create"]["type"] == "P2PError", v
        assert REFUSED.format(conf) in v["create"]["msg"], v["create"]["msg"]
        assert v["create"]["elapsed"] < CREATE_TIMEOUT, v["create"]
    # The model copied the file into rank 0's environment at ncclGetUniqueId, as NCCL does; rank 1
    # refused before any NCCL call that reads a parameter.
    assert [v["environ"] for v in ranks] == [text, None], ranks


@pytest.mark.parametrize("files, env, environ", [
    pytest.param({"conf": "NCCL_COMM_BLOCKING=0\n"}, {}, "0", id="conf-file-sets-0"),
    pytest.param({"conf": "NCCL_COMM_BLOCKING=1\n"}, {BLOCKING: "0"}, "0", id="environment-0-over-file-1"),
    pytest.param({"conf": "NCCL_COMM_BLOCKING=1\n"}, {BLOCKING: ""}, "", id="empty-environment-over-file-1"),
    pytest.param({"conf": "NCCL_DEBUG=WARN\n", "home": "NCCL_COMM_BLOCKING=1\n"}, {}, None,
                 id="conf-file-replaces-home"),
    pytest.param({"conf": "NCCL_COMM_BLOCKING = 1\n"}, {}, None, id="spaced-name-is-another-variable"),
])
def test_a_conf_file_that_leaves_nccl_nonblocking_makes_a_communicator(clean_env, tmp_path, files, env, environ):
    """What NCCL would read is not 1: creation succeeds and one exchange delivers exact data. The
    environment wins over the files, even empty (setenv(..., 0)); NCCL_CONF_FILE's file replaces
    ~/.nccl.conf; a name is everything before '=', spaces included."""
    run_env = dict(env)
    if "conf" in files:
        run_env["NCCL_CONF_FILE"] = write(tmp_path / "nccl.conf", files["conf"])
    if "home" in files:
        write(clean_env / ".nccl.conf", files["home"])
    ranks = job(run_env)
    by_rank = {v["rank"]: v for v in ranks if "rank" in v}
    for v in ranks:
        assert v["create"]["type"] is None, v["create"]
        assert v["environ"] == environ, v  # what the model read, as NCCL would
    assert sorted(by_rank) == [0, 1]
    for v in ranks:
        assert v["got"] == by_rank[v["prev"]]["sent"], ranks


# ---- the parser alone ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reader(tmp_path_factory) -> Path:
    binary = tmp_path_factory.mktemp("nccl_param") / "nccl_param_read"
    subprocess.run(["cc", "-std=c11", "-Wall", "-Wextra", "-Werror", "-D_GNU_SOURCE", "-I", str(ROOT / "csrc"),
                    "-o", str(binary), str(ROOT / "tests/c/nccl_param_read.c"), str(ROOT / "csrc/nccl/nccl_param.c")],
                   check=True, capture_output=True, timeout=120)
    return binary


V2_30, V2_29, V2_22 = 23007, 22907, 22203
N = BLOCKING


def read(reader: Path, tmp_path: Path, files: dict[str, str], env: dict[str, str],
         version: int = V2_30) -> tuple[int, str, str | None]:
    """(value, where from, which file: user, home or system) as nccl_param.c reads N, with the
    files written as given: user is NCCL_CONF_FILE's (where env names "{user}"), system stands in
    for /etc/nccl.conf."""
    paths = {"user": tmp_path / "user.conf", "home": tmp_path / "home" / ".nccl.conf", "system": tmp_path / "etc.conf"}
    paths["home"].parent.mkdir(exist_ok=True)
    for key, text in files.items():
        write(paths[key], text)
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("NCCL_")}
    run_env["HOME"] = str(paths["home"].parent)
    run_env.update({k: v.format(user=paths["user"], tmp=tmp_path) for k, v in env.items()})
    done = subprocess.run([str(reader), N, str(version), str(paths["system"])], env=run_env, capture_output=True,
                          text=True, timeout=30, check=True)
    value, source, path = done.stdout.rstrip("\n").split("\t")
    named = next((key for key, p in paths.items() if str(p) == path), None) if path else None
    return int(value), source, named


CONF = {"NCCL_CONF_FILE": "{user}"}


@pytest.mark.parametrize("files, env, expected", [
    pytest.param({"user": f"{N}=0\n"}, {N: "1", **CONF}, (1, "env", None), id="environment-wins"),
    pytest.param({"user": f"{N}=1\n", "system": f"{N}=1\n"}, {N: "", **CONF}, (-1, "env", None),
                 id="empty-environment-hides-every-file"),
    pytest.param({"user": f"{N}=1\n"}, CONF, (1, "file", "user"), id="conf-file"),
    pytest.param({"user": "NCCL_DEBUG=WARN\n", "home": f"{N}=1\n", "system": f"{N}=0\n"}, CONF,
                 (0, "file", "system"), id="conf-file-replaces-home"),
    pytest.param({"home": f"{N}=1\n"}, {"NCCL_CONF_FILE": ""}, (1, "file", "home"), id="empty-conf-file-reads-home"),
    pytest.param({"home": f"{N}=1\n"}, {"NCCL_CONF_FILE": "{tmp}/missing.conf"}, (-1, "unset", None),
                 id="missing-conf-file-skips-home"),
    pytest.param({"home": f"{N}=0x10\n", "system": f"{N}=1\n"}, {}, (16, "file", "home"), id="home-over-system"),
    pytest.param({"system": f"{N}=1\n"}, {}, (1, "file", "system"), id="system"),
    pytest.param({"home": f"{N}=0\n{N}=1\n"}, {}, (0, "file", "home"), id="first-line-wins"),
    pytest.param({"home": f"{N}=\n", "system": f"{N}=1\n"}, {}, (-1, "file", "home"), id="empty-line-hides-system"),
    pytest.param({"home": f"{N}=1\n"}, {N: "1"}, (1, "file", "home"), id="environment-equal-to-file-names-file"),
    pytest.param({}, {}, (-1, "unset", None), id="nowhere"),
])
def test_the_files_are_read_in_nccls_order_and_the_environment_wins(reader, tmp_path, files, env, expected):
    assert read(reader, tmp_path, files, env) == expected


@pytest.mark.parametrize("text, value", [
    (f"{N}=1\n", 1), (f"{N}=1", 1), (f"{N}=1\r\n", 1), (f"{N}= 1\n", 1), (f"{N}=1x\n", 1), (f"{N}=yes\n", 0),
    (f"{N}=1=2\n", 1), (f"# a comment\n{N}=1\n", 1), (f"{N}=99999999999999999999\n", -1),
    (f"{N} = 1\n", None), (f" {N}=1\n", None), (f"#{N}=1\n", None), (f"{N}\n", None), ("=1\n", None),
])
def test_a_line_is_read_as_nccl_reads_it(reader, tmp_path, text, value):
    """src/misc/param.cc setEnvFile: name before the first '=', untrimmed; value after it,
    untrimmed; '#' lines and lines without '=' skipped. src/misc/param.cc ncclLoadParam: strtoll in
    base 0, no end pointer, overflow the default. None: the line sets no NCCL_COMM_BLOCKING."""
    got = read(reader, tmp_path, {"home": text}, {})
    assert got == ((-1, "unset", None) if value is None else (value, "file", "home"))


def test_a_line_longer_than_4095_bytes_reads_as_several_from_nccl_2_30(reader, tmp_path):
    """2.30 reads lines with fgets into 4096 bytes; 2.29 with getline, whole."""
    text = "X" * 4095 + f"{N}=1\n"
    assert read(reader, tmp_path, {"home": text}, {}, V2_30) == (1, "file", "home")
    assert read(reader, tmp_path, {"home": text}, {}, V2_29) == (-1, "unset", None)


def test_before_nccl_2_30_the_home_file_is_the_password_entrys(reader, tmp_path):
    """userHomeDir: getenv("HOME") from 2.30, getpwuid(getuid())->pw_dir before; NCCL_CONF_FILE
    from 2.23 only."""
    if (Path(pwd.getpwuid(os.getuid()).pw_dir) / ".nccl.conf").exists():
        pytest.skip("this user has a ~/.nccl.conf of its own")
    assert read(reader, tmp_path, {"home": f"{N}=1\n"}, {}, V2_29) == (-1, "unset", None)
    assert read(reader, tmp_path, {"user": f"{N}=1\n"}, CONF, V2_29) == (1, "file", "user")
    assert read(reader, tmp_path, {"user": f"{N}=1\n"}, CONF, V2_22) == (-1, "unset", None)
