#!/usr/bin/env bash
# The last of the device calls that carry `bash benchmarks/gpu_pack.sh`'s pieces (that script says
# how; gpu_env.sh joins them into /root/b). Since 2026-12-04 the tree is too large to travel beside
# shared/device's own 60 MiB part (.bundle/call1), so its three-call recipe no longer fits here.
# The last call is one of:
#   run(command="bash benchmarks/gpu_e2e_run.sh tests")            kernel + vLLM GPU tests
#   run(command="bash benchmarks/gpu_e2e_run.sh kernel-tests")     the kernel tests alone
#   run(command="bash benchmarks/gpu_e2e_run.sh vllm-tests [-k EXPR]") the vLLM GPU tests alone
#   run(command="bash benchmarks/gpu_e2e_run.sh e2e [e2e.py args]") the end-to-end benchmark
#   run(command="bash benchmarks/gpu_e2e_run.sh attention [contexts]") the kernel benchmark
#   run(command="bash benchmarks/gpu_e2e_run.sh decode-check")  decode kernels' tests, their
#                   per-kernel breakdown at 512K (gated and ungated) and the vLLM graph tests
#   run(command="bash benchmarks/gpu_e2e_run.sh ext-check")     the kernel tests, and the decode
#                   layer's breakdown at 128K past the trained length (relative pruning)
#   run(command="bash benchmarks/gpu_e2e_run.sh prefill-check [args]") one sparse prefill chunk
#                   by kernel, RoPE remapping off and on (benchmarks/prefill_breakdown.py)
#   run(command="bash benchmarks/gpu_e2e_run.sh tier-tests")            the host tier's GPU tests
#   run(command="bash benchmarks/gpu_e2e_run.sh offload [offload.py args]") the host-tier benchmark
# Logs and results land in $OUT.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
what=${1:-tests}; shift || true
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
[ -x /tmp/site/bin/pytest ] && PYTEST_BIN=/tmp/site/bin/pytest || PYTEST_BIN=pytest
PYTEST="$PYTEST_BIN -q -p no:cacheprovider --import-mode=importlib"  # the console script: no checkout on sys.path
case $what in
  tests)
    timeout 240 $PYTEST -x tests/test_triton_decode.py tests/test_triton_bsa.py tests/test_triton_prune.py \
      2>&1 | tee "$OUTDIR/gpu-tests.log" | tail -8
    timeout 330 $PYTEST -x -rA tests/gpu 2>&1 | tee "$OUTDIR/gpu-vllm-tests.log" \
      | grep -E "passed|failed|Error|error|assert|PASSED|FAILED" | grep -vE "^(INFO|WARNING|DEBUG)" | tail -30 ;;
  kernel-tests)
    timeout 300 $PYTEST tests/test_triton_decode.py tests/test_triton_bsa.py tests/test_triton_prune.py \
      2>&1 | tee "$OUTDIR/gpu-tests.log" | tail -8 ;;
  vllm-tests)
    timeout 560 $PYTEST -x -rA tests/gpu "$@" 2>&1 | tee "$OUTDIR/gpu-vllm-tests.log" \
      | grep -E "passed|failed|Error|error|assert|PASSED|FAILED" | grep -vE "^(INFO|WARNING|DEBUG)" | tail -30 ;;
  e2e)
    # e2e.py rewrites its JSON after each engine straight into $OUT, so a call cut off at its
    # limit still returns the engines it finished; /root/e2e carries the rows across calls
    # on the same machine (--merge), and rows of an earlier machine (FLASH_ATTN's long
    # prefills) travel in the tree
    mkdir -p /root/e2e
    [ -n "$(ls /root/e2e/e2e-gpu-* 2>/dev/null)" ] || cp benchmarks/results/e2e-gpu-*.json /root/e2e/ 2>/dev/null
    [ "$OUTDIR" = benchmarks/results ] || cp /root/e2e/e2e-gpu-* "$OUTDIR"/ 2>/dev/null
    python3 benchmarks/e2e.py --out "$OUTDIR" --merge "$@" 2>&1 | tee -a "$OUTDIR/e2e.log" \
      | grep -E "^\[e2e\]|^\||Error|error" | tail -80
    cp "$OUTDIR"/e2e-gpu-* /root/e2e/ ;;
  tier-tests)
    # the host store's CUDA tests (the engine-level ones need the CPU's tiny model), then the
    # tier on/off greedy test through vLLM with CUDA graphs
    timeout 120 $PYTEST -m "not vllm" -k "not offload_selects and not refuses_a_custom" \
      tests/test_offload_config.py 2>&1 | tail -3
    timeout 120 $PYTEST tests/gpu/test_bank_gpu.py tests/test_bank.py tests/test_page_cache.py 2>&1 | tail -3
    timeout 240 $PYTEST -x -rA tests/gpu -k host_tier 2>&1 | tee "$OUTDIR/gpu-tier-tests.log" \
      | grep -E "passed|failed|Error|assert|PASSED|FAILED" | grep -vE "^(INFO|WARNING|DEBUG)" | tail -20 ;;
  offload)
    # results go straight to $OUTDIR (written after each engine), so a cut-short run keeps them
    python3 benchmarks/offload.py --out "$OUTDIR" "$@" 2>&1 | tee "$OUTDIR/offload.log" \
      | grep -E "^\[offload\]|^\||Error|error" | tail -60 ;;
  decode-check)
    timeout 200 $PYTEST tests/test_triton_decode.py tests/test_triton_slots.py 2>&1 \
      | tee "$OUTDIR/gpu-tests.log" | tail -4
    timeout 240 python3 benchmarks/decode_breakdown.py --out "$OUTDIR" --variants default ungated \
      "$@" 2>&1 | tee "$OUTDIR/decode-breakdown.log" | grep -E "^\[breakdown\]|^\||Error" | tail -12
    timeout 300 $PYTEST -x -rA tests/gpu/test_vllm_gpu.py -k "cuda_graphs_on_and_off" \
      2>&1 | tee "$OUTDIR/gpu-vllm-tests.log" | grep -E "passed|failed|Error|assert" \
      | grep -vE "^(INFO|WARNING|DEBUG)" | tail -10 ;;
  ext-check)
    timeout 300 $PYTEST tests/test_triton_decode.py tests/test_triton_bsa.py tests/test_triton_prune.py \
      2>&1 | tee "$OUTDIR/gpu-tests.log" | tail -4
    timeout 240 python3 benchmarks/decode_breakdown.py --out "$OUTDIR" --contexts 131072 \
      --rope-pruning relative --variants default tile64x2 tile128x1w8 "$@" 2>&1 \
      | tee "$OUTDIR/decode-breakdown-ext.log" | grep -E "^\[breakdown\]|^\||Error|    " | tail -30 ;;
  prefill-check)
    timeout 300 python3 benchmarks/prefill_breakdown.py --out "$OUTDIR" "$@" 2>&1 \
      | tee "$OUTDIR/prefill-breakdown.log" | grep -E "^\[prefill\]|^\||Error" | tail -20 ;;
  attention)
    BASELINES=fa3 python3 benchmarks/attention.py --out "$OUTDIR" --baselines fa3 ${@:+--contexts "$@"} \
      2>&1 | tee "$OUTDIR/attention.log" | tail -40 ;;
esac
