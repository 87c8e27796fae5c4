#!/usr/bin/env bash
# Long-context serving benchmark: `vllm serve --attention-backend infinitehip` at 128K input, then
# `vllm bench serve` (random dataset) at concurrency 1 and 8, and a /metrics scrape after each.
# A recipe for one GPU; not run in CI. Usage:
#   MODEL=meta-llama/Llama-3.1-8B-Instruct bash benchmarks/serve_recipe.sh
# Knobs (environment): MODEL, INPUT_LEN (131072), OUTPUT_LEN (256), NUM_PROMPTS_PER_CONC (4),
# PRESET (3k-fast), KV_DTYPE (fp8), EXTRA_SERVE_ARGS, OUTDIR (benchmarks/results/serve), PORT,
# ATTN_BACKEND (infinitehip; flash_attn runs the same load on vLLM's own backend, the baseline).
# Results: one JSON per concurrency (vLLM's own format: TTFT, TPOT, ITL percentiles, throughput),
# metrics-c<N>.txt (the infinitehip series after that run) and serve.log.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:?set MODEL to a HF model id or path}
INPUT_LEN=${INPUT_LEN:-131072}
OUTPUT_LEN=${OUTPUT_LEN:-256}
NUM_PROMPTS_PER_CONC=${NUM_PROMPTS_PER_CONC:-4}
PRESET=${PRESET:-3k-fast}
KV_DTYPE=${KV_DTYPE:-fp8}
PORT=${PORT:-8123}
OUTDIR=${OUTDIR:-benchmarks/results/serve}
MAX_LEN=$((INPUT_LEN + OUTPUT_LEN + 1024))
mkdir -p "$OUTDIR"
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1

# The recommended 128K flags (docs/serving.md). With infinitehip the server exports its
# vllm:infinitehip_* series on /metrics by itself (a KV connector that moves no KV).
ATTN_BACKEND=${ATTN_BACKEND:-infinitehip}
HIP_ARGS=()
if [ "$ATTN_BACKEND" = infinitehip ]; then
  HIP_ARGS=(--additional-config "{\"infinitehip\": {\"preset\": \"$PRESET\"}}")
fi
vllm serve "$MODEL" --host 127.0.0.1 --port "$PORT" \
  --attention-backend "$ATTN_BACKEND" "${HIP_ARGS[@]}" \
  --max-model-len "$MAX_LEN" --kv-cache-dtype "$KV_DTYPE" \
  --max-num-seqs 8 --max-num-batched-tokens 32768 \
  ${EXTRA_SERVE_ARGS:-} > "$OUTDIR/serve.log" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null || true' EXIT

for _ in $(seq 1200); do
  curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
  kill -0 "$SERVER" 2>/dev/null || { tail -50 "$OUTDIR/serve.log"; exit 1; }
  sleep 1
done

for CONC in 1 8; do
  vllm bench serve --backend vllm --base-url "http://127.0.0.1:$PORT" --model "$MODEL" \
    --dataset-name random --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN" \
    --random-range-ratio 0 --ignore-eos \
    --num-prompts $((CONC * NUM_PROMPTS_PER_CONC)) --max-concurrency "$CONC" \
    --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 \
    --save-result --result-dir "$OUTDIR" \
    --result-filename "${ATTN_BACKEND}-in${INPUT_LEN}-out${OUTPUT_LEN}-c${CONC}.json" \
    --metadata backend="$ATTN_BACKEND" preset="$PRESET" kv_cache_dtype="$KV_DTYPE"
  curl -sf "http://127.0.0.1:$PORT/metrics" | grep -E '^vllm:(infinitehip_|prefix_cache|num_preemptions)' \
    > "$OUTDIR/metrics-c$CONC.txt" || true
done
