#!/usr/bin/env bash
# The README's test command: set up .venv if missing or stale, then run the whole CPU test suite.
# With arguments, they go to one pytest run (`bash scripts/test.sh tests/test_config.py -k x`).
# The edit-test loop: `bash scripts/test.sh -m "not slow"` leaves out every engine, server and Ray
# startup and the longest Triton-interpreter tests (about 2 minutes on 2 busy CPU cores).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Every CPU engine's startup profiling samples randomly once, through a sampler vLLM wraps
# in torch.compile: 40 s of Inductor codegen per process (each engine, server and Ray
# worker), for one dummy sample. Eager engines need no compiler; the sampler runs eagerly.
export VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
       VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 TORCHDYNAMO_DISABLE=1
PYTEST=(.venv/bin/python -m pytest -ra)
if [ $# -gt 0 ]; then
  exec "${PYTEST[@]}" "$@"
fi
# The whole suite as two pytest processes side by side: the Triton kernels under the
# interpreter (single-threaded Python, a third of the suite's time) and everything else
# (vLLM engines, servers, Ray). Each module sets TRITON_INTERPRET before Triton's first
# import, which a process that has imported vLLM has already done; apart, neither waits.
INTERPRETED=(tests/test_bank.py tests/test_triton_bsa.py tests/test_triton_decode.py
             tests/test_triton_landmark.py tests/test_triton_prune.py tests/test_triton_slots.py)
log=$(mktemp)
"${PYTEST[@]}" "${INTERPRETED[@]}" > "$log" 2>&1 &
kernels_pid=$!
trap 'kill "$kernels_pid" 2>/dev/null || true' EXIT  # an interrupted run leaves no pytest behind
rest_rc=0
"${PYTEST[@]}" tests "${INTERPRETED[@]/#/--ignore=}" || rest_rc=$?
kernels_rc=0
wait "$kernels_pid" || kernels_rc=$?
echo "==================== the interpreted Triton kernel tests ===================="
cat "$log"
rm -f "$log"
[ "$rest_rc" -eq 0 ] && [ "$kernels_rc" -eq 0 ]
