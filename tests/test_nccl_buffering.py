"""The most NCCL may buffer of one send (csrc/nccl/nccl_buffering.c), which the stall analysis
treats as buffered: it names a cycle on NCCL only where every send in it is larger. The bound is
read from NCCL's own parameters, the environment and conf files alike, as NCCL 2.30.7 reads them
(channels from src/graph/paths.cc, steps from src/include/device.h, chunks from src/enqueue.cc
and src/init.cc computeBuffSizes)."""
from __future__ import annotations

import os
import subprocess

import pytest
from conftest import ROOT

V2_30 = 23007
KIB, MIB = 1 << 10, 1 << 20


@pytest.fixture(scope="module")
def bound_of(tmp_path_factory):
    """bound_of(env, system_conf_text="") -> bytes, for a process with only these NCCL_ variables."""
    work = tmp_path_factory.mktemp("nccl_buffering")
    binary = work / "nccl_buffered_at_most"
    subprocess.run(["cc", "-std=c11", "-Wall", "-Wextra", "-Werror", "-D_GNU_SOURCE", "-I", str(ROOT / "csrc"),
                    "-o", str(binary), str(ROOT / "tests/c/nccl_buffered_at_most.c"),
                    str(ROOT / "csrc/nccl/nccl_buffering.c"), str(ROOT / "csrc/nccl/nccl_param.c")],
                   check=True, capture_output=True, timeout=120)

    def run(env: dict[str, str], system_conf: str = "") -> int:
        conf = work / "nccl.conf"
        conf.write_text(system_conf)
        run_env = {k: v for k, v in os.environ.items() if not k.startswith("NCCL_")}
        run_env.update(HOME=str(work), **env)
        done = subprocess.run([str(binary), str(V2_30), str(conf)], env=run_env, capture_output=True, text=True,
                              timeout=30, check=True)
        return int(done.stdout)
    return run


@pytest.mark.parametrize("env, expected", [
    pytest.param({}, 64 * 8 * 512 * KIB, id="defaults-64-channels-of-8-nvlink-chunks"),
    pytest.param({"NCCL_MAX_P2P_NCHANNELS": "1", "NCCL_BUFFSIZE": str(MIB)}, MIB, id="one-channel-buffsize-1-mib"),
    pytest.param({"NCCL_MAX_P2P_NCHANNELS": "1"}, 8 * 512 * KIB, id="one-channel"),
    pytest.param({"NCCL_MAX_P2P_NCHANNELS": "3"}, 4 * 8 * 512 * KIB, id="channels-round-up-to-a-power-of-two"),
    pytest.param({"NCCL_MAX_P2P_NCHANNELS": "1000"}, 64 * 8 * 512 * KIB, id="channels-capped-at-maxchannels"),
    pytest.param({"NCCL_MAX_P2P_NCHANNELS": "1", "NCCL_P2P_NET_CHUNKSIZE": str(512 * KIB),
                  "NCCL_BUFFSIZE": str(16 * MIB)}, 8 * MIB, id="net-chunk-doubled-on-arm"),
    pytest.param({"NCCL_MAX_P2P_NCHANNELS": "1", "NCCL_P2P_NET_CHUNKSIZE": str(512 * KIB)}, 4 * MIB,
                 id="chunk-capped-at-a-step-of-buffsize"),
    pytest.param({"NCCL_MAX_P2P_NCHANNELS": "1", "NCCL_BUFFSIZE": str(8 * KIB)}, 16 * KIB,
                 id="ll-threshold-where-simple-holds-less"),
])
def test_the_bound_follows_nccls_parameters(bound_of, env, expected):
    assert bound_of(env) == expected


def test_the_bound_reads_nccls_conf_file_as_nccl_does(bound_of):
    one_channel = "NCCL_MAX_P2P_NCHANNELS=1\nNCCL_BUFFSIZE=1048576\n"
    assert bound_of({}, one_channel) == MIB
    assert bound_of({"NCCL_MAX_P2P_NCHANNELS": "2"}, one_channel) == 2 * MIB  # the environment wins
