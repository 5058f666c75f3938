#!/usr/bin/env bash
# The GPU checks, in one call on a lent GPU machine (torch with CUDA already installed there;
# nothing is installed): builds the extension in place, then runs, each under its own limit and
# whatever the others did:
#   gpu_checks      tests/gpu/gpu_checks.py (pytest when present), one rank exchanging with itself
#   two_process     tests/gpu/two_process_checks.py: two processes on one GPU where NCCL allows
#                   it, else the self-loop: exact bytes, 1F1B, debug matching and its cost,
#                   CUDA graphs (replayed against eager; captured after stream-only waits;
#                   abort and close with a live graph), the watchdog (raise, and ending the
#                   job with status 70)
#   gpu_selfloop    benchmarks/gpu_selfloop.py: megatron_p2p against torch's batch_isend_irecv
#                   (bandwidth, time per exchange, host time to post parity/batched exchanges)
# Prints PASS/FAIL with the time of each step, and exits nonzero if any failed. The limits add
# up to 475 s, under the 8 minutes allowed. Results and logs land in $OUT (or ./gpu-results).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-gpu-results}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
status=0
summary=()

# step NAME LIMIT_SECONDS COMMAND...: runs it with a limit, logs to $OUT/NAME.log, notes PASS/FAIL
step() {
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit} s) ==="
    local start=$SECONDS
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    local took=$((SECONDS - start))
    local verdict=PASS
    if [ "$rc" -ne 0 ]; then
        verdict="FAIL (exit $rc$([ "$rc" -eq 124 ] && echo ', past its limit'))"
        status=1
    fi
    echo "=== $verdict $name (${took} s) ==="
    summary+=("$verdict $name (${took} s)")
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
# The NCCL 2.30.7 that tests/gpu/build_nccl.sh built here and that travelled with the tree, unless
# one is named: it allows two ranks on one GPU, where torch's own NCCL may not.
CARRIED=build/nccl/libnccl.so.2
if [ -z "${MEGATRON_P2P_NCCL_LIBRARY:-}" ] && [ -f "$CARRIED" ]; then
    if tests/gpu/build_nccl.sh --check "$CARRIED"; then
        export MEGATRON_P2P_NCCL_LIBRARY="$PWD/$CARRIED"
    else
        echo "the carried $CARRIED does not load here: using the NCCL the loader finds"
    fi
fi
echo "MEGATRON_P2P_NCCL_LIBRARY=${MEGATRON_P2P_NCCL_LIBRARY:-unset, so the loader searches}"
"$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"
step build 90 "$PY" setup.py --quiet build_ext --inplace --build-temp build/gpu-temp
if [ "$status" -ne 0 ]; then
    echo "the extension did not build: nothing else can run"
    exit 1
fi
if "$PY" -c "import pytest" 2>/dev/null; then
    step gpu_checks 115 "$PY" -m pytest -v -rP -p no:cacheprovider --durations=0 tests/gpu/test_gpu_nccl.py
else
    echo "pytest is not installed here: running the checks directly"
    step gpu_checks 115 "$PY" tests/gpu/gpu_checks.py
fi
step two_process 180 "$PY" tests/gpu/two_process_checks.py --out "$OUT" --budget 170
step gpu_selfloop 90 "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/gpu_selfloop.py \
    --out "$OUT/gpu_selfloop.json"

echo "=== summary (${SECONDS} s in all) ==="
printf '%s\n' "${summary[@]}"
exit $status
