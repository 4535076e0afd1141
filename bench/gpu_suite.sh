#!/usr/bin/env bash
# One call on the GPU machine: install the carried wheels, run the GPU tests, write receipts to $OUT.
# Usage (device tool): bash bench/gpu_suite.sh   (carry: .whl)
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
    git rev-parse HEAD 2>/dev/null || true
} > "$OUT/environment.txt" 2>&1
python3 -m pytest -q -m gpu tests -p no:cacheprovider --junitxml="$OUT/gpu-tests.xml" 2>&1 | tee "$OUT/gpu-tests.log"
status=${PIPESTATUS[0]}
echo "gpu tests exit status: $status"
exit "$status"
