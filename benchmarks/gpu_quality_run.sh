#!/usr/bin/env bash
# The long-context quality runs on the H200, side by side: a 0.5B model's prefill leaves most of
# the GPU idle, so one GPU serves several runs at once. Each engine gets a fixed KV cache
# (--kv-cache-gib): vLLM's memory profiling counts the device's free memory, so with shares
# (gpu_memory_utilization) a neighbour's allocations were charged to the engine starting, and
# five of nine runs failed at start on 2026-12-03.
# After the pieces of `bash benchmarks/gpu_pack.sh qwen ruler` arrived (that script says
# how), the last carry call starts it in the background (benchmarks/gpu_background.sh), and the
# wait calls follow IN THE SAME MESSAGE, so that no gap lets the machine go back (2026-12-03: a
# wait sent after reading the start call's reply found a fresh machine, and the RULER rows were
# lost). With 11 carry calls (about 145 s with the machine's start) about 1650 s are left:
#   run(carry=[".bundle/pack/NN", ".whl"], command="cp .bundle/pack/NN/* /root/p/ && bash benchmarks/gpu_background.sh start 'bash benchmarks/gpu_quality_run.sh 1000'")
#   run(command="bash benchmarks/gpu_background.sh wait")            (run's default timeout_s)
#   run(command="bash benchmarks/gpu_background.sh wait 420", timeout_s=470)
# $1: seconds after which no run starts another batch of prompts (a batch of 8 at 128K can take
# minutes more on a shared GPU). Each run writes under $RESULTS/<name>/ and logs to
# $RESULTS/<name>.log; results.tgz brings them back, and benchmarks/merge_results.py joins them
# into benchmarks/results (a later cell replaces an earlier one).
# The runs are what issue 13 still lacks, the most needed first (eight side by side: ten saturated
# the GPU, and infinitehip's RULER at 128K took 20 s or more a sample):
# - RULER at 1x again, all 13 tasks: queries inside the trained length now attend at true
#   positions (no remapping), which changes infinitehip's 1x score, the targets' reference;
# - RULER's last cells at 2x (fwe had 8 samples) and at 4x (infinitehip, 4 runs of 2 tasks),
#   and the default backend's at 4x (2 runs of 4 tasks);
# - then, in 1x's slot, the reused decode masks at 1x, on the tasks with long answers: the
#   paper's refresh intervals (16, 8, 4), and the last stage refreshed every step (32, 16, 1).
#   Refreshing every stage every step doubled niah_single_3 (30 -> 70, extension off).
#   niah_multikey_2 and niah_single_2 too: benchmarks/ruler_answers.py reads where their wrong
#   numbers leave the truth (35% of the answers that start right go wrong at a block's first
#   token with the reused masks, 1 of 13 with masks refreshed every step);
# - last in that slot, RULER at 2x with a 4096-token window on the four tasks 2x lost most
#   against 1x (niah_single_2 85 -> 65, niah_multikey_1 40 -> 20, niah_multikey_2 15 -> 0,
#   niah_multiquery 76 -> 50): on the CPU that window lifts the decode steps' recall under the
#   remapping from 0.84 to 0.96 at 2x (SmolLM2), and at 1x it gained 7 points on RULER.
# The kernels these runs use passed compiled on the H200 on 2026-12-03 (115 tests,
# benchmarks/results/gpu-tests-2026-12-03-remap.log, at e19ec74); a change to kernels/ since then
# needs `bash benchmarks/gpu_e2e_run.sh tests` (or the pytest line of e19ec74's version of this
# script) before these runs mean anything.
set -uo pipefail
budget=${1:-1000}
source "$(dirname "$0")/gpu_models.sh"
ruler="python3 benchmarks/ruler.py --model qwen2.5-coder-0.5b --n 20 --device gpu --cache $RULER_CACHE"
rest_4x="niah_multikey_3 niah_multivalue niah_multiquery vt cwe fwe qa_1 qa_2"
j() { printf "'%s' " "$@"; }  # each argument one JSON config, quoted for the eval below
# 128K cells in pairs of tasks: a run takes 7-11 s a sample there with its neighbours busy, so the
# 8 missing tasks of one backend in one run (160 samples) would not end inside one session
runs=(
  ruler-1x "$ruler --lengths 32768 --backends infinitehip --kv-cache-gib 4 --out \$RESULTS/ruler-1x-all; $ruler --lengths 32768 --tasks niah_single_3 vt niah_multikey_1 niah_multikey_2 niah_single_2 --backends infinitehip --kv-cache-gib 4 --infinitehip $(j '{"refresh_intervals": [16, 8, 4]}' '{"refresh_intervals": [32, 16, 1]}') --out \$RESULTS/ruler-1x-refresh; $ruler --lengths 65536 --tasks niah_single_2 niah_multikey_1 niah_multikey_2 niah_multiquery --backends infinitehip --kv-cache-gib 7 --infinitehip $(j '{"window_tokens": 4096}')"
  ruler-2x "$ruler --lengths 65536 --tasks fwe qa_1 qa_2 --backends infinitehip --kv-cache-gib 7"
  ruler-4x-a "$ruler --lengths 131072 --tasks niah_multikey_3 niah_multivalue --backends infinitehip --kv-cache-gib 13"
  ruler-4x-b "$ruler --lengths 131072 --tasks niah_multiquery vt --backends infinitehip --kv-cache-gib 13"
  ruler-4x-c "$ruler --lengths 131072 --tasks cwe fwe --backends infinitehip --kv-cache-gib 13"
  ruler-4x-d "$ruler --lengths 131072 --tasks qa_1 qa_2 --backends infinitehip --kv-cache-gib 13"
  ruler-default-4x-a "$ruler --lengths 131072 --tasks niah_multikey_3 niah_multivalue niah_multiquery vt --backends default --kv-cache-gib 13"
  ruler-default-4x-b "$ruler --lengths 131072 --tasks cwe fwe qa_1 qa_2 --backends default --kv-cache-gib 13"
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
