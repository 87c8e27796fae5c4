"""One mask per layer against one per KV group: what a decode-like query's selection keeps, on a
real model's Q/K (CPU, HF transformers; no vLLM engine).

    python benchmarks/mask_heads.py --model smollm2-135m --lengths 16384 --depths 0.1 0.5 --n 1

For a passkey prompt (vllm_infinitehip.passkey), every layer's keys and its final query (the one
that writes the answer's first token; pruned alone, as decode queries are, b_q = 1) go through the
reference pruning cascade (kernels/reference.py ``run_stages``) twice, with the layer's own
parameters and RoPE remapping (extension on, as past the trained length):

- ``layer``: the stage scores max-reduced over all query heads, one ranking for the layer (the
  authors' default, ``HIP_HEAD_REDUCE=1``, and this plugin's);
- ``kv_group``: the cascade run per KV head on its own query heads, one ranking per GQA group.

Per layer it reports the remapped recall (``reference.remapped_attention_recall``: the share of
the dense softmax mass, under the layer's remapping, on the keys attended; mean and worst head)
and whether the passkey's tokens are attended (by all heads). Writes
``mask-heads-cpu.json`` (rows ``{model, config, context, depth, seed, layer, mode, recall,
recall_min_head, needle_kept}``), a PNG (recall by layer per mode) and prints the means over
layers per prompt.
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

import common  # noqa: E402  (benchmarks/common.py: --model and how it is prompted)


def capture_qk(model, ids: torch.Tensor,
               last: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """Per layer: the ``last`` queries ``[last, H_q, D]`` and all keys ``[T, H_kv, D]``, rotated
    at their true positions (what vLLM caches), from one forward pass."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    out: list[tuple[torch.Tensor, torch.Tensor]] = []

    def hook(attn, args, kwargs):
        h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        cos, sin = kwargs["position_embeddings"]
        d = attn.head_dim
        q = attn.q_proj(h[:, -last:]).view(1, last, -1, d).transpose(1, 2)
        k = attn.k_proj(h).view(1, h.shape[1], -1, d).transpose(1, 2)
        q, _ = apply_rotary_pos_emb(q, q, cos[:, -last:], sin[:, -last:])
        _, k = apply_rotary_pos_emb(k, k, cos, sin)
        out.append((q[0].transpose(0, 1).contiguous(), k[0].transpose(0, 1).contiguous()))

    handles = [layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True)
               for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(ids, use_cache=False, logits_to_keep=last)
    finally:
        for handle in handles:
            handle.remove()
    return out


@dataclasses.dataclass
class LoadedModel:
    tok: object
    chat: bool
    model: object
    cfg: object  # the InfiniteHiPConfig of the settings
    config: str  # the settings as a row's "config" (sorted JSON)
    table: object  # the RoPE table as vLLM builds it
    scale: float


def load_model(name: str, infinitehip: str) -> LoadedModel:
    """A real model in fp32 on the CPU (HF transformers, SDPA), its tokenizer and prompting, and
    the settings its Q/K are pruned with."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm_infinitehip.config import InfiniteHiPConfig
    from vllm_infinitehip.kernels.rope import RopeTable

    path = common.resolve_model(name)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    attn = model.model.layers[0].self_attn
    # the frequencies as vLLM builds them (the backend's table; it refuses rotary types that are
    # not a pure rotation), and the model's own softmax scale
    return LoadedModel(tok, common.prefers_chat(name, tok), model,
                       InfiniteHiPConfig.from_user(json.loads(infinitehip)),
                       json.dumps(json.loads(infinitehip), sort_keys=True),
                       RopeTable.from_vllm(attn.head_dim, model.config), attn.scaling)


def passkey_prompts(tok, chat: bool, lengths, depths, n: int):
    """The study's passkey prompts, seeded as the passkey harness seeds them: per length, depth
    and seed ``i``, ``(depth, i, token ids [1, T], the passkey's token positions)``."""
    from vllm_infinitehip.passkey import make_passkey_prompt

    for length in lengths:
        for depth in depths:
            for i in range(n):
                prompt = make_passkey_prompt(tok, length, depth, chat=chat,
                                             seed=1000 * i + int(depth * 100) + length)
                enc = tok(prompt.text, return_offsets_mapping=True)
                at = prompt.text.index(prompt.passkey)
                needle = [t for t, (a, b) in enumerate(enc["offset_mapping"])
                          if a < at + len(prompt.passkey) and b > at]
                yield depth, i, torch.tensor([enc["input_ids"]]), needle


def select(params, q, k, position, scale):
    from vllm_infinitehip.kernels import reference as ref

    pos = torch.tensor([position])
    prune = ref.run_stages(params, q, k, pos, scale)
    mask = ref.sparse_key_mask(params, k.shape[0], pos, prune.block_starts, prune.block_valid)
    return mask, ref.remapped_attention_recall(params, q, k, pos, mask, scale)[0]


def add_prompt_args(parser: argparse.ArgumentParser) -> None:
    """The passkey prompts and settings of a Q/K study (this one, ``representatives.py``)."""
    parser.add_argument("--model", default="smollm2-135m", help=common.MODEL_HELP)
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384])
    parser.add_argument("--depths", type=float, nargs="+", default=[0.5])
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--infinitehip", default="{}",
                        help="JSON settings (as additional_config's): the layers' parameters")
    parser.add_argument("--out", default=str(common.RESULTS))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_prompt_args(parser)
    args = parser.parse_args()

    from vllm_infinitehip.kernels import reference as ref

    from vllm_infinitehip.backend import layer_prune_params

    m = load_model(args.model, args.infinitehip)
    tok, chat, model, cfg, config, table, scale = (m.tok, m.chat, m.model, m.cfg, m.config,
                                                   m.table, m.scale)  # fmt: skip
    rows = []
    date = datetime.date.today().isoformat()
    out = Path(args.out) / "mask-heads-cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    for depth, i, ids, needle in passkey_prompts(tok, chat, args.lengths, args.depths,
                                                 args.n):
        position = ids.shape[1] - 1
        for layer, (q, k) in enumerate(capture_qk(model, ids)):
            rope = ref.RopePlan(table=table, pruning=cfg.rope_pruning_for_layer(layer),
                                bsa=cfg.rope_bsa)
            params = layer_prune_params(cfg, layer, rope)
            hkv = k.shape[1]
            group = q.shape[1] // hkv
            shared_mask, shared = select(params, q, k, position, scale)
            per_group, kept = [], True
            for g in range(hkv):
                mask, recall = select(params, q[:, g * group:(g + 1) * group],
                                      k[:, g:g + 1], position, scale)
                per_group.append(recall)
                kept &= bool(mask[0, needle].all())
            for mode, recall, needle_kept in (
                    ("layer", shared, bool(shared_mask[0, needle].all())),
                    ("kv_group", torch.cat(per_group), kept)):
                rows.append({"model": common.model_name(args.model), "config": config,
                             "context": ids.shape[1],
                             "depth": depth, "seed": i, "layer": layer, "mode": mode,
                             "recall": round(float(recall.mean()), 5),
                             "recall_min_head": round(float(recall.min()), 5),
                             "needle_kept": needle_kept})
        out.write_text(json.dumps({"name": "mask-heads", "date": date, "gpu": "cpu",
                                   "command": common.command_line(),
                                   "rows": rows}, indent=0))
        for mode in ("layer", "kv_group"):
            rs = [r for r in rows if r["mode"] == mode and r["depth"] == depth
                  and r["seed"] == i and r["context"] == ids.shape[1]]  # fmt: skip
            worst = min(rs, key=lambda r: r["recall"])
            print(f"{ids.shape[1]:>6} depth {depth} seed {i} {mode:<9} recall "
                  f"{sum(r['recall'] for r in rs) / len(rs):.3f} worst L{worst['layer']} "
                  f"{worst['recall']:.3f}, needle kept in "
                  f"{sum(r['needle_kept'] for r in rs)}/{len(rs)} layers", flush=True)
    from plot import plot_mask_heads  # benchmarks/plot.py, beside this file

    plot_mask_heads(json.loads(out.read_text()), out.with_suffix(".png"))
    print(f"wrote {out} and its .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
