"""One attention layer at long context: InfiniteHiP kernels vs dense, on the GPU.

    python benchmarks/attention.py [--contexts 32768 131072 524288 1048576] [--preset 3k-fast]

Llama-3-8B layer shapes (32 q / 8 kv heads, d=128, bf16), batch 1, vLLM-style paged KV (16-token
pages in random order). For each context it measures, in the same run:

- dense: torch SDPA (flash) decode, and a 32K-query prefill chunk at the end of the context;
- ours, decode: a refresh step at each level (all stages; from stage 2; from stage 3) and a reuse
  step (block-sparse attention only), each as a CUDA graph replay when capture works, and the
  amortized cost over the preset's refresh schedule;
- ours, prefill: pruning + block-sparse attention for the same 32K-query chunk;
- the bandwidth floor of the bytes a reuse step must read, at the measured copy bandwidth;
- attention-mass recall: the share of the dense softmax mass (decode query) on the keys selected.

Keys carry planted structure (smooth bumps aligned with the query) so that recall means something.
Writes benchmarks/results/attention-<gpu>-<date>.json and prints a table; plot with
benchmarks/plot.py.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from vllm_infinitehip.config import InfiniteHiPConfig
from vllm_infinitehip.kernels import reference as ref
from vllm_infinitehip.kernels.triton_bsa import sparse_decode_attention, sparse_prefill_attention
from vllm_infinitehip.kernels.triton_prune import run_stages_paged
from vllm_infinitehip.mask_state import refresh_level

HQ, HKV, D = 32, 8, 128
PAGE = 16
PREFILL_CHUNK = 32768


def bench(fn, graph: bool = True, warmup: int = 3, reps: int = 20) -> tuple[float, bool]:
    """Median µs of ``fn``; replays a CUDA graph of it when capture works (no host syncs)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    run = fn
    captured = False
    if graph:
        try:
            g = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                fn()
                with torch.cuda.graph(g, stream=s):
                    fn()
            torch.cuda.current_stream().wait_stream(s)
            torch.cuda.synchronize()
            run, captured = g.replay, True
        except Exception as e:  # noqa: BLE001 - report and fall back to eager timing
            print(f"  (graph capture failed: {type(e).__name__}: {str(e)[:120]}; eager timing)")
            torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000)
    times.sort()
    return times[len(times) // 2], captured


def copy_bandwidth() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    us, _ = bench(lambda: y.copy_(x), graph=False)
    return 2 * x.numel() / (us * 1e-6)


def make_layer(t: int, seed: int):
    """Paged K/V for one layer with planted bumps, the decode query, and a 32K prefill chunk."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    n_pages = (t + PAGE - 1) // PAGE
    kv = torch.randn(n_pages, 2, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    q = torch.randn(1, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    # Bumps: 32 spans of 64 keys whose keys lean towards the decode query (smooth, as in real
    # models), at random places outside the window.
    direction = q[0].float().view(HKV, HQ // HKV, D).mean(1)
    table = torch.randperm(n_pages, device="cuda", generator=g).to(torch.int32)
    centers = torch.randint(4096, max(4097, t - 4096), (32,), device="cuda", generator=g)
    kflat = kv[:, 0]  # [pages, PAGE, HKV, D] viewed by physical page
    for c in centers.tolist():
        for j in range(-32, 33, 4):
            tok = c + j
            page, off = table[tok // PAGE].item(), tok % PAGE
            w = 2.5 * (1 - abs(j) / 33)
            kflat[page, off] += (direction * w).to(torch.bfloat16)
    qp = torch.randn(min(PREFILL_CHUNK, t), HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    return kv, table, q, qp


def contiguous_kv(kv, table, t):
    k = kv[table.long(), 0].reshape(-1, HKV, D)[:t]
    v = kv[table.long(), 1].reshape(-1, HKV, D)[:t]
    return k, v


def prune_params(cfg: InfiniteHiPConfig) -> ref.PruneParams:
    stages = tuple(
        ref.StageParams(s.chunk_size, s.keep_tokens, s.block_size_q, s.query_stride)
        for s in cfg.stages
    )
    return ref.PruneParams(cfg.sink_tokens, cfg.window_tokens, stages, cfg.probe)


def run_context(t: int, cfg: InfiniteHiPConfig, bw: float) -> dict:
    params = prune_params(cfg)
    scale = D**-0.5
    kv, table, q, qp = make_layer(t, seed=t % 1000)
    k, v = contiguous_kv(kv, table, t)
    row = {"context": t, "preset": cfg.preset}

    # ---- dense decode and prefill (SDPA picks flash for bf16 on Hopper). Decode reads the 8 KV
    # heads once (GQA); the prefill chunk gets K/V heads expanded outside the timed region, since
    # the lower-right causal path does not take GQA.
    qd = q.view(1, HQ, 1, D)
    kg, vg = k.permute(1, 0, 2).unsqueeze(0), v.permute(1, 0, 2).unsqueeze(0)
    row["decode_us_dense"], _ = bench(
        lambda: F.scaled_dot_product_attention(qd, kg, vg, scale=scale, enable_gqa=True)
    )
    kd = kg.repeat_interleave(HQ // HKV, dim=1)
    vd = vg.repeat_interleave(HQ // HKV, dim=1)
    nq = qp.shape[0]
    qpd = qp.permute(1, 0, 2).unsqueeze(0)
    from torch.nn.attention.bias import causal_lower_right

    mask = causal_lower_right(nq, t)
    row["prefill_ms_dense"] = bench(
        lambda: F.scaled_dot_product_attention(qpd, kd, vd, attn_mask=mask, scale=scale),
        graph=False, reps=3,
    )[0] / 1000
    del kd, vd, kg, vg

    # ---- ours: decode
    pos = torch.tensor([t - 1], device="cuda")
    seq_lens = torch.tensor([t], device="cuda", dtype=torch.int32)
    btab = table.view(1, -1)
    state: dict[str, ref.PruneResult] = {}

    def refresh(level: int):
        def step():
            cached = state["full"]
            start = None if level == 0 else cached.stage_inputs[level]
            prune = run_stages_paged(params, q, kv, table, pos, scale, start_stage=level,
                                     start_input=start, seq_len=t)
            n_valid = prune.block_valid.sum(1).to(torch.int32)
            return sparse_decode_attention(
                q, kv, btab, seq_lens, prune.block_starts.to(torch.int32), n_valid,
                block_size_k=params.block_size_k, sink_tokens=params.sink_tokens,
                window_tokens=params.window_tokens, scale=scale,
            )
        return step

    state["full"] = run_stages_paged(params, q, kv, table, pos, scale, seq_len=t)
    sel = state["full"]
    sel_starts = sel.block_starts.to(torch.int32)
    sel_valid = sel.block_valid.sum(1).to(torch.int32)

    def reuse():
        return sparse_decode_attention(
            q, kv, btab, seq_lens, sel_starts, sel_valid, block_size_k=params.block_size_k,
            sink_tokens=params.sink_tokens, window_tokens=params.window_tokens, scale=scale,
        )

    n_stages = len(params.stages)
    level_us = {}
    graphs = {}
    for level in range(n_stages):
        level_us[level], graphs[level] = bench(refresh(level))
    reuse_us, graphs["reuse"] = bench(reuse)
    period = cfg.refresh_intervals[0]
    schedule = [refresh_level(s, cfg.refresh_intervals) for s in range(1, period + 1)]
    amortized = sum(level_us[lv] if lv < n_stages else reuse_us for lv in schedule) / period
    row.update(
        decode_us_refresh=level_us[0],
        decode_us_refresh_by_level={str(lv): us for lv, us in level_us.items()},
        decode_us_reuse=reuse_us,
        decode_us_amortized=amortized,
        decode_speedup_vs_dense_amortized=row["decode_us_dense"] / amortized,
        decode_cuda_graph=all(graphs.values()),
    )
    attended_tokens = params.sink_tokens + params.window_tokens + params.stages[-1].keep_tokens
    floor_bytes = attended_tokens * HKV * D * 2 * 2
    row["decode_us_floor_reuse"] = floor_bytes / bw * 1e6

    # ---- recall of the decode query's dense softmax mass
    logits = torch.einsum("hgd,thd->hgt", q[0].view(HKV, HQ // HKV, D), k).float()
    probs = torch.softmax(logits.view(HQ, t) * scale, dim=-1)
    del logits
    keymask = ref.sparse_key_mask(params, t, pos, sel.block_starts, sel.block_valid)[0]
    row["recall_decode"] = float((probs * keymask).sum(-1).mean())
    del probs

    # ---- ours: 32K-query prefill chunk at the end of the context
    ppos = torch.arange(t - nq, t, device="cuda")

    def prefill():
        prune = run_stages_paged(params, qp, kv, table, ppos, scale, seq_len=t)
        return sparse_prefill_attention(
            qp, kv, table, t, prune.block_starts.to(torch.int32), prune.block_valid,
            block_size_q=params.block_size_q, block_size_k=params.block_size_k,
            sink_tokens=params.sink_tokens, window_tokens=params.window_tokens, scale=scale,
        )

    row["prefill_ms"] = bench(prefill, graph=False, reps=5)[0] / 1000
    row["prefill_ms_prune"] = bench(
        lambda: run_stages_paged(params, qp, kv, table, ppos, scale, seq_len=t), graph=False,
        reps=5,
    )[0] / 1000
    row["prefill_speedup_vs_dense"] = row["prefill_ms_dense"] / row["prefill_ms"]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+",
                        default=[32768, 131072, 524288, 1048576])
    parser.add_argument("--preset", default="3k-fast")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    cfg = InfiniteHiPConfig.from_user({"preset": args.preset})
    bw = copy_bandwidth()
    gpu = torch.cuda.get_device_name()
    print(f"{gpu}: copy bandwidth {bw / 1e12:.2f} TB/s; preset {cfg.summary()}")
    rows = []
    date = datetime.date.today().isoformat()
    result = {
        "name": "attention",
        "date": date,
        "gpu": gpu,
        "command": "python " + " ".join(sys.argv),
        "copy_bandwidth_TBps": bw / 1e12,
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = "gpu" if torch.cuda.is_available() else "cpu"
    path = out / f"attention-{tag}-{date}.json"
    for t in args.contexts:
        row = run_context(t, cfg, bw)
        rows.append(row)
        print(json.dumps(row))
        path.write_text(json.dumps(result, indent=2))  # keep what is done if a later size fails
        torch.cuda.empty_cache()
    print_table(result)
    print(f"wrote {path}")
    return 0


def print_table(result: dict) -> None:
    hdr = (f"{'context':>8} {'dec dense µs':>12} {'refresh µs':>10} {'reuse µs':>9} "
           f"{'amort µs':>9} {'dec ×':>7} {'pre dense ms':>12} {'pre ms':>8} {'pre ×':>7} {'recall':>7}")
    print(hdr)
    for r in result["rows"]:
        print(f"{r['context']:>8} {r['decode_us_dense']:>12.1f} {r['decode_us_refresh']:>10.1f} "
              f"{r['decode_us_reuse']:>9.1f} {r['decode_us_amortized']:>9.1f} "
              f"{r['decode_speedup_vs_dense_amortized']:>7.1f} {r['prefill_ms_dense']:>12.1f} "
              f"{r['prefill_ms']:>8.1f} {r['prefill_speedup_vs_dense']:>7.1f} {r['recall_decode']:>7.3f}")


if __name__ == "__main__":
    raise SystemExit(main())
