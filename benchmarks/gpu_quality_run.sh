#!/usr/bin/env bash
# The long-context quality runs on the H200, side by side: a 0.5B model's prefill leaves most of
# the GPU idle, so one GPU serves several runs at once. Each engine gets a fixed KV cache
# (--kv-cache-gib): vLLM's memory profiling counts the device's free memory, so with shares
# (gpu_memory_utilization) a neighbour's allocations were charged to the engine starting, and
# five of nine runs failed at start on 2026-12-03.
# After the pieces of `bash benchmarks/gpu_pack.sh smollm2 qwen ruler` arrived (that script says
# how), the last call starts it in the background (benchmarks/gpu_background.sh):
#   run(carry=[".bundle/pack/NN", ".whl"], command="cp .bundle/pack/NN/* /root/p/ && bash benchmarks/gpu_background.sh start 'bash benchmarks/gpu_quality_run.sh 1000'")
#   run(command="bash benchmarks/gpu_background.sh wait")
# $1: seconds after which no run starts another batch of prompts. Each run writes under
# $RESULTS/<name>/ and logs to $RESULTS/<name>.log; results.tgz brings them back, and
# benchmarks/merge_results.py joins them into benchmarks/results (a later cell replaces an
# earlier one).
# The runs are what issue 13 still lacks after 2026-12-03, longest first:
# - RULER's missing cells at 2x and 4x, and the default backend's at 4x;
# - infinitehip at 1x with RoPE extension off, with a 4096 window, with the 5k preset's larger
#   budget, and with every decode step refreshing its masks: at 1x the prefill runs dense, so is
#   the 1x loss the decode steps' remapping, their window (a decode-like query keeps 0.895 of the
#   mass at 16K, 0.955 with the 4096 window: benchmarks/mask_heads.py), budget, or reused masks;
# - the SmolLM2 settings that did not start, and Qwen's passkeys at 1x-4x;
# - SmolLM2's RULER at 1x-4x, the default backend at 1x (does it score above chance there);
# - the decode queries' recall, which passkey.py now logs by running infinitehip eagerly (Qwen also
#   at depth 0.7, where its 256K passkeys all failed).
set -uo pipefail
budget=${1:-1000}
source "$(dirname "$0")/gpu_models.sh"
ruler="python3 benchmarks/ruler.py --model qwen2.5-coder-0.5b --n 20 --device gpu --cache $RULER_CACHE"
rest="niah_multikey_2 niah_multikey_3 niah_multivalue niah_multiquery vt cwe fwe qa_1 qa_2"
dirs="--depths 0.1 0.3 0.5 0.7 0.9 --n 4 --no-recall --backends infinitehip"
smol="python3 benchmarks/passkey.py $dirs --lengths 65536 --kv-cache-gib 2"
runs=(
  ruler-4x "$ruler --lengths 131072 --tasks $rest --backends infinitehip --kv-cache-gib 13"
  ruler-2x "$ruler --lengths 65536 --tasks $rest --backends infinitehip --kv-cache-gib 7"
  ruler-default-4x "$ruler --lengths 131072 --tasks $rest --backends default --kv-cache-gib 13"
  ruler-1x-diagnostics "$ruler --lengths 32768 --backends infinitehip --kv-cache-gib 4 --infinitehip '{\"rope_extension\": false}' '{\"window_tokens\": 4096}' '{\"preset\": \"5k\"}' '{\"rope_extension\": false, \"refresh_intervals\": [1, 1, 1]}'"
  smol-a "$smol --infinitehip '{\"prefill_tail_window\": 3776}' '{\"rope_pruning\": \"relative\"}' '{\"rope_pruning\": \"chunk-indexed\"}'"
  smol-b "$smol --infinitehip '{\"preset\": \"5k\"}' '{\"dense_layer_keep_tokens\": 3072}' '{\"window_tokens\": 4096, \"dense_layer_keep_tokens\": 2048}'"
  qwen-1x-4x "python3 benchmarks/passkey.py --model qwen2.5-coder-0.5b $dirs --lengths 32768 65536 131072 --kv-cache-gib 2"
  smol-ruler "python3 benchmarks/ruler.py --model smollm2-135m --n 20 --device gpu --cache $RULER_CACHE --lengths 8192 16384 32768 --backends infinitehip --kv-cache-gib 4"
  smol-ruler-default "python3 benchmarks/ruler.py --model smollm2-135m --n 20 --device gpu --cache $RULER_CACHE --lengths 8192 --backends default --kv-cache-gib 2"
  recall "python3 benchmarks/passkey.py --backends infinitehip --lengths 16384 32768 65536 --depths 0.5 --n 1 --kv-cache-gib 2 --out \$RESULTS/recall; python3 benchmarks/passkey.py --model qwen2.5-coder-0.5b --backends infinitehip --lengths 65536 131072 262144 --depths 0.5 0.7 --n 1 --kv-cache-gib 4"
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
