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


def test_the_module_users_import_has_no_test_hooks():
    """_C neither scribbles over segments nor opens the benchmark-only null transport: those live
    in megatron_p2p._testing, which the package itself never imports."""
    assert not hasattr(_C, "_corrupt_segment") and not hasattr(_C, "corrupt_segment")
    with pytest.raises(ValueError, match="backend must be 'shm' or 'nccl', got 'null'"):
        _C.Communicator("null", "no-null-in-_C", 0, [0, 1])
    code = "import sys, megatron_p2p; print('megatron_p2p._testing' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_the_testing_module_has_the_hooks():
    from megatron_p2p import _testing

    comm = _testing.null_communicator("testing-module", 0, [0, 1], timeout=5.0)
    assert comm.backend == "null" and isinstance(comm, _C.Communicator)
    with pytest.raises(ValueError, match="live communicator of the shm backend"):
        _testing.corrupt_segment(comm, 1)
    comm.close()
    with pytest.raises(TypeError, match="comm must be a Communicator, not int"):
        _testing.corrupt_segment(3, 1)  # type: ignore[arg-type]
