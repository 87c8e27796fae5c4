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
# The runs are what issue 13 still lacks after the first run of 2026-12-03, longest first:
# - RULER's missing cells at 2x and 4x (infinitehip), and the default backend's at 4x;
# - infinitehip at 1x on the tasks with the largest gaps to the default backend, with RoPE
#   extension off, with a 4096 window, and with extension off and every decode step refreshing
#   its masks: at 1x the prefill runs dense, so is the 1x loss the decode steps' remapping, their
#   window (a decode-like query keeps 0.895 of the mass at 16K, 0.955 with the 4096 window:
#   benchmarks/mask_heads.py), or their reused masks;
# - Qwen's passkeys at 1x-4x, and at 8x with a 4096 window (every span still inside 32K);
# - the SmolLM2 settings that did not start;
# - SmolLM2's RULER at 1x-4x, both backends (does it score above chance at 1x);
# - the decode queries' recall, which passkey.py now logs by running infinitehip eagerly (Qwen also
#   at depth 0.7, where its 256K passkeys all failed).
set -uo pipefail
budget=${1:-1000}
source "$(dirname "$0")/gpu_models.sh"
ruler="python3 benchmarks/ruler.py --model qwen2.5-coder-0.5b --n 20 --device gpu --cache $RULER_CACHE"
smol_ruler="python3 benchmarks/ruler.py --model smollm2-135m --n 20 --device gpu --cache $RULER_CACHE"
rest_a="niah_multikey_2 niah_multikey_3 niah_multivalue niah_multiquery vt"
rest_b="cwe fwe qa_1 qa_2"
dirs="--depths 0.1 0.3 0.5 0.7 0.9 --n 4 --no-recall --backends infinitehip"
smol="python3 benchmarks/passkey.py $dirs --lengths 65536 --kv-cache-gib 2"
j() { printf "'%s' " "$@"; }  # each argument one JSON config, quoted for the eval below
runs=(
  # infinitehip at 128K is the long pole (about 10 s a sample beside eight runs): two halves
  ruler-4x-a "$ruler --lengths 131072 --tasks $rest_a --backends infinitehip --kv-cache-gib 13"
  ruler-4x-b "$ruler --lengths 131072 --tasks $rest_b --backends infinitehip --kv-cache-gib 13"
  ruler-2x "$ruler --lengths 65536 --tasks $rest_a $rest_b --backends infinitehip --kv-cache-gib 7"
  ruler-default-4x "$ruler --lengths 131072 --tasks $rest_a $rest_b --backends default --kv-cache-gib 13"
  # the tasks with the largest 1x gaps to the default backend
  ruler-1x-diagnostics "$ruler --lengths 32768 --tasks niah_single_3 niah_multikey_1 niah_multikey_2 vt --backends infinitehip --kv-cache-gib 4 --infinitehip $(j '{"rope_extension": false}' '{"window_tokens": 4096}' '{"rope_extension": false, "refresh_intervals": [1, 1, 1]}')"
  qwen-1x-4x "python3 benchmarks/passkey.py --model qwen2.5-coder-0.5b $dirs --lengths 32768 65536 131072 --kv-cache-gib 2"
  qwen-8x-window "python3 benchmarks/passkey.py --model qwen2.5-coder-0.5b $dirs --lengths 262144 --kv-cache-gib 4 --infinitehip $(j '{"window_tokens": 4096}')"
  smol-settings "$smol --infinitehip $(j '{"prefill_tail_window": 3776}' '{"rope_pruning": "relative"}' '{"rope_pruning": "chunk-indexed"}' '{"preset": "5k"}' '{"dense_layer_keep_tokens": 3072}')"
  smol-ruler "$smol_ruler --lengths 8192 16384 32768 --backends default infinitehip --kv-cache-gib 7"
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
