"""Builds the one C extension, megatron_p2p._C: C11, no CUDA or NCCL at build time."""
import glob
import os

from setuptools import Extension, setup

extra_compile = ["-fno-omit-frame-pointer", "-std=c11", "-Wall", "-Wextra", "-Werror", "-D_GNU_SOURCE", "-fvisibility=hidden"]
extra_link = []
if os.environ.get("MEGATRON_P2P_SANITIZE"):
    flags = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=undefined", "-O1", "-g"]
    extra_compile += flags
    extra_link += ["-fsanitize=address,undefined"]
else:
    extra_compile += ["-O2"]

setup(
    ext_modules=[
        Extension(
            "megatron_p2p._C",
            sources=sorted(glob.glob("csrc/*.c")),
            depends=sorted(glob.glob("csrc/*.h")),
            extra_compile_args=extra_compile,
            extra_link_args=extra_link,
            libraries=["pthread", "dl"],
        )
    ]
)
