#!/usr/bin/env bash
# The README's test command: set up .venv if missing or stale, then run the whole CPU test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
       VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
exec .venv/bin/python -m pytest -ra "$@"
