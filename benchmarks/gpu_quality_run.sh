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
# lost). With 12 carry calls (about 150 s with the machine's start) about 1650 s are left:
#   run(carry=[".bundle/pack/NN", ".whl"], command="cp .bundle/pack/NN/* /root/p/ && bash benchmarks/gpu_background.sh start 'bash benchmarks/gpu_quality_run.sh 1000'")
#   run(command="bash benchmarks/gpu_background.sh wait")            (run's default timeout_s)
#   run(command="bash benchmarks/gpu_background.sh wait 420", timeout_s=470)
# $1: seconds after which no run starts another batch of prompts (a batch of 8 at 128K can take
# minutes more on a shared GPU). Each run writes under $RESULTS/<name>/ and logs to
# $RESULTS/<name>.log; results.tgz brings them back, and benchmarks/merge_results.py joins them
# into benchmarks/results (a later cell replaces an earlier one).
# The runs, run 4 on 2026-12-04 (benchmarks/results/quality-gpu-2026-12-04-run4.log: all six
# exited 0; 30 s a sample for infinitehip at 128K), are what issue 13 then lacked, the most needed
# first (six side by side: ten saturated the GPU; with eight, 44 s a sample on 2026-12-03):
# - RULER at 4x, the cells run 3 (2026-12-03) did not reach: infinitehip's niah_multivalue, fwe,
#   qa_2 and vt (8 samples of 20), the default backend's vt and qa_2 (16 of 20);
# - then in the same slots, the 2x cells measured under the former rule (queries inside the
#   trained length remapped too, before 444b441), so that 2x is measured as 1x now is:
#   niah_single_1-3, niah_multikey_1-3, niah_multivalue, niah_multiquery, vt, cwe;
# - RULER at 2x with a 4096-token window on the four tasks 2x lost most against 1x (niah_single_2
#   95 -> 65, niah_multikey_1 75 -> 20, niah_multikey_2 20 -> 0, qa_1 15 -> 0; run 3 reached 8
#   samples of niah_single_2: 87.5): on the CPU that window lifts the decode steps' recall under
#   the remapping from 0.84 to 0.96 at 2x (SmolLM2).
# Inputs on a fresh checkout (35 min): `bash benchmarks/gpu_prep.sh qwen ruler -- --model
# qwen2.5-coder-0.5b --lengths 131072 --tasks niah_multivalue fwe qa_2 vt`, then
# `.venv/bin/python benchmarks/ruler.py --generate-only --model qwen2.5-coder-0.5b --lengths 65536`
# and `bash benchmarks/gpu_pack.sh qwen ruler` again.
# The kernels these runs use passed compiled on the H200 on 2026-12-03 (115 tests,
# benchmarks/results/gpu-tests-2026-12-03-remap.log, at e19ec74); a change to kernels/ since then
# needs `bash benchmarks/gpu_e2e_run.sh tests` (or the pytest line of e19ec74's version of this
# script) before these runs mean anything.
set -uo pipefail
budget=${1:-1000}
source "$(dirname "$0")/gpu_models.sh"
ruler="python3 benchmarks/ruler.py --model qwen2.5-coder-0.5b --n 20 --device gpu --cache $RULER_CACHE"
j() { printf "'%s' " "$@"; }  # each argument one JSON config, quoted for the eval below
ih2="$ruler --lengths 65536 --backends infinitehip --kv-cache-gib 7 --tasks"
runs=(
  ruler-4x-a "$ruler --lengths 131072 --tasks niah_multivalue --backends infinitehip --kv-cache-gib 13 --out \$RESULTS/ruler-4x-a1; $ih2 niah_single_1 niah_single_2 niah_single_3"
  ruler-4x-b "$ruler --lengths 131072 --tasks fwe --backends infinitehip --kv-cache-gib 13 --out \$RESULTS/ruler-4x-b1; $ih2 niah_multikey_1 niah_multikey_2 niah_multikey_3"
  ruler-4x-c "$ruler --lengths 131072 --tasks qa_2 --backends infinitehip --kv-cache-gib 13 --out \$RESULTS/ruler-4x-c1; $ih2 niah_multivalue niah_multiquery"
  ruler-4x-d "$ruler --lengths 131072 --tasks vt --backends infinitehip --kv-cache-gib 13 --out \$RESULTS/ruler-4x-d1; $ih2 vt cwe"
  ruler-default-4x "$ruler --lengths 131072 --tasks vt qa_2 --backends default --kv-cache-gib 13"
  ruler-2x-window "$ih2 niah_single_2 niah_multikey_1 niah_multikey_2 qa_1 --infinitehip $(j '{"window_tokens": 4096}')"
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
