#!/usr/bin/env bash
# A later device call of an accuracy run (shared/device/README.md): the vLLM bundle is in /root/b,
# and the models' GGUFs arrive in pieces beside it (benchmarks/gpu_models.sh says which), each
# call's carry within 64 MiB with the tree:
#     run(carry=[".bundle/s1"], command="mkdir -p /root/b && cp -r .bundle/s1/. /root/b/")
#     run(carry=[".bundle/s2"], command="cp -r .bundle/s2/. /root/b/")
#     run(carry=[".bundle/s3"], command="cp .bundle/s3/* /root/b/")
#     (Qwen: run(carry=[".bundle/qN"], command="cp .bundle/qN/* /root/b/") for N in 0..7)
#     run(carry=[".whl"], command="bash benchmarks/gpu_passkey_run.sh --lengths ...")
# Rebuilds the models whose pieces are there and runs the passkey harness with the arguments given.
# Results accumulate in /root/passkey-results across calls (one file per day, rows of every model)
# and are copied to $OUT after each run.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
source "$(dirname "$0")/gpu_models.sh"
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
