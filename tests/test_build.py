"""The extension as built: what `make sanitize` promises is what the suite really runs."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_p2p import _C


@pytest.mark.skipif(not os.environ.get("MEGATRON_P2P_EXPECT_SANITIZED"), reason="only under `make sanitize`")
def test_sanitize_runs_the_suite_against_the_instrumented_extension():
    assert Path(_C.__file__).parent.parent.name == "asan", _C.__file__
    maps = Path("/proc/self/maps").read_text()
    assert "libasan" in maps and "libubsan" in maps


def test_importing_needs_no_gpu_library():
    """A fresh interpreter imports the package without mapping libnccl or libcuda: they are
    loaded only when an NCCL communicator is asked for."""
    code = "import megatron_p2p, pathlib; print(pathlib.Path('/proc/self/maps').read_text())"
    maps = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "megatron_p2p" in maps  # the extension itself is mapped
    assert "libnccl" not in maps and "libcuda" not in maps
