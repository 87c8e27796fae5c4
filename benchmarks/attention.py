"""One attention layer at long context: InfiniteHiP kernels vs dense, on the GPU.

    python benchmarks/attention.py [--contexts 32768 131072 524288 1048576] [--preset 3k-fast]
                                   [--baselines fa3 xformers]

Llama-3-8B layer shapes (32 q / 8 kv heads, d=128, bf16), batch 1, vLLM-style paged KV (16-token
pages in random order). For each context it measures, in the same run:

- dense: torch SDPA (flash) decode, and a 32K-query prefill chunk at the end of the context;
- dense baselines, each optional (``--baselines``) and allowed to fail without ending the run (the
  row then holds null and ``<field>_error``): vLLM's own FLASH_ATTN kernel (FA3 on Hopper) over its
  paged cache layout, and xformers' ``memory_efficient_attention_forward`` (whatever it dispatches
  to, plus its Triton split-K decode kernel), both checked against the SDPA output;
- ours, decode: a refresh step at each level (all stages; from stage 2; from stage 3) and a reuse
  step (block-sparse attention only), each as a CUDA graph replay when capture works, and the
  amortized cost over the preset's refresh schedule;
- ours, prefill: pruning + block-sparse attention for the same 32K-query chunk;
- the bandwidth floor of the bytes a reuse step must read, at the measured copy bandwidth;
- attention-mass recall: the share of the dense softmax mass (decode query) on the keys selected.

Keys hold planted structure (smooth bumps aligned with the query) so that recall means something.
Writes benchmarks/results/attention-<gpu|cpu>.json and prints tables; plot with
benchmarks/plot.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from vllm_infinitehip.kernels import decode as dec
from vllm_infinitehip.kernels import reference as ref
from vllm_infinitehip.kernels.graph_if import GraphIf, conditional_graphs_work
from vllm_infinitehip.kernels.triton_bsa import sparse_decode_attention, sparse_prefill_attention
from vllm_infinitehip.kernels.triton_decode import refresh_masks
from vllm_infinitehip.kernels.triton_prune import run_stages_paged

from vllm_infinitehip.config import InfiniteHiPConfig
from vllm_infinitehip.state import refresh_level

HQ, HKV, D = 32, 8, 128
PAGE = 16
PREFILL_CHUNK = 32768
BASELINES = ("fa3", "xformers")


def capture(fn):
    """A CUDA graph of ``fn`` (one warm-up call on a side stream first), as its replay."""
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        with torch.cuda.graph(g, stream=s):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    return g.replay


def bench(fn, graph: bool = True, warmup: int = 3, reps: int = 20) -> tuple[float, bool]:
    """Median µs of ``fn``; replays a CUDA graph of it when capture works (no host syncs)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    run = fn
    captured = False
    if graph:
        try:
            run, captured = capture(fn), True
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


LAYERS = 32


def bench_in_model(fn) -> float:
    """Median µs of one call among ``LAYERS`` back-to-back calls in one CUDA graph, as a decode
    step's layers run: no graph-launch latency in it (the one layer's KV stays warmer in L2 than
    32 layers' would)."""
    us, _ = bench(lambda: [fn() for _ in range(LAYERS)])
    return us / LAYERS


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


def dense_prefill_call(kg, vg, qp, t: int, scale: float):
    """torch SDPA's causal prefill of the chunk ``qp`` ``[nq, HQ, D]`` (the last ``nq``
    positions of ``t``) over ``kg``/``vg`` ``[1, HKV, t, D]``, as a call. The K/V heads are
    expanded here, outside any timing, since the lower-right causal path does not take GQA."""
    from torch.nn.attention.bias import causal_lower_right

    kd = kg.repeat_interleave(HQ // HKV, dim=1)
    vd = vg.repeat_interleave(HQ // HKV, dim=1)
    qpd = qp.permute(1, 0, 2).unsqueeze(0)
    mask = causal_lower_right(qp.shape[0], t)
    return lambda: F.scaled_dot_product_attention(qpd, kd, vd, attn_mask=mask, scale=scale)


class DecodeLayer:
    """One decode row's layer as the backend runs it: the pruning cascade, then split-K
    attention through the row's slot. ``gated`` (the backend where CUDA's conditional graph
    nodes work): the cascade sits in a graph_if region that a captured graph skips unless the
    row's level reruns a stage, with each stage's top-k in a launch of its own; otherwise the
    cascade launches every step with the top-k fused into SelectRep."""

    def __init__(self, params: ref.PruneParams, t: int, table, q, kv, scale: float,
                 gated: bool = True, rope_pruning: str | None = None) -> None:  # fmt: skip
        # rope_pruning: serve past the trained length (§2), the pruning stages in this style
        # ("relative" or "chunk-indexed") and block-sparse attention StreamingLLM-style
        self.placement = self.query_buffers = None
        if rope_pruning is not None:
            from vllm_infinitehip.kernels.rope import RopeTable
            from vllm_infinitehip.kernels.triton_decode import QueryPlacement

            rope = ref.RopePlan(RopeTable.default(D, 500000.0), pruning=rope_pruning,
                                bsa="streaming")  # fmt: skip
            params = dataclasses.replace(params, rope=rope)
            self.placement = QueryPlacement.build(rope_pruning, rope.table, params.scan_window,
                                                  q.device)  # fmt: skip
            self.query_buffers = torch.empty(2, 1, HQ, D, dtype=torch.float32, device=q.device)
        self.params, self.q, self.kv, self.scale = params, q, kv, scale
        # the row's device state, preallocated as the backend's is (no memset in a graph)
        i32 = dict(dtype=torch.int32, device="cuda")
        self.seq_lens = torch.tensor([t], **i32)
        self.btab = table.view(1, -1)
        self.masks = dec.DecodeMasks.allocate(params, params.stages[-1].keep_tokens, 1,
                                              table.device)  # fmt: skip
        self.scores = dec.allocate_scores(dec.stage_widths(params, t), 1, table.device)
        self.rows = dec.DecodeRows(self.btab, self.seq_lens, torch.zeros(1, **i32),
                                   torch.zeros(1, **i32))  # fmt: skip
        self.arrivals = torch.zeros(1, **i32)
        self.n_stages = len(params.stages)
        self.flag = torch.ones(1, dtype=torch.bool, device="cuda")
        # a gate per graph shape: each capture must open every region of its gate
        self.gates = {n: GraphIf(self.flag, n) for n in (1, LAYERS)} if gated else None

    def set_level(self, level: int) -> None:
        """The row's refresh level, and the flag the builder's slot kernel would set."""
        self.rows.levels.fill_(level)
        self.flag.fill_(level < self.n_stages)

    def attend(self, num_splits: int | None = None):
        p = self.params
        return sparse_decode_attention(
            self.q, self.kv, self.btab, self.seq_lens, self.masks.final,
            self.masks.final_counts(), block_size_k=p.block_size_k, sink_tokens=p.sink_tokens,
            window_tokens=p.window_tokens, scale=self.scale, row_slots=self.rows.slots,
            num_splits=num_splits, rope=p.rope.table if p.rope is not None else None,
        )  # fmt: skip

    def step(self, region: int = 0, layers: int = 1):
        gate = self.gates[layers].region(region) if self.gates else None
        refresh_masks(self.params, self.masks, self.q, self.kv, self.rows, self.scale,
                      self.scores, self.placement, arrivals=self.arrivals, gate=gate,
                      fuse_top=self.gates is None, query_buffers=self.query_buffers)  # fmt: skip
        return self.attend()

    def model_step(self) -> list:
        """``LAYERS`` layers back to back, as a decode step's graph holds them."""
        return [self.step(i, LAYERS) for i in range(LAYERS)]


def run_context(t: int, cfg: InfiniteHiPConfig, bw: float,
                baselines: tuple[str, ...] = BASELINES) -> dict:
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

    def dense_decode():
        return F.scaled_dot_product_attention(qd, kg, vg, scale=scale, enable_gqa=True)

    row["decode_us_dense"], _ = bench(dense_decode)
    ref_decode = dense_decode().view(HQ, D)
    nq = qp.shape[0]
    dense_prefill = dense_prefill_call(kg, vg, qp, t, scale)
    row["prefill_ms_dense"] = bench(dense_prefill, graph=False, reps=3)[0] / 1000
    ref_prefill = dense_prefill()[0].transpose(0, 1)  # [nq, HQ, D], as the baselines return it
    del dense_prefill, kg, vg

    # ---- ours: decode, as the backend runs it (DecodeLayer): the cascade, whose stages the row
    # joins by its refresh level (a device tensor), behind a gate that a graph skips on reuse
    # steps; then split-K BSA through the row's slot.
    pos = torch.tensor([t - 1], device="cuda")
    layer = DecodeLayer(params, t, table, q, kv, scale, gated=conditional_graphs_work("cuda"))
    row["decode_graph_gated"] = layer.gates is not None
    n_stages = layer.n_stages
    layer.step()  # level 0: fills the stored stage inputs the other levels resume from
    level_us = {}
    graphs = {}
    for level in range(n_stages + 1):
        layer.set_level(level)
        level_us[level], graphs[level] = bench(layer.step)
    reuse_us = level_us.pop(n_stages)
    attend_us, _ = bench(layer.attend)
    # per layer inside a step's graph: the reuse step, and attention alone at each split count
    layer.set_level(n_stages)
    row["decode_us_reuse_in_graph"] = bench(layer.model_step)[0] / LAYERS
    row["decode_us_attend_in_graph_by_splits"] = {
        str(n): bench_in_model(lambda n=n: layer.attend(n)) for n in (8, 16, 32, 48, 64)
    }
    layer.set_level(0)
    layer.step()
    masks = layer.masks
    sel = masks.prune_result(0)
    period = cfg.refresh_intervals[0]
    schedule = [refresh_level(s, cfg.refresh_intervals) for s in range(1, period + 1)]
    amortized = sum(level_us[lv] if lv < n_stages else reuse_us for lv in schedule) / period
    row.update(
        decode_us_refresh=level_us[0],
        decode_us_refresh_by_level={str(lv): us for lv, us in level_us.items()},
        decode_us_reuse=reuse_us,
        decode_us_attend_only=attend_us,
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

    # ---- other dense baselines, last: ours is measured even if one of them leaves the GPU broken
    refs = {"decode": ref_decode, "prefill": ref_prefill}
    if "fa3" in baselines:
        fa3_baseline(row, kv, table, q, qp, t, scale, refs)
        release()
    if "xformers" in baselines:
        xformers_baseline(row, k, v, q, qp, t, scale, refs)
        release()
    # a baseline not asked for is null without an error, so every row has the same fields
    for field in ("decode_us_fa3", "prefill_ms_fa3", "decode_us_xformers", "prefill_ms_xformers",
                  "decode_us_xformers_splitk"):
        row.setdefault(field, None)
    for name in BASELINES:
        row[f"decode_speedup_vs_{name}_amortized"] = ratio(row.get(f"decode_us_{name}"), amortized)
        row[f"prefill_speedup_vs_{name}"] = ratio(row.get(f"prefill_ms_{name}"), row["prefill_ms"])
    return row


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a / b


def release() -> None:
    try:
        torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - after a baseline broke the context, keep the row anyway
        pass


def one_line(e: BaseException) -> str:
    """The error on one line, long enough for xformers' list of kernels and why each refused."""
    return f"{type(e).__name__}: {' '.join(str(e).split())}"[:2000]


def skip(row: dict, fields: tuple[str, ...], e: BaseException) -> None:
    """A baseline that cannot run: its fields are null, with the reason beside each."""
    msg = one_line(e)
    for field in fields:
        row[field] = None
        row[f"{field}_error"] = msg
    print(f"  ({', '.join(fields)}: {msg[:300]})")


def measure(row: dict, field: str, run: Callable[[], torch.Tensor], ref: torch.Tensor) -> None:
    """Time one baseline call into ``row[field]`` (decode: µs, CUDA graph when it captures;
    prefill: ms, eager, as dense), after checking its output against dense SDPA's, since a wrong
    layout or mask would still time fine. Never raises."""
    try:
        out = run()
        diff = (out.reshape(ref.shape).float() - ref.float()).abs().max().item()
        row.setdefault("max_abs_diff_vs_dense", {})[field] = diff
        if field.startswith("decode"):
            row[field], captured = bench(run)
            row.setdefault("baseline_cuda_graph", {})[field] = captured
        else:
            row[field] = bench(run, graph=False, reps=3)[0] / 1000
    except Exception as e:  # noqa: BLE001 - a baseline must not end the run
        skip(row, (field,), e)
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001
            pass


def fa3_baseline(row, kv, table, q, qp, t: int, scale: float, refs: dict) -> None:
    """vLLM's FLASH_ATTN kernel (FA3) the way its backend calls it, over the same pages in the
    same order (block table = ours), in vLLM 0.26's cache layout: logical [blocks, H_kv, block,
    2*D] stored NHD, i.e. [blocks, block, H_kv, 2*D] with a token-head's K and V side by side; the
    backend hands FA3 the two strided halves. 16-token blocks, vLLM's CUDA default (FLASH_ATTN
    takes any multiple of 16)."""
    fields = ("decode_us_fa3", "prefill_ms_fa3")
    try:
        from vllm.vllm_flash_attn import (
            fa_version_unsupported_reason,
            flash_attn_varlen_func,
            is_fa_version_supported,
        )

        if not is_fa_version_supported(3):
            raise RuntimeError(fa_version_unsupported_reason(3))
        cache = torch.empty(kv.shape[0], PAGE, HKV, 2 * D, device=kv.device, dtype=kv.dtype)
        cache[..., :D] = kv[:, 0]
        cache[..., D:] = kv[:, 1]
    except Exception as e:  # noqa: BLE001 - no vLLM, no FA3 build, or no memory: skip it
        skip(row, fields, e)
        return
    key_cache, value_cache = cache.split(D, dim=-1)
    block_table = table.view(1, -1)
    seqused_k = torch.tensor([t], device=kv.device, dtype=torch.int32)

    def call(qq):
        # everything the call reads is made here, outside any graph capture
        nq = qq.shape[0]
        cu_seqlens_q = torch.tensor([0, nq], device=kv.device, dtype=torch.int32)
        out = torch.empty_like(qq)

        # num_splits=0: FA3's own split heuristic, as vLLM runs it outside full CUDA graphs
        def run():
            return flash_attn_varlen_func(
                q=qq, k=key_cache, v=value_cache, out=out, cu_seqlens_q=cu_seqlens_q,
                max_seqlen_q=nq, seqused_k=seqused_k, max_seqlen_k=t, softmax_scale=scale,
                causal=True, block_table=block_table, fa_version=3,
            )
        return run

    measure(row, "decode_us_fa3", call(q), refs["decode"])
    measure(row, "prefill_ms_fa3", call(qp), refs["prefill"])


def xformers_baseline(row, k, v, q, qp, t: int, scale: float, refs: dict) -> None:
    """xformers.ops.fmha on the contiguous K/V (its paged path needs the flash_attn package), GQA
    as 5-D [B, M, G, H, K] with the K/V heads broadcast (stride 0), so nothing is copied. Without
    its compiled extension it dispatches to PyTorch's flash / mem-efficient kernels or its Triton
    split-K; the op picked goes in the row. The prefill chunk's mask is causal from the bottom
    right: the chunk's last query sees the last key."""
    fields = ("decode_us_xformers", "prefill_ms_xformers", "decode_us_xformers_splitk")
    try:
        from xformers.ops import fmha
    except Exception as e:  # noqa: BLE001
        skip(row, fields, e)
        return
    g = HQ // HKV
    kx = k.view(1, t, HKV, 1, D).expand(1, t, HKV, g, D)
    vx = v.view(1, t, HKV, 1, D).expand(1, t, HKV, g, D)
    qdx = q.view(1, 1, HKV, g, D)
    qpx = qp.view(1, qp.shape[0], HKV, g, D)
    causal = fmha.attn_bias.LowerTriangularFromBottomRightMask()

    def attend(qq, bias=None, op=None):
        return lambda: fmha.memory_efficient_attention_forward(
            qq, kx, vx, attn_bias=bias, scale=scale, op=op
        )

    try:  # private API, only to say which kernel the numbers belong to
        row["xformers_ops"] = {
            name: fmha._dispatch_fw(
                fmha.Inputs(query=qq, key=kx, value=vx, attn_bias=bias, scale=scale), False
            ).NAME
            for name, qq, bias in (("decode", qdx, None), ("prefill", qpx, causal))
        }
    except Exception as e:  # noqa: BLE001
        row["xformers_ops"] = {"error": one_line(e)}
    measure(row, "decode_us_xformers", attend(qdx), refs["decode"])
    measure(row, "prefill_ms_xformers", attend(qpx, causal), refs["prefill"])
    # the default dispatch sends a GQA decode to PyTorch's own flash kernel; split-K is xformers'
    try:
        splitk = fmha.triton_splitk.FwOp
    except Exception as e:  # noqa: BLE001
        skip(row, ("decode_us_xformers_splitk",), e)
        return
    measure(row, "decode_us_xformers_splitk", attend(qdx, op=splitk), refs["decode"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+",
                        default=[32768, 131072, 524288, 1048576])
    parser.add_argument("--preset", default="3k-fast")
    parser.add_argument("--baselines", nargs="*", choices=BASELINES, default=list(BASELINES),
                        help="dense baselines besides SDPA (none: just --baselines)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    return parser.parse_args(argv)


def main() -> int:
    import common  # benchmarks/common.py, beside this file

    args = parse_args()
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
        "command": common.command_line(),
        "copy_bandwidth_TBps": bw / 1e12,
        "baselines": list(args.baselines),
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = "gpu" if torch.cuda.is_available() else "cpu"
    path = out / f"attention-{tag}.json"
    for t in args.contexts:
        row = run_context(t, cfg, bw, tuple(args.baselines))
        rows.append(row)
        print(json.dumps(row))
        path.write_text(json.dumps(result, indent=2))  # keep what is done if a later size fails
        torch.cuda.empty_cache()
    print_table(result)
    print(f"wrote {path}")
    return 0


def _cell(r: dict, key: str, width: int, fmt: str) -> str:
    value = r.get(key)
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{fmt}}"


def print_table(result: dict) -> None:
    """Decode and prefill tables; '-' where a baseline was not run or failed (reasons below)."""
    rows = result["rows"]
    decode = [("context", "context", 8, "d"),
              ("dense µs", "decode_us_dense", 9, ".1f"),
              ("fa3 µs", "decode_us_fa3", 9, ".1f"),
              ("xf µs", "decode_us_xformers", 9, ".1f"),
              ("xf-splitk", "decode_us_xformers_splitk", 9, ".1f"),
              ("refresh µs", "decode_us_refresh", 10, ".1f"),
              ("reuse µs", "decode_us_reuse", 9, ".1f"),
              ("in-graph", "decode_us_reuse_in_graph", 9, ".1f"),
              ("amort µs", "decode_us_amortized", 9, ".1f"),
              ("×dense", "decode_speedup_vs_dense_amortized", 7, ".2f"),
              ("×fa3", "decode_speedup_vs_fa3_amortized", 7, ".2f"),
              ("×xf", "decode_speedup_vs_xformers_amortized", 7, ".2f"),
              ("recall", "recall_decode", 7, ".3f")]
    prefill = [("context", "context", 8, "d"),
               ("dense ms", "prefill_ms_dense", 9, ".1f"),
               ("fa3 ms", "prefill_ms_fa3", 9, ".1f"),
               ("xf ms", "prefill_ms_xformers", 9, ".1f"),
               ("ours ms", "prefill_ms", 9, ".1f"),
               ("×dense", "prefill_speedup_vs_dense", 7, ".2f"),
               ("×fa3", "prefill_speedup_vs_fa3", 7, ".2f"),
               ("×xf", "prefill_speedup_vs_xformers", 7, ".2f")]
    for title, cols in (("decode, one layer (× = baseline / ours amortized)", decode),
                        (f"{PREFILL_CHUNK // 1024}K-query prefill chunk (× = baseline / ours)",
                         prefill)):
        print(title)
        print(" ".join(f"{name:>{w}}" for name, _, w, _ in cols))
        for r in rows:
            print(" ".join(_cell(r, key, w, fmt) for _, key, w, fmt in cols))
    for r in rows:
        by_splits = r.get("decode_us_attend_in_graph_by_splits")
        if by_splits:
            cells = ", ".join(f"{n}: {us:.1f}" for n, us in by_splits.items())
            print(f"{r['context']:>8} attention µs per layer in a graph, by split count: {cells}")
        for key in sorted(k for k in r if k.endswith("_error")):
            print(f"{r['context']:>8} {key}: {r[key][:300]}")
        if r.get("xformers_ops"):
            print(f"{r['context']:>8} xformers ops: {str(r['xformers_ops'])[:300]}")


if __name__ == "__main__":
    raise SystemExit(main())
