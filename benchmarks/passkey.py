"""Passkey retrieval by context length and depth, through vLLM: infinitehip vs the default backend.

    python benchmarks/passkey.py --lengths 4096 8192 16384 --depths 0.1 0.5 0.9 --n 2

For each backend, one engine serves every prompt (``--max-model-len`` = the longest prompt + 512;
the default backend gets the same rotary cache through ``hf_overrides``, and is expected to fail
past the trained length). Writes ``benchmarks/results/passkey-<cpu|gpu>-<date>.json`` with rows
``{model, trained_context, context, depth, backend, accuracy, n}``, a PNG heatmap per backend
(length x depth) beside it, and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

MODELS = {"smollm2-135m": ("vllm_infinitehip.offline_models", "smollm2_135m")}


def run_backend(model: str, backend: str, cells, max_len: int, device: str, hip: dict):
    from tqdm import tqdm
    from vllm import LLM, SamplingParams

    kw: dict = dict(max_model_len=max_len, max_num_seqs=4, max_num_batched_tokens=8192)
    if device == "cpu":
        kw.update(dtype="float32", enforce_eager=True, compilation_config={"mode": 0},
                  kv_cache_memory_bytes=4 << 30)
    if backend == "infinitehip":
        kw.update(attention_backend="infinitehip", additional_config={"infinitehip": hip})
    else:
        kw.update(hf_overrides={"max_position_embeddings": max_len})
    llm = LLM(model, **kw)
    params = SamplingParams(temperature=0, max_tokens=8)
    results = []
    for prompt in tqdm(cells, desc=backend, unit="prompt"):
        out = llm.generate([prompt.text], params, use_tqdm=False)
        results.append(prompt.is_correct(out[0].outputs[0].text))
    del llm
    gc.collect()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(MODELS))
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    parser.add_argument("--n", type=int, default=1, help="prompts per (length, depth)")
    parser.add_argument("--backends", nargs="+", default=["infinitehip", "default"])
    parser.add_argument("--infinitehip", default="{}", help="JSON for additional_config")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()

    import importlib

    import torch
    from transformers import AutoConfig, AutoTokenizer

    from vllm_infinitehip.passkey import make_passkey_prompt

    module, fn = MODELS[args.model]
    model = str(getattr(importlib.import_module(module), fn)())
    trained = AutoConfig.from_pretrained(model).max_position_embeddings
    tok = AutoTokenizer.from_pretrained(model)
    cells = [
        (n, d, make_passkey_prompt(tok, n, d, seed=1000 * i + j))
        for n in args.lengths
        for d in args.depths
        for i, j in [(k, int(d * 100)) for k in range(args.n)]
    ]
    max_len = max(c[2].num_tokens for c in cells) + 512
    device = "gpu" if torch.cuda.is_available() else "cpu"
    hip = json.loads(args.infinitehip)
    rows = []
    for backend in args.backends:
        ok = run_backend(model, backend, [c[2] for c in cells], max_len, device, hip)
        name = backend if backend == "infinitehip" else "default"
        for n in args.lengths:
            for d in args.depths:
                hits = [o for (cn, cd, _), o in zip(cells, ok) if cn == n and cd == d]
                rows.append({"model": args.model, "trained_context": trained, "context": n,
                             "depth": d, "backend": name, "accuracy": sum(hits) / len(hits),
                             "n": len(hits)})
    date = datetime.date.today().isoformat()
    result = {"name": "passkey", "date": date,
              "gpu": torch.cuda.get_device_name() if device == "gpu" else "cpu",
              "command": "python " + " ".join(sys.argv), "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"passkey-{device}-{date}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"{'backend':<12} {'context':>8} " + " ".join(f"d={d:<4}" for d in args.depths))
    for backend in sorted({r["backend"] for r in rows}):
        for n in args.lengths:
            accs = [r["accuracy"] for r in rows if r["backend"] == backend and r["context"] == n]
            print(f"{backend:<12} {n:>8} " + " ".join(f"{a:>6.2f}" for a in accs))
    from plot import plot_passkey  # benchmarks/plot.py, beside this file

    plot_passkey(result, path.with_suffix(".png"))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    raise SystemExit(main())
