"""Block-sparse attention (INFINITEHIP.md §1.7) in Triton, reading vLLM's paged KV cache.

Two entry points, both exact re-statements of :func:`reference.masked_attention` over the key set
of :func:`reference.sparse_key_mask` (sink ``[0, n_sink)``, window ``(p - n_stream, p]`` and the
query block's selected blocks, causal, every key once):

- :func:`sparse_decode_attention`: one query per request, FlashDecoding style. The key set of a
  request is laid out as one "virtual" key sequence (sink, then window, then the selected blocks),
  cut into ``num_splits`` equal pieces at run time; each (request, KV head, split) program writes a
  partial output and its log-sum-exp, and a second kernel merges them.
- :func:`sparse_prefill_attention`: one request's prefill chunk, FlashAttention-2 style, one program
  per (query block, query head), looping over the selected blocks, the sink, then the window.

Keys are deduplicated by masking rather than by building a set: a selected key counts only if it is
outside the sink, outside the query's window, and past the end of the previous selected block (the
starts are ascending, so that end is the furthest any earlier block reached). Window keys count only
outside the sink. Everything is in the exp2 domain with fp32 accumulation.

With ``rope`` both entry points instead restate ``reference._streaming_attention`` (§2,
StreamingLLM-style positions). The key set is that function's: the window
``(p_min - n_stream, p]`` of the query block at true positions, and before it the sink tokens
and then the selected tokens, not deduplicated. Those far keys are rotated in-kernel from their
true positions to contiguous positions just left of the window, with cos/sin from the
float64-built tables of :mod:`kernels.triton_rope`.

KV cache layout: ``[num_pages, 2, page_size, H_kv, D]`` (0 = K, 1 = V), any strides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .query_blocks import QueryBlocks
from .reference import FP8_DTYPE, SplitV, is_fp8_cache
from .rope import RopeTable
from .triton_rope import (
    LO_BITS,
    check_layout,
    delta_tables,
    load_split,
    rotate_split,
    split_blocks,
)

__all__ = ["sparse_decode_attention", "sparse_prefill_attention", "sparse_prefill_attention_blocks"]

_LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------- device helpers
@triton.jit
def _tanh(x):
    # Not every backend (the interpreter included) has a tanh; this form saturates to +-1 cleanly.
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)


@triton.jit
def _page_of(bt_row_ptr, stride_btp, t, ok, kv_head, stride_tok, stride_head,
             PAGE_SIZE: tl.constexpr):  # fmt: skip
    """The cache page of tokens ``t`` (0 where ``~ok``) and their offset within a page."""
    t = tl.where(ok, t, 0)
    page = tl.load(bt_row_ptr + (t // PAGE_SIZE) * stride_btp, mask=ok, other=0).to(tl.int64)
    # int64: page * stride_page overflows int32 for caches of a few GiB.
    return page, (t % PAGE_SIZE).to(tl.int64) * stride_tok + kv_head * stride_head


@triton.jit
def paged_rows(
    kv_ptr,
    bt_row_ptr,
    stride_btp,
    t,
    ok,
    kv_head,
    stride_page,
    stride_tok,
    stride_head,
    bank_ptr,
    table_ptr,
    stride_slot,
    PAGE_SIZE: tl.constexpr,
    HAS_BANK: tl.constexpr,
):
    """Pointers to the K rows of tokens ``t`` of one request and KV head; a row's V is at
    ``+ stride_kv``. With ``HAS_BANK`` a page whose residency-table entry holds a slot is read
    from that slot of the bank (a GPU copy of host pages, same layout within a page), any other
    from the cache itself: the arithmetic after the load is the same either way."""
    page, in_page = _page_of(bt_row_ptr, stride_btp, t, ok, kv_head, stride_tok, stride_head,
                             PAGE_SIZE)  # fmt: skip
    rows = kv_ptr + page * stride_page + in_page
    if HAS_BANK:
        slot = tl.load(table_ptr + page, mask=ok, other=-1).to(tl.int64)
        rows = tl.where(slot >= 0, bank_ptr + slot * stride_slot + in_page, rows)
    return rows


@triton.jit
def split_rows(
    kv_ptr,
    bt_row_ptr,
    stride_btp,
    t,
    ok,
    kv_head,
    stride_page,
    stride_tok,
    stride_head,
    v_dev_ptr,
    v_host_ptr,
    table_ptr,
    stride_vpage,
    PAGE_SIZE: tl.constexpr,
):
    """Pointers to the K rows (in the K plane ``kv_ptr``) and the V rows of tokens ``t`` of one
    request and KV head when the host tier splits V from K (``reference.SplitV``): a block's V
    is on the GPU page ``table[block]`` of ``v_dev`` when that is ``>= 0``, else on host page
    ``-1 - table[block]``. The planes share their layout within a page."""
    page, in_page = _page_of(bt_row_ptr, stride_btp, t, ok, kv_head, stride_tok, stride_head,
                             PAGE_SIZE)  # fmt: skip
    slot = tl.load(table_ptr + page, mask=ok, other=0).to(tl.int64)
    v_rows = tl.where(slot >= 0, v_dev_ptr + slot * stride_vpage + in_page,
                      v_host_ptr + (-1 - slot) * stride_vpage + in_page)  # fmt: skip
    return kv_ptr + page * stride_page + in_page, v_rows


@triton.jit
def kv_rows(
    kv_ptr,
    bt_row_ptr,
    stride_btp,
    t,
    ok,
    kv_head,
    stride_page,
    stride_kv,
    stride_tok,
    stride_head,
    split_ptrs,
    PAGE_SIZE: tl.constexpr,
    SPLIT_V: tl.constexpr,
):
    """K and V row pointers of tokens ``t`` in either layout: the whole cache (V at
    ``+ stride_kv``), or with ``SPLIT_V`` a K plane and ``split_ptrs = (v_dev, v_host, table,
    stride_vpage)`` (:func:`split_rows`)."""
    if SPLIT_V:
        v_dev_ptr, v_host_ptr, table_ptr, stride_vpage = split_ptrs
        return split_rows(
            kv_ptr, bt_row_ptr, stride_btp, t, ok, kv_head, stride_page, stride_tok,
            stride_head, v_dev_ptr, v_host_ptr, table_ptr, stride_vpage, PAGE_SIZE,
        )  # fmt: skip
    rows = paged_rows(
        kv_ptr, bt_row_ptr, stride_btp, t, ok, kv_head, stride_page, stride_tok, stride_head,
        kv_ptr, bt_row_ptr, 0, PAGE_SIZE, False,
    )  # fmt: skip
    return rows, rows + stride_kv


@triton.jit
def _load_rows(
    rows, v_rows, ok, offs_d, d_ok, stride_d, k_scale, v_scale, KV_FP8: tl.constexpr
):
    """K ``[BLOCK_N, BLOCK_D]`` at ``rows`` and V at ``v_rows`` (:func:`paged_rows`, whose V is at
    ``rows + stride_kv``, or :func:`split_rows`); zeros where ``~ok``.

    ``KV_FP8``: the cache holds e4m3 values, dequantized here as ``float32(x) * scale`` (what
    ``reference.gather_paged_kv`` returns); the rows stay float32 until ``_attend`` casts them
    to the dot's dtype, as it casts a 16-bit cache's rows."""
    mask = ok[:, None] & d_ok[None, :]
    k = tl.load(rows[:, None] + offs_d[None, :] * stride_d, mask=mask, other=0.0)
    v = tl.load(v_rows[:, None] + offs_d[None, :] * stride_d, mask=mask, other=0.0)
    if KV_FP8:
        k = k.to(tl.float32) * k_scale
        v = v.to(tl.float32) * v_scale
    return k, v


@triton.jit
def _kv_scales(k_scale_ptr, v_scale_ptr, KV_FP8: tl.constexpr):
    """The layer's K and V dequantization scales (1 for a cache that is not fp8)."""
    if KV_FP8:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    else:
        k_scale = 1.0
        v_scale = 1.0
    return k_scale, v_scale


@triton.jit
def _load_kv(
    kv_ptr,
    bt_row_ptr,
    stride_btp,
    t,
    ok,
    kv_head,
    offs_d,
    d_ok,
    stride_page,
    stride_kv,
    stride_tok,
    stride_head,
    stride_d,
    split_ptrs,
    PAGE_SIZE: tl.constexpr,
    SPLIT_V: tl.constexpr,
    k_scale,
    v_scale,
    KV_FP8: tl.constexpr,
):
    """K and V rows ``[BLOCK_N, BLOCK_D]`` of tokens ``t`` of one request; zeros where ``~ok``."""
    rows, v_rows = kv_rows(
        kv_ptr, bt_row_ptr, stride_btp, t, ok, kv_head, stride_page, stride_kv, stride_tok,
        stride_head, split_ptrs, PAGE_SIZE, SPLIT_V,
    )  # fmt: skip
    return _load_rows(rows, v_rows, ok, offs_d, d_ok, stride_d, k_scale, v_scale, KV_FP8)


@triton.jit
def _attend_rows(
    q,
    rows,
    v_rows,
    ok,
    acc,
    m_i,
    l_i,
    offs_d,
    d_ok,
    stride_d,
    k_scale,
    v_scale,
    qk_scale,
    cap_log2e,
    inv_cap_scale,
    KV_FP8: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """:func:`_attend` over the keys at ``rows`` and values at ``v_rows`` as cached."""
    k, v = _load_rows(rows, v_rows, ok, offs_d, d_ok, stride_d, k_scale, v_scale, KV_FP8)
    return _attend(q, k, v, ok[None, :], acc, m_i, l_i, qk_scale, cap_log2e, inv_cap_scale,
                   USE_SOFT_CAP, DOT_PRECISION)  # fmt: skip


@triton.jit
def _attend_rotated(
    q,
    qa,
    qb,
    qp,
    rows,
    v_rows,
    ok,
    delta,
    acc,
    m_i,
    l_i,
    stride_d,
    offs_d,
    d_ok,
    head_dim,
    rope_hi_ptr,
    rope_lo_ptr,
    rope_bias,
    rope_n_hi,
    k_scale,
    v_scale,
    qk_scale,
    cap_log2e,
    inv_cap_scale,
    KV_FP8: tl.constexpr,
    ROT_DIM: tl.constexpr,
    IS_NEOX: tl.constexpr,
    LO_BITS: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_P: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """:func:`_attend` over the keys at ``rows`` turned by ``delta`` each, values at ``v_rows``
    (identity where ``delta == 0``), all rows of the tile valid where ``ok``.

    The queries come split as :func:`triton_rope.load_split` splits the keys (``qa``, ``qb``,
    ``qp``; ``q`` whole gives the dtype of P.V): the scores are one ``tl.dot`` per part. Each
    turned key is rounded to the cache's dtype first, as a rotated cache would hold it (an fp8
    cache's keys are float32 once dequantized)."""
    ka, kb, kp = load_split(rows, ok, stride_d, head_dim, k_scale, KV_FP8, ROT_DIM, IS_NEOX,
                            BLOCK_F, BLOCK_P)  # fmt: skip
    ka, kb = rotate_split(ka, kb, delta, ok, rope_hi_ptr, rope_lo_ptr, rope_bias, rope_n_hi,
                          ROT_DIM, LO_BITS, BLOCK_F)  # fmt: skip
    if not KV_FP8:
        ka = ka.to(rows.dtype.element_ty)
        kb = kb.to(rows.dtype.element_ty)
    s = tl.dot(qa, tl.trans(ka.to(qa.dtype)), input_precision=DOT_PRECISION)
    s += tl.dot(qb, tl.trans(kb.to(qa.dtype)), input_precision=DOT_PRECISION)
    if BLOCK_P > 0:
        s += tl.dot(qp, tl.trans(kp.to(qa.dtype)), input_precision=DOT_PRECISION)
    v = tl.load(v_rows[:, None] + offs_d[None, :] * stride_d,
                mask=ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
    if KV_FP8:
        v = v.to(tl.float32) * v_scale
    return _softmax_step(q, s, v, ok[None, :], acc, m_i, l_i, qk_scale, cap_log2e,
                         inv_cap_scale, USE_SOFT_CAP, DOT_PRECISION)  # fmt: skip


@triton.jit
def _attend(
    q,
    k,
    v,
    valid,
    acc,
    m_i,
    l_i,
    qk_scale,
    cap_log2e,
    inv_cap_scale,
    USE_SOFT_CAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step over a key tile; ``valid`` is ``[rows, keys]``."""
    k = k.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    return _softmax_step(q, s, v, valid, acc, m_i, l_i, qk_scale, cap_log2e, inv_cap_scale,
                         USE_SOFT_CAP, DOT_PRECISION)  # fmt: skip


@triton.jit
def _softmax_step(
    q,
    s,
    v,
    valid,
    acc,
    m_i,
    l_i,
    qk_scale,
    cap_log2e,
    inv_cap_scale,
    USE_SOFT_CAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """:func:`_attend` from the raw scores ``s`` ``[rows, keys]`` on (q gives the dtype of
    P.V)."""
    if USE_SOFT_CAP:
        s = cap_log2e * _tanh(s * inv_cap_scale)
    else:
        s = s * qk_scale
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    pv = tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


# --------------------------------------------------------------------------- decode
@triton.jit
def _decode_split_kernel(
    q_ptr,
    kv_ptr,
    bt_ptr,
    seq_lens_ptr,
    starts_ptr,
    nvalid_ptr,
    slot_ptr,
    stale_ptr,
    stats_ptr,
    part_o_ptr,
    part_lse_ptr,
    rope_hi_ptr,
    rope_lo_ptr,
    bank_ptr,
    table_ptr,
    stride_slot,
    v_host_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_qb,
    stride_qh,
    stride_qd,
    stride_page,
    stride_kv,
    stride_tok,
    stride_head,
    stride_d,
    stride_btb,
    stride_btp,
    stride_sb,
    stride_sk,
    stride_nv,
    sink_tokens,
    window_tokens,
    trained_context,
    qk_scale,
    cap_log2e,
    inv_cap_scale,
    rope_bias,
    rope_n_hi,
    HAS_SLOTS: tl.constexpr,
    HAS_STATS: tl.constexpr,
    HAS_BANK: tl.constexpr,
    SPLIT_V: tl.constexpr,
    EXTEND: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    STREAMING: tl.constexpr,
    ROT_DIM: tl.constexpr,
    IS_NEOX: tl.constexpr,
    LO_BITS: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_P: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    k_scale, v_scale = _kv_scales(k_scale_ptr, v_scale_ptr, KV_FP8)

    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    pos = seq_len - 1
    if HAS_SLOTS:
        # starts and counts live in the row's state slot; no slot: a dense row
        row_slot = tl.load(slot_ptr + b)
    else:
        row_slot = b
    dense = row_slot < 0
    mask_row = tl.maximum(row_slot, 0).to(tl.int64)
    # Virtual key sequence: [0, sink_len) sink, then window positions [win_lo, pos], then the
    # selected blocks. win_lo >= sink_len, so sink and window never overlap.
    sink_len = tl.minimum(sink_tokens, seq_len)
    win_lo = tl.maximum(sink_len, pos - window_tokens + 1)
    if STREAMING:
        # A row below the trained length attends at true positions, over the key set of the
        # plain path (reference.sparse_attention): everything streaming below is off for it.
        remap = pos >= trained_context
        # As reference._streaming_attention: the window (p - n_stream, p] may reach into the
        # sink, whose tokens there are window keys (true positions), not sink keys.
        win_lo = tl.where(remap, tl.maximum(pos - window_tokens + 1, 0), win_lo)
        sink_len = tl.where(remap, tl.minimum(sink_len, win_lo), sink_len)
    # A dense row's whole context is its window, at true positions.
    sink_len = tl.where(dense, 0, sink_len)
    win_lo = tl.where(dense, 0, win_lo)
    n_sw = sink_len + tl.maximum(seq_len - win_lo, 0)
    n_valid = tl.load(nvalid_ptr + mask_row * stride_nv).to(tl.int32)
    n_valid = tl.where(dense, 0, n_valid)
    # Tokens read per selected block: BLOCK_K, or with EXTEND that many more as the row's
    # blocks age (decode steps since they were chosen, at most BLOCK_K), so a copy that walks
    # past a block's end between refreshes keeps reading the tokens it copies next.
    block_len = BLOCK_K
    if EXTEND:
        block_len = BLOCK_K + tl.minimum(tl.load(stale_ptr + b).to(tl.int32), BLOCK_K)
    total = n_sw + n_valid * block_len
    if HAS_STATS:
        # budget pairs and context pairs of the sparse rows, once per row
        if (kv_head == 0) & (split == 0) & (~dense) & (seq_len > 0):
            tl.atomic_add(stats_ptr, total.to(tl.int64))
            tl.atomic_add(stats_ptr + 1, seq_len.to(tl.int64))
    # Split boundaries are computed here from the live length, so the grid (shapes only) stays
    # graph-capturable while the work stays balanced whatever the request's length.
    per_split = tl.cdiv(tl.cdiv(total, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, total)

    offs_h = tl.arange(0, BLOCK_H)
    h_ok = offs_h < GROUP
    heads = kv_head * GROUP + offs_h
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=h_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    starts_row = starts_ptr + mask_row * stride_sb
    if STREAMING:
        # The query split as the keys are for their rotation (triton_rope.load_split).
        q_rows = q_ptr + b * stride_qb + heads * stride_qh
        qa, qb, qp = load_split(q_rows, h_ok, stride_qd, HEAD_DIM, 1.0, False, ROT_DIM, IS_NEOX,
                                BLOCK_F, BLOCK_P)  # fmt: skip
        # Streaming position of far-key slot j (sink tokens, then selected tokens):
        # max(0, j + first), so the last slot lands at p - n_stream (rope.streaming_positions).
        first = pos - window_tokens - sink_tokens - n_valid * block_len + 1
        sel_slot0 = tl.minimum(sink_tokens, seq_len)  # slots of the sink tokens that exist

    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    # Finite so that a row that has seen only masked keys keeps exp2(m_old - m_new) = 1, not NaN.
    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    for v0 in range(lo, hi, BLOCK_N):
        vi = v0 + tl.arange(0, BLOCK_N)
        live = vi < hi
        in_sw = vi < n_sw
        t_sw = tl.where(vi < sink_len, vi, win_lo + (vi - sink_len))
        vs = tl.where(in_sw, 0, vi - n_sw)  # kept >= 0: integer division of negatives differs
        blk = vs // block_len
        sel = live & ~in_sw
        start = tl.load(starts_row + blk * stride_sk, mask=sel, other=0).to(tl.int32)
        prev = tl.load(starts_row + (blk - 1) * stride_sk, mask=sel & (blk > 0), other=0)
        prev_end = tl.where(blk > 0, prev.to(tl.int32) + block_len, 0)
        t_sel = start + vs % block_len
        # t_sel < win_lo also keeps it causal and out of the sink-covered prefix.
        sel_ok = sel & (t_sel >= sink_tokens) & (t_sel < win_lo) & (t_sel >= prev_end)
        if STREAMING:
            # The reference's far list is not deduplicated: a selected token inside the sink, or
            # in two overlapping blocks, is attended once per occurrence, each at its own slot.
            # Only tokens inside the window are dropped (they are window keys).
            sel_ok = tl.where(remap, sel & (t_sel >= 0) & (t_sel < win_lo), sel_ok)
        t = tl.where(in_sw, t_sw, t_sel)
        ok = tl.where(in_sw, live, sel_ok)
        if SPLIT_V:
            # the host tier's split: K in the plane, V at its home or bank copy
            rows, v_rows = split_rows(
                kv_ptr, bt_row, stride_btp, t, ok, kv_head, stride_page, stride_tok,
                stride_head, bank_ptr, v_host_ptr, table_ptr, stride_slot, PAGE_SIZE,
            )  # fmt: skip
        else:
            rows = paged_rows(
                kv_ptr, bt_row, stride_btp, t, ok, kv_head, stride_page, stride_tok,
                stride_head, bank_ptr, table_ptr, stride_slot, PAGE_SIZE, HAS_BANK,
            )  # fmt: skip
            v_rows = rows + stride_kv
        # (constexpr branches outermost: the compiler visits both sides of a runtime branch)
        if STREAMING:
            far = ok & ((vi < sink_len) | ~in_sw) & remap
            if tl.max(far.to(tl.int32), axis=0) > 0:  # window-only tiles keep true positions
                slot = tl.where(in_sw, vi, sel_slot0 + vs)
                delta = tl.where(far, tl.maximum(slot + first, 0) - t, 0)
                acc, m_i, l_i = _attend_rotated(
                    q, qa, qb, qp, rows, v_rows, ok, delta, acc, m_i, l_i, stride_d, offs_d,
                    d_ok, HEAD_DIM, rope_hi_ptr, rope_lo_ptr, rope_bias, rope_n_hi, k_scale,
                    v_scale, qk_scale, cap_log2e, inv_cap_scale, KV_FP8, ROT_DIM, IS_NEOX,
                    LO_BITS, BLOCK_F, BLOCK_P, USE_SOFT_CAP, DOT_PRECISION,
                )  # fmt: skip
            else:
                acc, m_i, l_i = _attend_rows(
                    q, rows, v_rows, ok, acc, m_i, l_i, offs_d, d_ok, stride_d, k_scale,
                    v_scale, qk_scale, cap_log2e, inv_cap_scale, KV_FP8, USE_SOFT_CAP,
                    DOT_PRECISION,
                )  # fmt: skip
        else:
            acc, m_i, l_i = _attend_rows(
                q, rows, v_rows, ok, acc, m_i, l_i, offs_d, d_ok, stride_d, k_scale, v_scale,
                qk_scale, cap_log2e, inv_cap_scale, KV_FP8, USE_SOFT_CAP, DOT_PRECISION,
            )  # fmt: skip

    # Every partial is written, empty splits included (lse = -inf, o = 0), so the merge never
    # reads stale scratch.
    has = l_i > 0.0
    l_safe = tl.where(has, l_i, 1.0)
    o = acc / l_safe[:, None]
    lse = tl.where(has, m_i + tl.log2(l_safe), float("-inf"))
    row = (b * NUM_HEADS + heads) * NUM_SPLITS + split
    tl.store(
        part_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
        o,
        mask=h_ok[:, None] & d_ok[None, :],
    )
    tl.store(part_lse_ptr + row, lse, mask=h_ok)


@triton.jit
def _decode_merge_kernel(
    part_o_ptr,
    part_lse_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    stride_od,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    row = (b * NUM_HEADS + h) * NUM_SPLITS + offs_s
    lse = tl.load(part_lse_ptr + row, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # no keys at all: every weight is 0, output 0
    w = tl.exp2(lse - m)
    denom = tl.sum(w, 0)
    o = tl.load(
        part_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    res = tl.sum(w[:, None] * o, 0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(
        out_ptr + b * stride_ob + h * stride_oh + offs_d * stride_od,
        res.to(out_ptr.dtype.element_ty),
        mask=d_ok,
    )


# --------------------------------------------------------------------------- prefill
# Query rows per prefill program (heads of a KV group stacked): 128, as FlashAttention's tiles.
PREFILL_TILE_ROWS = 128


@triton.jit
def _prefill_streaming(
    q,
    qa,
    qb,
    qp,
    acc,
    m_i,
    l_i,
    kv_ptr,
    bt_ptr,
    starts_row,
    n_sel,
    pos,
    p_min,
    p_max,
    seq_len,
    kv_head,
    offs_d,
    d_ok,
    rope_hi_ptr,
    rope_lo_ptr,
    rope_bias,
    rope_n_hi,
    stride_page,
    stride_kv,
    stride_tok,
    stride_head,
    stride_d,
    stride_btp,
    stride_sk,
    split_ptrs,
    sink_tokens,
    window_tokens,
    qk_scale,
    cap_log2e,
    inv_cap_scale,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    SPLIT_V: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROT_DIM: tl.constexpr,
    IS_NEOX: tl.constexpr,
    LO_BITS: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    k_scale,
    v_scale,
    KV_FP8: tl.constexpr,
):
    """One query block over the key set of ``reference._streaming_attention`` (§2 StreamingLLM).

    The block's window is ``[win_lo, p_max]`` with ``win_lo = max(0, p_min - n_stream + 1)``,
    causal per query, at true positions (the query keeps its own too). The far keys are the
    sink tokens, then the selected blocks' tokens, in that order and not deduplicated. Each is
    rotated to ``max(0, slot + first)`` with ``first = p_min - n_stream - n_sink - K_sel + 1``
    and seen by every query of the block. Far tokens at or past ``win_lo`` are dropped, but
    they keep their slot.
    """
    win_lo = tl.maximum(p_min - window_tokens + 1, 0)
    first = p_min - window_tokens - sink_tokens - n_sel + 1
    sel_slot0 = tl.minimum(sink_tokens, seq_len)

    # 1. Selected blocks, before the window. They are causal for the whole block.
    for v0 in range(0, n_sel, BLOCK_N):
        vi = v0 + tl.arange(0, BLOCK_N)
        live = vi < n_sel
        start = tl.load(starts_row + (vi // BLOCK_K) * stride_sk, mask=live, other=0)
        t = start.to(tl.int32) + vi % BLOCK_K
        ok = live & (t >= 0) & (t < win_lo)
        rows, v_rows = kv_rows(
            kv_ptr, bt_ptr, stride_btp, t, ok, kv_head, stride_page, stride_kv, stride_tok,
            stride_head, split_ptrs, PAGE_SIZE, SPLIT_V,
        )  # fmt: skip
        delta = tl.maximum(sel_slot0 + vi + first, 0) - t
        acc, m_i, l_i = _attend_rotated(
            q, qa, qb, qp, rows, v_rows, ok, delta, acc, m_i, l_i, stride_d, offs_d, d_ok,
            HEAD_DIM, rope_hi_ptr, rope_lo_ptr, rope_bias, rope_n_hi, k_scale, v_scale,
            qk_scale, cap_log2e, inv_cap_scale, KV_FP8, ROT_DIM, IS_NEOX, LO_BITS, BLOCK_F,
            BLOCK_P, USE_SOFT_CAP, DOT_PRECISION,
        )  # fmt: skip

    # 2. Sink tokens before the window, at slots 0, 1, ...
    sink_hi = tl.minimum(tl.minimum(sink_tokens, seq_len), win_lo)
    for t0 in range(0, sink_hi, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        ok = t < sink_hi
        rows, v_rows = kv_rows(
            kv_ptr, bt_ptr, stride_btp, t, ok, kv_head, stride_page, stride_kv, stride_tok,
            stride_head, split_ptrs, PAGE_SIZE, SPLIT_V,
        )  # fmt: skip
        delta = tl.maximum(t + first, 0) - t
        acc, m_i, l_i = _attend_rotated(
            q, qa, qb, qp, rows, v_rows, ok, delta, acc, m_i, l_i, stride_d, offs_d, d_ok,
            HEAD_DIM, rope_hi_ptr, rope_lo_ptr, rope_bias, rope_n_hi, k_scale, v_scale,
            qk_scale, cap_log2e, inv_cap_scale, KV_FP8, ROT_DIM, IS_NEOX, LO_BITS, BLOCK_F,
            BLOCK_P, USE_SOFT_CAP, DOT_PRECISION,
        )  # fmt: skip

    # 3. The block's window at true positions, causal per query.
    for t0 in range(win_lo, p_max + 1, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        ok = t <= p_max
        k, v = _load_kv(
            kv_ptr, bt_ptr, stride_btp, t, ok, kv_head, offs_d, d_ok,
            stride_page, stride_kv, stride_tok, stride_head, stride_d, split_ptrs,
            PAGE_SIZE, SPLIT_V, k_scale, v_scale, KV_FP8,
        )  # fmt: skip
        valid = ok[None, :] & (t[None, :] <= pos[:, None])
        acc, m_i, l_i = _attend(
            q, k, v, valid, acc, m_i, l_i, qk_scale, cap_log2e, inv_cap_scale,
            USE_SOFT_CAP, DOT_PRECISION,
        )  # fmt: skip
    return acc, m_i, l_i


@triton.jit
def _prefill_plain(
    q,
    acc,
    m_i,
    l_i,
    kv_ptr,
    bt_ptr,
    starts_row,
    n_sel,
    pos,
    p_min,
    p_max,
    kv_head,
    offs_d,
    d_ok,
    stride_page,
    stride_kv,
    stride_tok,
    stride_head,
    stride_d,
    stride_btp,
    stride_sk,
    split_ptrs,
    sink_tokens,
    window_tokens,
    qk_scale,
    cap_log2e,
    inv_cap_scale,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    SPLIT_V: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    k_scale,
    v_scale,
    KV_FP8: tl.constexpr,
):
    """One query block over the key set of ``reference.sparse_key_mask`` at true positions."""
    # 1. Selected blocks: outside the sink, outside each query's window (which implies
    #    causal), and past the previous block's end (dedup of overlapping blocks).
    for v0 in range(0, n_sel, BLOCK_N):
        vi = v0 + tl.arange(0, BLOCK_N)
        live = vi < n_sel
        blk = vi // BLOCK_K
        start = tl.load(starts_row + blk * stride_sk, mask=live, other=0).to(tl.int32)
        prev = tl.load(starts_row + (blk - 1) * stride_sk, mask=live & (blk > 0), other=0)
        prev_end = tl.where(blk > 0, prev.to(tl.int32) + BLOCK_K, 0)
        t = start + vi % BLOCK_K
        ok = live & (t >= sink_tokens) & (t >= prev_end) & (t <= p_max - window_tokens)
        k, v = _load_kv(
            kv_ptr, bt_ptr, stride_btp, t, ok, kv_head, offs_d, d_ok,
            stride_page, stride_kv, stride_tok, stride_head, stride_d, split_ptrs,
            PAGE_SIZE, SPLIT_V, k_scale, v_scale, KV_FP8,
        )  # fmt: skip
        valid = ok[None, :] & (t[None, :] <= pos[:, None] - window_tokens)
        acc, m_i, l_i = _attend(
            q, k, v, valid, acc, m_i, l_i, qk_scale, cap_log2e, inv_cap_scale,
            USE_SOFT_CAP, DOT_PRECISION,
        )  # fmt: skip

    # 2. Sink: causal only.
    sink_hi = tl.minimum(sink_tokens, p_max + 1)
    for t0 in range(0, sink_hi, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        ok = t < sink_hi
        k, v = _load_kv(
            kv_ptr, bt_ptr, stride_btp, t, ok, kv_head, offs_d, d_ok,
            stride_page, stride_kv, stride_tok, stride_head, stride_d, split_ptrs,
            PAGE_SIZE, SPLIT_V, k_scale, v_scale, KV_FP8,
        )  # fmt: skip
        valid = ok[None, :] & (t[None, :] <= pos[:, None])
        acc, m_i, l_i = _attend(
            q, k, v, valid, acc, m_i, l_i, qk_scale, cap_log2e, inv_cap_scale,
            USE_SOFT_CAP, DOT_PRECISION,
        )  # fmt: skip

    # 3. Window: the union of the block's windows, starting past the sink; per query
    #    (p - n_stream, p].
    win_lo = tl.maximum(sink_tokens, p_min - window_tokens + 1)
    for t0 in range(win_lo, p_max + 1, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        ok = t <= p_max
        k, v = _load_kv(
            kv_ptr, bt_ptr, stride_btp, t, ok, kv_head, offs_d, d_ok,
            stride_page, stride_kv, stride_tok, stride_head, stride_d, split_ptrs,
            PAGE_SIZE, SPLIT_V, k_scale, v_scale, KV_FP8,
        )  # fmt: skip
        valid = (
            ok[None, :]
            & (t[None, :] <= pos[:, None])
            & (t[None, :] > pos[:, None] - window_tokens)
        )
        acc, m_i, l_i = _attend(
            q, k, v, valid, acc, m_i, l_i, qk_scale, cap_log2e, inv_cap_scale,
            USE_SOFT_CAP, DOT_PRECISION,
        )  # fmt: skip
    return acc, m_i, l_i


@triton.jit
def _prefill_kernel(
    q_ptr,
    kv_ptr,
    bt_ptr,
    rows_ptr,
    qstart_ptr,
    count_ptr,
    firstpos_ptr,
    end_ptr,
    starts_ptr,
    nvalid_ptr,
    out_ptr,
    rope_hi_ptr,
    rope_lo_ptr,
    v_dev_ptr,
    v_host_ptr,
    table_ptr,
    stride_vpage,
    k_scale_ptr,
    v_scale_ptr,
    stride_qn,
    stride_qh,
    stride_qd,
    stride_page,
    stride_kv,
    stride_tok,
    stride_head,
    stride_d,
    stride_btr,
    stride_btp,
    stride_sb,
    stride_sk,
    stride_on,
    stride_oh,
    stride_od,
    sink_tokens,
    window_tokens,
    trained_context,
    qk_scale,
    cap_log2e,
    inv_cap_scale,
    rope_bias,
    rope_n_hi,
    GROUP: tl.constexpr,
    HEADS: tl.constexpr,
    HEAD_TILES: tl.constexpr,
    BLOCK_SIZE_Q: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    STREAMING: tl.constexpr,
    ROT_DIM: tl.constexpr,
    IS_NEOX: tl.constexpr,
    LO_BITS: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_P: tl.constexpr,
    KV_FP8: tl.constexpr,
    SPLIT_V: tl.constexpr,
):
    # One program per (query block, tile of HEADS query heads of one KV group): the heads of a
    # group share the block's mask, so their queries are stacked as HEADS * BLOCK_Q rows and
    # each K/V tile is read once for all of them (once per HEAD_TILES, not per query head).
    qb = tl.program_id(0)
    tile = tl.program_id(1)
    kv_head = tile // HEAD_TILES
    k_scale, v_scale = _kv_scales(k_scale_ptr, v_scale_ptr, KV_FP8)
    split_ptrs = (v_dev_ptr, v_host_ptr, table_ptr, stride_vpage)

    # the block (query_blocks.QueryBlocks): its request's block-table row, its queries' rows
    # in q and out, how many it holds (none: a padding block), the first one's position, and
    # where its part of the chunk ends (seq_len: the keys the part may read)
    bt_ptr += tl.load(rows_ptr + qb).to(tl.int64) * stride_btr
    n_q = tl.load(count_ptr + qb).to(tl.int32)
    # a padding block reads nothing: its key ranges below come out empty (none selected)
    p_min = tl.where(n_q > 0, tl.load(firstpos_ptr + qb).to(tl.int32), 0)
    seq_len = tl.load(end_ptr + qb).to(tl.int32)
    # row r: query r % BLOCK_Q of the tile's head r // BLOCK_Q
    offs_r = tl.arange(0, HEADS * BLOCK_Q)
    offs_m = offs_r % BLOCK_Q
    head_in_group = (tile % HEAD_TILES) * HEADS + offs_r // BLOCK_Q
    h = kv_head * GROUP + head_in_group
    qi = tl.load(qstart_ptr + qb).to(tl.int64) + offs_m
    q_ok = (offs_m < BLOCK_SIZE_Q) & (offs_m < n_q) & (head_in_group < GROUP)
    pos = p_min + offs_m
    p_max = p_min + n_q - 1
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q_rows = q_ptr + qi.to(tl.int64) * stride_qn + h.to(tl.int64) * stride_qh
    q = tl.load(
        q_rows[:, None] + offs_d[None, :] * stride_qd,
        mask=q_ok[:, None] & d_ok[None, :],
        other=0.0,
    )

    acc = tl.zeros([HEADS * BLOCK_Q, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([HEADS * BLOCK_Q], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([HEADS * BLOCK_Q], dtype=tl.float32)

    starts_row = starts_ptr + qb.to(tl.int64) * stride_sb
    n_sel = tl.load(nvalid_ptr + qb).to(tl.int32) * BLOCK_K
    if STREAMING:
        # (q_a/q_b/q_p: qb is the query block here)
        q_a, q_b, q_p = load_split(q_rows, q_ok, stride_qd, HEAD_DIM, 1.0, False, ROT_DIM,
                                   IS_NEOX, BLOCK_F, BLOCK_P)  # fmt: skip
        # A block whose last query sits below the trained length attends at true positions,
        # as without the remapping (reference.RopePlan.trained_context).
        if p_max >= trained_context:
            acc, m_i, l_i = _prefill_streaming(
                q, q_a, q_b, q_p, acc, m_i, l_i, kv_ptr, bt_ptr, starts_row, n_sel, pos, p_min,
                p_max, seq_len, kv_head, offs_d, d_ok, rope_hi_ptr, rope_lo_ptr, rope_bias,
                rope_n_hi, stride_page, stride_kv, stride_tok, stride_head, stride_d, stride_btp,
                stride_sk, split_ptrs, sink_tokens, window_tokens, qk_scale, cap_log2e, inv_cap_scale,
                BLOCK_N, BLOCK_K, PAGE_SIZE, SPLIT_V, USE_SOFT_CAP, DOT_PRECISION, ROT_DIM, IS_NEOX,
                LO_BITS, BLOCK_F, BLOCK_P, HEAD_DIM, k_scale, v_scale, KV_FP8,
            )  # fmt: skip
        else:
            acc, m_i, l_i = _prefill_plain(
                q, acc, m_i, l_i, kv_ptr, bt_ptr, starts_row, n_sel, pos, p_min, p_max, kv_head,
                offs_d, d_ok, stride_page, stride_kv, stride_tok, stride_head, stride_d, stride_btp,
                stride_sk, split_ptrs, sink_tokens, window_tokens, qk_scale, cap_log2e, inv_cap_scale, BLOCK_N,
                BLOCK_K, PAGE_SIZE, SPLIT_V, USE_SOFT_CAP, DOT_PRECISION, k_scale, v_scale, KV_FP8,
            )  # fmt: skip
    else:
        acc, m_i, l_i = _prefill_plain(
            q, acc, m_i, l_i, kv_ptr, bt_ptr, starts_row, n_sel, pos, p_min, p_max, kv_head, offs_d,
            d_ok, stride_page, stride_kv, stride_tok, stride_head, stride_d, stride_btp, stride_sk, split_ptrs,
            sink_tokens, window_tokens, qk_scale, cap_log2e, inv_cap_scale, BLOCK_N, BLOCK_K,
            PAGE_SIZE, SPLIT_V, USE_SOFT_CAP, DOT_PRECISION, k_scale, v_scale, KV_FP8,
        )  # fmt: skip

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    out_rows = (out_ptr + qi[:, None].to(tl.int64) * stride_on
                + h[:, None].to(tl.int64) * stride_oh)  # fmt: skip
    tl.store(
        out_rows + offs_d[None, :] * stride_od,
        o.to(out_ptr.dtype.element_ty),
        mask=q_ok[:, None] & d_ok[None, :],
    )


# --------------------------------------------------------------------------- host side
def _softmax_consts(scale: float, logit_soft_cap: float) -> tuple[float, float, float]:
    """``(qk_scale, cap_log2e, inv_cap_scale)``: the kernels' exp2-domain score constants."""
    if logit_soft_cap > 0.0:
        return 0.0, logit_soft_cap * _LOG2E, scale / logit_soft_cap
    return scale * _LOG2E, 0.0, 0.0


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs must not silently drop to TF32: the fp32 path is the one checked to 1e-4.
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_kv(q: torch.Tensor, kv_cache: torch.Tensor, planes: int = 2) -> tuple[int, int, int]:
    """``(group, head_dim, page_size)`` after checking that q and the cache agree (``planes``:
    2, K and V, or 1, the K plane of a split cache)."""
    if kv_cache.dim() != 5 or kv_cache.shape[1] != planes:
        raise ValueError(
            f"kv_cache must be [num_pages, {planes}, page_size, H_kv, D], got "
            f"{tuple(kv_cache.shape)}"
        )
    hq, d = q.shape[-2], q.shape[-1]
    hkv = kv_cache.shape[3]
    if kv_cache.shape[4] != d:
        raise ValueError(f"head dim of q ({d}) and kv_cache ({kv_cache.shape[4]}) differ")
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if triton.knobs.runtime.interpret and torch.bfloat16 in (q.dtype, kv_cache.dtype):
        # Triton 3.6's interpreter multiplies bf16 tl.dot operands as raw integers.
        raise NotImplementedError("bf16 is not supported under TRITON_INTERPRET; use fp16/fp32")
    return hq // hkv, d, kv_cache.shape[2]


def _streaming_args(
    rope: RopeTable | None, head_dim: int, capacity: int, q: torch.Tensor
) -> tuple[tuple, dict]:
    """The kernels' rotation arguments: table pointers and ints, and the constexprs.

    Streaming deltas are ``new - t`` with both positions in ``[0, capacity)``, where
    ``capacity`` is the block table's token capacity, so the tables built for it cover every
    request that table can describe.
    """
    if rope is None:  # q stands in for the tables: the compiled-out code never reads them
        return (q, q, 0, 1), dict(STREAMING=False, ROT_DIM=0, IS_NEOX=True, LO_BITS=LO_BITS,
                                  BLOCK_F=16, BLOCK_P=0)  # fmt: skip
    check_layout(rope, head_dim)
    tables = delta_tables(rope, capacity, q.device)
    block_f, block_p = split_blocks(rope.rotary_dim, head_dim)
    meta = dict(STREAMING=True, ROT_DIM=rope.rotary_dim, IS_NEOX=rope.is_neox, LO_BITS=LO_BITS,
                BLOCK_F=block_f, BLOCK_P=block_p)  # fmt: skip
    return (tables.hi, tables.lo, tables.bias, tables.n_hi), meta


def check_split(split: SplitV, kv_cache: torch.Tensor) -> None:
    """The kernels address a V page with the K plane's strides within a page."""
    for name in ("v_dev", "v_host"):
        pages = getattr(split, name)
        if pages.dtype != kv_cache.dtype or pages.stride()[1:] != kv_cache.stride()[2:]:
            raise ValueError(
                f"split.{name} must have the K plane's dtype and page layout: {pages.dtype} "
                f"{pages.stride()[1:]} vs {kv_cache.dtype} {kv_cache.stride()[2:]}"
            )
    if split.table.dtype != torch.int32 or split.table.shape[0] < kv_cache.shape[0]:
        raise ValueError("split.table is int32 with an entry per block")


def check_bank(
    bank: tuple[torch.Tensor, torch.Tensor] | None, kv_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The bank's pages and residency table (placeholders without a bank), checked: the kernels
    address a bank page with the cache's strides within a page."""
    if bank is None:
        return kv_cache, kv_cache
    pages, table = bank
    if pages.dtype != kv_cache.dtype or pages.stride()[1:] != kv_cache.stride()[1:]:
        raise ValueError(
            f"bank pages must have the cache's dtype and page layout: {pages.dtype} "
            f"{pages.stride()[1:]} vs {kv_cache.dtype} {kv_cache.stride()[1:]}"
        )
    if table.dtype != torch.int32 or table.shape[0] < kv_cache.shape[0]:
        raise ValueError("the residency table is int32 with an entry per cache page")
    return pages, table


def _scale_tensor(scale: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A dequantization scale as the kernels read it: float32 ``[1]`` on ``device``. The layer's
    own ``_k_scale`` / ``_v_scale`` pass through as views (no copy: graph-capturable)."""
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"a KV scale is one value per layer, got shape {tuple(scale.shape)}")
        return scale.to(device=device, dtype=torch.float32).reshape(1)
    return torch.tensor([float(scale)], dtype=torch.float32, device=device)


def kv_quant_args(
    kv_cache: torch.Tensor,
    k_scale: float | torch.Tensor | None,
    v_scale: float | torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """``(cache as the kernels read it, k scale, v scale, KV_FP8)``.

    An fp8 cache (vLLM's uint8 storage, or float8_e4m3fn) is viewed as float8_e4m3fn, so that
    loads give e4m3 values, and must come with both scales. Any other cache ignores the scales
    (vLLM's layers hold scales of 1 whatever the cache dtype); the cache stands in for them.
    """
    if not is_fp8_cache(kv_cache):
        return kv_cache, kv_cache, kv_cache, False
    if k_scale is None or v_scale is None:
        raise ValueError(
            f"a {kv_cache.dtype} (fp8) KV cache needs k_scale and v_scale (the layer's _k_scale "
            "and _v_scale) to be dequantized"
        )
    device = kv_cache.device
    return (fp8_view(kv_cache), _scale_tensor(k_scale, device), _scale_tensor(v_scale, device),
            True)  # fmt: skip


def fp8_view(t: torch.Tensor) -> torch.Tensor:
    """An fp8 cache (or bank) stored as uint8, viewed as the e4m3 values it holds."""
    return t.view(FP8_DTYPE) if t.dtype == torch.uint8 else t


def _default_num_splits(max_keys: int, keys_per_split: int) -> int:
    """About ``keys_per_split`` keys per split, at most 32 splits. It does not depend on the
    batch, so a row's result is the same in any batch (and in a graph-padded one)."""
    return max(1, min(triton.cdiv(max_keys, keys_per_split), 32))


def _decode_tiling(block_d: int, rope: bool, rows_16bit: bool = True) -> tuple[int, int, int]:
    """(keys per tile, tiles per split, warps) of the split-K decode kernel. The keys per split
    depend on ``block_d`` and ``rope`` only, so neither does the split count or workspace."""
    if block_d <= 128 and not rope and rows_16bit:
        # One 128-key tile per split: its K and V loads are all in flight at once, where two
        # 64-key tiles waited on each other's page lookups (H200, 512K, a 32-layer graph:
        # 10.0 -> 7.0 us per layer; 8 warps 12.2 us; H200, 2026-12-02).
        return 128, 1, 4
    # A rotation keeps its pair halves and their cos/sin live, and rows loaded as float32 (an
    # fp8 cache's, dequantized; a float32 cache's) twice the registers: two tiles of 64 (32 with
    # a rotation or D > 128). With a rotation (H200, 128K, 32-layer graph) 32 and 64 keys per
    # tile tie (16.3 / 16.2 us per layer), one 128-key tile on 8 warps is slower (18.4;
    # H200, 2026-12-02). An fp8 cache and its float32 dequantization
    # therefore tile alike, and give the same result.
    block_n = 32 if block_d > 128 or rope else 64
    return block_n, 2, 4 if block_d <= 128 else 8


def _decode_workspace(
    batch: int, num_heads: int, num_splits: int, head_dim: int, device: torch.device,
    workspace: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scratch for the split partials (a separate function so tests can poison it): views of
    ``workspace`` (flat float32) when given, which a caller preallocates for CUDA graphs."""
    n = batch * num_heads * num_splits
    if workspace is None:
        workspace = torch.empty(n * (head_dim + 1), dtype=torch.float32, device=device)
    elif workspace.numel() < n * (head_dim + 1):
        raise ValueError(
            f"decode workspace holds {workspace.numel()} floats; {n * (head_dim + 1)} needed"
        )
    part_o = workspace[: n * head_dim].view(batch, num_heads, num_splits, head_dim)
    part_lse = workspace[n * head_dim : n * (head_dim + 1)].view(batch, num_heads, num_splits)
    return part_o, part_lse


def decode_workspace_floats(
    max_batch: int, num_heads: int, head_dim: int, max_keys: int, rope: bool
) -> int:
    """Floats a :func:`sparse_decode_attention` workspace needs for batches up to
    ``max_batch`` with the default split count and at most ``max_keys`` keys per row."""
    block_n, tiles, _ = _decode_tiling(triton.next_power_of_2(head_dim), rope)
    splits = _default_num_splits(max_keys, block_n * tiles)
    return max_batch * num_heads * splits * (head_dim + 1)


def sparse_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_starts: torch.Tensor,
    num_valid_blocks: torch.Tensor,
    *,
    block_size_k: int,
    sink_tokens: int,
    window_tokens: int,
    scale: float,
    num_splits: int | None = None,
    logit_soft_cap: float = 0.0,
    out: torch.Tensor | None = None,
    rope: RopeTable | None = None,
    row_slots: torch.Tensor | None = None,
    stats: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    bank: tuple[torch.Tensor, torch.Tensor] | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    trained_context: int = 0,
    stale_steps: torch.Tensor | None = None,
    split: SplitV | None = None,
) -> torch.Tensor:
    """Block-sparse attention of one decode query per request; returns ``[B, Hq, D]`` in q's dtype.

    ``q`` is ``[B, Hq, D]``, the query at position ``seq_lens[b] - 1``; ``block_table`` is
    ``[B, max_pages]``; ``block_starts`` ``[B, K]`` holds ascending block starts of which the first
    ``num_valid_blocks[b]`` are used. The result equals ``reference.masked_attention`` over
    ``reference.sparse_key_mask`` (each key once, causal). A request with no key at all (e.g. a
    padding row with ``seq_lens = 0``) gets zeros. No host synchronisation: the launch grid depends
    on shapes and ``num_splits`` only, so the call can be captured in a CUDA graph. With
    ``logit_soft_cap > 0`` scores become ``cap * tanh(scores / cap)``.

    With ``rope`` (keys cached rotated at their true positions, q rotated at its own), the
    positions follow the StreamingLLM style of §2 and the result equals
    ``reference.sparse_attention`` with a ``RopePlan(rope, bsa="streaming")``. The window
    ``(p - n_stream, p]`` and the query keep their true positions. The sink tokens, then the
    selected blocks' tokens, are rotated in-kernel to contiguous positions that end just left
    of the window. The key set is the reference's, which differs from the one above: the window
    may reach into the sink, and sink and selected tokens are not deduplicated against each
    other. The rotation tables are built on the first call for the block table's capacity, so
    build them before capturing a graph. NeoX and GPT-J pairing and partial rotary are
    supported. ``trained_context`` (with ``rope``): a row whose query sits below it attends as
    without ``rope`` (``reference.RopePlan.trained_context``); 0 streams every row.

    With ``row_slots`` (int32 ``[B]``), row ``b`` reads its blocks from row ``row_slots[b]`` of
    ``block_starts`` and ``num_valid_blocks`` (one per state slot; any stride), and a row whose
    slot is negative attends densely to its whole context at true positions. ``stats``
    (int64 ``[2]``) accumulates, over the rows with a slot, the keys in their budget (sink,
    window and selected blocks) and their context lengths. ``workspace`` is preallocated
    scratch (:func:`decode_workspace_floats`).

    ``bank = (pages, table)`` reads through the host tier's GPU cache: ``pages`` holds copies of
    cache pages in the cache's own page layout (``[slots, 2, page, H_kv, D]``), and ``table``
    (int32, one entry per cache page) the slot holding each page or -1. A page with a slot is
    read from the bank, any other from ``kv_cache`` (which may be a GPU view of host memory);
    the result is the same as long as the bank's copies equal the cache's pages.

    An fp8 cache (``--kv-cache-dtype fp8``: uint8 storage of e4m3 values, the bank's pages
    too) needs ``k_scale`` and ``v_scale`` (the layer's ``_k_scale`` / ``_v_scale``, float32
    device tensors of one value; read on the device, so graph-capturable): every K and V row is
    dequantized on load as ``float32(x) * scale``, the result then equals the above on the
    dequantized cache. Other caches ignore the scales.

    ``stale_steps`` (int32 ``[B]``, per row, not per slot): row ``b`` reads each selected block
    ``min(stale_steps[b], block_size_k)`` tokens past its end, as
    ``reference.sparse_attention(..., extend_blocks=...)`` does (the decode steps since the
    row's blocks were chosen, :func:`vllm_infinitehip.state.stale_steps`).

    ``split`` (``reference.SplitV``, no ``bank``): ``kv_cache`` is the K plane
    ``[num_blocks, 1, page, H_kv, D]`` and each block's V is read where ``split.table`` places
    it, on a GPU page or in host memory, as ``reference.gather_paged_kv(split=...)`` reads it.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D], got {tuple(q.shape)}")
    group, d, page_size = _check_kv(q, kv_cache, planes=1 if split is not None else 2)
    if split is not None:
        if bank is not None:
            raise ValueError("a split cache reads host pages through split.table, not a bank")
        check_split(split, kv_cache)
        bank_pages, bank_table, v_host = split.v_dev, split.table, fp8_view(split.v_host)
    else:
        bank_pages, bank_table = check_bank(bank, kv_cache)
        v_host = kv_cache
    kv_cache, k_sc, v_sc, kv_fp8 = kv_quant_args(kv_cache, k_scale, v_scale)
    bank_pages = fp8_view(bank_pages)
    batch, hq = q.shape[0], q.shape[1]
    hkv = hq // group
    k_max = block_starts.shape[1]
    block_d = triton.next_power_of_2(d)
    rows_16bit = kv_cache.element_size() == 2 and not kv_fp8
    block_n, tiles, num_warps = _decode_tiling(block_d, rope is not None, rows_16bit)
    if num_splits is None:
        reach = block_size_k * (1 if stale_steps is None else 2)
        max_keys = sink_tokens + window_tokens + k_max * reach
        num_splits = _default_num_splits(max_keys, block_n * tiles)
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    rope_args, rope_meta = _streaming_args(rope, d, block_table.shape[1] * page_size, q)
    hi_t, lo_t, bias, n_hi = rope_args
    part_o, part_lse = _decode_workspace(batch, hq, num_splits, d, q.device, workspace)
    qk_scale, cap_log2e, inv_cap_scale = _softmax_consts(scale, logit_soft_cap)
    # tl.dot needs at least 16 rows; the padding rows are masked on load and store.
    block_h = max(16, triton.next_power_of_2(group))
    _decode_split_kernel[(batch, hkv, num_splits)](
        q, kv_cache, block_table, seq_lens, block_starts, num_valid_blocks,
        seq_lens if row_slots is None else row_slots,
        seq_lens if stale_steps is None else stale_steps, seq_lens if stats is None else stats,
        part_o, part_lse, hi_t, lo_t, bank_pages, bank_table, bank_pages.stride(0), v_host,
        k_sc, v_sc, *q.stride(), *kv_cache.stride(),
        *block_table.stride(), *block_starts.stride(), num_valid_blocks.stride(0),
        sink_tokens, window_tokens, trained_context, qk_scale, cap_log2e, inv_cap_scale, bias,
        n_hi, HAS_SLOTS=row_slots is not None, HAS_STATS=stats is not None,
        HAS_BANK=bank is not None, SPLIT_V=split is not None, EXTEND=stale_steps is not None,
        NUM_HEADS=hq, GROUP=group, BLOCK_H=block_h, HEAD_DIM=d, BLOCK_D=block_d,
        BLOCK_N=block_n, BLOCK_K=block_size_k, PAGE_SIZE=page_size, NUM_SPLITS=num_splits,
        USE_SOFT_CAP=logit_soft_cap > 0.0, DOT_PRECISION=_dot_precision(q.dtype),
        KV_FP8=kv_fp8, num_warps=num_warps, **rope_meta,
    )  # fmt: skip
    _decode_merge_kernel[(batch, hq)](
        part_o, part_lse, out, *out.stride(),
        NUM_HEADS=hq, HEAD_DIM=d, BLOCK_D=block_d, NUM_SPLITS=num_splits,
        BLOCK_S=triton.next_power_of_2(num_splits), num_warps=4 if block_d <= 128 else 8,
    )  # fmt: skip
    return out


def sparse_prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table_row: torch.Tensor,
    seq_len: int,
    block_starts: torch.Tensor,
    block_valid: torch.Tensor,
    *,
    block_size_q: int,
    block_size_k: int,
    sink_tokens: int,
    window_tokens: int,
    scale: float,
    logit_soft_cap: float = 0.0,
    out: torch.Tensor | None = None,
    rope: RopeTable | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    trained_context: int = 0,
    split: SplitV | None = None,
) -> torch.Tensor:
    """Block-sparse attention of one request's prefill chunk; returns ``[Nq, Hq, D]`` in q's dtype.

    ``q`` is ``[Nq, Hq, D]``, the queries at positions ``seq_len - Nq .. seq_len - 1`` (``seq_len``
    counts the chunk's own keys, already in the cache). Query block ``j`` is queries
    ``[j * block_size_q, (j + 1) * block_size_q)`` and attends to the selected blocks of row ``j``
    of ``block_starts`` / ``block_valid`` (``[n_qblocks, K]``, valid entries first and ascending).
    The result equals ``reference.masked_attention`` over ``reference.sparse_key_mask``. With
    ``logit_soft_cap > 0`` scores become ``cap * tanh(scores / cap)``. No host synchronisation.

    With ``rope`` the positions follow the StreamingLLM style of §2, per query block, as in
    :func:`sparse_decode_attention`. The result then equals ``reference.sparse_attention`` with a
    ``RopePlan(rope, bsa="streaming")``. Every query of a block sees the same far keys (sink,
    then selected) and the block's window ``(p_min - n_stream, p]``, causal. A block whose
    last query sits below ``trained_context`` attends as without ``rope`` (0: none does).

    ``k_scale`` / ``v_scale``: an fp8 cache's dequantization, and ``split``, the host tier's
    K plane with V elsewhere, as in :func:`sparse_decode_attention`.
    """
    nq = q.shape[0]
    if nq > seq_len:
        raise ValueError(f"{nq} queries cannot be the last positions of a {seq_len}-token sequence")
    blocks = QueryBlocks.single(nq, seq_len - nq, seq_len, block_size_q, q.device)
    return sparse_prefill_attention_blocks(
        q, kv_cache, block_table_row.view(1, -1), blocks, block_starts, block_valid,
        block_size_k=block_size_k, sink_tokens=sink_tokens, window_tokens=window_tokens,
        scale=scale, logit_soft_cap=logit_soft_cap, out=out, rope=rope, k_scale=k_scale,
        v_scale=v_scale, trained_context=trained_context, split=split,
    )  # fmt: skip


def sparse_prefill_attention_blocks(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    blocks: QueryBlocks,
    block_starts: torch.Tensor,
    block_valid: torch.Tensor,
    *,
    block_size_k: int,
    sink_tokens: int,
    window_tokens: int,
    scale: float,
    logit_soft_cap: float = 0.0,
    out: torch.Tensor | None = None,
    rope: RopeTable | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    trained_context: int = 0,
    split: SplitV | None = None,
) -> torch.Tensor:
    """:func:`sparse_prefill_attention` for the query blocks of one or more requests (a step's
    prefill chunks, :class:`query_blocks.QueryBlocks`) in one launch: block ``b`` holds the
    queries ``q[start[b] : start[b] + count[b]]``, reads row ``row[b]`` of ``block_table``
    ``[rows, pages]`` and its part of the chunk ends at ``slice_end[b]``; its selected blocks
    are row ``b`` of ``block_starts`` / ``block_valid``. Each block's rows of ``out`` (shaped
    like ``q``; other rows are left alone) equal what the request alone gets. No host sync."""
    if q.dim() != 3:
        raise ValueError(f"q must be [Nq, Hq, D], got {tuple(q.shape)}")
    group, d, page_size = _check_kv(q, kv_cache, planes=1 if split is not None else 2)
    if split is not None:
        check_split(split, kv_cache)
        v_args = (fp8_view(split.v_dev), fp8_view(split.v_host), split.table,
                  split.v_dev.stride(0))  # fmt: skip
    kv_cache, k_sc, v_sc, kv_fp8 = kv_quant_args(kv_cache, k_scale, v_scale)
    if split is None:
        v_args = (kv_cache, kv_cache, block_table, 0)
    hq = q.shape[1]
    n_qblocks = blocks.num_blocks
    if block_starts.shape[0] != n_qblocks or block_valid.shape != block_starts.shape:
        raise ValueError(
            f"block_starts {tuple(block_starts.shape)} / block_valid {tuple(block_valid.shape)} "
            f"must be [{n_qblocks}, K] for {n_qblocks} query blocks"
        )
    if block_table.dim() != 2:
        raise ValueError(f"block_table must be [rows, pages], got {tuple(block_table.shape)}")
    if out is None:
        out = torch.empty_like(q)
    if n_qblocks == 0:
        return out
    block_size_q = blocks.block_size_q
    # Valid entries come first, so their count bounds the loop (a device op: no sync).
    n_valid = block_valid.sum(dim=1, dtype=torch.int32)
    block_d = triton.next_power_of_2(d)
    block_q = max(16, triton.next_power_of_2(block_size_q))
    # heads of a KV group stacked per program, up to PREFILL_TILE_ROWS rows (a 64-query block:
    # two heads), so K/V tiles are read once per HEADS query heads
    heads = min(triton.next_power_of_2(group), max(1, PREFILL_TILE_ROWS // block_q))
    head_tiles = triton.cdiv(group, heads)
    rows = heads * block_q
    block_n = 32 if block_d > 128 or rows > 64 or rope is not None else 64
    qk_scale, cap_log2e, inv_cap_scale = _softmax_consts(scale, logit_soft_cap)
    capacity = max(block_table.shape[1] * page_size, blocks.max_seq_len)
    (hi_t, lo_t, bias, n_hi), rope_meta = _streaming_args(rope, d, capacity, q)
    _prefill_kernel[(n_qblocks, (hq // group) * head_tiles)](
        q, kv_cache, block_table, blocks.row, blocks.start, blocks.count, blocks.first_pos,
        blocks.slice_end, block_starts, n_valid, out, hi_t, lo_t, *v_args, k_sc, v_sc,
        *q.stride(), *kv_cache.stride(), *block_table.stride(), *block_starts.stride(),
        *out.stride(), sink_tokens, window_tokens, trained_context, qk_scale, cap_log2e,
        inv_cap_scale, bias, n_hi, GROUP=group, HEADS=heads, HEAD_TILES=head_tiles,
        BLOCK_SIZE_Q=block_size_q, BLOCK_Q=block_q, HEAD_DIM=d, BLOCK_D=block_d,
        BLOCK_N=block_n, BLOCK_K=block_size_k, PAGE_SIZE=page_size,
        USE_SOFT_CAP=logit_soft_cap > 0.0, DOT_PRECISION=_dot_precision(q.dtype),
        KV_FP8=kv_fp8, SPLIT_V=split is not None,
        num_warps=4 if rows <= 64 and block_d <= 128 else 8, **rope_meta,
    )  # fmt: skip
    return out
