#!/usr/bin/env bash
# The long-context quality runs on the H200, side by side: a 0.5B model's prefill leaves most of
# the GPU idle, so one GPU serves several runs at once, each engine with a share of its memory
# (--gpu-memory-utilization; the shares plus what deleted engines keep stay under 1). Started in
# the background (benchmarks/gpu_background.sh), after the models and RULER's samples arrived in
# pieces (benchmarks/gpu_models.sh):
#   run(command="bash benchmarks/gpu_background.sh start 'bash benchmarks/gpu_quality_run.sh 900'")
# $1: seconds after which no run starts another batch of prompts. Each run writes under
# $RESULTS/<name>/ and logs to $RESULTS/<name>.log; benchmarks/merge_results.py joins them.
set -uo pipefail
budget=${1:-900}
source "$(dirname "$0")/gpu_models.sh"
ruler="python3 benchmarks/ruler.py --model qwen2.5-coder-0.5b --n 20 --device gpu --cache $RULER_CACHE"
dirs="--depths 0.1 0.3 0.5 0.7 0.9 --n 4 --no-recall --backends infinitehip"
smol="python3 benchmarks/passkey.py $dirs --lengths 32768 65536 --gpu-memory-utilization 0.06"
qwen="python3 benchmarks/passkey.py --model qwen2.5-coder-0.5b $dirs"
runs=(
  ruler-4x "$ruler --lengths 131072 --backends infinitehip --gpu-memory-utilization 0.16"
  ruler-1x2x "$ruler --lengths 32768 65536 --backends infinitehip --gpu-memory-utilization 0.1"
  ruler-default "$ruler --lengths 32768 65536 131072 --backends default --gpu-memory-utilization 0.14"
  qwen-8x "$qwen --lengths 262144 --gpu-memory-utilization 0.1"
  smol-a "$smol --infinitehip '{}' '{\"window_tokens\": 2048}' '{\"dense_layer_keep_tokens\": 3072}'"
  smol-b "$smol --infinitehip '{\"prefill_tail_window\": 3776}' '{\"rope_pruning\": \"relative\"}' '{\"rope_pruning\": \"chunk-indexed\"}'"
  smol-c "$smol --infinitehip '{\"preset\": \"5k\"}' '{\"window_tokens\": 4096, \"dense_layer_keep_tokens\": 2048}'"
  qwen-1x-4x "$qwen --lengths 32768 65536 131072 --gpu-memory-utilization 0.08"
  recall "python3 benchmarks/passkey.py --backends infinitehip --lengths 16384 32768 65536 --depths 0.5 --n 1 --gpu-memory-utilization 0.06 --out \$RESULTS/recall; python3 benchmarks/passkey.py --model qwen2.5-coder-0.5b --backends infinitehip --lengths 65536 131072 262144 --depths 0.5 --n 1 --gpu-memory-utilization 0.1"
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
  sleep 20  # one engine's memory profiling at a time: others' allocations skew it
done
wait
