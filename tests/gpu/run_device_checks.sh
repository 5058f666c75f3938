#!/usr/bin/env bash
# The device checks, in one call on a lent GPU machine (torch with CUDA already installed there;
# nothing is installed), or on the model of libcuda and libnccl under tests/fakes/ with --model
# (the dry run, which `make test` runs: tests/test_device_script.py). Each step runs under its own
# limit, whatever the others did:
#   build          the extension, in place (GPU only: on the model, make has built it)
#   gpu_checks     tests/gpu/gpu_checks.py (pytest when present), one rank exchanging with itself
#                  (GPU only: it drives torch.cuda directly)
#   two_process    tests/gpu/two_process_checks.py: two processes on one GPU where NCCL allows it,
#                  falling back to NCCL_CUMEM_ENABLE=0, then to the self-loop: exact bytes, 1F1B,
#                  debug matching, CUDA graphs, the watchdog, the naive ring, a silent and a killed
#                  peer, a size mismatch, replay of shipped programs, megatron-core's and torch's
#                  pipeline schedules (the same steps on the model, with sizes up to 1 MiB)
#   rma            tests/test_nccl_model_rma.py: NCCL's one-sided calls (windows, ncclPutSignal,
#                  ncclWaitSignal, hostRmaSupport) between two processes on one GPU, with
#                  tests/c/nccl_rma_check.c built against the real libnccl and libcuda; on the
#                  model, the same tests against tests/fakes/
#   gpu_exchange   benchmarks/gpu_exchange.py on the ranks two_process ran: megatron_p2p against
#                  torch's batch_isend_irecv over the same libnccl (GPU only: needs torch's NCCL)
# Prints PASS/FAIL with the time of each step, then a table of every check's verdict on the model
# beside the GPU's (the model's from the dry run's results, when they travelled with the tree, in
# build/device-dry-run/), and exits nonzero if any failed. The GPU limits add up to 475 s, under
# the 8 minutes allowed. Results and logs land in $OUT (default ./gpu-results, or
# build/device-dry-run with --model).
# Carry to the GPU machine (it reaches no package index) what `make gpu-carry [NCCL_LIB=FILE]`
# prepares, build/gpu-site (megatron-core) and build/nccl (NCCL 2.30.7), and build/device-dry-run
# (make test leaves it).
set -uo pipefail
cd "$(dirname "$0")/../.."
MODEL=0
if [ "${1:-}" = "--model" ]; then
    MODEL=1
elif [ -n "${1:-}" ]; then
    echo "usage: $0 [--model]" >&2
    exit 2
fi
DRY_RUN=build/device-dry-run
OUT="${OUT:-$([ $MODEL = 1 ] && echo $DRY_RUN || echo gpu-results)}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-$([ $MODEL = 1 ] && [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}"
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

gpu_only() {
    echo "=== $1: not run on the model ($2) ==="
    summary+=("GPU ONLY $1 ($2)")
}

if [ $MODEL = 1 ]; then
    echo "the dry run: the model of libcuda and libnccl under tests/fakes/ (build/fakes)"
    gpu_only build "make builds the extension"
    gpu_only gpu_checks "it drives torch.cuda directly"
    # The model shares 2 cores with the rest of the suite: its jobs get their full limits (a hang still ends).
    step two_process 270 "$PY" tests/gpu/two_process_checks.py --model --out "$OUT" --budget 260
    step rma 60 "$PY" -m pytest -q -p no:cacheprovider tests/test_nccl_model_rma.py
    gpu_only gpu_exchange "it times torch's own NCCL, which a CPU build of torch lacks"
else
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
    # megatron-core, where it travelled with the tree (make gpu-carry)
    [ -d build/gpu-site ] && export PYTHONPATH="$PWD/build/gpu-site${PYTHONPATH:+:$PYTHONPATH}"
    "$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"
    step build 45 "$PY" setup.py --quiet build_ext --inplace --build-temp build/gpu-temp
    if [ "$status" -ne 0 ]; then
        echo "the extension did not build: nothing else can run"
        exit 1
    fi
    if "$PY" -c "import pytest" 2>/dev/null; then
        step gpu_checks 60 "$PY" -m pytest -v -rP -p no:cacheprovider --durations=0 tests/gpu/test_gpu_nccl.py
    else
        echo "pytest is not installed here: running the checks directly"
        step gpu_checks 60 "$PY" tests/gpu/gpu_checks.py
    fi
    step two_process 250 "$PY" tests/gpu/two_process_checks.py --out "$OUT" --budget 240
    # The ranks and NCCL settings two_process ran on; torch's NCCL over the same library.
    read -r NPROC PATH_ENV < <("$PY" -c "import json, sys; s = json.load(open(sys.argv[1])); print(s['ranks'], ' '.join(s.get('path_env', [])))" "$OUT/two_process.json" 2>/dev/null || echo "1")
    # NCCL's one-sided calls, linked against the NCCL in use (2.29 or later has them) and libcuda.
    NCCL_SO="${MEGATRON_P2P_NCCL_LIBRARY:-$("$PY" -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null)}"
    mkdir -p build/rma
    if gcc -std=c11 -O2 -Icsrc -o build/rma/nccl_rma_check tests/c/nccl_rma_check.c -L"$(dirname "$NCCL_SO")" \
        -l:libnccl.so.2 -l:libcuda.so.1 -Wl,-rpath,"$(dirname "$NCCL_SO")" -ldl; then
        if "$PY" -c "import pytest" 2>/dev/null; then
            step rma 30 env ${PATH_ENV:-} NCCL_MULTI_RANK_GPU_ENABLE=1 MEGATRON_P2P_RMA_CHECK="$PWD/build/rma/nccl_rma_check" \
                "$PY" -m pytest -v -rA -p no:cacheprovider tests/test_nccl_model_rma.py
        else  # what each scenario found, for the note; the verdicts need pytest
            step rma 30 env ${PATH_ENV:-} NCCL_MULTI_RANK_GPU_ENABLE=1 sh -c 'for s in properties exchange order early refusals; do build/rma/nccl_rma_check $s || exit 1; done'
        fi
    else
        echo "=== FAIL rma: tests/c/nccl_rma_check.c did not link against $NCCL_SO and libcuda.so.1 ==="
        summary+=("FAIL rma (no build against $NCCL_SO)")
        status=1
    fi
    step gpu_exchange 90 env ${PATH_ENV:-} NCCL_MULTI_RANK_GPU_ENABLE=1 LD_PRELOAD="${MEGATRON_P2P_NCCL_LIBRARY:-}" \
        "$PY" -m torch.distributed.run --standalone --nproc-per-node "${NPROC:-1}" --local-ranks-filter 0 \
        benchmarks/gpu_exchange.py --out "$OUT/gpu_exchange.json"
fi

echo "=== summary (${SECONDS} s in all) ==="
printf '%s\n' "${summary[@]}"
if [ $MODEL = 1 ]; then
    "$PY" tests/gpu/two_process_checks.py --table "$OUT/two_process.json" ""
else
    "$PY" tests/gpu/two_process_checks.py --table "$DRY_RUN/two_process.json" "$OUT/two_process.json"
fi
exit $status
