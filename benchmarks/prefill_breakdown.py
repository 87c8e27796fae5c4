"""Where one sparse prefill chunk's time goes, kernel by kernel, with and without RoPE remapping,
for variants of the pruning kernel's launch configuration (GPU).

    python benchmarks/prefill_breakdown.py [--contexts 131072] [--out benchmarks/results]

Llama-3-8B layer shapes and the paged layout of ``benchmarks/attention.py`` (its ``make_layer``),
preset ``3k-fast``, one 32K-query chunk at the end of the context, as the backend prunes and
attends it on the GPU (``TritonOps``: ``run_stages_paged`` with tf32 scoring, then
``sparse_prefill_attention``). Per context, RoPE mode (``off``; ``relative`` and
``chunk-indexed`` pruning with StreamingLLM-style attention, as past the trained length) and
variant (``triton_prune._launch_config``; the first is the code's), with torch SDPA's dense
prefill of the same chunk as the reference in the same run:

- the chunk's pruning and attention ms (eager, as the backend runs prefill), and each kernel's
  GPU ms from ``torch.profiler``;
- the variant's selections against the first variant's (the launch configuration must not
  change what is selected);
- with ``--representatives bisection landmark``, the same with the stages scoring chunks by
  landmark representatives (``prefill_representatives``): the chunk's landmark addition
  (``landmark_ms``, in the pruning time; the earlier chunks' additions made before, with the
  chunk's queries standing in for theirs) and ``final_overlap`` against bisection's blocks;
  ``group-bisection``: the query heads of a KV group bisecting one path;
- with ``--first-stage-block 64 128 256``, the same with the first pruning stage scoring query
  blocks of that many queries (``query_stride`` scaled to keep 16 pooled queries; the later
  stages keep 64: neighbouring blocks share the first stage's work), and ``final_overlap``: the
  share of the 64-query first stage's final blocks that this one also selects.

Writes ``benchmarks/results/prefill-breakdown-gpu.json``, a PNG and a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import attention as ab  # the kernel benchmark's layer and timing helpers
import common
from decode_breakdown import kernel_times
from vllm_infinitehip.kernels import reference as ref
from vllm_infinitehip.kernels import triton_prune
from vllm_infinitehip.kernels.query_blocks import LandmarkTiles
from vllm_infinitehip.kernels.rope import RopeTable
from vllm_infinitehip.kernels.triton_bsa import sparse_prefill_attention
from vllm_infinitehip.kernels.triton_landmark import landmark_accumulate_tiles

from vllm_infinitehip.config import PREFILL_REPRESENTATIVES, InfiniteHiPConfig

# name -> _launch_config(head_dim, rope) replacement, or None for the code's own
# (measured on an H200: the whole tile with pipelining and a rotation needed more shared memory
# than it has)
VARIANTS = {
    "default": None,
    "half-tile": lambda d, rope=False: ((32 if d > 128 else 64) // 2, 8, 1 if rope else 3),
}
ROPE_MODES = ("off", "relative", "chunk-indexed")


def chunk_runner(params: ref.PruneParams, t: int, layer, scale: float,
                 landmarks: torch.Tensor | None = None):  # fmt: skip
    """``(prune, attend)`` of the chunk, as ``TritonOps.prune`` / ``attend`` call the kernels
    (``landmarks``: the layer's landmark state, the chunk's queries already added)."""
    kv, table, _, qp = layer
    ppos = torch.arange(t - qp.shape[0], t, device="cuda")
    streaming = params.rope is not None and params.rope.bsa == "streaming"

    def prune():
        return triton_prune.run_stages_paged(params, qp, kv, table, ppos, scale, seq_len=t,
                                             precision="tf32", landmarks=landmarks)  # fmt: skip

    def attend(sel):
        return sparse_prefill_attention(
            qp, kv, table, t, sel.block_starts.to(torch.int32), sel.block_valid,
            block_size_q=params.block_size_q, block_size_k=params.block_size_k,
            sink_tokens=params.sink_tokens, window_tokens=params.window_tokens, scale=scale,
            rope=params.rope.table if streaming else None,
        )  # fmt: skip

    return prune, attend


def landmark_layer(t: int, cfg: InfiniteHiPConfig, layer, scale: float):
    """The layer's landmark state with every chunk before the measured one added (its queries
    stand in for theirs), and the measured chunk's own addition as a call to time."""
    kv, table, _, qp = layer
    n, window = qp.shape[0], cfg.landmark_window
    state = torch.zeros(kv.shape[0], kv.shape[2], kv.shape[3] + 1, device="cuda")
    for lo in range(0, t - n, n):
        size = min(n, t - n - lo)
        tiles = LandmarkTiles.single(size, lo, window, qp.device)
        landmark_accumulate_tiles(qp[:size], kv, table.view(1, -1), tiles, state, scale,
                                  window=window)  # fmt: skip
    tiles = LandmarkTiles.single(n, t - n, window, qp.device)
    before = state.clone()

    def add():
        state.copy_(before)
        landmark_accumulate_tiles(qp, kv, table.view(1, -1), tiles, state, scale, window=window)

    add()
    return state, add


def run_mode(t: int, cfg: InfiniteHiPConfig, layer, mode: str) -> dict:
    params = dataclasses.replace(ab.prune_params(cfg), group_probes=cfg.prefill_group_probes)
    if mode != "off":
        rope = ref.RopePlan(RopeTable.default(ab.D, 500000.0), pruning=mode, bsa="streaming")
        params = dataclasses.replace(params, rope=rope)
    scale = ab.D**-0.5
    state, add = None, None
    if cfg.prefill_representatives == "landmark":
        state, add = landmark_layer(t, cfg, layer, scale)
    prune, attend = chunk_runner(params, t, layer, scale, state)
    sel = prune()
    prune_ms = ab.bench(prune, graph=False, reps=3)[0] / 1000
    attend_ms = ab.bench(lambda: attend(sel), graph=False, reps=3)[0] / 1000
    # the chunk's landmark addition (with the copy that resets the state, timed apart)
    landmark_ms = 0.0 if add is None else ab.bench(add, graph=False, reps=3)[0] / 1000
    kernels: dict[str, float] = {}
    for name, us in kernel_times(lambda: attend(prune()), reps=2):
        kernels[name] = kernels.get(name, 0.0) + us / 1000
    if add is not None:
        for name, us in kernel_times(add, reps=2):
            if "landmark" in name:
                kernels[name] = kernels.get(name, 0.0) + us / 1000
    return {"prune_ms": prune_ms + landmark_ms, "attend_ms": attend_ms,
            "landmark_ms": landmark_ms, "kernels_ms": kernels, "sel": sel}


def with_first_stage_block(cfg: InfiniteHiPConfig, block: int) -> InfiniteHiPConfig:
    """``cfg`` with its first stage scoring blocks of ``block`` queries, 16 pooled per block."""
    first = dataclasses.replace(cfg.stages[0], block_size_q=block, query_stride=max(1, block // 16))
    return InfiniteHiPConfig.from_user({**cfg.to_dict(),
                                        "stages": [dataclasses.asdict(st) for st in
                                                   (first, *cfg.stages[1:])]})  # fmt: skip


def selection_overlap(sel: ref.PruneResult, base: ref.PruneResult) -> float:
    """The share of ``base``'s valid (query block, block start) pairs that ``sel`` also has."""
    def pairs(r):
        rows = torch.arange(r.block_starts.shape[0], device=r.block_starts.device)
        rows = rows.view(-1, 1).expand_as(r.block_starts)
        return set(zip(rows[r.block_valid].tolist(), r.block_starts[r.block_valid].tolist()))

    want = pairs(base)
    return len(pairs(sel) & want) / max(1, len(want))


def print_table(rows: list[dict]) -> None:
    print("| context | rope | representatives | first-stage b_q | variant | prune ms | attend ms "
          "| chunk ms | x SDPA | same selection | final overlap |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['context'] // 1024}K | {r['rope']} | {r['representatives']} | "
              f"{r['first_stage_block_q']} | {r['variant']} | {r['prune_ms']:.1f} | "
              f"{r['attend_ms']:.1f} | "
              f"{r['chunk_ms']:.1f} | {r['speedup_vs_dense']:.1f} | "
              f"{r['same_selection_as_first']} | {r['final_overlap']:.3f} |")  # fmt: skip


def dense_prefill_ms(t: int, layer) -> float:
    """torch SDPA's causal prefill of the same chunk (K/V heads expanded outside the timing)."""
    kv, table, _, qp = layer
    k, v = ab.contiguous_kv(kv, table, t)
    kg, vg = k.permute(1, 0, 2).unsqueeze(0), v.permute(1, 0, 2).unsqueeze(0)
    return ab.bench(ab.dense_prefill_call(kg, vg, qp, t, ab.D**-0.5), graph=False,
                    reps=3)[0] / 1000  # fmt: skip


def write_rows(rows: list[dict], date: str, argv: list[str] | None,
               out: str) -> tuple[dict, Path]:  # fmt: skip
    """The result file with the rows so far; returns its content and path."""
    result = {"name": "prefill-breakdown", "date": date, "gpu": torch.cuda.get_device_name(),
              "command": common.command_line(
                  None if argv is None else ["benchmarks/prefill_breakdown.py", *argv]),
              "rows": rows}  # fmt: skip
    path = Path(out) / "prefill-breakdown-gpu.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    return result, path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[131072])
    ap.add_argument("--rope", nargs="+", choices=ROPE_MODES, default=list(ROPE_MODES))
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--first-stage-block", type=int, nargs="+", default=[64],
                    help="query block sizes of the first pruning stage (the first is the base)")
    ap.add_argument("--representatives", nargs="+", choices=list(PREFILL_REPRESENTATIVES),
                    default=["bisection"], help="the prefill's chunk representatives "
                    "(config prefill_representatives; the first is the base of final_overlap)")
    ap.add_argument("--out", default=str(common.RESULTS))
    args = ap.parse_args(argv)
    date = datetime.date.today().isoformat()
    rows = []
    base_sel: dict[tuple, ref.PruneResult] = {}
    original = triton_prune._launch_config
    for t in args.contexts:
        layer = ab.make_layer(t, seed=t % 1000)
        dense_ms = dense_prefill_ms(t, layer)
        for mode, block, reps in [(m, b, r) for m in args.rope for r in args.representatives
                                  for b in args.first_stage_block]:  # fmt: skip
            base = InfiniteHiPConfig.from_user({"preset": "3k-fast",
                                                "prefill_representatives": reps})
            cfg = with_first_stage_block(base, block)
            first_sel = None
            for name in args.variants:
                triton_prune._launch_config = VARIANTS[name] or original
                try:
                    r = run_mode(t, cfg, layer, mode)
                finally:
                    triton_prune._launch_config = original
                sel = r.pop("sel")
                first_sel = sel if first_sel is None else first_sel
                same = bool(torch.equal(sel.block_valid, first_sel.block_valid)
                            and torch.equal(sel.block_starts[sel.block_valid],
                                            first_sel.block_starts[first_sel.block_valid]))
                if block == args.first_stage_block[0] and reps == args.representatives[0]:
                    base_sel[(t, mode, name)] = sel
                r.update(context=t, rope=mode, variant=name, first_stage_block_q=block,
                         representatives=reps,
                         prefill_ms_dense=dense_ms, chunk_ms=r["prune_ms"] + r["attend_ms"],
                         same_selection_as_first=same)  # fmt: skip
                r["final_overlap"] = selection_overlap(sel, base_sel[(t, mode, name)])
                r["speedup_vs_dense"] = dense_ms / r["chunk_ms"]
                rows.append(r)
                write_rows(rows, date, argv, args.out)  # each row as it comes: a later one may fail
                top = sorted(r["kernels_ms"].items(), key=lambda kv: -kv[1])[:6]
                print(f"[prefill] {t} {mode} {reps} {name}: prune {r['prune_ms']:.1f} ms, attend "
                      f"{r['attend_ms']:.1f} ms, same selection {same}; kernels "
                      + ", ".join(f"{n} {ms:.1f}" for n, ms in top), flush=True)  # fmt: skip
        del layer
        torch.cuda.empty_cache()
    result, path = write_rows(rows, date, argv, args.out)
    from plot import plot_prefill_breakdown

    plot_prefill_breakdown(result, path.with_suffix(".png"))
    print_table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
