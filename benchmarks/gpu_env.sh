# Sourced by the benchmarks/gpu_*.sh scripts on the device machine: installs, once per machine,
# vLLM from the bundle carried to ${VLLM_BUNDLE:-/root/b} (shared/device/README.md; skipped when
# none was carried: the kernel tests and the dense baselines but FA3 run without it), the wheels in
# .whl/ (pytest, gguf, xformers) and this package into /tmp/site, and sets the environment.
export PYTHONUNBUFFERED=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_USE_FLASHINFER_SAMPLER=0 \
       HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
OUTDIR=${OUT:-benchmarks/results}
BUNDLE=${VLLM_BUNDLE:-/root/b}
# the pieces benchmarks/gpu_pack.sh cut, carried to /root/p call by call: one tar stream
if ls /root/p/piece.* > /dev/null 2>&1; then
  mkdir -p "$BUNDLE" && cat /root/p/piece.* | tar -xf - -C "$BUNDLE" && rm -rf /root/p
fi
if [ -f "$BUNDLE/install.sh" ] && ! PYTHONPATH=/tmp/site python3 -c "import vllm" 2>/dev/null; then
  bash "$BUNDLE/install.sh" "$BUNDLE" /tmp/site > /tmp/install.log 2>&1 \
    || { echo "vLLM bundle install failed:"; tail -5 /tmp/install.log; }
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
python3 -m pip install -q --no-deps --no-build-isolation --no-index --upgrade --target /tmp/site . 2>&1 | tail -2
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
