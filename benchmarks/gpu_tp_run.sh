#!/usr/bin/env bash
# Tensor parallelism over Ray on the 2-GPU kind (`nvidia-h200-x2`), in the background
# (benchmarks/gpu_background.sh), after the pieces of `bash benchmarks/gpu_pack.sh ray qwen`
# arrived (that script says how; `ray` packs shared/device's Ray 2.58.1 part, which
# install.sh installs beside vLLM). The start call and the wait calls go in one message:
#   run(kind="nvidia-h200-x2", carry=[".bundle/pack/NN", ".whl"], command="cp .bundle/pack/NN/* /root/p/ && bash benchmarks/gpu_background.sh start 'bash benchmarks/gpu_tp_run.sh 1300'")
#   run(command="bash benchmarks/gpu_background.sh wait")
#   run(command="bash benchmarks/gpu_background.sh wait 420", timeout_s=470)
# $1: seconds for the speed part's engines together (each gets a third). Results under
# $RESULTS: tp-gpu-<date>.{json,png} and the parts' own files in tp-parts/ (benchmarks/tp.py).
set -uo pipefail
budget=${1:-1300}
source "$(dirname "$0")/gpu_models.sh"
nvidia-smi -L
python3 -c "import ray, vllm; print('ray', ray.__version__, 'vllm', vllm.__version__)" \
  || { echo "no Ray on this machine: carry the ray part (gpu_pack.sh ray)"; exit 1; }
[ "$(nvidia-smi -L | wc -l)" -ge 2 ] || { echo "one GPU: tensor parallelism needs two"; exit 1; }
# the greedy part first: short, and the issue's correctness half
python3 benchmarks/tp.py --parts greedy --out "$RESULTS"
python3 benchmarks/tp.py --parts speed --contexts 131072 524288 --budget-s $((budget / 3)) \
  --out "$RESULTS"
