#!/usr/bin/env bash
# Third of three device calls (shared/device/README.md): install the vLLM bundle carried into
# /root/b, this package and pytest, then run the GPU tests of the backend inside vLLM.
#   run(carry=[".whl"], command="bash benchmarks/gpu_vllm_run.sh")
set -uo pipefail
bash /root/b/install.sh /root/b /tmp/site > /tmp/install.log 2>&1 || { tail -20 /tmp/install.log; exit 1; }
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH VLLM_USE_FLASHINFER_SAMPLER=0 \
       HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site .
OUTDIR=${OUT:-benchmarks/results}
# not `python3 -m pytest`: the checkout's vllm_infinitehip lacks the kernels/ package-dir mapping
python3 /tmp/site/bin/pytest -q -x -p no:cacheprovider --import-mode=importlib tests/gpu \
  2>&1 | tee "$OUTDIR/gpu-vllm-tests.log" | grep -vE "^(INFO|WARNING|DEBUG)" | tail -40
