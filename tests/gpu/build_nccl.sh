#!/usr/bin/env bash
# Builds a small libnccl.so.2 for the device checks (tests/gpu/run_device_checks.sh takes it through
# MEGATRON_P2P_NCCL_LIBRARY): NCCL 2.30.7, from an NVIDIA/nccl source tree at tag v2.30.7-1 (no NCCL
# code is kept in this repository), for one GPU architecture and only the device functions named,
# then stripped; then checks it (--check, below).
#
#   tests/gpu/build_nccl.sh [options] SRC [OUT]   build from SRC into OUT (default build/nccl)
#   tests/gpu/build_nccl.sh --check LIB           only check LIB: it loads, ncclGetVersion reports
#                                                 23007, it has every symbol csrc/nccl/libraries.c
#                                                 resolves; prints its size and sha256
# Options:
#   --gencode SM      the GPU architecture, as a number: 90 (the default) covers H100 and H200;
#                     NVCC_GENCODE in the environment overrides it with nvcc's own flags
#   --sendrecv-only   ONLY_FUNCS="SendRecv" (about 5.1 MB): no collective at all, so nothing that
#                     runs collectives (torch's ProcessGroupNCCL) may use this library
#   --only-funcs F    NCCL's ONLY_FUNCS (src/device/generate.py); the default is SendRecv and the
#                     Ring/Simple variants of the collectives torch's process groups use (5.6 MB)
#   --jobs N          make -j N (default: the number of cores; about 20 minutes on 2)
#   --dry-run         check SRC and print the make command, build nothing
# OUT receives libnccl.so.2 (stripped), include/nccl.h and BUILD-INFO; NCCL's objects go to
# build/nccl-obj/ (NCCL_OBJ overrides it), one folder per architecture and function set. Both are
# under build/, which git ignores; OUT alone is small enough to carry to a GPU machine.
# Environment: CUDA_HOME (default /usr/local/cuda, else the CUDA around the nvcc on PATH), NVCC.
# The library needs glibc 2.34 or later where it is built and where it is loaded.
set -uo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PY="${PYTHON:-python3}"
TAG=v2.30.7-1
VERSION=2.30.7
TAG_COMMIT=73cf112295c33aee2b895f329f592f2a9b4b0f97  # NVIDIA/nccl's v2.30.7-1
VERSION_CODE=23007
MIN_GLIBC=2.34
COLLECTIVES="SendRecv|AllReduce Sum (f32|u8|u32|u64|f16|bf16) RING SIMPLE|Broadcast RING SIMPLE|AllGather RING SIMPLE|ReduceScatter Sum f32 RING SIMPLE"

die() { echo "build_nccl: $*" >&2; exit 2; }

usage() {
    echo "usage: $0 [options] SRC [OUT] | --check LIB" >&2
    sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
    exit 2
}

# check_lib LIB: the checks, and what the library needs of the machine that loads it.
check_lib() {
    local lib=$1
    [ -e "$lib" ] || die "--check: $lib does not exist"
    if command -v objdump >/dev/null; then
        local glibc glibcxx
        glibc=$(objdump -T "$lib" 2>/dev/null | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1)
        glibcxx=$(objdump -T "$lib" 2>/dev/null | grep -o 'GLIBCXX_[0-9.]*' | sort -uV | tail -1)
        echo "needs of the loading machine: ${glibc:-no GLIBC version} ${glibcxx:-(no GLIBCXX)}; here: $(getconf GNU_LIBC_VERSION 2>/dev/null)"
    fi
    "$PY" "$HERE/check_nccl_lib.py" "$lib" --expect-version "$VERSION_CODE"
}

# version_of SRC: NCCL's version as makefiles/version.mk states it, e.g. 2.30.7-1
version_of() {
    local mk=$1/makefiles/version.mk
    [ -f "$mk" ] || return 1
    awk -F':=' '/^NCCL_MAJOR|^NCCL_MINOR|^NCCL_PATCH|^NCCL_SUFFIX|^PKG_REVISION/ {
        gsub(/[ \t]/, "", $1); gsub(/[ \t]/, "", $2); v[$1] = $2 }
        END { printf "%s.%s.%s%s-%s\n", v["NCCL_MAJOR"], v["NCCL_MINOR"], v["NCCL_PATCH"], v["NCCL_SUFFIX"], v["PKG_REVISION"] }' "$mk"
}

# check_source SRC: refuses anything but NVIDIA/nccl at v2.30.7-1, unmodified.
check_source() {
    local src=$1 found
    [ -d "$src" ] || die "SRC $src is not a directory"
    found=$(version_of "$src") || die "SRC $src has no makefiles/version.mk: not an NCCL source tree"
    [ "$found" = "${TAG#v}" ] || die "SRC $src is NCCL $found (makefiles/version.mk); this script builds ${TAG#v} only"
    if git -C "$src" rev-parse --git-dir >/dev/null 2>&1; then
        local head
        head=$(git -C "$src" rev-parse HEAD 2>/dev/null) || die "SRC $src: git has no HEAD"
        [ "$head" = "$TAG_COMMIT" ] || die "SRC $src is at commit $head, not NVIDIA/nccl's $TAG ($TAG_COMMIT)" \
            "$(git -C "$src" describe --tags --always HEAD 2>/dev/null | sed 's/^/(git describe: /; s/$/)/')"
        git -C "$src" diff --quiet HEAD -- 2>/dev/null || die "SRC $src has local changes to tracked files: build from a clean $TAG"
        echo "source: $src, git commit $head ($TAG)"
    else
        echo "source: $src, NCCL $found by makefiles/version.mk (not a git checkout: the commit cannot be checked)"
    fi
}

glibc_ok() {
    local have
    have=$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}')
    [ -n "$have" ] || die "cannot tell this machine's glibc version (getconf GNU_LIBC_VERSION)"
    [ "$(printf '%s\n%s\n' "$MIN_GLIBC" "$have" | sort -V | head -1)" = "$MIN_GLIBC" ] ||
        die "this machine has glibc $have; NCCL $TAG needs $MIN_GLIBC or later to build"
}

gencode=90
only_funcs="$COLLECTIVES"
jobs=$(nproc 2>/dev/null || echo 2)
dry_run=0
args=()
while [ $# -gt 0 ]; do
    case $1 in
        --check)
            [ $# -eq 2 ] || die "usage: $0 --check LIB"
            check_lib "$2"
            exit $? ;;
        --gencode) [ $# -ge 2 ] || die "--gencode needs a value"; gencode=$2; shift 2 ;;
        --sendrecv-only) only_funcs=SendRecv; shift ;;
        --only-funcs) [ $# -ge 2 ] || die "--only-funcs needs a value"; only_funcs=$2; shift 2 ;;
        --jobs) [ $# -ge 2 ] || die "--jobs needs a value"; jobs=$2; shift 2 ;;
        --dry-run) dry_run=1; shift ;;
        -h|--help) usage ;;
        -*) die "unknown option $1 (see $0 --help)" ;;
        *) args+=("$1"); shift ;;
    esac
done
[ ${#args[@]} -ge 1 ] && [ ${#args[@]} -le 2 ] || usage
[[ "$gencode" =~ ^[0-9]+[a-z]?$ ]] || die "--gencode takes an architecture number such as 90, not $gencode"
[[ "$jobs" =~ ^[1-9][0-9]*$ ]] || die "--jobs takes a positive number, not $jobs"
SRC="$(cd "${args[0]}" 2>/dev/null && pwd)" || die "SRC ${args[0]} is not a directory"
OUT="${args[1]:-$ROOT/build/nccl}"
case $OUT in /*) ;; *) OUT="$PWD/$OUT" ;; esac
GENCODE="${NVCC_GENCODE:--gencode=arch=compute_${gencode},code=sm_${gencode}}"

check_source "$SRC"
glibc_ok
if [ -z "${CUDA_HOME:-}" ]; then
    if [ -x /usr/local/cuda/bin/nvcc ]; then
        CUDA_HOME=/usr/local/cuda
    elif command -v nvcc >/dev/null && [ -f "$(dirname "$(command -v nvcc)")/../include/cuda.h" ]; then
        CUDA_HOME="$(cd "$(dirname "$(command -v nvcc)")/.." && pwd)"
    else
        die "no CUDA toolkit found: set CUDA_HOME (its bin/nvcc, include/ and lib64/)"
    fi
fi
NVCC="${NVCC:-$CUDA_HOME/bin/nvcc}"
[ -x "$NVCC" ] || command -v "$NVCC" >/dev/null || die "no nvcc at $NVCC (set NVCC or CUDA_HOME)"
key=$(printf '%s\n%s\n' "$GENCODE" "$only_funcs" | sha256sum | cut -c1-12)
OBJ="${NCCL_OBJ:-$ROOT/build/nccl-obj}/$key"
make_cmd=(make -C "$SRC" -j"$jobs" src.build BUILDDIR="$OBJ" CUDA_HOME="$CUDA_HOME" NVCC="$NVCC"
          NVCC_GENCODE="$GENCODE" ONLY_FUNCS="$only_funcs")
echo "nvcc: $("$NVCC" --version 2>/dev/null | grep -o 'release [0-9.]*' || echo "$NVCC")"
echo "out: $OUT (objects in $OBJ)"
printf 'make:'; printf ' %q' "${make_cmd[@]}"; echo
if [ "$dry_run" -eq 1 ]; then
    echo "--dry-run: nothing built"
    exit 0
fi

start=$SECONDS
"${make_cmd[@]}" || { echo "build_nccl: make failed (after $((SECONDS - start)) s)" >&2; exit 1; }
built="$OBJ/lib/libnccl.so.$VERSION"
[ -f "$built" ] || die "make succeeded but $built is missing"
mkdir -p "$OUT/include"
strip -o "$OUT/libnccl.so.2" "$built" || die "strip failed"
cp "$OBJ/include/nccl.h" "$OUT/include/nccl.h"
{
    echo "NCCL $TAG from $(git -C "$SRC" rev-parse HEAD 2>/dev/null || echo "$SRC (no git)")"
    echo "NVCC_GENCODE=$GENCODE"
    echo "ONLY_FUNCS=$only_funcs"
    echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(getconf GNU_LIBC_VERSION) in $((SECONDS - start)) s"
    echo "sha256 $(sha256sum "$OUT/libnccl.so.2" | cut -d' ' -f1)"
} > "$OUT/BUILD-INFO"
echo "built $OUT/libnccl.so.2 in $((SECONDS - start)) s"
if [ "$only_funcs" = SendRecv ]; then
    echo "NOTE: SendRecv only: every collective on this library is a no-op that returns wrong data silently;" \
         "nothing that runs collectives (torch's ProcessGroupNCCL) may load it"
else
    echo "NOTE: device functions outside ONLY_FUNCS=\"$only_funcs\" are no-ops that return wrong data silently:" \
         "run collectives on this library only with NCCL_ALGO=Ring NCCL_PROTO=Simple"
fi
check_lib "$OUT/libnccl.so.2"
