#!/usr/bin/env bash
# The last device call of an accuracy run (shared/device/README.md), after the pieces of
# `bash benchmarks/gpu_pack.sh smollm2 qwen` arrived call by call (that script says how):
#     run(carry=[".bundle/pack/NN", ".whl"], command="cp .bundle/pack/NN/* /root/p/ && bash benchmarks/gpu_passkey_run.sh --lengths ...")
# Builds the models packed (benchmarks/gpu_models.sh) and runs the passkey harness with the
# arguments given.
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
