#!/usr/bin/env bash
# One call on the GPU machine: install the carried wheels, run the GPU tests, build the scaled
# DeepSeek-V4-Flash bench model and run the standard decode benchmark; everything lands in $OUT.
# Usage (device tool): MOETIER_GIT_SHA=<sha> bash bench/gpu_suite.sh   (carry: .whl)
# Stages can be skipped: SKIP_TESTS=1, SKIP_BENCH=1. BENCH_LAYERS (default 3) sets the model depth;
# GPU_TEST_ARGS adds pytest arguments (e.g. "-k deepseek_v4"); BENCH_ARGS replaces "--profile".
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
export MOETIER_RESULTS=$OUT PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
    echo "git ${MOETIER_GIT_SHA:-unknown}"
    df -h /tmp | tail -1
} > "$OUT/environment.txt" 2>&1
status=0
if [ -z "${SKIP_TESTS:-}" ]; then
    gpu_files=$(grep -l "mark.gpu" tests/test_*.py)
    timeout 300 python3 -m pytest -q -m gpu $gpu_files ${GPU_TEST_ARGS:-} -p no:cacheprovider 2>&1 \
        | tee "$OUT/gpu-tests.log"
    status=${PIPESTATUS[0]}
    echo "gpu tests exit status: $status"
fi
if [ -z "${SKIP_BENCH:-}" ]; then
    model=/tmp/moetier-bench/v4flash-${BENCH_LAYERS:-3}l
    # Progress bars are dropped from the log (carriage returns); the device returns at most 8 files.
    timeout 240 python3 -m moetier.cli make-bench-model --shape deepseek-v4-flash --layers "${BENCH_LAYERS:-3}" \
        --out "$model" --device cuda --force 2>&1 | tr '\r' '\n' | grep -v '^writing' | tee "$OUT/bench.log"
    timeout 420 python3 -m moetier.cli bench decode --model "$model" --streams 1,2,4 --cache-fraction 0.05 \
        --policy lfu ${BENCH_ARGS---profile} --out "$OUT" 2>&1 | tr '\r' '\n' | grep -v '^\(pinning\|loading\)' | tee -a "$OUT/bench.log"
    bench_status=${PIPESTATUS[0]}
    echo "bench exit status: $bench_status"
    [ "$bench_status" -eq 0 ] || status=$bench_status
fi
exit "$status"
