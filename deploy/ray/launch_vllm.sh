#!/usr/bin/env bash
# Start `vllm serve` with the InfiniteHiP backend over the Ray cluster of deploy/ray/cluster.yaml:
# tensor parallel within a node, pipeline parallel across nodes, workers placed by vLLM's Ray
# executor. Run it on the head node (a GPU node: vLLM's engine core runs where `vllm serve` does):
#
#   ray exec deploy/ray/cluster.yaml --tmux \
#       'MODEL=Qwen/Qwen2.5-7B-Instruct TP=4 bash /opt/infinitehip-deploy/deploy/ray/launch_vllm.sh'
#
# Settings (environment): MODEL, TP (GPUs per node, default 4), PP (nodes, default 1),
# MAX_MODEL_LEN (default 131072), HIP_CONFIG (the --additional-config JSON), HOST (default
# 127.0.0.1: reach it through `ray attach deploy/ray/cluster.yaml -p 8000`), PORT (8000), and
# INFINITEHIP_API_KEY_FILE (default ~/.infinitehip/api_key; its first key becomes vLLM's API key).
# Extra arguments go to `vllm serve` as they are.
set -euo pipefail

MODEL=${MODEL:-Qwen/Qwen2.5-7B-Instruct}
TP=${TP:-4}
PP=${PP:-1}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-131072}
HIP_CONFIG=${HIP_CONFIG:-'{"infinitehip": {"preset": "3k"}}'}
HOST=${HOST:-127.0.0.1}
PORT=${PORT:-8000}
API_KEY_FILE=${INFINITEHIP_API_KEY_FILE:-$HOME/.infinitehip/api_key}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

die() { echo "launch_vllm.sh: $*" >&2; exit 1; }

[[ "${RAY_AUTH_MODE:-}" == token ]] \
    || die "RAY_AUTH_MODE=token is not set: this cluster runs Ray with token auth (cluster.yaml)"
[[ -s "$API_KEY_FILE" ]] || die "no API key in $API_KEY_FILE (deploy/README.md, step 2)"
if [[ -n "${VLLM_PLUGINS+set}" && ",${VLLM_PLUGINS// /}," != *",infinitehip,"* ]]; then
    die "VLLM_PLUGINS=$VLLM_PLUGINS does not list infinitehip: vLLM would not load the plugin"
fi

# every node: the plugin's entry point, vLLM 0.26.0, Ray 2.58.1
python "$HERE/check_nodes.py" >/dev/null

# the key goes through the environment (not argv, which `ps` shows to every user)
VLLM_API_KEY=$(awk '!/^[[:space:]]*(#|$)/ {print $1; exit}' "$API_KEY_FILE")
[[ -n "$VLLM_API_KEY" ]] || die "no key line in $API_KEY_FILE"
export VLLM_API_KEY
export RAY_ADDRESS=${RAY_ADDRESS:-auto}

exec vllm serve "$MODEL" \
    --attention-backend infinitehip \
    --additional-config "$HIP_CONFIG" \
    --distributed-executor-backend ray \
    --tensor-parallel-size "$TP" \
    --pipeline-parallel-size "$PP" \
    --max-model-len "$MAX_MODEL_LEN" \
    --host "$HOST" \
    --port "$PORT" \
    --disable-fastapi-docs \
    "$@"
