#!/usr/bin/env bash
# One device call: install this package (no vLLM needed for the kernels), run the GPU kernel
# tests, then the attention benchmark. Results land in $OUT (device tool) or benchmarks/results.
#   run(carry=[".whl"], command="bash benchmarks/gpu_run.sh [contexts...]")
set -uo pipefail
export PYTHONUNBUFFERED=1
OUTDIR=${OUT:-benchmarks/results}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site . 2>&1 | tail -2
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
# not `python3 -m pytest`: that puts the checkout first on sys.path, whose vllm_infinitehip
# lacks the package-dir mapping of kernels/
python3 /tmp/site/bin/pytest -q -x -p no:cacheprovider --import-mode=importlib tests/test_triton_bsa.py tests/test_triton_prune.py 2>&1 | tee "$OUTDIR/gpu-tests.log" | tail -15

python3 benchmarks/attention.py --out "$OUTDIR" ${@:+--contexts "$@"} 2>&1 | tee "$OUTDIR/attention.log" | tail -30
