"""Where one decode layer's time goes, kernel by kernel, for variants of the decode kernels' launch
parameters (GPU).

    python benchmarks/decode_breakdown.py [--contexts 524288] [--out benchmarks/results]
        [--rope-pruning relative|chunk-indexed]

Llama-3-8B layer shapes and the paged layout of ``benchmarks/attention.py`` (its ``make_layer``),
preset ``3k-fast``. For each variant (a set of the kernels' module-level launch parameters) and
context it measures, with torch SDPA's dense decode as the reference in the same run:

- the reuse step per layer among 32 back-to-back layers in one CUDA graph (as a decode step runs),
  and each of its kernels' GPU µs (from ``torch.profiler``, kernels in launch order); the cascade
  sits behind the backend's graph gate (``ungated``: launched every step, top-k fused);
- a refresh at each level in a one-layer graph, and its kernels' µs;
- the amortized step per layer over the refresh schedule: the in-graph reuse step plus each
  refresh's extra over the one-layer reuse step;
- the variant's output against the first variant's (same masks, so the same attention).

Writes ``benchmarks/results/decode-breakdown-gpu[-ext].json``, a PNG and a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import attention as ab  # the kernel benchmark's layer and timing helpers
import common
from e2e import _kernel_spans
from vllm_infinitehip.kernels import triton_bsa, triton_decode
from vllm_infinitehip.kernels.graph_if import conditional_graphs_work

from vllm_infinitehip.config import InfiniteHiPConfig
from vllm_infinitehip.state import refresh_level

# name -> {(module, attribute): value, or "gated": bool}; the first is the code's default (the
# cascade behind the graph gate where conditional nodes work, as the backend runs it)
VARIANTS: dict[str, dict] = {
    "default": {},
    "ungated": {"gated": False},
    "tile64x2": {(triton_bsa, "_decode_tiling"): lambda d, r, b16=True: (64, 2, 4)},
    "tile128x1w8": {(triton_bsa, "_decode_tiling"): lambda d, r, b16=True: (128, 1, 8)},
    "heads4": {(triton_decode, "SELECT_HEADS"): 4},
    "unfused": {(triton_decode, "FUSED_TOP_MAX_CHUNKS"): 0},
}


def kernel_times(run, reps: int = 5) -> list[tuple[str, float]]:
    """(kernel, µs) of one ``run()``, in launch order, averaged over ``reps`` runs."""
    run()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        for _ in range(reps):
            run()
        torch.cuda.synchronize()
    spans = sorted(_kernel_spans(p), key=lambda span: span[1])  # (name, start, end)
    n = len(spans) // reps
    return [
        (spans[i][0][:40], sum(spans[r * n + i][2] - spans[r * n + i][1] for r in range(reps)) / reps)
        for i in range(n)
    ]


def graphed(fn):
    """A CUDA graph of ``fn``, warmed up first, as its replay."""
    for _ in range(3):
        fn()
    return ab.capture(fn)


def per_layer(times: list[tuple[str, float]], layers: int) -> list[tuple[str, float]]:
    """A ``layers``-layer graph's kernels folded to one layer's: each kernel's total over the
    graph / ``layers``, in order of first launch (a once-per-step launch, like the gate's
    handle setter, counts 1/``layers`` of itself)."""
    total: dict[str, float] = {}
    for name, us in times:
        total[name] = total.get(name, 0.0) + us
    return [(name, us / layers) for name, us in total.items()]


def run_variant(t: int, cfg: InfiniteHiPConfig, layer, gated: bool,
                rope_pruning: str | None = None) -> dict:  # fmt: skip
    params = ab.prune_params(cfg)
    kv, table, q, _ = layer
    dl = ab.DecodeLayer(params, t, table, q, kv, ab.D**-0.5, gated=gated,
                        rope_pruning=rope_pruning)  # fmt: skip
    n_stages = dl.n_stages
    out = dl.step().clone()  # level 0: fills the stored stage inputs
    row = {"levels": {}, "gated": gated}
    for level in range(n_stages + 1):
        dl.set_level(level)
        replay = graphed(dl.step)
        us, _ = ab.bench(replay, graph=False)
        row["levels"][str(level)] = {"us": us, "kernels": kernel_times(replay)}
    dl.set_level(n_stages)
    replay = graphed(dl.model_step)
    us, _ = ab.bench(replay, graph=False)
    row["reuse_in_graph_us"] = us / ab.LAYERS
    row["reuse_in_graph_kernels"] = per_layer(kernel_times(replay), ab.LAYERS)
    reuse_one = row["levels"][str(n_stages)]["us"]
    period = cfg.refresh_intervals[0]
    extra = sum(
        row["levels"][str(lv)]["us"] - reuse_one
        for lv in (refresh_level(s, cfg.refresh_intervals) for s in range(1, period + 1))
        if lv < n_stages
    )
    row["amortized_in_graph_us"] = row["reuse_in_graph_us"] + extra / period
    row["out"] = out
    return row


def print_table(rows: list[dict]) -> None:
    print("| context | variant | reuse in graph us | refresh us (L0 / L1 / L2) | amortized us | "
          "x SDPA |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        lv = " / ".join(f"{r['levels'][str(i)]['us']:.0f}" for i in range(3))
        print(f"| {r['context'] // 1024}K | {r['variant']} | {r['reuse_in_graph_us']:.1f} | {lv} | "
              f"{r['amortized_in_graph_us']:.1f} | {r['speedup_vs_dense_amortized']:.1f} |")


def dense_decode_us(t: int, layer) -> float:
    """torch SDPA's decode over the same context, contiguous K/V (the reference)."""
    kv, table, q, _ = layer
    k, v = ab.contiguous_kv(kv, table, t)
    kg, vg = k.permute(1, 0, 2).unsqueeze(0), v.permute(1, 0, 2).unsqueeze(0)
    qd = q.view(1, ab.HQ, 1, ab.D)
    us, _ = ab.bench(
        lambda: F.scaled_dot_product_attention(qd, kg, vg, scale=ab.D**-0.5, enable_gqa=True)
    )
    return us


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[524288])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--out", default=str(common.RESULTS))
    ap.add_argument("--rope-pruning", choices=("relative", "chunk-indexed"), default=None,
                    help="serve past the trained length: pruning in this RoPE style, "
                         "block-sparse attention StreamingLLM-style (results file -ext)")
    args = ap.parse_args(argv)
    cfg = InfiniteHiPConfig.from_user({"preset": "3k-fast"})
    date = datetime.date.today().isoformat()
    rows = []
    for t in args.contexts:
        layer = ab.make_layer(t, seed=t % 1000)
        dense_us = dense_decode_us(t, layer)
        base_out = None
        for name in args.variants:
            patch = {k: v for k, v in VARIANTS[name].items() if k != "gated"}
            gated = VARIANTS[name].get("gated", True) and conditional_graphs_work("cuda")
            saved = {key: getattr(*key) for key in patch}
            for (mod, attr), value in patch.items():
                setattr(mod, attr, value)
            try:
                r = run_variant(t, cfg, layer, gated, args.rope_pruning)
            finally:
                for (mod, attr), value in saved.items():
                    setattr(mod, attr, value)
            out = r.pop("out")
            base_out = out if base_out is None else base_out
            r.update(context=t, variant=name, decode_us_dense=dense_us,
                     rope_pruning=args.rope_pruning,
                     max_abs_diff_vs_first=float((out.float() - base_out.float()).abs().max()),
                     speedup_vs_dense_amortized=dense_us / r["amortized_in_graph_us"])  # fmt: skip
            rows.append(r)
            print(f"[breakdown] {t} {name}: reuse in graph {r['reuse_in_graph_us']:.1f} us, "
                  f"amortized {r['amortized_in_graph_us']:.1f} us, refresh "
                  + " / ".join(f"{r['levels'][str(lv)]['us']:.0f}" for lv in range(3))
                  + f", diff {r['max_abs_diff_vs_first']:.2e}", flush=True)  # fmt: skip
            print("    reuse kernels: " + ", ".join(f"{n} {us:.1f}" for n, us in r["reuse_in_graph_kernels"]))
            for lv in range(3):
                print(f"    level {lv} kernels: " + ", ".join(
                    f"{n} {us:.1f}" for n, us in r["levels"][str(lv)]["kernels"]))  # fmt: skip
        del layer
        torch.cuda.empty_cache()
    result = {"name": "decode-breakdown", "date": date, "gpu": torch.cuda.get_device_name(),
              "command": common.command_line(
                  None if argv is None else ["benchmarks/decode_breakdown.py", *argv]),
              "rows": rows}  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"decode-breakdown-gpu{'-ext' if args.rope_pruning else ''}.json"
    path.write_text(json.dumps(result, indent=1))
    from plot import plot_decode_breakdown

    plot_decode_breakdown(result, path.with_suffix(".png"))
    print_table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
