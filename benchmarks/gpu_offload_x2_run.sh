#!/usr/bin/env bash
# The host tier past 2M tokens on the 2-GPU kind (`nvidia-h200-x2`: 256 GiB of host memory; one
# GPU used), in the background (benchmarks/gpu_background.sh), with vLLM's bundle carried
# (`bash benchmarks/gpu_pack.sh`, no options; that script says how). Start and waits in one message:
#   run(kind="nvidia-h200-x2", carry=[".bundle/pack/NN", ".whl"], command="cp .bundle/pack/NN/* /root/p/ && bash benchmarks/gpu_background.sh start 'bash benchmarks/gpu_offload_x2_run.sh fp8'")
#   run(command="bash benchmarks/gpu_background.sh wait")
#   run(command="bash benchmarks/gpu_background.sh wait 420", timeout_s=470)
# $1: which part, one per session (a 1.5M-token fp8 prefill through the tier took 334 s on
# 2026-12-03, so 2M-3M take most of a session's 30 minutes):
#   fp8     the largest fp8 context: 3M tokens (183 GiB of KV on the host, 32 GiB bank);
#   bf16    2M tokens of bf16 KV (244 GiB on the host: the machine's memory less a few GiB),
#           a 32 GiB bank;
#   greedy  at 256K (bf16): greedy tokens with a 4 GiB bank and a 64 GiB one, each against the
#           tier off (which a 2M context cannot have: its KV is past the GPU).
# Results: offload-gpu-<date>.json under $RESULTS (rows as benchmarks/offload.py writes them).
set -uo pipefail
# gpu_background.sh start ran gpu_env.sh (installs, environment); this session inherits it
CUDA_VISIBLE_DEVICES=0; export CUDA_VISIBLE_DEVICES  # the second GPU is unused
free -g | head -2
offload="python3 benchmarks/offload.py --out $RESULTS --merge"
case ${1:?fp8, bf16 or greedy} in
  fp8) $offload --contexts 3000000 --engines fp8:32 --host-gib 190 ;;
  bf16) $offload --contexts 2000000 --engines bf16:32 --host-gib 246 ;;
  greedy) $offload --contexts 262144 --engines off bf16:4 bf16:64 --host-gib 40 ;;
  *) echo "unknown part: $1 (fp8, bf16, greedy)"; exit 2 ;;
esac
