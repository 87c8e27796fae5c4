#!/usr/bin/env bash
# Third of three device calls (shared/device/README.md): with the vLLM bundle carried into
# /root/b, run the GPU tests of the backend inside vLLM.
#   run(carry=[".whl"], command="bash benchmarks/gpu_vllm_run.sh")
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
python3 /tmp/site/bin/pytest -q -x -p no:cacheprovider --import-mode=importlib tests/gpu \
  2>&1 | tee "$OUTDIR/gpu-vllm-tests.log" | grep -vE "^(INFO|WARNING|DEBUG)" | tail -40
