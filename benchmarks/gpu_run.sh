#!/usr/bin/env bash
# One device call: the GPU kernel tests, then the attention benchmark. Results land in $OUT
# (device tool) or benchmarks/results. With the vLLM bundle carried to /root/b first (see
# gpu_env.sh), the benchmark's FA3 baseline runs too; the xformers wheel rides in .whl/.
#   run(carry=[".whl"], command="bash benchmarks/gpu_run.sh [contexts...]")
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
# not `python3 -m pytest`: that puts the checkout first on sys.path, whose vllm_infinitehip
# lacks the package-dir mapping of kernels/
python3 /tmp/site/bin/pytest -q -x -p no:cacheprovider --import-mode=importlib tests/test_triton_bsa.py tests/test_triton_prune.py 2>&1 | tee "$OUTDIR/gpu-tests.log" | tail -15

# BASELINES="fa3" (or "" for none) narrows the dense baselines; unset runs them all
python3 benchmarks/attention.py --out "$OUTDIR" ${BASELINES+--baselines $BASELINES} ${@:+--contexts "$@"} 2>&1 | tee "$OUTDIR/attention.log" | tail -45
