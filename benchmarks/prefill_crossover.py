"""Dense against sparse prefill of one chunk, by context length: where sparse starts to pay.

    python benchmarks/prefill_crossover.py [--contexts 8192 16384 32768 65536] [--chunk 8192]
        [--model smollm2-135m] [--rope-extension on off] [--threads N]

One prefill chunk (``--chunk`` queries ending at the context's last token) of every layer of a
model's attention shapes, through the ops the backend runs on this machine
(``kernels.ops.ops_for``: the PyTorch reference on the CPU, the Triton kernels and vLLM's
FlashAttention on a GPU): ``dense`` (what chunks below ``prefill_dense_threshold`` run) against
``prune`` then ``attend`` with the default config's per-layer parameters, with RoPE extension
on (as the backend sets it for a model served past its trained length: the paper's pruning
styles, streaming block-sparse attention) and off. Random keys; the cost does not depend on
them. The GPU constant predates this script (docs/results.md, attention kernels, 2026-11-30).

Each layer kind (``dense_layers`` with their larger budget and chunk-indexed pruning, and the
rest) is timed once and weighted by its count, so a row is one chunk of the whole model's
attention. The first call of each kind is a warm-up and not timed.

Rows ``{model, context, chunk, rope_extension, dense_s, sparse_s, prune_s, sparse_vs_dense}``.
Writes ``prefill-crossover-<cpu|gpu>.json``, a PNG and a table. This is what the ``"auto"``
rule of ``prefill_dense_threshold`` is set from (``config.DENSE_PREFILL_CROSSOVER`` on a GPU,
``config.CPU_DENSE_PREFILL_CROSSOVER`` on the CPU).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import common
from e2e import gpu_name, markdown_table
from scheduler_host import _cpu_name

# Attention shapes of the models the project serves in tests and benchmarks:
# (layers, query heads, KV heads, head size, rope theta).
SHAPES = {
    "smollm2-135m": (30, 9, 3, 64, 100000.0),
    "qwen2.5-coder-0.5b": (24, 14, 2, 64, 1000000.0),
    "llama3-8b": (32, 32, 8, 128, 500000.0),
}
PAGE = 16


def shapes(model: str) -> tuple:
    """``(layers, q heads, kv heads, head dim, rope theta)`` of ``model``: the table's, or from its
    Hugging Face config."""
    if model in SHAPES:
        return SHAPES[model]
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(common.resolve_model(model))
    c = getattr(c, "get_text_config", lambda: c)()
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    theta = getattr(c, "rope_theta", None) or (getattr(c, "rope_parameters", None) or {}).get(
        "rope_theta", 10000.0)
    return (c.num_hidden_layers, c.num_attention_heads,
            getattr(c, "num_key_value_heads", None) or c.num_attention_heads, head_dim, theta)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def chunk_seconds(context: int, chunk: int, shape: tuple, extension: bool, device) -> dict:
    """Seconds of one chunk's attention over all layers: dense, sparse, and its pruning."""
    import torch
    from vllm_infinitehip.kernels import reference as ref
    from vllm_infinitehip.kernels.ops import RequestKV, ops_for
    from vllm_infinitehip.kernels.rope import RopeTable

    from vllm_infinitehip.backend import layer_prune_params
    from vllm_infinitehip.config import InfiniteHiPConfig

    n_layers, hq, hkv, d, theta = shape
    config = InfiniteHiPConfig.from_user({})
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    gen = torch.Generator(device="cpu").manual_seed(context)
    pages = -(-context // PAGE)
    kv = torch.randn(pages, 2, PAGE, hkv, d, generator=gen).to(device, dtype)
    table = torch.randperm(pages, generator=gen).to(device=device, dtype=torch.int32)
    q = torch.randn(chunk, hq, d, generator=gen).to(device, dtype)
    positions = torch.arange(context - chunk, context, device=device)
    scale = d**-0.5
    rope_table = RopeTable.default(d, theta).to(device) if extension else None
    ops = ops_for(device, config.scoring_precision, None)

    def run(params, dense: bool) -> tuple[float, float]:
        req = RequestKV(kv, table, context)
        _sync(device)
        t0 = time.perf_counter()
        if dense:
            ops.dense(req, q, positions, scale)
            _sync(device)
            return time.perf_counter() - t0, 0.0
        prune = ops.prune(params, req, q, positions, scale)
        _sync(device)
        t1 = time.perf_counter()
        ops.attend(params, req, q, positions, scale, prune, context)
        _sync(device)
        return time.perf_counter() - t0, t1 - t0

    kinds = {}  # layer kind -> (count, params)
    for i in range(n_layers):
        rope = None
        if extension:
            rope = ref.RopePlan(rope_table, config.rope_pruning_for_layer(i), config.rope_bsa)
        params = layer_prune_params(config, i, rope)
        key = (params.stages[-1].keep_tokens, None if rope is None else rope.pruning)
        count, _ = kinds.get(key, (0, params))
        kinds[key] = (count + 1, params)
    run(None, True)  # warm-up
    dense_s = run(None, True)[0] * n_layers  # every layer's dense attention costs the same
    sparse_s = prune_s = 0.0
    for count, params in kinds.values():
        run(params, False)  # warm-up (Triton compiles on a GPU)
        total, prune = run(params, False)
        sparse_s += count * total
        prune_s += count * prune
    return {"context": context, "chunk": chunk, "rope_extension": extension,
            "dense_s": round(dense_s, 3), "sparse_s": round(sparse_s, 3),
            "prune_s": round(prune_s, 3),
            "sparse_vs_dense": round(sparse_s / dense_s, 2)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--model", default="smollm2-135m",
                    help=f"one of {sorted(SHAPES)} or {common.MODEL_HELP}; only its shapes matter")
    ap.add_argument("--rope-extension", nargs="+", choices=["on", "off"], default=["on", "off"])
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--out", default=str(common.RESULTS))
    args = ap.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for mode in args.rope_extension:
        for context in args.contexts:
            chunk = min(args.chunk, context)
            rows.append({"model": common.model_name(args.model), **chunk_seconds(
                context, chunk, shapes(args.model), mode == "on", device)})  # fmt: skip
            print(rows[-1], flush=True)
    gpu = gpu_name()
    date = datetime.date.today().isoformat()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"prefill-crossover-{'gpu' if gpu else 'cpu'}.json"
    path.write_text(json.dumps({
        "name": "prefill-crossover", "date": date, "gpu": gpu, "cpu": _cpu_name(),
        "threads": torch.get_num_threads(), "command": common.command_line(),
        "rows": rows,
    }, indent=1))  # fmt: skip
    plot(rows, path.with_suffix(".png"))
    print(markdown_table(rows, ["model", "context", "chunk", "rope_extension", "dense_s",
                                "sparse_s", "prune_s", "sparse_vs_dense"]))  # fmt: skip
    print(f"wrote {path}")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for ext in (True, False):
        rs = [r for r in rows if r["rope_extension"] == ext]
        if not rs:
            continue
        ctx = [r["context"] / 1024 for r in rs]
        tag = "extension on" if ext else "extension off"
        style = "-" if ext else ":"
        ax.plot(ctx, [r["dense_s"] for r in rs], marker="o", linestyle=style, label=f"dense ({tag})")
        ax.plot(ctx, [r["sparse_s"] for r in rs], marker="s", linestyle=style,
                label=f"sparse, prune + attend ({tag})")  # fmt: skip
    ax.set_xlabel("context (K tokens)")
    ax.set_ylabel(f"s per {rows[0]['chunk']}-query chunk, all layers")
    ax.set_title(f"prefill chunk, dense vs sparse ({rows[0]['model']})")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
