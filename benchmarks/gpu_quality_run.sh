#!/usr/bin/env bash
# The long-context quality runs on the H200, side by side: a 0.5B model's prefill leaves most of
# the GPU idle, so one GPU serves several runs at once. Each engine gets a fixed KV cache
# (--kv-cache-gib): vLLM's memory profiling counts the device's free memory, so with shares
# (gpu_memory_utilization) a neighbour's allocations were charged to the engine starting, and
# five of nine runs failed at start on 2026-12-03.
# After the pieces of `bash benchmarks/gpu_pack.sh qwen ruler` arrived (that script says
# how), the last call starts it in the background (benchmarks/gpu_background.sh):
#   run(carry=[".bundle/pack/NN", ".whl"], command="cp .bundle/pack/NN/* /root/p/ && bash benchmarks/gpu_background.sh start 'bash benchmarks/gpu_quality_run.sh 1000'")
#   run(command="bash benchmarks/gpu_background.sh wait")
#   (with run's default timeout_s: its loop ends at 560 s and then packs the results; a call
#   limited to 560 s dies before it packs them)
# $1: seconds after which no run starts another batch of prompts. Each run writes under
# $RESULTS/<name>/ and logs to $RESULTS/<name>.log; results.tgz brings them back, and
# benchmarks/merge_results.py joins them into benchmarks/results (a later cell replaces an
# earlier one).
# The runs are what issue 13 still lacks after the two runs of 2026-12-03, longest first. Ten
# runs side by side saturated the GPU (infinitehip's RULER at 128K: 20 s or more a sample), so
# this plan keeps six:
# - RULER's last cells at 4x (infinitehip, two halves) and at 2x (fwe had 8 samples), and the
#   default backend's at 4x;
# - RULER at 1x again, all 13 tasks: queries inside the trained length now attend at true
#   positions (no remapping), which changes infinitehip's 1x score, the targets' reference;
# - the reused decode masks at 1x, on the tasks with long answers: the paper's refresh intervals
#   (16, 8, 4), and the last stage refreshed every step (32, 16, 1). Refreshing every stage every
#   step doubled niah_single_3 (30 -> 70, extension off).
set -uo pipefail
budget=${1:-1000}
source "$(dirname "$0")/gpu_models.sh"
# The kernels changed since they last ran on a GPU (only queries past the trained length are
# remapped, 2026-12-03: tested under the Triton interpreter only), so they must pass here first.
[ -x /tmp/site/bin/pytest ] && pytest_bin=/tmp/site/bin/pytest || pytest_bin=pytest
# the console script, not `python3 -m pytest`: no checkout on sys.path (gpu_run.sh)
if ! timeout 400 $pytest_bin -q -x -p no:cacheprovider --import-mode=importlib \
    tests/test_triton_decode.py tests/test_triton_bsa.py tests/test_triton_prune.py \
    tests/test_reference_rope.py > "$RESULTS/kernel-tests.log" 2>&1; then
  tail -30 "$RESULTS/kernel-tests.log"; echo "kernel tests failed: no runs"; exit 1
fi
tail -1 "$RESULTS/kernel-tests.log"
# The streaming prefill kernel now holds both bodies behind a run-time branch: its attend time
# against 2026-12-03's (524288, one layer's chunk: 10.2 ms off, 21.7 ms relative)
timeout 300 python3 benchmarks/prefill_breakdown.py --contexts 524288 --rope off relative \
  --variants default --first-stage-block 64 --out "$RESULTS/prefill-breakdown" \
  > "$RESULTS/prefill-breakdown.log" 2>&1
# The decode kernels now choose per row between true and remapped positions: their time against
# decode-breakdown-gpu-2026-12-02-ext (131072, relative: amortized 33.7 us, reuse in a graph 23.2 us)
timeout 200 python3 benchmarks/decode_breakdown.py --contexts 131072 --rope-pruning relative \
  --variants default --out "$RESULTS/decode-breakdown" > "$RESULTS/decode-breakdown.log" 2>&1
ruler="python3 benchmarks/ruler.py --model qwen2.5-coder-0.5b --n 20 --device gpu --cache $RULER_CACHE"
rest_4x="niah_multikey_3 niah_multivalue niah_multiquery vt cwe fwe qa_1 qa_2"
j() { printf "'%s' " "$@"; }  # each argument one JSON config, quoted for the eval below
runs=(
  ruler-4x-a "$ruler --lengths 131072 --tasks niah_multikey_3 niah_multivalue niah_multiquery vt --backends infinitehip --kv-cache-gib 13"
  ruler-4x-b "$ruler --lengths 131072 --tasks cwe fwe qa_1 qa_2 --backends infinitehip --kv-cache-gib 13"
  ruler-2x "$ruler --lengths 65536 --tasks fwe qa_1 qa_2 --backends infinitehip --kv-cache-gib 7"
  ruler-default-4x "$ruler --lengths 131072 --tasks $rest_4x --backends default --kv-cache-gib 13"
  ruler-1x "$ruler --lengths 32768 --backends infinitehip --kv-cache-gib 4"
  ruler-1x-refresh "$ruler --lengths 32768 --tasks niah_single_3 vt niah_multikey_1 --backends infinitehip --kv-cache-gib 4 --infinitehip $(j '{"refresh_intervals": [16, 8, 4]}' '{"refresh_intervals": [32, 16, 1]}')"
)
end=$(($(date +%s) + budget))
# every command of a line gets what is left of the budget when it starts
left='--time-budget $((end - $(date +%s)))'
for ((i = 0; i < ${#runs[@]}; i += 2)); do
  name=${runs[i]} cmd=${runs[i + 1]}
  echo "[$(date +%T)] $name: $cmd"
  mkdir -p "$RESULTS/$name"
  (eval "${cmd//; /" $left; "} --out $RESULTS/$name $left" > "$RESULTS/$name.log" 2>&1
   echo "[$(date +%T)] $name exit $?") &
  sleep 10
done
wait
