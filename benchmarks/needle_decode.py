"""Does a decode step's fresh mask keep the needle? RULER samples on a real model's Q/K (CPU, HF
transformers; no vLLM engine).

    python benchmarks/needle_decode.py benchmarks/results/ruler-samples-gpu.json \\
        --task niah_multikey_1 --context 32768 --config '{"rope_extension": false}' --limit 4

For each chosen sample (the ones whose answer, from the samples file's infinitehip engine with
``--config``, started right and then diverged; ``benchmarks/ruler_answers.py``), the prompt is
followed by the true answer (teacher forcing), and every query that writes one of its digits is
pruned alone, as a decode step's is (b_q = 1, a fresh mask: the refresh-every-step case), through
the reference cascade (``kernels/reference.py`` ``run_stages``) with each layer's parameters at
true positions (the samples' 1× prompts lie inside the trained length). Per layer and answer
digit: the share of the needle's digit tokens the mask keeps (``needle_kept``), dense attention's
softmax mass on them (``needle_mass``: how much the layer reads the needle at all) and the
mask's recall of the dense mass (``recall``). ``--infinitehip`` compares several settings'
cascades on the same Q/K (one forward pass per sample); a setting may name the reference's
research settings (``kernels/reference.py`` ``PruneParams``): ``head_reduction`` values the
kernels do not have (``reduce_heads``: how the heads' chunk scores become one ranking), and
``exact_every_stage`` (every stage scores a chunk by its best key: what the budgets could keep
without representatives). Writes ``needle-decode-cpu.json``,
a PNG (kept share by layer and digit, the first settings) and prints, per settings, sample and
digit, in how many layers the whole needle was kept, and in how many of those that read it
(needle mass > 0.05).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (--model)
import mask_heads  # noqa: E402  (capture_qk)
import ruler_answers  # noqa: E402  (divergence, needle_start)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("samples", type=Path)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b",
                    help="the ruler.py run's --model: " + common.MODEL_HELP)
    ap.add_argument("--task", default="niah_multikey_1", choices=ruler_answers.TASKS)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--config", default='{"rope_extension": false}',
                    help="the infinitehip engine's config in the samples file whose answers pick "
                         "the samples; its settings are the layers' parameters here")
    ap.add_argument("--infinitehip", nargs="+", default=None,
                    help="JSON settings whose cascades are compared on the same Q/K (default: "
                         "--config's); each row names its settings")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--indices", type=int, nargs="+", default=None,
                    help="only these samples (of those chosen), to extend an earlier run")
    ap.add_argument("--cache", type=Path, default=Path(".cache/ruler"),
                    help="ruler.py's --cache, where the samples' prompts are")
    ap.add_argument("--n", type=int, default=20, help="the run's --n")
    ap.add_argument("--seed", type=int, default=42, help="the run's --seed")
    ap.add_argument("--out", type=Path, default=common.RESULTS)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from vllm_infinitehip.backend import layer_prune_params
    from vllm_infinitehip.config import InfiniteHiPConfig

    settings = json.loads(args.config)
    config = json.dumps(settings, sort_keys=True)  # infinitehip rows hold "{}" for the defaults
    rows = [r for r in json.loads(args.samples.read_text())["rows"]
            if r["model"] == common.model_name(args.model) and r["backend"] == "infinitehip"
            and r["task"] == args.task and r["context"] == args.context
            and r["config"] == config]  # fmt: skip
    path, tok, prompt_ids = ruler_answers.run_tokens(args.model, args.cache, args.n, args.seed)
    chosen = []
    for r in sorted(rows, key=lambda r: r["index"]):
        truth = r["outputs"][0]
        kind, j = ruler_answers.answer_kind(truth, r["pred"])
        if r["score"] < 100 and truth.isdigit() and kind == "diverged":
            chosen.append((r["index"], truth, j, r["pred"]))
    if args.indices is not None:
        chosen = [c for c in chosen if c[0] in args.indices]
    chosen = chosen[: args.limit]
    print(f"{len(chosen)} samples whose answer started right and diverged: "
          f"{[(i, t, p.strip()) for i, t, _, p in chosen]}", flush=True)

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    variants = [json.loads(v) for v in args.infinitehip or [args.config]]
    # the reference's research settings (kernels/reference.py PruneParams), not config fields:
    # set on each layer's parameters below
    research = ("head_reduction", "exact_every_stage")
    cfgs = [(json.dumps(v, sort_keys=True), {k: v[k] for k in research if k in v},
             InfiniteHiPConfig.from_user({k: x for k, x in v.items()
                                          if k not in ("rope_extension", *research)}))
            for v in variants]  # fmt: skip
    scale = model.model.layers[0].self_attn.scaling
    date = datetime.date.today().isoformat()
    out = args.out / "needle-decode-cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    result_rows = []
    for index, truth, diverged_at, pred in chosen:
        prompt = prompt_ids(args.task, args.context, index)
        answer_ids = tok(" " + truth, add_special_tokens=False)["input_ids"]
        digit_ids = tok(truth, add_special_tokens=False)["input_ids"]
        start = ruler_answers.needle_start(prompt, digit_ids)
        needle = torch.arange(start, start + len(digit_ids))
        ids = torch.tensor([prompt + answer_ids])
        if ids.shape[1] > model.config.max_position_embeddings:
            ap.error(f"{ids.shape[1]} tokens: past the trained length, where the cascade would "
                     "remap positions; this diagnostic scores at true positions (1x samples)")
        # the queries that write the answer's digits: the last len(truth) positions before its end
        n_q = len(digit_ids)
        positions = list(range(ids.shape[1] - 1 - n_q, ids.shape[1] - 1))
        for layer, (q, k) in enumerate(mask_heads.capture_qk(model, ids, last=n_q + 1)):
            t = torch.arange(k.shape[0])
            for digit, p in enumerate(positions):
                qi = q[digit : digit + 1]
                hkv, hq = k.shape[1], q.shape[1]
                qg = qi.view(hkv, hq // hkv, -1) * scale
                s = torch.einsum("hgd,thd->hgt", qg, k).reshape(hq, -1)
                probs = s.masked_fill(t > p, float("-inf")).softmax(-1)
                for name, research_settings, cfg in cfgs:
                    params = dataclasses.replace(layer_prune_params(cfg, layer, None),
                                                 **research_settings)  # fmt: skip
                    mask, recall = mask_heads.select(params, qi, k, p, scale)
                    result_rows.append({
                        "model": common.model_name(args.model), "task": args.task,
                        "context": args.context,
                        "config": config, "settings": name, "index": index, "truth": truth,
                        "pred": pred.strip(), "diverged_at": diverged_at, "digit": digit,
                        "layer": layer,
                        "needle_kept": round(float(mask[0, needle].float().mean()), 4),
                        "needle_mass": round(float(probs[:, needle].sum(-1).mean()), 5),
                        "recall": round(float(recall.mean()), 5)})  # fmt: skip
        out.write_text(json.dumps({"name": "needle-decode", "date": date, "gpu": None,
                                   "command": common.command_line(), "rows": result_rows},
                                  indent=0))
        for name, digit in ((c[0], d) for c in cfgs for d in range(n_q)):
            rs = [r for r in result_rows
                  if (r["index"], r["digit"], r["settings"]) == (index, digit, name)]
            reading = [r for r in rs if r["needle_mass"] > 0.05]
            print(f"{name} sample {index} ({truth} -> {pred.strip()}) digit {digit}"
                  f"{' (first wrong)' if digit == diverged_at else ''}: needle kept whole in "
                  f"{sum(r['needle_kept'] == 1.0 for r in rs)}/{len(rs)} layers, in "
                  f"{sum(r['needle_kept'] == 1.0 for r in reading)}/{len(reading)} of those "
                  f"reading it; mean recall {sum(r['recall'] for r in rs) / len(rs):.3f}",
                  flush=True)  # fmt: skip
    plot(result_rows, out.with_suffix(".png"))
    print(f"wrote {out} and its .png")
    return 0


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # one panel per sample (a file may hold several tasks' samples), the first settings' rows
    samples = sorted({(r["task"], r["index"]) for r in rows})
    fig, axes = plt.subplots(len(samples), 1, figsize=(9, 2.6 * len(samples)), squeeze=False)
    for ax, (task, index) in zip(axes[:, 0], samples):
        rs = [r for r in rows if (r["task"], r["index"]) == (task, index)
              and r["settings"] == rows[0]["settings"]]
        layers = max(r["layer"] for r in rs) + 1
        digits = max(r["digit"] for r in rs) + 1
        grid = [[next(r["needle_kept"] for r in rs if r["layer"] == la and r["digit"] == d)
                 for la in range(layers)] for d in range(digits)]  # fmt: skip
        im = ax.imshow(grid, vmin=0, vmax=1, aspect="auto", cmap="viridis")
        ax.set_ylabel("answer digit")
        ax.set_title(f"{task} sample {index}: {rs[0]['truth']} -> {rs[0]['pred']} "
                     f"(first wrong digit {rs[0]['diverged_at']})", fontsize=9)  # fmt: skip
    axes[-1, 0].set_xlabel("layer")
    fig.colorbar(im, ax=axes[:, 0], label="share of the needle's digits kept")
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
