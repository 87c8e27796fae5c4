"""The host KV tier end to end through vLLM: the same context with the tier off and on, one run.

``--model``'s architecture with dummy weights (Llama-3-8B by default), infinitehip preset
``3k-fast``, vLLM's ``LLM`` in process (CUDA graphs as vLLM configures them), each engine in its own
process. Per context and engine:

- ``prefill_s``: a cold prompt with ``max_tokens=1`` (vLLM's ``first_token_ts - scheduled_ts``);
- ``decode_tok_s`` at batch 1: the same prompt again (a prefix-cache hit), 128 tokens over the
  engine core's own ``last_token_ts - first_token_ts`` of a 129-token call, and
  ``decode_tok_s_wall_diff``, ``(t(129 tokens) - t(1 token)) / 128`` of the wall times (what
  files before 2026-12-02 reported as ``decode_tok_s``; unreliable at long contexts), each the
  median of three (``e2e.decode_seconds``);
- the greedy tokens of one 129-token call, compared across engines of the same context
  (``greedy_equal_to_tier_off``; past what the tier off holds, ``greedy_equal_to_more_gpu``:
  against the engine that kept the most KV on the GPU);
- with the tier on, its counters over the timed decode calls (the ``infinitehip_stats`` worker method):
  ``hit_ratio_attn`` (decode attention's page reads served by the bank), ``hit_ratio_mask``
  (the pruning stages' probes served by the key-row bank, refresh steps), ``hit_ratio_promote``
  (pages a refresh asked for that were already resident), ``host_bytes_per_step`` (attention's
  and pruning's host reads plus the copies into both banks), ``tier_pages_per_step`` (pages
  attention read through the tier per step, all layers: with the split layout only the
  host-homed ones, from their bank copies or the host);
- ``host_share`` and ``kernel_us_per_step``: as in ``e2e.py`` (``e2e.decode_profile``).

The compiling warm-up call is excluded from every timing. Results: ``offload-gpu.json`` (a rerun
replaces it, or with ``--merge`` only the rows it measures), a PNG and a table on stdout.

    python benchmarks/offload.py --contexts 524288 --engines off bf16:16
    python benchmarks/offload.py --contexts 1048576 --engines fp8-off fp8-split fp8-split:40

Engines: ``off`` / ``fp8-off`` (the tier off), ``bf16:BANK_GIB`` / ``fp8:BANK_GIB`` (the
``"host"`` layout, a bank of that size), ``bf16-split`` / ``fp8-split[:GPU_GIB[:BANK_GIB]]``
(the ``"split"`` layout, its GPU side capped at GPU_GIB: the rest of V goes to the host; its V
bank of BANK_GIB, 0 for none, by default the config's). Each row has ``gpu_kv_gib`` /
``host_kv_gib``, where the request's KV is.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import common  # noqa: E402  (--model)
from e2e import (  # noqa: E402
    DECODE_TOKENS,
    DEFAULT_MODEL,
    cold_prefill,
    decode_profile,
    decode_seconds,
    drive_engines,
    engine_spec,
    markdown_table,
    random_prompt,
    timed_generate,
)


def kv_bytes_per_token(path: str, kv: str) -> int:
    """One token's KV over every layer, from the model's config (``kv``: bf16 or fp8)."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(path)
    c = getattr(c, "get_text_config", lambda: c)()
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return 2 * c.num_hidden_layers * kv_heads * head_dim * (1 if kv == "fp8" else 2)


def parse_engine(name: str) -> tuple[str, str, float | None, float | None]:
    """``(kv dtype, layout, GiB, V bank GiB)``: ``off`` / ``fp8-off`` (tier off: layout
    ``"off"``), ``bf16:BANK_GIB`` / ``fp8:BANK_GIB`` (the ``"host"`` layout with a bank of that
    size), ``bf16-split`` / ``fp8-split[:GPU_GIB[:BANK_GIB]]`` (the ``"split"`` layout, its GPU
    side capped, its V bank sized: ``fp8-split:40:0`` has none; default the config's)."""
    kind, _, sizes = name.partition(":")
    size, _, bank = sizes.partition(":")
    gib = float(size) if size else None
    if kind in ("off", "fp8-off"):
        return ("bf16" if kind == "off" else "fp8"), "off", None, None
    if kind.endswith("-split"):
        return kind.removesuffix("-split"), "split", gib, float(bank) if bank else None
    return kind, "host", gib, None


def spec_for(name: str, max_len: int, host_gib: float) -> dict:
    kv, layout, gib, bank = parse_engine(name)
    kw = engine_spec("3k-fast", max_len)
    if kv == "fp8":
        kw["kv_cache_dtype"] = "fp8"
    if layout != "off":
        hip = dict(kw["additional_config"]["infinitehip"])
        size = {"bank_gib": gib} if layout == "host" else {"gpu_gib": gib}
        if bank is not None:
            size["bank_gib"] = bank
        hip["offload"] = {"enabled": True, "layout": layout, "host_gib": host_gib, **size}
        kw["additional_config"] = {"infinitehip": hip}
    return kw


def run_engine(model: str, name: str, contexts: list[int], max_len: int, host_gib: float,
               budget_s: float) -> list[dict]:  # fmt: skip
    from vllm import LLM


    kv, layout, gib, _ = parse_engine(name)
    path = common.resolve_model(model)
    per_token = kv_bytes_per_token(path, kv)
    t_start = time.perf_counter()
    llm = LLM(path, **spec_for(name, max_len, host_gib))
    init_s = time.perf_counter() - t_start

    call = timed_generate(llm)
    rows = []
    t_ready = time.perf_counter()
    for i, ctx in enumerate(contexts):
        # from when the engine is ready, and never before its first context (e2e.run_engine)
        if i and time.perf_counter() - t_ready > budget_s:
            print(f"[offload] {name}: time budget spent before {ctx}", flush=True)
            break
        prompt = random_prompt(ctx - 1, ctx)
        prefill, _ = cold_prefill(call, prompt)
        _, outs = call([prompt], DECODE_TOKENS + 1)
        tokens = list(outs[0].outputs[0].token_ids)
        llm.collective_rpc("infinitehip_stats", kwargs={"reset": True})
        wall_s, engine_s = decode_seconds(call, [prompt])
        steady_s, cold_s = steady_decode_seconds(call, [prompt])
        stats = llm.collective_rpc("infinitehip_stats", kwargs={"reset": True})[0]
        tier = stats.get("tier", {})
        # where the request's KV is: the split layout counts it; the host layout keeps all of
        # it on the host (the GPU's banks are copies); the tier off on the GPU
        split = stats.get("split", {})
        kv_gib = ctx * per_token / 2**30
        gpu_kv, host_kv = {"off": (kv_gib, 0.0), "host": (0.0, kv_gib)}.get(
            layout, (split.get("gpu_kv_bytes", 0) / 2**30, split.get("host_kv_bytes", 0) / 2**30))
        # where a step's time goes: GPU time by kernel (graphs included) and the idle share
        host_share, kernels = decode_profile(call, [prompt], engine_s / DECODE_TOKENS)
        rows.append({
            "model": common.model_name(model),
            "context": ctx, "kv_dtype": kv, "offload": layout != "off", "layout": layout,
            "bank_gib": gib if layout == "host" else None,
            "gpu_gib": gib if layout == "split" else None,
            "gpu_kv_gib": round(gpu_kv, 2), "host_kv_gib": round(host_kv, 2),
            "spilled_blocks": split.get("spilled_blocks"),
            "engine": name, "init_s": round(init_s, 1),
            "decode_tok_s": round(DECODE_TOKENS / engine_s, 1),
            "decode_tok_s_wall_diff": round(DECODE_TOKENS / wall_s, 1),
            "decode_tok_s_steady": round(DECODE_TOKENS / steady_s, 1),
            "cold_start_s": round(cold_s, 3),
            "prefill_s": round(prefill, 2),
            "hit_ratio_mask": _round(tier.get("hit_ratio_mask")),
            "hit_ratio_promote": _round(tier.get("hit_ratio_promote")),
            "hit_ratio_attn": _round(tier.get("hit_ratio_attn")),
            "hit_ratio_attn_refresh": _round(tier.get("hit_ratio_attn_refresh")),
            "hit_ratio_attn_reuse": _round(tier.get("hit_ratio_attn_reuse")),
            "host_bytes_per_step": round(tier["host_bytes_per_step"]) if tier else 0,
            "tier_pages_per_step": tier_pages_per_step(tier),
            "host_share": round(host_share, 3), "kernel_us_per_step": kernels,
            "tokens": tokens,
        })  # fmt: skip
        print(f"[offload] {({k: v for k, v in rows[-1].items() if k != 'tokens'})}", flush=True)
    return rows


WARM_TOKENS = 32  # a stage-0 refresh interval of 3k-fast: the first refresh's misses are in


def steady_decode_seconds(call, prompts) -> tuple[float, float]:
    """``(seconds of DECODE_TOKENS steps past the first WARM_TOKENS, cold-start seconds)``.
    Each call is a new request whose banks start cold (a finished request's blocks leave both),
    so its first refresh reads what it probes from the host. The engine-core inter-token time
    of a (WARM_TOKENS + DECODE_TOKENS + 1)-token call less that of a (WARM_TOKENS + 1)-token
    call (medians of two) is the steady state; the short call's time less WARM_TOKENS steady
    steps is what the cold start added."""
    import statistics

    def engine_s(n: int) -> float:
        _, outs = call(prompts, n)
        return max(o.metrics.last_token_ts - o.metrics.first_token_ts for o in outs)

    short = statistics.median(engine_s(WARM_TOKENS + 1) for _ in range(2))
    long = statistics.median(engine_s(WARM_TOKENS + DECODE_TOKENS + 1) for _ in range(2))
    steady = long - short
    return steady, short - WARM_TOKENS * steady / DECODE_TOKENS


def tier_pages_per_step(tier: dict) -> float | None:
    """``metrics.tier_ratios``' ``attn_pages_per_step`` for a row: pages decode attention read
    through the tier per step (in the split layout only the host-homed ones); None without the
    tier."""
    return round(tier["attn_pages_per_step"], 1) if tier else None


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def compare(rows: list[dict]) -> None:
    """``greedy_equal_to_tier_off`` and the decode ratio against the tier-off row of the same
    context and KV dtype. Where the tier off has no row (a context it cannot hold),
    ``greedy_equal_to_more_gpu``: against the engine of that context and dtype that kept the
    most KV on the GPU, when another one kept more than this one."""
    off = {(r["context"], r["kv_dtype"]): r for r in rows if not r["offload"]}
    for r in rows:
        cell = (r["context"], r["kv_dtype"])
        base = off.get(cell)
        r["greedy_equal_to_tier_off"] = (
            (r["tokens"] == base["tokens"]) if base and r["offload"] else None
        )
        for key in ("decode_tok_s", "decode_tok_s_steady"):
            ratio = key.replace("decode_tok_s", "decode_ratio") + "_vs_tier_off"
            r[ratio] = round(r[key] / base[key], 3) if base and base.get(key) else None
        more = [] if base else [o for o in rows if (o["context"], o["kv_dtype"]) == cell
                                and o.get("gpu_kv_gib", 0) > r.get("gpu_kv_gib", 0)]  # fmt: skip
        r["greedy_equal_to_more_gpu"] = (
            r["tokens"] == max(more, key=lambda o: o["gpu_kv_gib"])["tokens"] if more else None
        )


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for engine in sorted({r["engine"] for r in rows}):
        pts = sorted((r["context"], r["decode_tok_s"]) for r in rows if r["engine"] == engine)
        ax.plot([c / 1024 for c, _ in pts], [v for _, v in pts], "-o", label=engine)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (K tokens)")
    ax.set_ylabel("decode tokens / s (batch 1)")
    models = ", ".join(sorted({str(r.get("model") or "?") for r in rows}))
    ax.set_title(f"Host KV tier: {models} (dummy weights), vLLM 0.26", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, title="KV dtype : bank / GPU GiB")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


COLUMNS = ["context", "kv_dtype", "layout", "bank_gib", "gpu_gib", "gpu_kv_gib", "host_kv_gib",
           "prefill_s",
           "decode_tok_s", "decode_ratio_vs_tier_off", "decode_tok_s_steady",
           "decode_ratio_steady_vs_tier_off", "cold_start_s", "hit_ratio_mask", "hit_ratio_promote",
           "hit_ratio_attn", "tier_pages_per_step",
           "host_bytes_per_step", "greedy_equal_to_tier_off",
           "greedy_equal_to_more_gpu"]  # fmt: skip


def table(rows: list[dict]) -> str:
    return markdown_table(sorted(rows, key=lambda r: (r["context"], r["kv_dtype"], r["offload"])),
                          COLUMNS)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help=common.MODEL_HELP + "; dummy weights")
    ap.add_argument("--contexts", type=int, nargs="+", default=[524288])
    ap.add_argument("--engines", nargs="+", default=["off", "bf16:16"],
                    help="off, fp8-off, bf16:BANK_GIB, fp8:BANK_GIB")
    ap.add_argument("--host-gib", type=float, default=80.0, help="host KV with the tier on")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--budget-s", type=float, default=1e9,
                    help="per engine, from when it is ready (the first context always runs)")
    ap.add_argument("--out", default=str(common.RESULTS))
    ap.add_argument("--merge", action="store_true", help="keep rows already in the file")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    max_len = args.max_model_len or max(args.contexts) + 256

    if args.worker:
        name, out = args.worker.split("=", 1)
        rows = run_engine(args.model, name, args.contexts, max_len, args.host_gib, args.budget_s)
        Path(out).write_text(json.dumps(rows))
        return

    notes = ("compiling warm-up call excluded; decode from two calls on a prefix-cache hit, each "
             "a new request whose banks start cold (a finished request's blocks leave both); "
             "tier counters over the timed decode calls; hit_ratio_mask: pruning probes served "
             "by the key-row bank; hit_ratio_promote: pages a step's rows asked for that were "
             "resident")
    rows = drive_engines(__file__, "offload", args,
                         lambda r: (r.get("model"), r["engine"], r["context"]),
                         compare, plot, notes)  # fmt: skip
    print(table(rows))


if __name__ == "__main__":
    main()
