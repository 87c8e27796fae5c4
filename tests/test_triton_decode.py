"""The batched decode cascade and the fused top-k / sort / split against the PyTorch reference.

Without a GPU the kernels run in Triton's CPU interpreter (set up as in test_triton_prune.py);
with one, the same cases run compiled on it. The oracle is :mod:`kernels.decode`'s reference,
i.e. :func:`reference.run_stages` row by row, whose top-k is ``torch.topk`` plus a stable sort:
no code is shared with the kernels.
"""

from __future__ import annotations

import dataclasses
import os

import torch

if not torch.cuda.is_available():
    os.environ["_TRITON_INTERPRET_BEFORE"] = os.environ.get("TRITON_INTERPRET", "<unset>")
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from vllm_infinitehip.kernels import decode as dec
from vllm_infinitehip.kernels import reference as ref
from vllm_infinitehip.kernels import triton_bsa
from vllm_infinitehip.kernels import triton_decode as td
from vllm_infinitehip.kernels import triton_topk
from vllm_infinitehip.kernels.rope import RopeTable

from tests.helpers import interpret

HAS_CUDA = torch.cuda.is_available()
_SAVED_INTERPRET = interpret.take_saved()

INTERPRETED = isinstance(td._top_chunks_kernel, InterpretedFunction) and isinstance(
    tl.max, InterpretedFunction
)
DEVICE = "cpu" if INTERPRETED else "cuda"

pytestmark = interpret.module_marks(INTERPRETED, HAS_CUDA)


@pytest.fixture(autouse=True, scope="module")
def _interpreter_env():
    yield from interpret.scoped_env(INTERPRETED, _SAVED_INTERPRET)


def rope_plan(style: str | None, d: int, layout: str = "neox") -> ref.RopePlan | None:
    """Pruning in ``style`` with streaming block-sparse attention; None: no RoPE remapping.
    ``layout`` ``"gptj-partial"``: GPT-J pairs over the first 3/4 of the head only."""
    if style is None:
        return None
    if layout == "gptj-partial":
        table = RopeTable(RopeTable.default(d * 3 // 4, 10000.0).inv_freq, is_neox=False)
    else:
        table = RopeTable.default(d, 10000.0)
    return ref.RopePlan(table, pruning=style, bsa="streaming")


def small_params(rope: ref.RopePlan | None = None, final_keep: int = 64) -> ref.PruneParams:
    stages = (
        ref.StageParams(64, 512, 32, 4),
        ref.StageParams(16, 256, 32, 4),
        ref.StageParams(8, final_keep, 32, 1),
    )
    return ref.PruneParams(sink_tokens=16, window_tokens=128, stages=stages, rope=rope)


def batch(seq_lens: list[int], hq: int, hkv: int, d: int, page: int, gen: torch.Generator):
    """A paged fp32 cache holding every row's keys in shuffled pages, queries and block table."""
    pages = [-(-t // page) for t in seq_lens]
    num_pages = sum(pages) + 3
    cache = torch.randn(num_pages, 2, page, hkv, d, generator=gen)
    perm = torch.randperm(num_pages, generator=gen).to(torch.int32)
    width = max(pages) + 2
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    at = 0
    for b, n in enumerate(pages):
        table[b, :n] = perm[at : at + n]
        at += n
    q = torch.randn(len(seq_lens), hq, d, generator=gen)
    return cache, table, q


def rows_on(device, table, seq_lens, slots, levels, stale=None) -> dec.DecodeRows:
    i32 = dict(dtype=torch.int32, device=device)
    return dec.DecodeRows(table.to(device), torch.tensor(seq_lens, **i32),
                          torch.tensor(slots, **i32), torch.tensor(levels, **i32),
                          None if stale is None else torch.tensor(stale, **i32))  # fmt: skip


def assert_masks_equal(got: dec.DecodeMasks, want: dec.DecodeMasks, slots: list[int]) -> None:
    n = got.counts.shape[1] - 1
    for s in slots:
        gc, wc = got.counts[s].cpu(), want.counts[s].cpu()
        assert torch.equal(gc[1:], wc[1:]), f"slot {s}: counts {gc.tolist()} != {wc.tolist()}"
        for i in range(1, n):
            c = int(wc[i])
            assert torch.equal(got.inputs[i][s, :c].cpu(), want.inputs[i][s, :c].cpu())
            assert int(got.widths[s, i]) == int(want.widths[s, i])
        c = int(wc[n])
        assert torch.equal(got.final[s, :c].cpu(), want.final[s, :c].cpu())


def masks_and_output(p: ref.PruneParams, q, cache, rows: dec.DecodeRows, scale: float):
    """The reference's masks (a slot per row) and decode attention output for ``rows``."""
    masks = dec.DecodeMasks.allocate(p, 64, rows.slots.shape[0], torch.device("cpu"))
    dec.refresh_masks_reference(p, masks, q, cache, rows, scale)
    out, _ = dec.attend_reference(p, masks, q, cache, rows, scale)
    return masks, out


def kernel_masks(params: ref.PruneParams, rope_style: str, q, cache, table, seq_lens, slots,
                 levels, scale: float) -> tuple[dec.DecodeMasks, dec.DecodeRows]:
    """The batched kernel cascade's masks (a slot per row) for ``rope_style``, and its rows."""
    dev = torch.device(DEVICE)
    got = dec.DecodeMasks.allocate(params, 64, len(slots), dev)
    scores = dec.allocate_scores(dec.stage_widths(params, max(seq_lens) + 1000), len(slots),
                                 dev)  # fmt: skip
    placement = td.QueryPlacement.build(rope_style, params.rope.table, params.scan_window, dev)
    rows = rows_on(DEVICE, table, seq_lens, slots, levels)
    td.refresh_masks(params, got, q.to(dev), cache.to(dev), rows, scale, scores, placement)
    return got, rows


ROPE_STYLES = [None, "relative", "chunk-indexed"]


# Stage 0's scores here are 94 wide (128 as a power of two): a fused-top-k limit of 2048 ranks
# every stage inside its SelectRep launch, 64 leaves stage 0 its own top-k launch, 0 every stage;
# fuse_top=False (the backend's choice when a graph gate skips reuse steps) ranks none inside.
# "gptj-partial": the kernels split each key by its rotation pairs, GPT-J's interleaved ones
# and the unrotated dimensions past a partial rotary too.
@pytest.mark.slow  # long under the Triton interpreter
@pytest.mark.parametrize(
    ("rope_style", "fused_top_max", "fuse_top", "layout"),
    [(style, 2048, True, "neox") for style in ROPE_STYLES]
    + [(None, 64, True, "neox"), ("relative", 0, True, "neox"),
       ("chunk-indexed", 2048, False, "neox"), ("relative", 2048, True, "gptj-partial"),
       ("chunk-indexed", 2048, True, "gptj-partial")],
)
def test_batched_cascade_equals_reference_at_mixed_levels(
    rope_style, fused_top_max, fuse_top, layout, monkeypatch
):
    monkeypatch.setattr(td, "FUSED_TOP_MAX_CHUNKS", fused_top_max)
    gen = torch.Generator().manual_seed(7 + len(str(rope_style)))
    hq, hkv, d, page = 4, 2, 32, 16
    rope = rope_plan(rope_style, d, layout)
    params = small_params(rope)
    # the fifth row is dense (no slot); the sixth has a slot but is too short for any stage-0
    # chunk to be a candidate (nothing to score: its top-k still runs, and keeps nothing)
    seq_lens = [1500, 2900, 700, 5000, 40, 70]
    cache, table, q = batch(seq_lens, hq, hkv, d, page, gen)
    scale = d**-0.5
    slots = [3, 0, 2, 1, -1, 4]
    max_len = 6000
    want = dec.DecodeMasks.allocate(params, 64, 5, torch.device("cpu"))
    got = dec.DecodeMasks.allocate(params, 64, 5, torch.device(DEVICE))
    got.counts[4] = 99  # what the kernels must overwrite
    scores = dec.allocate_scores(dec.stage_widths(params, max_len), 8, torch.device(DEVICE))
    arrivals = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    placement = None
    if rope is not None:
        placement = td.QueryPlacement.build(rope_style, rope.table, params.scan_window,
                                            torch.device(DEVICE))  # fmt: skip

    # step 0: every row refreshes fully; then the same rows at levels 1, 2 and reuse, each
    # resuming from what the first step stored (the queries move on to other vectors)
    for levels in ([0, 0, 0, 0, -1, 0], [1, 2, 3, 0, -1, 1], [2, 1, 1, 3, -1, 0]):
        rows_cpu = rows_on("cpu", table, seq_lens, slots, levels)
        dec.refresh_masks_reference(params, want, q, cache, rows_cpu, scale)
        td.refresh_masks(params, got, q.to(DEVICE), cache.to(DEVICE),
                         rows_on(DEVICE, table, seq_lens, slots, levels), scale, scores,
                         placement, arrivals=arrivals, fuse_top=fuse_top)  # fmt: skip
        assert_masks_equal(got, want, [s for s in slots if s >= 0])
        for s in scores:  # the top-k left its scratch as it found it
            assert torch.isneginf(s).all()
        assert not arrivals.any()  # and the arrival counters
        q = torch.randn(q.shape, generator=gen)
    assert int(want.counts[4, 1:].sum()) == 0
    # the long rows were really pruned: fewer final blocks than their context holds
    assert int(want.counts[1, -1]) == 64 // 8 and int(want.counts[2, -1]) == 64 // 8


def test_top_chunks_breaks_ties_to_the_earlier_chunk_and_keeps_position_order():
    """Equal scores: the earlier chunk wins (torch.topk leaves ties unspecified, so this is
    checked by hand); survivors come out ascending and split."""
    params = small_params()
    masks = dec.DecodeMasks.allocate(params, 64, 1, torch.device(DEVICE))
    seq_len = 16 + 64 * 20
    scores = torch.full((1, 20), float("-inf"), device=DEVICE)
    vals = torch.tensor([1.0, 5.0, 5.0, 2.0, 5.0, 5.0, 5.0, 0.5, 5.0, 3.0, 5.0, 5.0])
    scores[0, : vals.numel()] = vals.to(DEVICE)
    rows = rows_on(DEVICE, torch.zeros(1, 90, dtype=torch.int32), [seq_len], [0], [0])
    td.top_chunks(scores, rows, masks, params, 0)  # keep 512 // 64 = 8 chunks
    kept = [1, 2, 4, 5, 6, 8, 10, 11]  # the eight 5.0s but the last one (9 of them)
    want = torch.tensor([16 + 64 * c + 16 * j for c in kept for j in range(4)], dtype=torch.int32)
    assert int(masks.counts[0, 1]) == 32 and int(masks.widths[0, 1]) == 32
    assert torch.equal(masks.inputs[1][0, :32].cpu(), want)
    assert torch.isneginf(scores).all()


@pytest.mark.parametrize("extend", [False, True], ids=["as-chosen", "reused-past-the-end"])
@pytest.mark.parametrize("streaming", [False, True])
def test_decode_attention_through_slots_equals_reference(streaming, extend):
    """With ``extend_reused_blocks`` the rows' blocks are read past their end by their own
    stale steps (the second row's past the cap of one block)."""
    gen = torch.Generator().manual_seed(11 + streaming)
    hq, hkv, d, page = 4, 2, 32, 16
    rope = ref.RopePlan(RopeTable.default(d), pruning="relative", bsa="streaming")
    params = small_params(rope if streaming else None)
    params = dataclasses.replace(params, extend_reused_blocks=extend)
    seq_lens = [1500, 90, 2900, 0]  # a dense row and a padding row
    cache, table, q = batch([max(t, 1) for t in seq_lens], hq, hkv, d, page, gen)
    slots, levels, stale = [1, -1, 0, -1], [0, -1, 0, -1], [3, 0, 11, 0]
    masks = dec.DecodeMasks.allocate(params, 64, 2, torch.device("cpu"))
    rows_cpu = rows_on("cpu", table, seq_lens, slots, levels, stale)
    dec.refresh_masks_reference(params, masks, q, cache, rows_cpu, d**-0.5)
    want, _ = dec.attend_reference(params, masks, q, cache, rows_cpu, d**-0.5)
    dev = torch.device(DEVICE)
    rows = rows_on(DEVICE, table, seq_lens, slots, levels, stale)
    stats = torch.zeros(2, dtype=torch.int64, device=dev)
    got = triton_bsa.sparse_decode_attention(
        q.to(dev), cache.to(dev), rows.block_table, rows.seq_lens, masks.final.to(dev),
        masks.final_counts().to(dev), block_size_k=params.block_size_k,
        sink_tokens=params.sink_tokens, window_tokens=params.window_tokens, scale=d**-0.5,
        rope=rope.table if streaming else None, row_slots=rows.slots, stats=stats,
        stale_steps=rows.stale_steps if extend else None,
    )  # fmt: skip
    torch.testing.assert_close(got.cpu(), want, rtol=2e-4, atol=2e-5)
    assert torch.equal(got[3].cpu(), torch.zeros(hq, d))
    # budget count of the two sparse rows: sink + window + final blocks each (8 blocks, read
    # 3 and 8 tokens longer with the extension); context pairs
    budget = 2 * (16 + 128 + 64) + (8 * (3 + 8) if extend else 0)
    assert stats.tolist() == [budget, 1500 + 2900]


# the host-tier tests' shapes: query heads, KV heads, head_dim, page size; three rows
TIER_HQ, TIER_HKV, TIER_D, TIER_PAGE = 4, 2, 32, 16
TIER_SEQ_LENS = [1500, 2900, 700]


def tier_rows(seed: int, rope_style: str | None):
    """``(gen, cache, table, refresh)`` of the host-tier tests: a paged cache of three rows and
    ``refresh(kv, **banks)``, the masks of a full refresh of every row reading ``kv`` through
    the given ``bank`` / ``key_rows``."""
    gen = torch.Generator().manual_seed(seed)
    rope = rope_plan(rope_style, TIER_D)
    params = small_params(rope)
    cache, table, q = batch(TIER_SEQ_LENS, TIER_HQ, TIER_HKV, TIER_D, TIER_PAGE, gen)
    cache, q = cache.to(DEVICE), q.to(DEVICE)
    device = torch.device(DEVICE)
    placement = None
    if rope is not None:
        placement = td.QueryPlacement.build(rope_style, rope.table, params.scan_window, device)

    def refresh(kv, **banks):
        masks = dec.DecodeMasks.allocate(params, 64, 4, device)
        scores = dec.allocate_scores(dec.stage_widths(params, 3000), 4, device)
        rows = rows_on(DEVICE, table, TIER_SEQ_LENS, [0, 1, 2], [0, 0, 0])
        td.refresh_masks(params, masks, q, kv, rows, TIER_D**-0.5, scores, placement, **banks)
        return masks

    return gen, cache, table, refresh


@pytest.mark.slow  # long under the Triton interpreter
@pytest.mark.parametrize("rope_style", [None, "chunk-indexed"])
def test_cascade_reads_resident_pages_from_the_bank(rope_style):
    """The host tier's GPU cache: with the host's copies of the bank's pages poisoned, the
    cascade through the bank stores exactly the masks it stores reading the cache alone."""
    gen, cache, _, masks_from = tier_rows(21, rope_style)
    n_pages = cache.shape[0]
    resident = torch.randperm(n_pages, generator=gen)[: n_pages // 2].to(DEVICE)
    slots_of = torch.randperm(n_pages // 2 + 1, generator=gen)[: n_pages // 2].to(DEVICE)
    pages = torch.zeros(n_pages // 2 + 1, *cache.shape[1:], device=DEVICE)
    pages[slots_of] = cache[resident]
    residency = torch.full((n_pages,), -1, dtype=torch.int32, device=DEVICE)
    residency[resident] = slots_of.int()
    poisoned = cache.clone()
    poisoned[resident] = float("nan")

    want = masks_from(cache)
    assert_masks_equal(masks_from(poisoned, bank=(pages, residency)), want, [0, 1, 2])
    with pytest.raises(AssertionError):  # the poisoned pages are probed
        assert_masks_equal(masks_from(poisoned), want, [0, 1, 2])


@pytest.mark.slow  # long under the Triton interpreter
@pytest.mark.parametrize(
    "rope_style,k_scale", [(None, 0.5), ("chunk-indexed", -0.5)],
    ids=["true-positions", "chunk-indexed-negative-k-scale"],
)
def test_fp8_cache_cascade_and_attention_equal_reference(rope_style, k_scale):
    """An fp8 cache (uint8 storage) read through an fp8 bank: the batched cascade stores the
    reference's masks at mixed levels, and decode attention over them equals the reference's;
    both dequantize every read.

    A positive k_scale scales every score alike, so it cannot change a mask; a negative one
    (not something vLLM makes) flips them, so the masks show whether the kernel applies it.
    """
    gen = torch.Generator().manual_seed(31 + len(str(rope_style)))
    hq, hkv, d, page = 4, 2, 32, 16
    rope = rope_plan(rope_style, d)
    params = small_params(rope)
    seq_lens = [1500, 700, 40]  # the last row is dense
    cache, table, q = batch(seq_lens, hq, hkv, d, page, gen)
    scales = torch.tensor([k_scale, 2.0]).view(1, 2, 1, 1, 1)
    stored = (3 * cache / scales).to(torch.float8_e4m3fn).view(torch.uint8)
    dev = torch.device(DEVICE)
    sc_cpu = dict(k_scale=torch.tensor([k_scale]), v_scale=torch.tensor([2.0]))
    k_scale, v_scale = sc_cpu["k_scale"].to(dev), sc_cpu["v_scale"].to(dev)
    n_pages = stored.shape[0]
    resident = torch.randperm(n_pages, generator=gen)[: n_pages // 2]
    slots_of = torch.randperm(n_pages // 2 + 1, generator=gen)[: n_pages // 2]
    pages = torch.zeros(n_pages // 2 + 1, *stored.shape[1:], dtype=torch.uint8)
    pages[slots_of] = stored[resident]
    residency = torch.full((n_pages,), -1, dtype=torch.int32)
    residency[resident] = slots_of.int()
    host = stored.clone()
    host[resident] = 0x7E  # 448: finite (the interpreter has no e4m3 NaN), but far off
    bank = (pages.to(dev), residency.to(dev))
    placement = None
    if rope is not None:
        placement = td.QueryPlacement.build(rope_style, rope.table, params.scan_window, dev)
    slots = [1, 0, -1]
    want = dec.DecodeMasks.allocate(params, 64, 2, torch.device("cpu"))
    got = dec.DecodeMasks.allocate(params, 64, 2, dev)
    scores = dec.allocate_scores(dec.stage_widths(params, 2000), 4, dev)
    for levels in ([0, 0, -1], [2, 1, -1]):
        rows_cpu = rows_on("cpu", table, seq_lens, slots, levels)
        dec.refresh_masks_reference(params, want, q, stored, rows_cpu, d**-0.5, **sc_cpu)
        rows = rows_on(DEVICE, table, seq_lens, slots, levels)
        td.refresh_masks(params, got, q.to(dev), host.to(dev), rows, d**-0.5, scores, placement,
                         bank=bank, k_scale=k_scale, v_scale=v_scale)  # fmt: skip
        assert_masks_equal(got, want, [0, 1])
        q = torch.randn(q.shape, generator=gen)
    assert int(want.counts[1, -1]) == 64 // 8  # the long row was pruned

    out_want, _ = dec.attend_reference(params, want, q, stored, rows_cpu, d**-0.5, **sc_cpu)
    out = triton_bsa.sparse_decode_attention(
        q.to(dev), host.to(dev), rows.block_table, rows.seq_lens, got.final, got.final_counts(),
        block_size_k=params.block_size_k, sink_tokens=params.sink_tokens,
        window_tokens=params.window_tokens, scale=d**-0.5,
        rope=rope.table if rope is not None else None, row_slots=rows.slots, bank=bank,
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    torch.testing.assert_close(out.cpu(), out_want, rtol=2e-4, atol=2e-5)
    no_bank = triton_bsa.sparse_decode_attention(
        q.to(dev), host.to(dev), rows.block_table, rows.seq_lens, got.final, got.final_counts(),
        block_size_k=params.block_size_k, sink_tokens=params.sink_tokens,
        window_tokens=params.window_tokens, scale=d**-0.5,
        rope=rope.table if rope is not None else None, row_slots=rows.slots,
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    assert not torch.allclose(no_bank.cpu(), out_want), "the host's resident pages are read"
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        td.refresh_masks(params, got, q.to(dev), stored.to(dev), rows, d**-0.5, scores, placement)


@pytest.mark.parametrize("style", ["relative", "chunk-indexed"])
@pytest.mark.parametrize("is_neox", [True, False])
def test_place_queries_equals_decode_queries(style, is_neox):
    """The one-launch query placement (what a gated cascade runs) against its PyTorch reference:
    scaled, un-rotated from the true position and turned to the style's query position (one
    rotation there, two here), for NeoX and GPT-J pairs and a partial rotary dimension."""
    from vllm_infinitehip.kernels.triton_rope import delta_tables

    gen = torch.Generator().manual_seed(5)
    d, hq = 32, 4
    inv_freq = RopeTable.default(24, 10000.0).inv_freq  # rotary_dim 24 < head size 32
    table = RopeTable(inv_freq, is_neox)
    placement = td.QueryPlacement.build(style, table, 768, torch.device(DEVICE))
    q = torch.randn(3, hq, d, generator=gen).to(torch.bfloat16)
    seq_lens = torch.tensor([1500, 40, 700_000], dtype=torch.int32)
    reference = td.QueryPlacement.build(style, table, 768, torch.device("cpu"))
    want_l, want_r = td.decode_queries(q, seq_lens, 0.17, reference)
    out = torch.full((2, 5, hq, d), float("nan"), device=DEVICE)
    tables = delta_tables(table, 2 * 700_000, torch.device(DEVICE))
    got_l, got_r = td.place_queries(q.to(DEVICE), seq_lens.to(DEVICE), 0.17, placement, tables,
                                    out)  # fmt: skip
    assert torch.allclose(got_l.cpu(), want_l, rtol=0, atol=2e-5)
    if style == "relative":
        assert torch.allclose(got_r.cpu(), want_r, rtol=0, atol=2e-5)
    else:
        assert got_r is None
    assert torch.isnan(out[:, 3:]).all()  # nothing past the batch


@pytest.mark.skipif(INTERPRETED or not HAS_CUDA, reason="CUDA graphs need a GPU; the CPU twins "
                    "are the flag (test_triton_slots.py) and the unfused cascade (above)")
def test_a_captured_cascade_behind_a_gate_runs_only_when_the_flag_is_set():
    """The cascade captured in a CUDA graph inside a graph_if region (unfused top-k, as the
    backend runs it there): replays with the flag set equal the reference at every level; a
    replay with the flag cleared leaves the masks alone even though the rows' levels ask for a
    refresh (the body really is skipped)."""
    from vllm_infinitehip.kernels.graph_if import GraphIf, conditional_graphs_work

    assert conditional_graphs_work(torch.device("cuda"))
    gen = torch.Generator().manual_seed(11)
    hq, hkv, d, page = 4, 2, 32, 16
    params = small_params()
    seq_lens = [1500, 2900, 700, 5000]
    cache, table, q = batch(seq_lens, hq, hkv, d, page, gen)
    scale = d**-0.5
    slots = [3, 0, 2, 1]
    want = dec.DecodeMasks.allocate(params, 64, 4, torch.device("cpu"))
    got = dec.DecodeMasks.allocate(params, 64, 4, torch.device("cuda"))
    scores = dec.allocate_scores(dec.stage_widths(params, 6000), 4, torch.device("cuda"))
    arrivals = torch.zeros(4, dtype=torch.int32, device="cuda")
    rows = rows_on("cuda", table, seq_lens, slots, [0, 0, 0, 0])
    q_dev, cache_dev = q.to("cuda"), cache.to("cuda")
    flag = torch.ones(1, dtype=torch.bool, device="cuda")
    gate = GraphIf(flag, 1)

    def cascade():
        td.refresh_masks(params, got, q_dev, cache_dev, rows, scale, scores, arrivals=arrivals,
                         gate=gate.region(0), fuse_top=False)  # fmt: skip

    cascade()  # compiles eagerly (outside a capture the region is a no-op)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cascade()
    for levels in ([0, 0, 0, 0], [1, 2, 3, 0], [3, 3, 3, 3], [2, 1, 1, 3]):
        rows_cpu = rows_on("cpu", table, seq_lens, slots, levels)
        dec.refresh_masks_reference(params, want, q, cache, rows_cpu, scale)
        rows.levels.copy_(rows_cpu.levels)
        q_dev.copy_(q)
        flag.fill_(any(0 <= lv < 3 for lv in levels))
        graph.replay()
        assert_masks_equal(got, want, slots)
        q = torch.randn(q.shape, generator=gen)
    before = [t.clone() for t in (got.final, got.counts, *got.inputs[1:])]
    rows.levels.fill_(0)
    q_dev.copy_(q)
    flag.fill_(False)
    graph.replay()
    after = [got.final, got.counts, *got.inputs[1:]]
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    flag.fill_(True)  # the same replay with the flag set does refresh
    graph.replay()
    assert not torch.equal(got.final, before[0])


def _key_rows_consistent(bank, cache: torch.Tensor) -> int:
    """Every row the table places in a slot is that slot's owner, and the slot holds the
    cache's row; nothing is left listed. Returns how many rows are resident."""
    from vllm_infinitehip.block_manager.key_rows import LISTED

    table = bank.table[0, :-1].cpu()
    k_rows = cache[:, 0].reshape(-1, cache.shape[-1]).cpu()
    assert not bool((table == LISTED).any()), "a listed row outlived its refresh"
    resident = torch.nonzero(table >= 0).view(-1)
    slots = table[resident].long()
    assert torch.equal(bank.owner[0].cpu()[slots].long(), resident)
    assert torch.equal(bank.rows[0].cpu()[slots], k_rows[resident])
    return resident.numel()


@pytest.mark.slow  # long under the Triton interpreter
def test_key_row_bank_lists_misses_promotes_them_and_serves_the_next_refresh():
    """The host tier's cache for the pruning stages: a refresh through an empty key-row bank
    stores the masks it stores without one, lists what it read, and promotes exactly those
    rows; the next refresh reads every probe from the bank (its rows poisoned in the cache,
    the masks unchanged). A bank too small for the probes evicts first in, first out, and
    stays consistent and exact; Triton's promotion equals the PyTorch one."""
    from vllm_infinitehip.block_manager.key_rows import ABSENT, KeyRowBank
    from vllm_infinitehip.kernels import triton_bank

    gen, cache, _, refresh = tier_rows(33, None)
    hkv, d, page = TIER_HKV, TIER_D, TIER_PAGE
    device = torch.device(DEVICE)

    want = refresh(cache)
    n_pages = cache.shape[0]
    big = KeyRowBank(1, n_pages, page, hkv, d, n_pages * page * hkv, cache.dtype, device)
    assert_masks_equal(refresh(cache, key_rows=big.layer(0)), want, [0, 1, 2])
    hits, misses, filled = big.state[0, 2:].tolist()
    resident = _key_rows_consistent(big, cache)
    assert hits == 0 and misses >= resident > 100 and filled == resident
    assert big.state[0, :2].tolist() == [0, resident]  # list emptied, ring moved on
    # the second refresh probes the same rows: all resident, read from the bank
    poisoned = cache.clone()
    r = torch.nonzero(big.table[0, :-1] >= 0).view(-1)
    per_page = page * hkv
    poisoned[r // per_page, 0, (r % per_page) // hkv, r % hkv] = float("nan")
    big.state[0, 2:] = 0
    assert_masks_equal(refresh(poisoned, key_rows=big.layer(0)), want, [0, 1, 2])
    assert big.state[0, 3:].tolist() == [0, 0] and big.state[0, 2].item() >= resident
    assert _key_rows_consistent(big, cache) == resident
    with pytest.raises(AssertionError):  # the poisoned rows are probed
        assert_masks_equal(refresh(poisoned), want, [0, 1, 2])

    # too small: more misses than slots; the list's overflow is absent again, not stuck
    small = KeyRowBank(1, n_pages, page, hkv, d, 64, cache.dtype, device)
    for _ in range(2):
        assert_masks_equal(refresh(cache, key_rows=small.layer(0)), want, [0, 1, 2])
        assert _key_rows_consistent(small, cache) == 64
    assert small.state[0, 1].item() == 0  # two full turns of the ring

    # the promotion itself, Triton against PyTorch, from the same listed rows
    small.table[0, :-1][small.table[0, :-1] >= 0] = ABSENT  # stale owners stay
    twin = KeyRowBank(1, n_pages, page, hkv, d, 64, cache.dtype, device)
    for name in ("rows", "table", "owner", "state"):
        getattr(twin, name).copy_(getattr(small, name))
    listed = torch.randperm(n_pages * page * hkv, generator=gen)[:50].int().to(device)
    for b in (small, twin):
        b.missed[0, :50] = listed
        b.missed_rows[0, :50] = cache[:, 0].reshape(-1, d)[listed.long()]
        b.table[0, listed.long()] = -2
        b.state[0, :2] = torch.tensor([50, 40])
    triton_bank.promote_key_rows(small.layer(0))
    triton_bank.promote_key_rows_reference(twin.layer(0))
    for name in ("rows", "table", "owner", "state"):
        assert torch.equal(getattr(small, name), getattr(twin, name)), name
    assert small.missed.shape[1] == 64
    assert _key_rows_consistent(small, cache) == 50

    # the rows of a written token (every KV head) leave the table, and so do freed pages' rows
    written = int(listed[0])
    small.allocate_plan(4)
    small.plan_writes(torch.tensor([-1, written // hkv], device=device))  # a padding slot too
    small.forget_writes(0, 2)
    assert int(small.table[0, written]) == ABSENT
    after_write = _key_rows_consistent(small, cache)
    assert after_write < 50
    small.invalidate(torch.unique(listed[1:].long() // (page * hkv))[:3])
    left = _key_rows_consistent(small, cache)
    assert left < after_write and int(small.occupancy()[0]) == left


@pytest.mark.slow  # long under the Triton interpreter
@pytest.mark.parametrize("rope_style", ["relative", "chunk-indexed"])
def test_rows_inside_the_trained_length_keep_true_positions(rope_style):
    """A batch mixing rows below and past the trained length (2000): each row's masks and
    attention are what its own path gives, true positions below (as without a remapping),
    the remapping past it; the kernels equal the reference on the mixed batch."""
    import dataclasses

    gen = torch.Generator().manual_seed(31)
    hq, hkv, d, page = 4, 2, 32, 16
    remapping = rope_plan(rope_style, d)
    rope = dataclasses.replace(remapping, trained_context=2000)
    params = small_params(rope)
    seq_lens = [1500, 2900, 2000, 5000, 2001]  # queries at 1499, 2899, 1999, 4999, 2000
    below, past = [0, 2], [1, 3, 4]
    cache, table, q = batch(seq_lens, hq, hkv, d, page, gen)
    scale = d**-0.5
    slots, levels = [0, 1, 2, 3, 4], [0] * 5
    rows_cpu = rows_on("cpu", table, seq_lens, slots, levels)

    def reference(p):
        return masks_and_output(p, q, cache, rows_cpu, scale)

    want, want_out = reference(params)
    plain, plain_out = reference(small_params(None))
    remapped, remapped_out = reference(small_params(remapping))
    assert_masks_equal(want, plain, below)
    assert_masks_equal(want, remapped, past)
    assert not torch.equal(plain.final[below], remapped.final[below])  # the paths differ here
    assert torch.equal(want_out[below], plain_out[below])
    assert torch.equal(want_out[past], remapped_out[past])

    dev = torch.device(DEVICE)
    got, rows = kernel_masks(params, rope_style, q, cache, table, seq_lens, slots, levels, scale)
    assert_masks_equal(got, want, slots)
    out = triton_bsa.sparse_decode_attention(
        q.to(dev), cache.to(dev), rows.block_table, rows.seq_lens, got.final,
        got.final_counts(), block_size_k=params.block_size_k, sink_tokens=params.sink_tokens,
        window_tokens=params.window_tokens, scale=scale, rope=rope.table, row_slots=rows.slots,
        trained_context=rope.trained_context,
    )  # fmt: skip
    torch.testing.assert_close(out.cpu(), want_out, rtol=2e-4, atol=2e-5)


def test_place_queries_leaves_rows_inside_the_trained_length_at_true_positions():
    from vllm_infinitehip.kernels.triton_rope import delta_tables

    gen = torch.Generator().manual_seed(9)
    d, hq = 32, 4
    table = RopeTable.default(d, 10000.0)
    placement = td.QueryPlacement.build("relative", table, 768, torch.device(DEVICE))
    q = torch.randn(3, hq, d, generator=gen)
    seq_lens = torch.tensor([1500, 1501, 40], dtype=torch.int32)  # trained 1500: only row 1
    reference = td.QueryPlacement.build("relative", table, 768, torch.device("cpu"))
    want_l, want_r = td.decode_queries(q, seq_lens, 0.17, reference, 1500)
    all_l, all_r = td.decode_queries(q, seq_lens, 0.17, reference)
    for want in (want_l, want_r):
        assert torch.equal(want[[0, 2]], q[[0, 2]] * 0.17)
    assert torch.equal(want_l[1], all_l[1]) and torch.equal(want_r[1], all_r[1])
    out = torch.empty(2, 3, hq, d, device=DEVICE)
    tables = delta_tables(table, 4000, torch.device(DEVICE))
    got_l, got_r = td.place_queries(q.to(DEVICE), seq_lens.to(DEVICE), 0.17, placement, tables,
                                    out, 1500)  # fmt: skip
    assert torch.equal(got_l.cpu()[[0, 2]], want_l[[0, 2]])  # a turn by 0 is exact
    assert torch.allclose(got_l.cpu(), want_l, rtol=0, atol=2e-5)
    assert torch.allclose(got_r.cpu(), want_r, rtol=0, atol=2e-5)


# --------------------------------------------------------------------------- selection rules
def _paged(k: torch.Tensor, page: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``k`` in a paged cache at shuffled pages (V random), and its one-row block table."""
    t, hkv, d = k.shape
    n = -(-t // page)
    cache = torch.randn(n + 2, 2, page, hkv, d, generator=gen)
    perm = torch.randperm(n + 2, generator=gen)[:n]
    padded = torch.zeros(n * page, hkv, d)
    padded[:t] = k
    cache[perm, 0] = padded.view(n, page, hkv, d)
    return cache, perm.to(torch.int32).view(1, n)


RULES = {
    "dominant-head": ("dominant_head", {"head_reduction": "z-score"}),
    "sharp-key": ("sharp_keys", {"exact_last_stage": True}),
    "window-overlap": ("recent_keys", {"drop_window_candidates": True}),
}


@pytest.mark.slow  # long under the Triton interpreter
@pytest.mark.parametrize("rule", list(RULES))
def test_selection_rule_kernels_equal_reference_where_the_rule_decides(rule):
    """On a case built so that the rule changes the kept blocks (tests/helpers/planted.py),
    the batched decode cascade keeps exactly the reference's, and the rule does what it is
    for: the needles survive (or no final block lies inside the window)."""
    from tests.helpers import planted

    builder, rules = RULES[rule]
    case = getattr(planted, builder)(seed=1)
    t = case.k.shape[0]
    gen = torch.Generator().manual_seed(3)
    cache, table = _paged(case.k, 16, gen)
    paper = case.params
    params = planted.with_rules(paper, **rules)
    final_keep = params.stages[-1].keep_tokens
    hq = case.q.shape[1]
    results = {}
    for name, p in (("paper", paper), ("rule", params)):
        want = dec.DecodeMasks.allocate(p, final_keep, 1, torch.device("cpu"))
        got = dec.DecodeMasks.allocate(p, final_keep, 1, torch.device(DEVICE))
        heads = hq if p.head_reduction == "z-score" else None
        scores = dec.allocate_scores(dec.stage_widths(p, t), 1, torch.device(DEVICE), heads)
        dec.refresh_masks_reference(p, want, case.q, cache, rows_on("cpu", table, [t], [0], [0]),
                                    1.0)  # fmt: skip
        td.refresh_masks(p, got, case.q.to(DEVICE), cache.to(DEVICE),
                         rows_on(DEVICE, table, [t], [0], [0]), 1.0, scores)  # fmt: skip
        assert_masks_equal(got, want, [0])
        results[name] = set(want.final[0, : int(want.counts[0, -1])].tolist())
    if case.needles:
        assert not set(case.needles) <= results["paper"]  # the paper's rule loses a needle
        assert set(case.needles) <= results["rule"]
    else:
        edge = t - 1 - planted.WINDOW
        assert any(s > edge for s in results["paper"])
        assert not any(s > edge for s in results["rule"])


@pytest.mark.slow  # long under the Triton interpreter
@pytest.mark.parametrize(("rope_style", "combined"),
                         [(style, False) for style in ROPE_STYLES] + [(None, True)])
def test_all_selection_rules_cascade_equals_reference_at_mixed_levels(rope_style, combined):
    """z-score ranking, exact last stage and the window check together, on random keys, with
    every RoPE style and rows resuming at every level, fused top-k and not. ``combined``: each
    stage's ranking after a combine over the TP group (``tp_mask: "global"``: each rank's heads
    standardised, then the max over all ranks'; here the identity, one rank), on scratch that
    held other scores, so every entry the ranking reads must be written by the launch."""
    gen = torch.Generator().manual_seed(11)
    hq, hkv, d, page = 4, 2, 32, 16
    rope = rope_plan(rope_style, d)
    params = dataclasses.replace(small_params(rope), head_reduction="z-score",
                                 exact_last_stage=True, drop_window_candidates=True)
    seq_lens = [1500, 2900, 700]
    cache, table, q = batch(seq_lens, hq, hkv, d, page, gen)
    scale = d**-0.5
    slots = [2, 0, 1]
    want = dec.DecodeMasks.allocate(params, 64, 3, torch.device("cpu"))
    got = dec.DecodeMasks.allocate(params, 64, 3, torch.device(DEVICE))
    scores = dec.allocate_scores(dec.stage_widths(params, 3000), 4, torch.device(DEVICE), hq)
    calls = []

    def combine(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape)
        return x.clone()

    reduce = combine if combined else None
    if combined:
        for s in scores:  # stale values where no launch of this test wrote
            s.copy_(torch.randn(s.shape, generator=gen).to(s.device))
    placement = None
    if rope is not None:
        placement = td.QueryPlacement.build(rope_style, rope.table, params.scan_window,
                                            torch.device(DEVICE))  # fmt: skip
    for levels, fuse in (([0, 0, 0], True), ([1, 2, 0], False), ([2, 1, 1], True)):
        dec.refresh_masks_reference(params, want, q, cache,
                                    rows_on("cpu", table, seq_lens, slots, levels), scale,
                                    reduce_scores=reduce)  # fmt: skip
        td.refresh_masks(params, got, q.to(DEVICE), cache.to(DEVICE),
                         rows_on(DEVICE, table, seq_lens, slots, levels), scale, scores,
                         placement, fuse_top=fuse, reduce_scores=reduce)  # fmt: skip
        assert_masks_equal(got, want, slots)
        q = torch.randn(q.shape, generator=gen)
    assert bool(calls) == combined


def test_z_score_ranking_refuses_max_reduced_scratch():
    params = dataclasses.replace(small_params(), head_reduction="z-score")
    cache, table, q = batch([700], 4, 2, 32, 16, torch.Generator().manual_seed(0))
    masks = dec.DecodeMasks.allocate(params, 64, 1, torch.device(DEVICE))
    scores = dec.allocate_scores(dec.stage_widths(params, 700), 1, torch.device(DEVICE))
    with pytest.raises(ValueError, match="per-head scratch"):
        td.refresh_masks(params, masks, q.to(DEVICE), cache.to(DEVICE),
                         rows_on(DEVICE, table, [700], [0], [0]), 1.0, scores)  # fmt: skip




@pytest.mark.slow  # long under the Triton interpreter
@pytest.mark.parametrize("rope_style", ["relative", "chunk-indexed"])
def test_remapped_pruning_below_the_trained_length_keeps_true_position_attention(rope_style):
    """``pruning_from=0`` (``remap_pruning: "always"``): rows below the trained length (2000)
    are pruned as the remapping prunes them and attend their blocks at true positions; the
    kernels equal the reference on a batch mixing both sides."""
    gen = torch.Generator().manual_seed(37)
    hq, hkv, d, page = 4, 2, 32, 16
    remapping = rope_plan(rope_style, d)
    rope = dataclasses.replace(remapping, trained_context=2000, pruning_from=0)
    params = small_params(rope)
    seq_lens = [1500, 2900, 1999]
    below = [0, 2]
    cache, table, q = batch(seq_lens, hq, hkv, d, page, gen)
    scale = d**-0.5
    slots, levels = [0, 1, 2], [0] * 3
    rows_cpu = rows_on("cpu", table, seq_lens, slots, levels)

    def reference(p):
        return masks_and_output(p, q, cache, rows_cpu, scale)

    want, want_out = reference(params)
    remapped, _ = reference(small_params(remapping))  # every row pruned and attended remapped
    plain, _ = reference(small_params(dataclasses.replace(remapping, trained_context=2000)))
    assert_masks_equal(want, remapped, slots)
    assert not torch.equal(want.final[below], plain.final[below])  # the pruning moved
    # attention below the trained length at true positions: as the plain path over want's blocks
    true_pos = small_params(dataclasses.replace(remapping, trained_context=1 << 20))
    true_out, _ = dec.attend_reference(true_pos, want, q, cache, rows_cpu, scale)
    assert torch.equal(want_out[below], true_out[below])

    got, _ = kernel_masks(params, rope_style, q, cache, table, seq_lens, slots, levels, scale)
    assert_masks_equal(got, want, slots)


def test_z_score_ranking_by_tiles_of_heads_equals_reference():
    """The top-k standardises the heads a tile at a time: six query heads make tiles of 4 and
    a remainder of 2 over stage 0's 299 chunks, and one tile with two masked heads over stage
    1's 32; the cascade keeps the reference's blocks, its top-k fused or not, whatever the
    scratch held past the row's heads."""
    gen = torch.Generator().manual_seed(5)
    hq, hkv, d, page, t = 6, 2, 16, 16, 4800
    stages = (ref.StageParams(16, 256, 32, 4), ref.StageParams(8, 64, 32, 1))
    params = ref.PruneParams(sink_tokens=16, window_tokens=64, stages=stages,
                             head_reduction="z-score")  # fmt: skip
    cache, table, q = batch([t], hq, hkv, d, page, gen)
    # room for two rows, holding stale scores: a tile's masked heads lie over the next row's
    scores = dec.allocate_scores(dec.stage_widths(params, t), 2, torch.device(DEVICE), hq)
    for s in scores:
        s.copy_(torch.randn(s.shape, generator=gen).to(s.device))
    tiles = [triton_topk.head_block(s, triton.next_power_of_2(s.shape[-1])) for s in scores]
    assert tiles == [4, 8]
    for fuse in (True, False):
        want = dec.DecodeMasks.allocate(params, 64, 1, torch.device("cpu"))
        got = dec.DecodeMasks.allocate(params, 64, 1, torch.device(DEVICE))
        dec.refresh_masks_reference(params, want, q, cache, rows_on("cpu", table, [t], [0], [0]),
                                    d**-0.5)  # fmt: skip
        td.refresh_masks(params, got, q.to(DEVICE), cache.to(DEVICE),
                         rows_on(DEVICE, table, [t], [0], [0]), d**-0.5, scores,
                         fuse_top=fuse)  # fmt: skip
        assert_masks_equal(got, want, [0])
        q = torch.randn(q.shape, generator=gen)
