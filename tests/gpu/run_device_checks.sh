#!/usr/bin/env bash
# The GPU checks, in one call on a lent GPU machine (torch with CUDA already installed there):
# builds the extension in place, runs tests/gpu and the self-loop benchmark. Under 8 minutes.
# Results land in $OUT (or ./gpu-results) when given.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-gpu-results}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"
"$PY" setup.py --quiet build_ext --inplace --build-temp build/gpu-temp || exit 1
status=0
if "$PY" -c "import pytest" 2>/dev/null; then
    timeout 300 "$PY" -m pytest -q -p no:cacheprovider tests/gpu \
        2>&1 | tee "$OUT/gpu_tests.log" || status=1
else
    echo "pytest is not installed here: running the checks directly"
    timeout 300 "$PY" tests/gpu/gpu_checks.py 2>&1 | tee "$OUT/gpu_tests.log" || status=1
fi
timeout 150 "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/gpu_selfloop.py \
    --out "$OUT/gpu_selfloop.json" 2>&1 | tee "$OUT/gpu_selfloop.log" || status=1
exit $status
