#!/usr/bin/env bash
# The README's main-job command: set up .venv if missing or stale, then run the CPU demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Every CPU engine's startup profiling samples randomly once, through a sampler vLLM wraps
# in torch.compile: 40 s of Inductor codegen per process (each engine, server and Ray
# worker), for one dummy sample. Eager engines need no compiler; the sampler runs eagerly.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 TORCHDYNAMO_DISABLE=1
exec .venv/bin/python examples/demo.py "$@"
