"""Decode masks for a whole batch: one pruning cascade for every decode row of a step (§1.4-§1.6).

Per layer and stage, one launch serves all decode rows, whatever their refresh levels:

- :func:`_decode_select_kernel` (grid: rows x chunk tiles x head blocks) is SelectRep for one
  decode query per row over that row's candidate chunks. A program takes ``HEADS`` query heads
  of one KV group (scores max-reduced in registers); programs meet in an atomic max into
  ``scores[row, chunk]``. ``HEADS = 1``: each bisection step waits on its gathered keys, so more
  programs in flight beat sharing the group's first probes (the heads diverge after one step).
  With ``head_reduction`` ``"z-score"`` a head's scores cannot be standardised before all its
  chunks are scored, which many programs do: each program stores its head's scores in
  ``scores[row, head, chunk]`` instead, and the top-k below ranks them.
- :func:`_keep_top` keeps the row's top ``keep`` chunks by score, in position order, and splits
  them into the next stage's chunks (or, after the last stage, writes the final blocks) in the
  row's state slot. It resets the scores it read to -inf, so the scratch needs no clearing
  launch. It runs as :func:`_top_chunks_kernel` (grid: rows), a launch of its own, where the
  backend gates the cascade in its decode graphs (:mod:`kernels.graph_if`: steps that refresh
  nothing skip every launch, so the faster refresh wins); otherwise, in the row's last
  SelectRep program to finish (an atomic arrival counter per row, zeroed again by that program),
  except for a stage wider than ``FUSED_TOP_MAX_CHUNKS`` or one whose scores are combined over
  TP ranks first.

A row takes part in stage ``i`` only if its refresh level is ``<= i`` (``-1``: a row without a
slot takes part in nothing), so the launch sequence is the same for every step and can be
captured in a CUDA graph; rows that reuse their mask exit at once.

Layout of one layer's masks (:class:`DecodeMasks`), per state slot: the input of every stage
``i >= 1`` (chunk starts, valid entries first), the final blocks, and per stage the number of
valid entries and the candidate-list width (the ordinal count chunk-indexed RoPE uses). Stage 0's
input is never stored: it is every stage-0 chunk of the live context.

The PyTorch reference of this cascade is :func:`decode.refresh_masks_reference`
(:func:`reference.run_stages` row by row from the same stored inputs); tests compare the two.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import reference as ref
from .decode import DecodeMasks, DecodeRows
from .triton_bsa import check_bank, fp8_view, kv_quant_args, paged_rows
from .triton_rope import (
    LO_BITS,
    check_layout,
    delta_cos_sin,
    delta_tables,
    load_split,
    rope_pair_layout,
    rotate_pairs,
    rotate_split,
    split_blocks,
)
from .triton_topk import head_block, head_ranking, top_by_bisection, top_num_warps

ROPE_NONE, ROPE_RELATIVE, ROPE_CHUNK_INDEXED = 0, 1, 2
# The widest score row (a power of two) that the last 4-warp SelectRep program of a row ranks:
# 16 scores per thread; wider rows would spill. A wider stage (stage 0 past ~512K tokens) keeps
# its top-k launch, of 8 or 16 warps. H200, 512K: the fusion made a full refresh slower (183 ->
# 234 us per layer in a one-layer graph: the ranking runs on 4 warps and raises the kernel's
# register count) and the 28-in-32 reuse steps cheaper (21.1 -> 18.3 us), 179.3 -> 182.7 tok/s.
FUSED_TOP_MAX_CHUNKS = 2048
# Query heads per SelectRep program (see the module docstring). 4 at 512K: stage 0's launch in
# a full refresh 154 -> 193 us, a reuse step's three no-op launches 5.8 -> 4.1 us
# (H200, 2026-12-02).
SELECT_HEADS = 1
_ROPE_CODES = {"none": ROPE_NONE, "relative": ROPE_RELATIVE, "chunk-indexed": ROPE_CHUNK_INDEXED}


# --------------------------------------------------------------------------- kernels
@triton.jit
def _load_query(
    q_ptr,
    offs_d,
    d_in,
    stride_qd,
    head_dim,
    scale,
    ROPE: tl.constexpr,
    ROT_DIM: tl.constexpr,
    IS_NEOX: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """One query (fp32, times ``scale``) as :func:`_probe` takes it: whole, or with ``ROPE``
    split as :func:`triton_rope.load_split` splits the keys, each part ``[1, block]``."""
    # one return: the compiler checks every return statement's types, constexpr branches too
    if ROPE:
        qa, qb, qp = load_split(q_ptr + tl.zeros([1], tl.int64), tl.full([1], True, tl.int1),
                                stride_qd, head_dim, 1.0, False, ROT_DIM, IS_NEOX, BLOCK_F,
                                BLOCK_P)  # fmt: skip
        qa = qa.to(tl.float32) * scale
        qb = qb.to(tl.float32) * scale
        qp = qp.to(tl.float32) * scale
    else:
        qa = tl.load(q_ptr + offs_d * stride_qd, mask=d_in, other=0.0).to(tl.float32) * scale
        qb = qa
        qp = qa
    return qa, qb, qp


@triton.jit
def _probe(
    kv_ptr,
    bt_row,
    stride_btp,
    pos,
    mask,
    kv_head,
    qa,
    qb,
    qp,
    offs_d,
    d_in,
    head_dim,
    stride_kpage,
    stride_ktok,
    stride_khead,
    stride_kd,
    delta,
    rope_hi_ptr,
    rope_lo_ptr,
    rope_bias,
    rope_n_hi,
    bank_ptr,
    table_ptr,
    stride_slot,
    rows_ptr,
    row_table_ptr,
    missed_ptr,
    missed_rows_ptr,
    row_state_ptr,
    stride_row,
    missed_cap,
    n_kv_heads,
    PAGE_SIZE: tl.constexpr,
    ROPE: tl.constexpr,
    ROT_DIM: tl.constexpr,
    IS_NEOX: tl.constexpr,
    LO_BITS: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_P: tl.constexpr,
    HAS_BANK: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    k_scale,
    KV_FP8: tl.constexpr,
):
    """q . k (fp32) of one query (:func:`_load_query`'s parts) at each key position in ``pos``,
    keys turned by ``delta``, and the (hits, misses) of the key-row bank. With ``HAS_BANK``,
    keys of pages the residency table places in the bank are read there; with ``HAS_ROWS``,
    keys the key-row bank holds (:func:`_key_row_rows`). With ``KV_FP8`` the keys are e4m3
    (banks too), dequantized as ``float32(k) * k_scale`` before anything else."""
    rows = paged_rows(
        kv_ptr, bt_row, stride_btp, pos, mask, kv_head, stride_kpage, stride_ktok, stride_khead,
        bank_ptr, table_ptr, stride_slot, PAGE_SIZE, HAS_BANK,
    )  # fmt: skip
    n_hit = 0
    n_miss = 0
    if HAS_ROWS:
        rows, n_hit, n_miss = _key_row_rows(
            rows, bt_row, stride_btp, pos, mask, kv_head, n_kv_heads, rows_ptr, row_table_ptr,
            missed_ptr, missed_rows_ptr, row_state_ptr, stride_row, missed_cap, offs_d, d_in,
            stride_kd, PAGE_SIZE,
        )  # fmt: skip
    # One query: an fp32 product-sum, exact like the reference's fp32 matmul (no tensor cores
    # needed for a single row).
    if ROPE:
        ka, kb, kp = load_split(rows, mask, stride_kd, head_dim, k_scale, KV_FP8, ROT_DIM,
                                IS_NEOX, BLOCK_F, BLOCK_P)  # fmt: skip
        ka, kb = rotate_split(ka, kb, delta, mask, rope_hi_ptr, rope_lo_ptr, rope_bias, rope_n_hi,
                              ROT_DIM, LO_BITS, BLOCK_F)  # fmt: skip
        s = tl.sum(ka * qa + kb * qb, axis=1)
        if BLOCK_P > 0:
            s += tl.sum(kp.to(tl.float32) * qp, axis=1)
    else:
        m2 = mask[:, None] & d_in[None, :]
        k = tl.load(rows[:, None] + offs_d[None, :] * stride_kd, mask=m2, other=0.0)
        k = k.to(tl.float32)
        if KV_FP8:
            k = k * k_scale
        s = tl.sum(k * qa[None, :], axis=1)
    return s, n_hit, n_miss


@triton.jit
def _key_row_rows(
    rows,
    bt_row,
    stride_btp,
    t,
    ok,
    kv_head,
    n_kv_heads,
    rows_ptr,
    row_table_ptr,
    missed_ptr,
    missed_rows_ptr,
    row_state_ptr,
    stride_row,
    missed_cap,
    offs_d,
    d_in,
    stride_kd,
    PAGE_SIZE: tl.constexpr,
):
    """The key-row bank's part of a probe (``reference.KeyRows``): rows it holds are read
    there; each absent row is listed once for promotion (a compare-and-swap -1 -> -2 on its
    table entry picks one lister among the programs that missed it), and the lister keeps a
    copy of it beside the list, so that the promotion reads GPU memory, not the host a second
    time. Returns the pointers and this probe's (hits, misses). No bank slot is written here:
    the promotion is a launch of its own after the stages, so no program can read a slot while
    it is refilled."""
    t = tl.where(ok, t, 0)
    page = tl.load(bt_row + (t // PAGE_SIZE) * stride_btp, mask=ok, other=0).to(tl.int64)
    r = (page * PAGE_SIZE + (t % PAGE_SIZE)) * n_kv_heads + kv_head
    slot = tl.load(row_table_ptr + r, mask=ok, other=-1).to(tl.int64)
    hit = ok & (slot >= 0)
    rows = tl.where(hit, rows_ptr + slot * stride_row, rows)
    absent = ok & (slot == -1)  # -2: another program listed it already
    if tl.max(absent.to(tl.int32), axis=0) > 0:
        # lanes that list nothing compare against -3, a value no entry holds
        cmp = tl.where(absent, -1, -3).to(tl.int32)
        old = tl.atomic_cas(row_table_ptr + r, cmp, tl.full(cmp.shape, -2, tl.int32),
                            sem="relaxed")  # fmt: skip
        listed = absent & (old == -1)
        at = tl.atomic_add(row_state_ptr + r * 0, listed.to(tl.int64), mask=listed,
                           sem="relaxed")  # fmt: skip
        kept = listed & (at < missed_cap)
        tl.store(missed_ptr + at, r.to(tl.int32), mask=kept)
        m2 = kept[:, None] & d_in[None, :]
        raw = tl.load(rows[:, None] + offs_d[None, :] * stride_kd, mask=m2)
        tl.store(missed_rows_ptr + at[:, None] * stride_row + offs_d[None, :], raw, mask=m2)
        # past the list's end: absent again, so that a later refresh lists it
        tl.store(row_table_ptr + r, tl.full(cmp.shape, -1, tl.int32),
                 mask=listed & (at >= missed_cap))  # fmt: skip
    n_hit = tl.sum(hit.to(tl.int32), axis=0)
    n_miss = tl.sum((ok & (slot < 0)).to(tl.int32), axis=0)
    return rows, n_hit, n_miss


@triton.jit
def _stage_input(
    row_slot,
    seq_len,
    counts_ptr,
    widths_ptr,
    stride_ns,
    sink_tokens,
    scan_window,
    STAGE: tl.constexpr,
    CHUNK_SIZE: tl.constexpr,
):
    """(valid candidates, candidate-list width) of a row's stage input."""
    if STAGE == 0:
        # Every stage-0 chunk of the live context; active when it starts at or before
        # pos - sw' (§1.3), pos = seq_len - 1.
        width = tl.maximum(tl.cdiv(seq_len - sink_tokens, CHUNK_SIZE), 0)
        lim = seq_len - 1 - scan_window - sink_tokens
        n_cand = tl.where(lim >= 0, tl.minimum(lim // CHUNK_SIZE + 1, width), 0)
    else:
        n_cand = tl.load(counts_ptr + row_slot * stride_ns + STAGE)
        width = tl.load(widths_ptr + row_slot * stride_ns + STAGE)
    return n_cand, width


@triton.jit
def _decode_select_kernel(
    q_ptr,
    q_right_ptr,
    kv_ptr,
    bt_ptr,
    seq_lens_ptr,
    slot_ptr,
    level_ptr,
    cand_ptr,
    counts_ptr,
    widths_ptr,
    scores_ptr,
    rope_hi_ptr,
    rope_lo_ptr,
    rope_bias,
    rope_n_hi,
    bank_ptr,
    table_ptr,
    stride_slot,
    rows_ptr,
    row_table_ptr,
    missed_ptr,
    missed_rows_ptr,
    row_state_ptr,
    stride_row,
    missed_cap,
    n_kv_heads,
    k_scale_ptr,
    q_scale,
    head_dim,
    sink_tokens,
    scan_window,
    trained_context,
    stride_qb,
    stride_qh,
    stride_qd,
    stride_kpage,
    stride_ktok,
    stride_khead,
    stride_kd,
    stride_btb,
    stride_btp,
    stride_cs,
    stride_cc,
    stride_ns,
    stride_sb,
    arrivals_ptr,
    out_ptr,
    stride_os,
    stride_oc,
    keep,
    n_scores,
    stride_sh,
    n_heads,
    window_tokens,
    STAGE: tl.constexpr,
    GROUP: tl.constexpr,
    HEADS: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    CHUNK_SIZE: tl.constexpr,
    N_ITERS: tl.constexpr,
    MIDPOINT: tl.constexpr,
    ROPE_STYLE: tl.constexpr,
    ROT_DIM: tl.constexpr,
    IS_NEOX: tl.constexpr,
    LO_BITS: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_CHUNK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_BANK: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    KV_FP8: tl.constexpr,
    FUSE_TOP: tl.constexpr,
    OUT_INDEX: tl.constexpr,
    WRITE_WIDTH: tl.constexpr,
    SUB: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_C: tl.constexpr,
    EXACT: tl.constexpr,
    HEAD_SCORES: tl.constexpr,
    HEAD_BLOCK: tl.constexpr,
    DROP_WINDOW: tl.constexpr,
    SCORE_WHOLE_ROW: tl.constexpr,
):
    b = tl.program_id(0)
    tile = tl.program_id(1)
    head_block = tl.program_id(2)
    kv_head = head_block * HEADS // GROUP
    row_slot = tl.load(slot_ptr + b)
    level = tl.load(level_ptr + b)
    if (row_slot < 0) | (level < 0) | (level > STAGE):
        return
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    n_cand, width = _stage_input(
        row_slot, seq_len, counts_ptr, widths_ptr, stride_ns, sink_tokens, scan_window,
        STAGE, CHUNK_SIZE,
    )  # fmt: skip
    if tile * BLOCK_CHUNK >= n_cand:
        if SCORE_WHOLE_ROW:  # a combine over TP ranks reads every entry of the row
            offs_t = tile * BLOCK_CHUNK + tl.arange(0, BLOCK_CHUNK)
            for g in tl.static_range(HEADS):
                tl.store(scores_ptr + b.to(tl.int64) * stride_sb
                         + (head_block * HEADS + g) * stride_sh + offs_t,
                         tl.full([BLOCK_CHUNK], float("-inf"), tl.float32),
                         mask=offs_t < n_scores)  # fmt: skip
        if FUSE_TOP:
            if (n_cand == 0) & (tile == 0) & (head_block == 0):  # nothing scored: none arrive
                _keep_top(
                    b, row_slot, seq_len, n_cand, width, scores_ptr, cand_ptr, counts_ptr,
                    widths_ptr, out_ptr, stride_sb, stride_cs, stride_cc, stride_ns, stride_os,
                    stride_oc, sink_tokens, keep, n_scores, stride_sh, n_heads, STAGE,
                    OUT_INDEX, WRITE_WIDTH, CHUNK_SIZE, SUB, SPLIT, BLOCK_C, HEAD_SCORES,
                    HEAD_BLOCK,
                )  # fmt: skip
        return
    offs_c = tile * BLOCK_CHUNK + tl.arange(0, BLOCK_CHUNK)
    listed = offs_c < n_cand
    c_in = listed
    if STAGE == 0:
        start = sink_tokens + offs_c * CHUNK_SIZE
    else:
        cand_row = cand_ptr + row_slot.to(tl.int64) * stride_cs
        start = tl.load(cand_row + offs_c * stride_cc, mask=c_in, other=0)
        if DROP_WINDOW:
            # a candidate inside the window would hold budget for keys the window reads anyway
            # (reference.drop_window_candidates); it scores -inf and is never kept
            c_in = c_in & (start <= seq_len - 1 - window_tokens)
    # key_limit of a decode query is its whole context
    right0 = tl.minimum(start + CHUNK_SIZE, seq_len)

    offs_d = tl.arange(0, BLOCK_D)
    d_in = offs_d < head_dim
    ROPE: tl.constexpr = ROPE_STYLE != 0
    if ROPE_STYLE == 2:
        # chunk-indexed: chunk j's keys at ordinal j, the query at min(p, C + sw'); keys
        # cached at t turn by (j - q_pos) - t
        q_pos = tl.minimum(seq_len - 1, width + scan_window)
        base = offs_c - q_pos
    else:  # relative: every probe key to position 0 (the queries hold the distances)
        base = offs_c * 0
    # A row below the trained length scores the keys as cached against its true query
    # (place_queries leaves it unturned): no key turns.
    remap = seq_len - 1 >= trained_context
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    if KV_FP8:
        k_scale = tl.load(k_scale_ptr)
    else:
        k_scale = 1.0

    best_all = tl.full([BLOCK_CHUNK], float("-inf"), tl.float32)
    row_hits = tl.zeros([], tl.int32)
    row_misses = tl.zeros([], tl.int32)
    for g in tl.static_range(HEADS):
        head = head_block * HEADS + g
        q_row = b.to(tl.int64) * stride_qb + head * stride_qh
        qa, qb, qp = _load_query(q_ptr + q_row, offs_d, d_in, stride_qd, head_dim, q_scale,
                                 ROPE, ROT_DIM, IS_NEOX, BLOCK_F, BLOCK_P)  # fmt: skip
        if ROPE_STYLE == 1:
            ra, rb, rp = _load_query(q_right_ptr + q_row, offs_d, d_in, stride_qd, head_dim,
                                     q_scale, ROPE, ROT_DIM, IS_NEOX, BLOCK_F, BLOCK_P)  # fmt: skip
        else:
            ra, rb, rp = qa, qb, qp
        left = start
        right = right0
        best = tl.full([BLOCK_CHUNK], float("-inf"), tl.float32)
        if EXACT:
            # every key of the chunk against the left-branch query (reference: ``exact``)
            for j in tl.static_range(CHUNK_SIZE):
                p_key = start + j
                live_key = c_in & (p_key < right0)
                s_key, hk, mk = _probe(
                    kv_ptr, bt_row, stride_btp, p_key, live_key, kv_head, qa, qb, qp, offs_d,
                    d_in, head_dim, stride_kpage, stride_ktok, stride_khead, stride_kd,
                    tl.where(remap, base - p_key, 0),
                    rope_hi_ptr, rope_lo_ptr, rope_bias, rope_n_hi, bank_ptr, table_ptr,
                    stride_slot, rows_ptr, row_table_ptr, missed_ptr, missed_rows_ptr,
                    row_state_ptr, stride_row, missed_cap, n_kv_heads, PAGE_SIZE, ROPE, ROT_DIM,
                    IS_NEOX, LO_BITS, BLOCK_F, BLOCK_P, HAS_BANK, HAS_ROWS, k_scale, KV_FP8,
                )  # fmt: skip
                best = tl.where(live_key, tl.maximum(best, s_key), best)
                row_hits += hk
                row_misses += mk
        for _ in range(0 if EXACT else N_ITERS):
            live = c_in & (right - left > 1)
            mid = (left + right) // 2
            if MIDPOINT:
                p_left = (left + mid) // 2
                p_right = (mid + right) // 2
            else:  # the paper's Algorithm 3: the first key of each half
                p_left = left
                p_right = mid
            s_left, h1, m1 = _probe(
                kv_ptr, bt_row, stride_btp, p_left, live, kv_head, qa, qb, qp, offs_d, d_in,
                head_dim, stride_kpage, stride_ktok, stride_khead, stride_kd,
                tl.where(remap, base - p_left, 0),
                rope_hi_ptr, rope_lo_ptr, rope_bias, rope_n_hi, bank_ptr, table_ptr, stride_slot,
                rows_ptr, row_table_ptr, missed_ptr, missed_rows_ptr, row_state_ptr, stride_row,
                missed_cap, n_kv_heads, PAGE_SIZE, ROPE, ROT_DIM, IS_NEOX, LO_BITS, BLOCK_F, BLOCK_P, HAS_BANK,
                HAS_ROWS, k_scale, KV_FP8,
            )  # fmt: skip
            s_right, h2, m2 = _probe(
                kv_ptr, bt_row, stride_btp, p_right, live, kv_head, ra, rb, rp, offs_d, d_in,
                head_dim, stride_kpage, stride_ktok, stride_khead, stride_kd,
                tl.where(remap, base - p_right, 0),
                rope_hi_ptr, rope_lo_ptr, rope_bias, rope_n_hi, bank_ptr, table_ptr, stride_slot,
                rows_ptr, row_table_ptr, missed_ptr, missed_rows_ptr, row_state_ptr, stride_row,
                missed_cap, n_kv_heads, PAGE_SIZE, ROPE, ROT_DIM, IS_NEOX, LO_BITS, BLOCK_F, BLOCK_P, HAS_BANK,
                HAS_ROWS, k_scale, KV_FP8,
            )  # fmt: skip
            # Strictly greater goes left, so a tie descends right, as in the reference.
            row_hits += h1 + h2
            row_misses += m1 + m2
            go_left = s_left > s_right
            best = tl.where(live, tl.maximum(best, tl.where(go_left, s_left, s_right)), best)
            right = tl.where(live & go_left, mid, right)
            left = tl.where(live & ~go_left, mid, left)
        # A chunk one key wide never probed: that key is its score (left-branch query).
        single = c_in & (best == float("-inf"))
        if tl.max(single.to(tl.int32), axis=0) > 0:
            s_single, h3, m3 = _probe(
                kv_ptr, bt_row, stride_btp, left, single, kv_head, qa, qb, qp, offs_d, d_in,
                head_dim, stride_kpage, stride_ktok, stride_khead, stride_kd,
                tl.where(remap, base - left, 0),
                rope_hi_ptr, rope_lo_ptr, rope_bias, rope_n_hi, bank_ptr, table_ptr, stride_slot,
                rows_ptr, row_table_ptr, missed_ptr, missed_rows_ptr, row_state_ptr, stride_row,
                missed_cap, n_kv_heads, PAGE_SIZE, ROPE, ROT_DIM, IS_NEOX, LO_BITS, BLOCK_F, BLOCK_P, HAS_BANK,
                HAS_ROWS, k_scale, KV_FP8,
            )  # fmt: skip
            best = tl.where(single, s_single, best)
            row_hits += h3
            row_misses += m3
        if HEAD_SCORES:
            # each head's own scores (-inf past the list); the row's top-k program, or a
            # combine over TP ranks first, standardises them (z-score)
            tl.store(scores_ptr + b.to(tl.int64) * stride_sb + head * stride_sh + offs_c,
                     tl.where(listed, best, float("-inf")), mask=offs_c < n_scores)  # fmt: skip
        best_all = tl.maximum(best_all, best)
    if HAS_ROWS:
        tl.atomic_add(row_state_ptr + 2, row_hits.to(tl.int64), sem="relaxed")
        tl.atomic_add(row_state_ptr + 3, row_misses.to(tl.int64), sem="relaxed")
    if not HEAD_SCORES:
        # The max over heads is exact in any order, so the atomic keeps the result
        # deterministic.
        tl.atomic_max(scores_ptr + b.to(tl.int64) * stride_sb + offs_c, best_all, mask=c_in)
    if FUSE_TOP:
        # The row's last program to arrive ranks its scores: the top-k costs no launch of its
        # own (a reuse step's cascade is launches whose programs exit at once). The barrier
        # puts every thread's maxima before the release of the arrival.
        tl.debug_barrier()
        n_prog = tl.cdiv(n_cand, BLOCK_CHUNK) * tl.num_programs(2)
        arrived = tl.atomic_add(arrivals_ptr + b, 1, sem="acq_rel")
        if arrived == n_prog - 1:
            tl.atomic_xchg(arrivals_ptr + b, 0)  # zero again for the next launch
            _keep_top(
                b, row_slot, seq_len, n_cand, width, scores_ptr, cand_ptr, counts_ptr,
                widths_ptr, out_ptr, stride_sb, stride_cs, stride_cc, stride_ns, stride_os,
                stride_oc, sink_tokens, keep, n_scores, stride_sh, n_heads, STAGE, OUT_INDEX,
                WRITE_WIDTH, CHUNK_SIZE, SUB, SPLIT, BLOCK_C, HEAD_SCORES, HEAD_BLOCK,
            )  # fmt: skip


@triton.jit
def _keep_top(
    b,
    row_slot,
    seq_len,
    n_cand,
    width,
    scores_ptr,
    cand_ptr,
    counts_ptr,
    widths_ptr,
    out_ptr,
    stride_sb,
    stride_cs,
    stride_cc,
    stride_ns,
    stride_os,
    stride_oc,
    sink_tokens,
    keep,
    n_scores,
    stride_sh,
    n_heads,
    STAGE: tl.constexpr,
    OUT_INDEX: tl.constexpr,
    WRITE_WIDTH: tl.constexpr,
    CHUNK_SIZE: tl.constexpr,
    SUB: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HEAD_SCORES: tl.constexpr,
    HEAD_BLOCK: tl.constexpr,
):
    """Row ``b``'s top ``keep`` chunks by score, split into the next stage's input (or the
    final blocks) of its slot. The max-reduced scores it read are reset to -inf (the next
    launch's atomic max starts there). With ``HEAD_SCORES`` the scores are per head (``[H_q, C]``
    of the row, every listed entry written by this launch, so nothing is reset) and rank by the
    max over heads of each head's z-score (:func:`reference.reduce_heads`), ``HEAD_BLOCK`` heads
    at a time (:func:`triton_topk.head_block`)."""
    offs = tl.arange(0, BLOCK_C)
    in_c = offs < n_scores
    score_row = scores_ptr + b.to(tl.int64) * stride_sb
    listed = in_c
    if HEAD_SCORES:
        listed = in_c & (offs < n_cand)
    s = head_ranking(score_row, stride_sh, n_heads, offs, listed, HEAD_SCORES, HEAD_SCORES,
                     HEAD_BLOCK, BLOCK_C)  # fmt: skip
    if not HEAD_SCORES:  # the next launch's atomic max starts from -inf
        tl.store(score_row + offs, tl.full([BLOCK_C], float("-inf"), tl.float32), mask=in_c)
    if STAGE == 0:
        start = sink_tokens + offs * CHUNK_SIZE
    else:
        cand_row = cand_ptr + row_slot.to(tl.int64) * stride_cs
        start = tl.load(cand_row + offs * stride_cc, mask=offs < n_cand, other=0)

    # Top `keep` by score, ties to the earlier chunk. Candidates are ascending in position, so
    # the survivors come out sorted (§1.5).
    sel, rank = top_by_bisection(s, (s > float("-inf")) & in_c, keep)

    out_row = out_ptr + row_slot.to(tl.int64) * stride_os
    n_out = tl.zeros([BLOCK_C], tl.int32)
    for j in tl.static_range(SPLIT):
        sub_start = start + j * SUB
        tl.store(out_row + (rank * SPLIT + j) * stride_oc, sub_start, mask=sel)
        # sub-chunks at or past the context end are invalid; they can only trail (ascending)
        n_out += (sel & (sub_start < seq_len)).to(tl.int32)
    tl.store(counts_ptr + row_slot * stride_ns + OUT_INDEX, tl.sum(n_out, axis=0))
    if WRITE_WIDTH:
        tl.store(widths_ptr + row_slot * stride_ns + OUT_INDEX,
                 tl.minimum(keep, width) * SPLIT)  # fmt: skip


@triton.jit
def _top_chunks_kernel(
    scores_ptr,
    seq_lens_ptr,
    slot_ptr,
    level_ptr,
    cand_ptr,
    counts_ptr,
    widths_ptr,
    out_ptr,
    stride_sb,
    stride_cs,
    stride_cc,
    stride_ns,
    stride_os,
    stride_oc,
    sink_tokens,
    scan_window,
    keep,
    n_scores,
    stride_sh,
    n_heads,
    STAGE: tl.constexpr,
    OUT_INDEX: tl.constexpr,
    WRITE_WIDTH: tl.constexpr,
    CHUNK_SIZE: tl.constexpr,
    SUB: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HEAD_SCORES: tl.constexpr,
    HEAD_BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    row_slot = tl.load(slot_ptr + b)
    level = tl.load(level_ptr + b)
    if (row_slot < 0) | (level < 0) | (level > STAGE):
        return
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    n_cand, width = _stage_input(
        row_slot, seq_len, counts_ptr, widths_ptr, stride_ns, sink_tokens, scan_window,
        STAGE, CHUNK_SIZE,
    )  # fmt: skip
    _keep_top(
        b, row_slot, seq_len, n_cand, width, scores_ptr, cand_ptr, counts_ptr, widths_ptr,
        out_ptr, stride_sb, stride_cs, stride_cc, stride_ns, stride_os, stride_oc, sink_tokens,
        keep, n_scores, stride_sh, n_heads, STAGE, OUT_INDEX, WRITE_WIDTH, CHUNK_SIZE, SUB,
        SPLIT, BLOCK_C, HEAD_SCORES, HEAD_BLOCK,
    )  # fmt: skip


# --------------------------------------------------------------------------- host side
def _head_args(scores: torch.Tensor) -> tuple[int, int]:
    """(stride between heads, heads) of a per-head scratch ``[rows, H_q, C]``; (0, 0) for the
    max-reduced one ``[rows, C]``."""
    if scores.dim() == 3:
        return scores.stride(1), scores.shape[1]
    return 0, 0


def _top_args(
    scores: torch.Tensor, masks: DecodeMasks, params: ref.PruneParams, stage: int
) -> tuple[torch.Tensor, torch.Tensor, int, dict]:
    """Stage ``stage``'s top-k operands: its candidate list, where survivors go, how many
    chunks it keeps, and the constexprs."""
    st = params.stages[stage]
    n = len(params.stages)
    last = stage == n - 1
    sub = st.chunk_size if last else params.stages[stage + 1].chunk_size
    out = masks.final if last else masks.inputs[stage + 1]
    cand = masks.inputs[stage] if stage > 0 else masks.counts  # placeholder at stage 0
    block_c = triton.next_power_of_2(scores.shape[-1])
    meta = dict(STAGE=stage, OUT_INDEX=n if last else stage + 1, WRITE_WIDTH=not last,
                CHUNK_SIZE=st.chunk_size, SUB=sub, SPLIT=st.chunk_size // sub, BLOCK_C=block_c,
                HEAD_SCORES=scores.dim() == 3, HEAD_BLOCK=head_block(scores, block_c))  # fmt: skip
    return cand, out, st.keep_tokens // st.chunk_size, meta


def top_chunks(
    scores: torch.Tensor,
    rows: DecodeRows,
    masks: DecodeMasks,
    params: ref.PruneParams,
    stage: int,
) -> None:
    """Stage ``stage``'s survivors into the next stage's input (or the final blocks) of every
    row taking part; resets ``scores`` of those rows to -inf."""
    batch = rows.slots.shape[0]
    if batch == 0:
        return
    cand, out, keep, meta = _top_args(scores, masks, params, stage)
    block_c = meta["BLOCK_C"]
    _top_chunks_kernel[(batch,)](
        scores, rows.seq_lens, rows.slots, rows.levels, cand, masks.counts, masks.widths, out,
        scores.stride(0), cand.stride(0), cand.stride(1), masks.counts.stride(0),
        out.stride(0), out.stride(1),
        params.sink_tokens, params.scan_window, keep, scores.shape[-1], *_head_args(scores),
        num_warps=top_num_warps(block_c), **meta,
    )  # fmt: skip


@triton.jit
def _place_queries_kernel(
    q_ptr,
    seq_lens_ptr,
    left_ptr,
    right_ptr,
    rope_hi_ptr,
    rope_lo_ptr,
    rope_bias,
    rope_n_hi,
    scale,
    n_heads,
    head_dim,
    left_turn,
    right_turn,
    trained_context,
    stride_qb,
    stride_qh,
    stride_qd,
    stride_ob,
    stride_oh,
    ROT_DIM: tl.constexpr,
    IS_NEOX: tl.constexpr,
    LO_BITS: tl.constexpr,
    RIGHT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One row's queries, scaled and turned from their true position to where the style places
    them: by ``turn - (seq_len - 1)`` in one rotation (rotations compose exactly). A row below
    ``trained_context`` stays at its true position (a turn by 0 is exact)."""
    b = tl.program_id(0)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_in = offs_h < n_heads
    m = h_in[:, None] & (offs_d < head_dim)[None, :]
    partner, freq, sign, rot = rope_pair_layout(offs_d, ROT_DIM, IS_NEOX)
    row = q_ptr + b.to(tl.int64) * stride_qb + offs_h[:, None] * stride_qh
    x = tl.load(row + offs_d[None, :] * stride_qd, mask=m, other=0.0).to(tl.float32) * scale
    xp = tl.load(row + partner[None, :] * stride_qd, mask=m, other=0.0).to(tl.float32) * scale
    pos = tl.load(seq_lens_ptr + b).to(tl.int32) - 1
    remap = pos >= trained_context
    out = b.to(tl.int64) * stride_ob + offs_h[:, None] * stride_oh + offs_d[None, :]
    left_turn = tl.where(remap, left_turn - pos, 0)
    cos, sin = delta_cos_sin(left_turn + offs_h * 0, h_in, freq, rot, rope_hi_ptr,
                             rope_lo_ptr, rope_bias, rope_n_hi, ROT_DIM // 2, LO_BITS)  # fmt: skip
    tl.store(left_ptr + out, rotate_pairs(x, xp, cos, sin, sign), mask=m)
    if RIGHT:
        right_turn = tl.where(remap, right_turn - pos, 0)
        cos, sin = delta_cos_sin(right_turn + offs_h * 0, h_in, freq, rot, rope_hi_ptr,
                                 rope_lo_ptr, rope_bias, rope_n_hi, ROT_DIM // 2,
                                 LO_BITS)  # fmt: skip
        tl.store(right_ptr + out, rotate_pairs(x, xp, cos, sin, sign), mask=m)


def place_queries(
    q: torch.Tensor, seq_lens: torch.Tensor, scale: float, placement: QueryPlacement,
    tables: object, out: torch.Tensor, trained_context: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """:func:`decode_queries` as one launch into ``out`` (float32 ``[2, >= B, H, D]``,
    contiguous rows), so that it allocates nothing and can sit in a graph gate's body.
    ``tables``: :func:`triton_rope.delta_tables` covering ``max(seq_lens) + sw' + 1``."""
    batch, hq, d = q.shape
    left, right = out[0, :batch], out[1, :batch]
    relative = placement.style == ROPE_RELATIVE
    _place_queries_kernel[(batch,)](
        q, seq_lens, left, right, tables.hi, tables.lo, tables.bias, tables.n_hi, scale, hq, d,
        placement.left_turn, placement.right_turn, trained_context, *q.stride(), left.stride(0),
        left.stride(1),
        ROT_DIM=placement.table.rotary_dim, IS_NEOX=placement.table.is_neox, LO_BITS=LO_BITS,
        RIGHT=relative, BLOCK_H=triton.next_power_of_2(hq),
        BLOCK_D=max(16, triton.next_power_of_2(d)), num_warps=4,
    )  # fmt: skip
    return left, right if relative else None


def decode_queries(
    q: torch.Tensor, seq_lens: torch.Tensor, scale: float, placement: QueryPlacement,
    trained_context: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """The scaled fp32 decode queries the pruning stages score with when they are placed by a
    RoPE style, and the right-branch ones of the relative style (§2); rows whose query sits
    below ``trained_context`` keep it at its true position, on both sides. No host sync. The
    PyTorch reference of :func:`place_queries`."""
    from .rope import apply_rotation, rotate

    true = q.float() * scale
    pos = seq_lens.long() - 1
    remap = (pos >= trained_context).view(-1, 1, 1)
    # un-rotate from the true position, then place where the style says (as run_stages does)
    qs = rotate(true, -pos, placement.table)
    if placement.style == ROPE_CHUNK_INDEXED:
        return torch.where(remap, qs, true), None
    left = apply_rotation(qs, placement.left_cos, placement.left_sin, placement.table)
    right = apply_rotation(qs, placement.right_cos, placement.right_sin, placement.table)
    return torch.where(remap, left, true), torch.where(remap, right, true)


@dataclass(frozen=True)
class QueryPlacement:
    """A layer's RoPE style in the pruning stages, with the fixed query turns of the relative
    style (as position deltas for the kernel, and precomputed on the device for the reference:
    nothing is built during a CUDA-graph capture)."""

    style: int
    table: object
    left_cos: torch.Tensor | None = None
    left_sin: torch.Tensor | None = None
    right_cos: torch.Tensor | None = None
    right_sin: torch.Tensor | None = None
    left_turn: int = 0
    right_turn: int = 0

    @classmethod
    def build(
        cls, style: str, table: object, scan_window: int, device: torch.device
    ) -> QueryPlacement:
        """The placement of pruning style ``style`` ("relative" or "chunk-indexed") on
        ``device``; the RoPE tables the kernels read must be built too
        (:func:`triton_rope.delta_tables`), also before any capture."""
        from .rope import relative_positions, rope_cos_sin
        from .triton_rope import rope_table_on

        table = rope_table_on(table, device)
        code = _ROPE_CODES[style]
        if code != ROPE_RELATIVE:
            return cls(code, table)
        pos = relative_positions(scan_window)
        left = int(pos.query_pos - pos.left_probe_pos)
        right = int(pos.query_pos - pos.right_probe_pos)
        lc, ls = rope_cos_sin(left, table)
        rc, rs = rope_cos_sin(right, table)
        return cls(code, table, lc.to(device), ls.to(device), rc.to(device), rs.to(device),
                   left, right)  # fmt: skip


def refresh_masks(
    params: ref.PruneParams,
    masks: DecodeMasks,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    rows: DecodeRows,
    scale: float,
    scores: list[torch.Tensor],
    placement: QueryPlacement | None = None,
    bank: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    reduce_scores: ref.ScoreReduce | None = None,
    arrivals: torch.Tensor | None = None,
    gate: contextlib.AbstractContextManager | None = None,
    fuse_top: bool = True,
    query_buffers: torch.Tensor | None = None,
    key_rows: ref.KeyRows | None = None,
) -> None:
    """Rerun every stage at or after each row's refresh level, from its stored input (§1.6).

    ``q`` is ``[B, H_q, D]`` (the decode queries, unscaled, rotated at their true positions;
    with ``placement``, a row whose query sits below ``params.prune_remap_from`` is scored at
    true positions, as without it, chosen on the device);
    ``scores[i]`` is stage ``i``'s scratch, ``[>= B, >= W_i]`` float32 at -inf (left so), or,
    with ``params.head_reduction`` ``"z-score"``, ``[>= B, H_q, >= W_i]`` per-head scores
    (:func:`decode.allocate_scores`; any contents: each launch writes what it reads).
    Launches ``n_stages`` kernels whatever the levels (a stage wider than
    :data:`FUSED_TOP_MAX_CHUNKS`, or every stage with ``reduce_scores``, adds its top-k
    launch); no host sync, graph-capturable once
    the RoPE tables and ``placement`` are built (:meth:`QueryPlacement.build`). ``bank =
    (pages, table)``: keys are read through the host tier's GPU cache, as in
    :func:`triton_bsa.sparse_decode_attention` (the stages read K only). An fp8 cache needs
    ``k_scale`` and ``v_scale`` (the layer's ``_k_scale`` / ``_v_scale``; read on the device),
    as there: keys are dequantized on load, and the masks equal those of
    :func:`decode.refresh_masks_reference` with the same scales.
    ``reduce_scores``: as in :func:`reference.run_stages` (the stage's scores of all rows,
    combined in place before its top-k; a collective that CUDA graphs can capture).
    ``arrivals``: int32 ``[>= B]`` at zero (left so), the fused top-k's per-row arrival
    counters; a caller that captures graphs preallocates it.
    ``gate``: a context the launches run in (a :class:`graph_if.GraphIf` region, which a
    captured graph skips when no row refreshes); what it needs to be allocation-free (the
    arrival counters, the placed queries' buffers) is made before it.
    ``query_buffers``: float32 ``[2, >= B, H_q, D]`` for the queries a RoPE style places
    (:func:`place_queries`); a caller that captures graphs preallocates it.
    ``key_rows``: the host tier's key-row bank of the layer (``reference.KeyRows``; it takes
    the place of ``bank`` here): probed rows it holds are read there, the others from the cache
    and listed, and after the last stage the listed rows are promoted
    (:func:`triton_bank.promote_key_rows`), inside ``gate``.
    ``fuse_top``: rank each stage in its SelectRep launch (saves a launch per stage on steps
    that refresh nothing, whose programs exit at once) or in a launch of its own (a faster
    refresh: the fused ranking raises SelectRep's register count; the choice where a gate
    skips those steps).
    """
    batch, hq, d = q.shape
    if batch == 0:
        return
    per_head = params.head_reduction == "z-score"
    if params.head_reduction not in ("max", "z-score"):
        raise ValueError(f"head_reduction {params.head_reduction!r}: decode runs max or z-score")
    if per_head and (scores[0].dim() != 3 or scores[0].shape[1] != hq):
        raise ValueError("z-score ranking needs per-head scratch [rows, H_q, C] "
                         "(decode.allocate_scores with heads)")
    hkv = kv_cache.shape[3]
    page_size = kv_cache.shape[2]
    trained = params.prune_remap_from  # rows from here on score at remapped positions
    if placement is not None:
        check_layout(placement.table, d)
        capacity = rows.block_table.shape[1] * page_size
        tables = delta_tables(placement.table, 2 * capacity + scores[0].shape[1] + 1, q.device)
        if query_buffers is None:
            query_buffers = torch.empty(2, batch, hq, d, dtype=torch.float32, device=q.device)
        q_scale = 1.0  # placed queries are scaled
        rope_args = (tables.hi, tables.lo, tables.bias, tables.n_hi)
        block_f, block_p = split_blocks(placement.table.rotary_dim, d)
        rope_meta = dict(ROPE_STYLE=placement.style, ROT_DIM=placement.table.rotary_dim,
                         IS_NEOX=placement.table.is_neox, BLOCK_F=block_f, BLOCK_P=block_p)
    else:
        # the kernel scales the queries as it loads them: no conversion launches per layer
        q_left, q_right, q_scale = q, None, scale
        rope_args = (q_left, q_left, 0, 1)
        rope_meta = dict(ROPE_STYLE=ROPE_NONE, ROT_DIM=0, IS_NEOX=True, BLOCK_F=16, BLOCK_P=0)
    if key_rows is not None:
        bank = None  # the stages read K only: the key rows serve them
        row_args = _key_row_args(key_rows, kv_cache)
    else:
        row_args = (kv_cache, kv_cache, kv_cache, kv_cache, kv_cache, 0, 0, 0)
    bank_pages, bank_table = check_bank(bank, kv_cache)
    kv_cache, k_sc, _, kv_fp8 = kv_quant_args(kv_cache, k_scale, v_scale)
    bank_pages = fp8_view(bank_pages)
    block_d = max(16, triton.next_power_of_2(d))
    block_chunk = 32
    heads = SELECT_HEADS
    if arrivals is None:
        arrivals = torch.zeros(batch, dtype=torch.int32, device=q.device)
    # the placed queries, tables and counters above are made outside: a gate's body must not
    # allocate (graph_if.py)
    with gate or contextlib.nullcontext():
        if placement is not None:  # only a refresh scores: reuse steps skip this too
            q_left, q_right = place_queries(q, rows.seq_lens, scale, placement, tables,
                                            query_buffers, trained)  # fmt: skip
        for i, st in enumerate(params.stages):
            width = scores[i].shape[-1]
            cand, out, keep, top_meta = _top_args(scores[i], masks, params, i)
            # tp_mask "global" combines every rank's scores between SelectRep and the top-k
            fuse = (fuse_top and reduce_scores is None
                    and top_meta["BLOCK_C"] <= FUSED_TOP_MAX_CHUNKS)  # fmt: skip
            _decode_select_kernel[(batch, triton.cdiv(width, block_chunk), hq // heads)](
                q_left, q_left if q_right is None else q_right, kv_cache, rows.block_table,
                rows.seq_lens, rows.slots, rows.levels, cand, masks.counts, masks.widths,
                scores[i], *rope_args, bank_pages, bank_table, bank_pages.stride(0), *row_args,
                k_sc, q_scale, d, params.sink_tokens, params.scan_window, trained,
                *q_left.stride(), kv_cache.stride(0), kv_cache.stride(2), kv_cache.stride(3),
                kv_cache.stride(4), *rows.block_table.stride(), cand.stride(0), cand.stride(1),
                masks.counts.stride(0), scores[i].stride(0), arrivals, out, out.stride(0),
                out.stride(1), keep, width, *_head_args(scores[i]), params.window_tokens,
                GROUP=hq // hkv, HEADS=heads, PAGE_SIZE=page_size,
                EXACT=params.exact_last_stage and i == len(params.stages) - 1,
                DROP_WINDOW=params.drop_window_candidates,
                SCORE_WHOLE_ROW=per_head and reduce_scores is not None,
                N_ITERS=ref.bisect_steps(st.chunk_size), MIDPOINT=params.probe == "midpoint",
                LO_BITS=LO_BITS, BLOCK_CHUNK=block_chunk, BLOCK_D=block_d,
                HAS_BANK=bank is not None, HAS_ROWS=key_rows is not None, KV_FP8=kv_fp8,
                FUSE_TOP=fuse, num_warps=4,
                **rope_meta, **top_meta,
            )  # fmt: skip
            if fuse:
                continue
            if reduce_scores is not None:  # (never under a gate: it allocates, and collectives)
                if per_head:
                    # each rank's heads standardised, then the max over every rank's: the
                    # ranking of all heads at once (a row's entries are all written)
                    ranked = ref.reduce_heads(scores[i][:batch], params.head_reduction)
                    top_chunks(reduce_scores(ranked), rows, masks, params, i)
                    continue
                scores[i][:batch].copy_(reduce_scores(scores[i][:batch]))
            top_chunks(scores[i], rows, masks, params, i)
        if key_rows is not None:
            from .triton_bank import promote_key_rows

            promote_key_rows(key_rows)


def _key_row_args(key_rows: ref.KeyRows, kv_cache: torch.Tensor) -> tuple:
    """The select kernel's key-row bank arguments, checked: rows in the cache's dtype, one
    contiguous ``D``-row per slot."""
    rows = key_rows.rows
    d, hkv = kv_cache.shape[4], kv_cache.shape[3]
    if rows.dtype != kv_cache.dtype or rows.shape[1] != d or rows.stride(1) != 1:
        raise ValueError(f"key rows must be [slots + 1, {d}] rows of the cache's dtype")
    if kv_cache.stride(4) != 1:
        raise ValueError("the key-row bank needs a cache whose head_dim is contiguous")
    if key_rows.table.numel() < kv_cache.shape[0] * kv_cache.shape[2] * hkv + 1:
        raise ValueError("the key-row table needs an entry per cache row, plus a spare")
    if key_rows.missed_rows.shape != (key_rows.missed.shape[0], d):
        raise ValueError("the missed rows' copies are [list length, D]")
    return (fp8_view(rows), key_rows.table, key_rows.missed, fp8_view(key_rows.missed_rows),
            key_rows.state, rows.stride(0), key_rows.missed.shape[0], hkv)  # fmt: skip
