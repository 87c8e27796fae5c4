"""Landmark scores kept per KV slot, added to by each prefill chunk (Triton, and the PyTorch
reference beside it).

A key's landmark score is the mean of its scaled logits over the ``window`` queries that follow
it (:func:`reference.landmark_sums`). The scores live in a per-layer state shaped like the
cache's pages, ``[num_pages, page_size, H + 1]`` float32: per slot the sums of ``H`` columns (a
query head each, or a KV head each, summed over its query heads) and, last, the count of
queries added. A prefill chunk at positions ``[s, s + n)`` adds its queries to the keys
``[s - window, s + n)``: the keys it writes, and the earlier chunk's last ``window`` keys, whose
followers it holds. Chunks add up to what one call gives, so a prompt's scores do not depend on
how vLLM chunked it; a prefix-cache hit reuses its pages' scores as written.

Kernel layout: one launch per layer for all of a step's chunks, one program per (tile of
``LANDMARK_TILE`` keys of one chunk, landmark column; ``query_blocks.LandmarkTiles``, planned
once per step). A tile's followers span at most ``LANDMARK_TILE + window`` queries: ``[tile, D]
x [D, BLOCK_Q]`` products, masked to the band, summed along the queries. Programs own disjoint
(slot, column) cells, so a read-modify-write needs no atomics; the count column is written by
column 0's programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference as ref
from .query_blocks import LANDMARK_TILE, LandmarkTiles
from .triton_bsa import kv_quant_args


@triton.jit
def _landmark_kernel(
    q_ptr,
    k_ptr,
    block_table_ptr,
    tiles_ptr,
    state_ptr,
    k_scale_ptr,
    head_dim,
    scale,
    stride_qn,
    stride_qh,
    stride_qd,
    stride_kpage,
    stride_ktok,
    stride_khead,
    stride_kd,
    stride_btr,
    stride_spage,
    stride_stok,
    stride_sh,
    WINDOW: tl.constexpr,
    GROUP: tl.constexpr,
    HEADS_PER_COLUMN: tl.constexpr,
    N_COLUMNS: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_FP8: tl.constexpr,
    DOT_16BIT: tl.constexpr,
):
    tile = tiles_ptr + tl.program_id(0).to(tl.int64) * 5
    column = tl.program_id(1)
    row = tl.load(tile).to(tl.int64)
    first_t = tl.load(tile + 1)
    q_lo = tl.load(tile + 2)
    q_start = tl.load(tile + 3)
    q_end = q_start + tl.load(tile + 4)
    offs_t = first_t + tl.arange(0, BLOCK_T)
    t_in = offs_t < q_end
    offs_d = tl.arange(0, BLOCK_D)
    d_in = offs_d < head_dim
    kv_head = (column * HEADS_PER_COLUMN) // GROUP

    table = block_table_ptr + row * stride_btr
    page = tl.load(table + offs_t // PAGE_SIZE, mask=t_in, other=0).to(tl.int64)
    in_page = (offs_t % PAGE_SIZE).to(tl.int64)
    k = tl.load(k_ptr + page[:, None] * stride_kpage + in_page[:, None] * stride_ktok
                + kv_head * stride_khead + offs_d[None, :] * stride_kd,
                mask=t_in[:, None] & d_in[None, :], other=0.0)  # fmt: skip
    logit_scale = scale
    if KV_FP8:
        logit_scale = scale * tl.load(k_scale_ptr)
    if DOT_16BIT:
        # 16-bit queries and keys (e4m3 keys are exact in 16 bits): their products are exact
        # in fp32, so one tensor-core pass with fp32 accumulation matches the fp32 reference,
        # and the scales apply to the logits
        k = k.to(q_ptr.dtype.element_ty)
    else:
        k = k.to(tl.float32)

    p_lo = tl.maximum(first_t + 1, q_start)
    p_hi = tl.minimum(first_t + BLOCK_T + WINDOW, q_end)  # exclusive
    acc = tl.zeros([BLOCK_T], dtype=tl.float32)
    for p0 in range(p_lo, p_hi, BLOCK_Q):
        offs_p = p0 + tl.arange(0, BLOCK_Q)
        p_in = offs_p < p_hi
        band = (offs_p[None, :] > offs_t[:, None]) & (offs_p[None, :] <= offs_t[:, None] + WINDOW)
        band = band & p_in[None, :] & t_in[:, None]
        q_rows = (q_lo + offs_p - q_start).to(tl.int64)
        for j in tl.static_range(HEADS_PER_COLUMN):
            head = column * HEADS_PER_COLUMN + j
            q = tl.load(q_ptr + q_rows[None, :] * stride_qn + head * stride_qh
                        + offs_d[:, None] * stride_qd,
                        mask=p_in[None, :] & d_in[:, None], other=0.0)  # fmt: skip
            # 137 GFLOP per 32K-query chunk and layer of Llama-3-8B: [BLOCK_T, BLOCK_Q] logits
            if DOT_16BIT:
                s = tl.dot(k, q) * logit_scale
            else:  # fp32 queries: tf32x3, fp32-accurate on tensor cores (3 passes)
                s = tl.dot(k, q.to(tl.float32), input_precision="tf32x3") * logit_scale
            acc += tl.sum(tl.where(band, s, 0.0), axis=1)

    cell = state_ptr + page * stride_spage + in_page * stride_stok
    old = tl.load(cell + column * stride_sh, mask=t_in, other=0.0)
    tl.store(cell + column * stride_sh, old + acc, mask=t_in)
    if column == 0:
        # followers of t in this call: (t, t + WINDOW] within [q_start, q_end)
        lo = tl.maximum(offs_t + 1, q_start)
        hi = tl.minimum(offs_t + WINDOW, q_end - 1)
        count = tl.maximum(hi - lo + 1, 0).to(tl.float32)
        counted = tl.load(cell + N_COLUMNS * stride_sh, mask=t_in, other=0.0)
        tl.store(cell + N_COLUMNS * stride_sh, counted + count, mask=t_in)


def landmark_accumulate_tiles(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    tiles: LandmarkTiles,
    state: torch.Tensor,
    scale: float,
    *,
    window: int = ref.LANDMARK_WINDOW,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
) -> None:
    """Add every prefill chunk of a step (``tiles``, planned with the same ``window``; ``q``
    the step's queries, ``block_table [rows, pages]``; one chunk: ``LandmarkTiles.plan`` of
    it) to the landmark ``state`` in place, in one launch, as
    :func:`reference.landmark_accumulate_paged` does chunk by chunk. Chunks of
    one step are different requests, so no two programs own the same cell."""
    hq, d = q.shape[1], q.shape[2]
    h = ref.check_landmark_state(state, kv_cache, hq)
    n_tiles = tiles.tiles.shape[0]
    if n_tiles == 0:
        return
    cache, k_sc, _, fp8 = kv_quant_args(kv_cache, k_scale, v_scale)
    hkv, page_size = kv_cache.shape[3], kv_cache.shape[2]
    if block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    _landmark_kernel[(n_tiles, h)](
        q, cache, block_table, tiles.tiles, state, k_sc, d, scale,
        *q.stride(), cache.stride(0), cache.stride(2), cache.stride(3), cache.stride(4),
        block_table.stride(0) if block_table.dim() == 2 else 0, *state.stride(),
        WINDOW=window, GROUP=hq // hkv, HEADS_PER_COLUMN=hq // h, N_COLUMNS=h,
        PAGE_SIZE=page_size, BLOCK_T=LANDMARK_TILE, BLOCK_Q=64,
        BLOCK_D=max(16, triton.next_power_of_2(d)), KV_FP8=fp8,
        DOT_16BIT=_dot_16bit(q.dtype, cache.dtype, fp8), num_warps=4,
    )  # fmt: skip


def _dot_16bit(q_dtype: torch.dtype, cache_dtype: torch.dtype, fp8: bool) -> bool:
    """Whether the kernel's logits take one 16-bit tensor-core pass: queries of 16 bits over
    keys of their dtype or of fp8. Not bf16 under Triton's interpreter, which multiplies bf16
    ``tl.dot`` operands as raw integers (those take the fp32 path there)."""
    if q_dtype == torch.bfloat16 and triton.knobs.runtime.interpret:
        return False
    return q_dtype in (torch.bfloat16, torch.float16) and (fp8 or cache_dtype == q_dtype)


def landmark_tables(
    state: torch.Tensor,
    block_table: torch.Tensor,
    lengths: dict[int, int],
    sink: int,
    chunk_sizes: list[int],
    group: int,
) -> dict[int, torch.Tensor]:
    """Per chunk size ``l``: ``[rows, n, H]`` int32, the landmark representative of every
    aligned chunk ``[sink + j l, sink + (j + 1) l)`` of the requests at block-table rows
    ``lengths`` (row -> its length: keys past it never stand for a chunk), what
    :func:`reference.landmark_table` gives over each request's scores
    (:func:`reference.landmark_means_paged`). Rows not listed hold zeros. One gather of the
    requests' state cells for all sizes (``[R, T, H + 1]`` float32, T the longest request)."""
    h = state.shape[2] - 1
    page = state.shape[1]
    device = state.device
    rows = sorted(lengths)
    longest = max(lengths.values(), default=0)
    out = {}
    if not rows or longest == 0:
        return {size: torch.zeros(block_table.shape[0], 0, h, dtype=torch.int32, device=device)
                for size in chunk_sizes}  # fmt: skip
    t = torch.arange(longest, device=device)
    row_ids = torch.tensor(rows, device=device)
    slots = block_table[row_ids][:, t // page].long() * page + t % page  # [R, T]
    cells = state.view(-1, h + 1)[slots]
    means = ref.landmark_means(cells[..., :h].reshape(-1, h), cells[..., h].reshape(-1), group)
    lens = torch.tensor([lengths[r] for r in rows], device=device)
    means = means.view(len(rows), longest, h).masked_fill(
        (t.view(1, -1) >= lens.view(-1, 1)).unsqueeze(-1), ref.NEG_INF)
    for size in chunk_sizes:
        n = max(0, -(-(longest - sink) // size))
        table = torch.zeros(block_table.shape[0], n, h, dtype=torch.int32, device=device)
        table[row_ids] = ref.landmark_table(means, sink, size, n)
        out[size] = table
    return out
