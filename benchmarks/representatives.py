"""Chunk representatives on a real model's Q/K: bisection (SelectRep, per query head or per KV
group) against landmark scores (CPU, HF transformers; no vLLM engine).

    python benchmarks/representatives.py --model smollm2-135m --lengths 8192 16384 \\
        --depths 0.1 0.3 0.5 0.7 0.9

Each pruning stage scores a candidate chunk by one key per head. SelectRep finds it by
bisection (two probes per step, per query block); a landmark representative is the chunk's key
that the text right after it reads most (``kernels/reference.py`` ``landmark_scores``: the mean
scaled logit over the 512 queries that follow a key, per head), found once per key and
query-independent (the authors' later prefill). For a passkey prompt (vllm_infinitehip.passkey),
every layer's keys and queries go through the reference cascade (``run_stages``) with the
layer's parameters, RoPE plan (extension on past the trained length, pruning remapped as
``remap_pruning: "always"``) and each setting:

- ``bisection``: the configured stages (today's);
- ``group-bisection``: the same, the query heads of each KV group bisecting one path
  (``prefill_representatives: "group-bisection"``);
- ``landmark``: the same stages, stages before an exact last one scored by landmark
  representatives;
- ``landmark-group``: one landmark per KV head (the mean of its query heads'), so the query
  heads of a group share their representatives: 2 bytes a token and layer per KV head in
  bf16, and one probe row per group;
- ``landmark-64-16-4``: landmarks with the authors' later chunk sizes (64 / 16 / 4; the same
  budgets).

Two masks per layer: the prompt's final query pruned alone (``decode``: b_q = 1, a decode-like
fresh mask, the query that writes the answer's first token) and the final prefill query block
(``prefill``: its last 64 queries as one block; the row of its last query). Per layer and mask
it reports the remapped recall (``reference.remapped_attention_recall``: the share of the dense
softmax mass, under the layer's remapping, on the keys attended; mean over heads) and whether
every passkey token is attended. Writes ``representatives-cpu.json`` (``--merge``: beside the
rows of other settings already there), a PNG (recall and the layers keeping the needle, by
budget and setting) and prints the means per prompt.
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

import common  # noqa: E402  (--model and how it is prompted)
import mask_heads  # noqa: E402  (capture_qk, load_model)

SETTINGS = ("bisection", "group-bisection", "landmark", "landmark-group", "landmark-64-16-4")


def setting_params(params, setting: str):
    if setting == "group-bisection":
        return dataclasses.replace(params, group_probes=True)
    if setting != "landmark-64-16-4":
        return params
    sizes = (64, 16, 4)
    stages = tuple(dataclasses.replace(st, chunk_size=c) for st, c in zip(params.stages, sizes))
    return dataclasses.replace(params, stages=stages)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mask_heads.add_prompt_args(ap)
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=SETTINGS)
    ap.add_argument("--merge", action="store_true",
                    help="keep the rows of other configs already in the file")
    args = ap.parse_args()

    from vllm_infinitehip.backend import layer_prune_params
    from vllm_infinitehip.kernels import reference as ref

    m = mask_heads.load_model(args.model, args.infinitehip)
    tok, chat, model, cfg, config, table, scale = (m.tok, m.chat, m.model, m.cfg, m.config,
                                                   m.table, m.scale)  # fmt: skip
    trained = cfg.trained_context or model.config.max_position_embeddings
    # the prompts run past the trained length: the model's own rotary embedding must reach them
    model.config.max_position_embeddings = max(args.lengths) + 256
    rows: list[dict] = []
    date = datetime.date.today().isoformat()
    out = Path(args.out) / "representatives-cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    kept: list[dict] = []
    if args.merge and out.exists():
        kept = [r for r in json.loads(out.read_text())["rows"] if r["config"] != config]
    for depth, i, ids, needle in mask_heads.passkey_prompts(tok, chat, args.lengths,
                                                            args.depths, args.n):
        n = ids.shape[1]
        for layer, (q, k) in enumerate(mask_heads.capture_qk(model, ids, last=n)):
            rope = None
            if n > trained:
                rope = ref.RopePlan(table=table, pruning=cfg.rope_pruning_for_layer(layer),
                                    bsa=cfg.rope_bsa, trained_context=trained,
                                    pruning_from=0 if cfg.remap_pruning == "always"
                                    else None)  # fmt: skip
            base = layer_prune_params(cfg, layer, rope)
            landmarks = ref.landmark_scores(q, k, scale)
            hkv = k.shape[1]
            group = landmarks.view(n, hkv, -1).mean(-1, keepdim=True)
            group = group.expand(n, hkv, q.shape[1] // hkv).reshape(n, -1)
            for setting in args.settings:
                params = setting_params(base, setting)
                lm = {"bisection": None, "group-bisection": None,
                      "landmark-group": group}.get(setting, landmarks)  # fmt: skip
                for kind, first in (("decode", n - 1), ("prefill", n - 64)):
                    # one query block either way (its last query's row is measured)
                    pos = torch.arange(first, n)
                    prune = ref.run_stages(params, q[first:], k, pos, scale,
                                           landmarks=lm)  # fmt: skip
                    mask = ref.sparse_key_mask(params, n, pos, prune.block_starts,
                                               prune.block_valid)[-1:]  # fmt: skip
                    recall = ref.remapped_attention_recall(
                        params, q[n - 1 :], k, pos[-1:], mask, scale)[0]
                    rows.append({"model": common.model_name(args.model),
                                 "config": config, "context": n, "depth": depth,
                                 "seed": i, "layer": layer, "setting": setting,
                                 "mask": kind,
                                 "recall": round(float(recall.mean()), 5),
                                 "needle_kept": bool(mask[0, needle].all())})
        out.write_text(json.dumps({"name": "representatives", "date": date,
                                   "gpu": "cpu", "command": common.command_line(),
                                   "rows": kept + rows}, indent=0))
        for setting in args.settings:
            for kind in ("decode", "prefill"):
                rs = [r for r in rows if (r["setting"], r["mask"], r["context"],
                                          r["depth"], r["seed"]) == (setting, kind, n,
                                                                     depth, i)]
                print(f"{n:>6} depth {depth} seed {i} {setting:<17} {kind:<8} recall "
                      f"{sum(r['recall'] for r in rs) / len(rs):.3f}, needle kept in "
                      f"{sum(r['needle_kept'] for r in rs)}/{len(rs)} layers",
                      flush=True)  # fmt: skip
    plot(kept + rows, out.with_suffix(".png"))
    print(f"wrote {out} and its .png")
    return 0


def config_label(config: str) -> str:
    """A short name for a row's settings: the budgets it changes, or the defaults."""
    stages = json.loads(config).get("stages")
    if not stages:
        return "defaults"
    return "keep " + " / ".join(str(st["keep_tokens"]) for st in stages)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = ("decode", "prefill")
    configs = list(dict.fromkeys(r["config"] for r in rows))
    settings = list(dict.fromkeys(r["setting"] for r in rows))
    width = 0.8 / max(1, len(settings))
    fig, axes = plt.subplots(2, 2, figsize=(11, 6.4), sharey="row")
    for col, kind in enumerate(kinds):
        for row, (metric, label) in enumerate((("recall", "recall of the dense mass"),
                                               ("needle_kept", "layers keeping the needle"))):
            ax = axes[row, col]
            for j, setting in enumerate(settings):
                means = []
                for config in configs:
                    rs = [float(r[metric]) for r in rows
                          if (r["config"], r["setting"], r["mask"]) == (config, setting, kind)]
                    means.append(sum(rs) / len(rs) if rs else 0.0)
                ax.bar([x + j * width for x in range(len(configs))], means, width,
                       label=setting)  # fmt: skip
            ax.set_xticks([x + width * (len(settings) - 1) / 2 for x in range(len(configs))],
                          [config_label(c) for c in configs], fontsize=8)  # fmt: skip
            ax.set_ylim(0.8 if metric == "recall" else 0.5, 1.0)
            if col == 0:
                ax.set_ylabel(label)
            if row == 0:
                ax.set_title(f"{kind} mask (mean over layers and prompts)", fontsize=9)
    contexts = sorted({r["context"] for r in rows})
    fig.suptitle(f"{rows[0]['model']}, passkey prompts of {', '.join(map(str, contexts))} "
                 "tokens, CPU", fontsize=10)  # fmt: skip
    axes[0, 0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
