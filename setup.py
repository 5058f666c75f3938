"""Builds megatron_p2p._C (C11, no CUDA or NCCL at build time) from csrc/'s layers, and, only when
MEGATRON_P2P_TESTING is set (the Makefile's test and benchmark targets), megatron_p2p._testing: the
test and benchmark hooks, kept out of the module users import (as CPython keeps _testcapi)."""
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


def extension(name, *layers, libraries=()):
    """An extension built from the C files of csrc/<layer>/ for each layer; includes are relative to csrc/."""
    return Extension(
        name,
        sources=sorted(f for layer in layers for f in glob.glob(f"csrc/{layer}/*.c")),
        depends=sorted(glob.glob("csrc/*/*.h")),
        include_dirs=["csrc"],
        extra_compile_args=extra_compile,
        extra_link_args=extra_link,
        libraries=list(libraries),
    )


ext_modules = [extension("megatron_p2p._C", "core", "shm", "nccl", "python", libraries=["pthread", "dl"])]
if os.environ.get("MEGATRON_P2P_TESTING"):
    ext_modules.append(extension("megatron_p2p._testing", "testing"))

setup(ext_modules=ext_modules)
