"""The main job: SmolLM2-135M (a real model, trained on 8K tokens) answers passkey questions on
4K-7K-token prompts through ``LLM(..., attention_backend="infinitehip")`` on the CPU, with the
sparse path doing the work. Prints each answer, whether it is right, and the sparsity achieved.

    bash scripts/demo.sh        (sets everything up on a fresh machine, then runs this)
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def smollm2_135m() -> Path:
    """SmolLM2-135M-Instruct's directory, from the offline-models helper beside the tests (not
    part of the installed package; loaded from its file, so the checkout never shadows the
    installed ``vllm_infinitehip``)."""
    path = Path(__file__).resolve().parent.parent / "tests" / "helpers" / "offline_models.py"
    spec = importlib.util.spec_from_file_location("offline_models", path)
    helper = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helper)
    return helper.smollm2_135m()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 5632, 7168])
    parser.add_argument("--depths", type=float, nargs="+", default=[0.3])
    # 3k-fast, not the default 3k-5k: its 3.3K decode budget keeps these short prompts' decode
    # sparse too (below sink + window + budget, decode is dense)
    parser.add_argument("--preset", default="3k-fast")
    args = parser.parse_args()

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from vllm_infinitehip.passkey import make_passkey_prompt

    model = smollm2_135m()
    tok = AutoTokenizer.from_pretrained(model)
    prompts = [
        make_passkey_prompt(tok, n, d, seed=i)
        for i, (n, d) in enumerate((n, d) for n in args.lengths for d in args.depths)
    ]
    t0 = time.time()
    llm = LLM(
        str(model),
        attention_backend="infinitehip",
        # Below 16K tokens the CPU's "auto" rule would prefill densely (the reference's sparse
        # prefill is the slower one there: benchmarks/prefill_crossover.py); the demo shows the
        # sparse path, so only the dense threshold applies.
        additional_config={"infinitehip": {"preset": args.preset,
                                           "prefill_dense_threshold": None}},
        max_model_len=8192,
        dtype="float32",
        enforce_eager=True,
        compilation_config={"mode": 0},
        kv_cache_memory_bytes=2 << 30,
        max_num_seqs=len(prompts),
    )
    t1 = time.time()
    llm.collective_rpc("infinitehip_stats", kwargs={"reset": True})  # drop the warm-up run's counts
    outs = llm.generate([p.text for p in prompts], SamplingParams(temperature=0, max_tokens=8))
    t2 = time.time()
    stats = llm.collective_rpc("infinitehip_stats")[0]
    right = 0
    print(f"\n{'tokens':>7} {'depth':>6} {'passkey':>8}  {'answer':<24} ok")
    for p, o in zip(prompts, outs):
        answer = o.outputs[0].text.strip().replace("\n", " ")
        ok = p.is_correct(answer)
        right += ok
        print(f"{p.num_tokens:>7} {p.depth:>6.2f} {p.passkey:>8}  {answer[:24]:<24} {'yes' if ok else 'NO'}")
    print(
        f"\n{right}/{len(prompts)} correct | sparse prefill queries {stats['sparse_prefill_queries']}"
        f", sparse decode queries {stats['sparse_decode_queries']}, dense queries "
        f"{stats['dense_queries']} | attention sparsity {stats['sparsity']:.1%} of the causal "
        f"(query, key) pairs skipped | engine start {t1 - t0:.0f} s, generate {t2 - t1:.0f} s"
    )
    return 0 if right == len(prompts) else 1


if __name__ == "__main__":
    raise SystemExit(main())
