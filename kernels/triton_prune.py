"""Triton SelectRep (one pruning stage's scoring) reading keys straight from vLLM's paged cache.

:func:`select_rep_scores_paged` computes exactly what :func:`reference.select_rep_scores` does
(shared/docs/INFINITEHIP.md §1.4) without gathering the request's keys first: each probe key is
read through the block table where it lies. :func:`run_stages_paged` is the N-stage cascade of
:func:`reference.run_stages` on top of it: each stage's ranking over heads and top-k run in one
launch (:func:`triton_topk.keep_top_blocks`), the split between stages as torch ops with static
shapes (§1.5), so the whole cascade runs without a host sync once ``seq_len`` is given.

Kernel layout (§4): one program per (query block, tile of ``BLOCK_CHUNK`` chunks, query head;
with ``group_probes`` KV head, its group's queries as its rows). Every bisection step loads a
``[BLOCK_CHUNK, D]`` tile of probe keys per half and multiplies it with the block's ``[n_q, D]``
pooled queries; the per-head scores go to a ``[n_blocks, H, C]`` buffer that the top-k's launch
ranks (a z-score needs all of a head's chunks first), so programs never race and need no
atomics.

RoPE remapping (§2): vLLM caches keys rotated at their true positions. The kernel can rotate
each probe key it reads by ``base[b, j] - t``, with angles from the float64-built tables of
:mod:`kernels.triton_rope`. It can also score the right-branch probes against their own
queries. Together these are the relative and chunk-indexed styles of
:func:`reference.run_stages`. The queries are moved by torch on the host side, and they are
small. Without RoPE the rotation is compiled out.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from . import reference as ref
from .query_blocks import QueryBlocks, pool_block_queries, shared_once
from .rope import RopeTable, relative_positions, rotate
from .triton_bsa import kv_quant_args
from .triton_landmark import landmark_tables
from .triton_rope import (
    LO_BITS,
    check_layout,
    delta_tables,
    load_split,
    pair_dims,
    rope_pair_layout,
    rope_table_on,
    rotate_split,
    split_blocks,
)
from .triton_topk import keep_top_blocks

logger = logging.getLogger("vllm.vllm_infinitehip")

PROBES = ("midpoint", "first")
PRECISIONS = ("fp32", "tf32", "ieee", "fast")


@triton.jit
def _probe_scores(
    k_head_ptr,
    block_table_ptr,
    pos,
    mask,
    qa_t,
    qb_t,
    qp_t,
    q_absent,
    offs_d,
    d_in,
    head_dim,
    stride_kpage,
    stride_ktok,
    stride_kd,
    delta,
    turn,
    rope_hi_ptr,
    rope_lo_ptr,
    rope_bias,
    rope_n_hi,
    PAGE_SIZE: tl.constexpr,
    FAST_DOT: tl.constexpr,
    PRECISION: tl.constexpr,
    ROPE: tl.constexpr,
    ROT_DIM: tl.constexpr,
    IS_NEOX: tl.constexpr,
    LO_BITS: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_P: tl.constexpr,
    k_scale,
    KV_FP8: tl.constexpr,
    turn_rows,
    right_cs_ptr,
    RIGHT_TURN: tl.constexpr,
):
    """Per position in ``pos``: max over the block's present queries of q·k at that key.

    Without ``ROPE`` the queries are ``qa_t`` ``[D, n_q]`` (the other two are unused). With
    ``ROPE`` each key is first rotated by its ``delta`` (where ``turn``; else read as cached:
    a block at true positions; cos/sin from the delta tables), and
    keys and queries come split by the rotation pairs (:func:`triton_rope.load_split`; the
    queries ``[part, n_q]``): one product per part. With ``KV_FP8`` the keys are e4m3,
    dequantized as ``float32(k) * k_scale`` before anything else, so the rest is the fp32-key
    arithmetic. With ``RIGHT_TURN`` (and no ``ROPE``) the keys of ``turn_rows`` are turned by
    one constant angle first, its cos and sin per rotation pair at ``right_cs_ptr``: relative
    style's right-branch probes, scored against the left-branch queries.
    """
    page = tl.load(block_table_ptr + pos // PAGE_SIZE, mask=mask, other=0).to(tl.int64)
    # int64: a large cache spans more than 2**31 elements.
    rows = k_head_ptr + page * stride_kpage + (pos % PAGE_SIZE).to(tl.int64) * stride_ktok
    if ROPE:
        ka, kb, kp = load_split(rows, mask, stride_kd, head_dim, k_scale, KV_FP8, ROT_DIM,
                                IS_NEOX, BLOCK_F, BLOCK_P)  # fmt: skip
        delta = tl.where(turn, delta, 0)
        ka, kb = rotate_split(ka, kb, delta, mask, rope_hi_ptr, rope_lo_ptr, rope_bias, rope_n_hi,
                              ROT_DIM, LO_BITS, BLOCK_F)  # fmt: skip
        if FAST_DOT:
            # Rotated keys are rounded to the queries' dtype, as a rotated cache would hold them.
            s = tl.dot(ka.to(qa_t.dtype), qa_t)
            s += tl.dot(kb.to(qa_t.dtype), qb_t)
            if BLOCK_P > 0:
                s += tl.dot(kp.to(qa_t.dtype), qp_t)
        else:
            s = tl.dot(ka, qa_t, input_precision=PRECISION)
            s += tl.dot(kb, qb_t, input_precision=PRECISION)
            if BLOCK_P > 0:
                s += tl.dot(kp.to(tl.float32), qp_t, input_precision=PRECISION)
    else:
        k = tl.load(rows[:, None] + offs_d[None, :] * stride_kd,
                    mask=mask[:, None] & d_in[None, :], other=0.0)  # fmt: skip
        if KV_FP8:
            k = k.to(tl.float32) * k_scale
        if RIGHT_TURN:
            # x cos + partner sign sin per pair (one angle for every row); the partners' lines
            # were just loaded, so the second gather hits L1
            partner, freq, sign, rot = rope_pair_layout(offs_d, ROT_DIM, IS_NEOX)
            kp = tl.load(rows[:, None] + partner[None, :] * stride_kd,
                         mask=(mask & turn_rows)[:, None] & d_in[None, :], other=0.0)  # fmt: skip
            if KV_FP8:
                kp = kp.to(tl.float32) * k_scale
            cos = tl.load(right_cs_ptr + freq, mask=rot, other=1.0)
            sin = tl.load(right_cs_ptr + ROT_DIM // 2 + freq, mask=rot, other=0.0)
            turned = k.to(tl.float32) * cos[None, :] + kp.to(tl.float32) * (sign * sin)[None, :]
            k = tl.where(turn_rows[:, None], turned, k.to(tl.float32))
        if FAST_DOT:
            # Tensor-core precision: 16-bit keys as stored (q_t was cast to match), or tf32.
            s = tl.dot(k.to(qa_t.dtype), qa_t)
        else:
            # fp32 like the reference: exact upcast of the keys, then IEEE products (FMA) or
            # tf32x3, whose split operands reach fp32 accuracy on tensor cores.
            s = tl.dot(k.to(tl.float32), qa_t, input_precision=PRECISION)
    s = tl.where(q_absent[None, :], float("-inf"), s)
    return tl.max(s, axis=1)


@triton.jit
def _load_split_queries_t(q_ptr, blk, head, offs_q, offs_d, d_in, head_dim, n_q, stride_qb,
                          stride_qh, stride_qn, stride_qd, ROPE: tl.constexpr,
                          ROT_DIM: tl.constexpr, IS_NEOX: tl.constexpr, BLOCK_F: tl.constexpr,
                          BLOCK_P: tl.constexpr):  # fmt: skip
    """:func:`_load_queries_t` whole (three times the same; ``ROPE`` off), or split by the
    rotation pairs as :func:`_probe_scores` takes them."""
    if ROPE:
        offs_f = tl.arange(0, BLOCK_F)
        first, second = pair_dims(offs_f, ROT_DIM, IS_NEOX)
        f_in = offs_f < ROT_DIM // 2
        qa_t, q_absent = _load_queries_t(q_ptr, blk, head, offs_q, first, f_in, n_q, stride_qb,
                                         stride_qh, stride_qn, stride_qd)  # fmt: skip
        qb_t, _ = _load_queries_t(q_ptr, blk, head, offs_q, second, f_in, n_q, stride_qb,
                                  stride_qh, stride_qn, stride_qd)  # fmt: skip
        if BLOCK_P > 0:
            offs_p = ROT_DIM + tl.arange(0, BLOCK_P)
            qp_t, _ = _load_queries_t(q_ptr, blk, head, offs_q, offs_p, offs_p < head_dim, n_q,
                                      stride_qb, stride_qh, stride_qn, stride_qd)  # fmt: skip
        else:
            qp_t = qa_t
    else:
        qa_t, q_absent = _load_queries_t(q_ptr, blk, head, offs_q, offs_d, d_in, n_q, stride_qb,
                                         stride_qh, stride_qn, stride_qd)  # fmt: skip
        qb_t = qa_t
        qp_t = qa_t
    return qa_t, qb_t, qp_t, q_absent


@triton.jit
def _load_queries_t(q_ptr, blk, head, offs_q, offs_d, d_in, n_q, stride_qb, stride_qh,
                    stride_qn, stride_qd):  # fmt: skip
    """A block's pooled queries transposed to [D, n_q] (fp32), NaN (absent) rows zeroed, and
    the absent mask (padding rows past n_q are absent too)."""
    q_t = tl.load(
        q_ptr
        + blk * stride_qb
        + head * stride_qh
        + offs_q[None, :] * stride_qn
        + offs_d[:, None] * stride_qd,
        mask=(offs_q[None, :] < n_q) & d_in[:, None],
        other=0.0,
    ).to(tl.float32)
    # NaN marks a pooled row that holds no query; zero it so the product stays finite and mask
    # its scores instead.
    q_nan = q_t != q_t  # noqa: PLR0124 (the NaN test)
    q_absent = (tl.max(q_nan.to(tl.int32), axis=0) > 0) | (offs_q >= n_q)
    return tl.where(q_nan, 0.0, q_t), q_absent


@triton.jit
def _select_rep_kernel(
    q_ptr,
    q_right_ptr,
    k_ptr,
    block_table_ptr,
    block_rows_ptr,
    starts_ptr,
    valid_ptr,
    key_limit_ptr,
    base_ptr,
    turn_ptr,
    rope_hi_ptr,
    rope_lo_ptr,
    out_ptr,
    k_scale_ptr,
    reps_ptr,
    right_cs_ptr,
    n_q,
    n_chunks,
    head_dim,
    rope_bias,
    rope_n_hi,
    rep_sink,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_qd,
    stride_kpage,
    stride_ktok,
    stride_khead,
    stride_kd,
    stride_btr,
    stride_sb,
    stride_sc,
    stride_vb,
    stride_vc,
    stride_bb,
    stride_bc,
    stride_ob,
    stride_oh,
    stride_oc,
    stride_rr,
    stride_rc,
    stride_rh,
    GROUP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    CHUNK_SIZE: tl.constexpr,
    N_ITERS: tl.constexpr,
    MIDPOINT: tl.constexpr,
    FAST_DOT: tl.constexpr,
    PRECISION: tl.constexpr,
    TWO_SIDED: tl.constexpr,
    ROPE: tl.constexpr,
    ROT_DIM: tl.constexpr,
    IS_NEOX: tl.constexpr,
    LO_BITS: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_CHUNK: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_FP8: tl.constexpr,
    EXACT: tl.constexpr,
    REPS: tl.constexpr,
    HEADS_PER_REP: tl.constexpr,
    RIGHT_TURN: tl.constexpr,
):
    blk = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    head = tl.program_id(2)
    if KV_FP8:
        k_scale = tl.load(k_scale_ptr)
    else:
        k_scale = 1.0

    offs_c = tile * BLOCK_CHUNK + tl.arange(0, BLOCK_CHUNK)
    c_in = offs_c < n_chunks
    offs_q = tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, BLOCK_D)
    d_in = offs_d < head_dim

    # Queries transposed to [D, n_q] (or its parts) so each probe is one [BLOCK_CHUNK, D] x
    # [D, n_q] product (or one per part).
    qa_t, qb_t, qp_t, q_absent = _load_split_queries_t(
        q_ptr, blk, head, offs_q, offs_d, d_in, head_dim, n_q, stride_qb, stride_qh, stride_qn,
        stride_qd, ROPE, ROT_DIM, IS_NEOX, BLOCK_F, BLOCK_P,
    )  # fmt: skip
    if FAST_DOT:
        qa_t = qa_t.to(k_ptr.dtype.element_ty)
        qb_t = qb_t.to(k_ptr.dtype.element_ty)
        qp_t = qp_t.to(k_ptr.dtype.element_ty)
    if TWO_SIDED:
        # Right-branch probes score against their own queries (relative RoPE puts the two
        # probe keys at different distances); their absent rows are the left ones'.
        ra_t, rb_t, rp_t, _ = _load_split_queries_t(
            q_right_ptr, blk, head, offs_q, offs_d, d_in, head_dim, n_q, stride_qb, stride_qh,
            stride_qn, stride_qd, ROPE, ROT_DIM, IS_NEOX, BLOCK_F, BLOCK_P,
        )  # fmt: skip
        if FAST_DOT:
            ra_t = ra_t.to(k_ptr.dtype.element_ty)
            rb_t = rb_t.to(k_ptr.dtype.element_ty)
            rp_t = rp_t.to(k_ptr.dtype.element_ty)
    else:
        ra_t = qa_t
        rb_t = qb_t
        rp_t = qp_t

    limit = tl.load(key_limit_ptr + blk).to(tl.int32)
    # the block's request: its row of the block table (one row for all when stride_btr is 0)
    row = tl.load(block_rows_ptr + blk).to(tl.int64)
    block_table_ptr += row * stride_btr
    start = tl.load(starts_ptr + blk * stride_sb + offs_c * stride_sc, mask=c_in, other=0)
    start = start.to(tl.int32)
    flag = tl.load(valid_ptr + blk * stride_vb + offs_c * stride_vc, mask=c_in, other=0)
    valid = (flag != 0) & c_in & (start < limit)

    if ROPE:
        # a probe key at t turns by base - t, in the blocks that are remapped
        base = tl.load(base_ptr + blk * stride_bb + offs_c * stride_bc, mask=c_in, other=0)
        base = base.to(tl.int32)
        turn = tl.load(turn_ptr + blk) != 0
    else:  # placeholders; every use is compiled out
        base = start
        turn = False

    left = start
    right = tl.minimum(start + CHUNK_SIZE, limit)
    best = tl.full([BLOCK_CHUNK], float("-inf"), tl.float32)
    k_head_ptr = k_ptr + (head // GROUP).to(tl.int64) * stride_khead  # K plane: index 0

    # Tiles past the live context (static shapes: the allocated maximum) skip the bisection.
    n_iters = tl.where(tl.max(valid.to(tl.int32), axis=0) > 0, N_ITERS, 0)
    if EXACT:
        # Every key of the chunk against the left-branch queries; a valid chunk holds at least
        # one key (start < limit), so none is left at -inf.
        # (names of their own: the bisection below, which then takes no step, reuses `pos`
        # and `s` at twice the width, and a compiled loop's variables keep one type)
        for j in tl.static_range(CHUNK_SIZE):
            key_pos = left + j
            key_live = valid & (key_pos < right)
            key_s = _probe_scores(
                k_head_ptr, block_table_ptr, key_pos, key_live, qa_t, qb_t, qp_t, q_absent,
                offs_d, d_in, head_dim, stride_kpage, stride_ktok, stride_kd, base - key_pos,
                turn, rope_hi_ptr, rope_lo_ptr, rope_bias, rope_n_hi, PAGE_SIZE, FAST_DOT,
                PRECISION, ROPE, ROT_DIM, IS_NEOX, LO_BITS, BLOCK_F, BLOCK_P, k_scale, KV_FP8,
                valid, right_cs_ptr, False,
            )  # fmt: skip
            best = tl.where(key_live, tl.maximum(best, key_s), best)
        n_iters = 0
    elif REPS:
        # One probe per chunk: its landmark representative, by the chunk's ordinal among the
        # aligned chunks of this size (run_stages_blocks' tables), against the left queries.
        ordinal = (start - rep_sink) // CHUNK_SIZE
        rep = tl.load(reps_ptr + row * stride_rr + ordinal.to(tl.int64) * stride_rc
                      + (head // HEADS_PER_REP) * stride_rh, mask=valid, other=0)  # fmt: skip
        rep_s = _probe_scores(
            k_head_ptr, block_table_ptr, rep, valid, qa_t, qb_t, qp_t, q_absent, offs_d, d_in,
            head_dim, stride_kpage, stride_ktok, stride_kd, base - rep, turn, rope_hi_ptr,
            rope_lo_ptr, rope_bias, rope_n_hi, PAGE_SIZE, FAST_DOT, PRECISION, ROPE, ROT_DIM,
            IS_NEOX, LO_BITS, BLOCK_F, BLOCK_P, k_scale, KV_FP8,
            valid, right_cs_ptr, False,
        )  # fmt: skip
        best = tl.where(valid, rep_s, best)
        n_iters = 0
    for _ in range(n_iters):
        live = valid & (right - left > 1)
        mid = (left + right) // 2
        if MIDPOINT:
            p_left = (left + mid) // 2
            p_right = (mid + right) // 2
        else:  # the paper's Algorithm 3: the first key of each half
            p_left = left
            p_right = mid
        if TWO_SIDED:
            # Two query sets, so two products per step.
            s_left = _probe_scores(
                k_head_ptr, block_table_ptr, p_left, live, qa_t, qb_t, qp_t, q_absent, offs_d,
                d_in, head_dim, stride_kpage, stride_ktok, stride_kd, base - p_left, turn,
                rope_hi_ptr, rope_lo_ptr, rope_bias, rope_n_hi, PAGE_SIZE, FAST_DOT, PRECISION,
                ROPE, ROT_DIM, IS_NEOX, LO_BITS, BLOCK_F, BLOCK_P, k_scale, KV_FP8,
                valid, right_cs_ptr, False,
            )  # fmt: skip
            s_right = _probe_scores(
                k_head_ptr, block_table_ptr, p_right, live, ra_t, rb_t, rp_t, q_absent, offs_d,
                d_in, head_dim, stride_kpage, stride_ktok, stride_kd, base - p_right, turn,
                rope_hi_ptr, rope_lo_ptr, rope_bias, rope_n_hi, PAGE_SIZE, FAST_DOT, PRECISION,
                ROPE, ROT_DIM, IS_NEOX, LO_BITS, BLOCK_F, BLOCK_P, k_scale, KV_FP8,
                valid, right_cs_ptr, False,
            )  # fmt: skip
        else:
            # Both halves' probes in one [2 * BLOCK_CHUNK, D] tile: one product per step (with
            # RIGHT_TURN the right ones, the odd rows, turned first).
            pos = tl.reshape(tl.join(p_left, p_right), [2 * BLOCK_CHUNK])
            need = tl.reshape(tl.join(live, live), [2 * BLOCK_CHUNK])
            turn_rows = (tl.arange(0, 2 * BLOCK_CHUNK) % 2) == 1
            if ROPE:
                delta = tl.reshape(tl.join(base - p_left, base - p_right), [2 * BLOCK_CHUNK])
            else:
                delta = pos
            s = _probe_scores(
                k_head_ptr, block_table_ptr, pos, need, qa_t, qb_t, qp_t, q_absent, offs_d, d_in,
                head_dim, stride_kpage, stride_ktok, stride_kd, delta, turn, rope_hi_ptr,
                rope_lo_ptr, rope_bias, rope_n_hi, PAGE_SIZE, FAST_DOT, PRECISION, ROPE, ROT_DIM,
                IS_NEOX, LO_BITS, BLOCK_F, BLOCK_P, k_scale, KV_FP8,
                turn_rows, right_cs_ptr, RIGHT_TURN,
            )  # fmt: skip
            s_left, s_right = tl.split(tl.reshape(s, [BLOCK_CHUNK, 2]))
        # Strictly greater goes left, so a tie descends right, as in the reference.
        go_left = s_left > s_right
        best = tl.where(live, tl.maximum(best, tl.where(go_left, s_left, s_right)), best)
        right = tl.where(live & go_left, mid, right)
        left = tl.where(live & ~go_left, mid, left)

    # A chunk that was one key wide from the start never probed: that key is its score
    # (against the left-branch queries, as in the reference).
    single = valid & (best == float("-inf"))
    if tl.max(single.to(tl.int32), axis=0) > 0:
        s_single = _probe_scores(
            k_head_ptr, block_table_ptr, left, single, qa_t, qb_t, qp_t, q_absent, offs_d, d_in,
            head_dim, stride_kpage, stride_ktok, stride_kd, base - left, turn, rope_hi_ptr,
            rope_lo_ptr, rope_bias, rope_n_hi, PAGE_SIZE, FAST_DOT, PRECISION, ROPE, ROT_DIM,
            IS_NEOX, LO_BITS, BLOCK_F, BLOCK_P, k_scale, KV_FP8,
            valid, right_cs_ptr, False,
        )  # fmt: skip
        best = tl.where(single, s_single, best)
    # Invalid chunks were never live nor single, so they still hold -inf.
    tl.store(out_ptr + blk * stride_ob + head * stride_oh + offs_c * stride_oc, best, mask=c_in)


def _launch_config(head_dim: int, rope: bool = False) -> tuple[int, int, int]:
    """(BLOCK_CHUNK, num_warps, num_stages): two [BLOCK_CHUNK, D] key tiles per step must fit in
    registers.

    On an H200 (D=128, 64K-1M keys, decode and 16-block prefill) 64 chunks with 8 warps was
    within noise of the best of {16, 32, 64} x {2, 4, 8}; fewer warps spill in the fp32 modes
    (``"ieee"`` ran 6-8x slower with 4 warps than with 8). A rotation holds more tiles live (the
    key's pair halves and their cos/sin), and with software pipelining the same tile asks for
    more shared memory than the H200 has (246272 > 232448 bytes), so it runs unpipelined. With
    the rotation split by pairs (``triton_rope.load_split``), the whole tile beats half of it:
    a 32K-query chunk at 128K pruned in 209 against 412 ms (relative) and 163 against 230 ms
    (chunk-indexed), the same selections (prefill-breakdown-gpu-2026-12-02.json).
    """
    block_chunk = 32 if head_dim > 128 else 64
    return block_chunk, 8, 1 if rope else 3


def select_rep_scores_paged(
    q_pooled: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    starts: torch.Tensor,
    valid: torch.Tensor,
    key_limit: torch.Tensor,
    *,
    chunk_size: int,
    probe: str = "midpoint",
    per_head_out: torch.Tensor | None = None,
    precision: str = "fp32",
    q_pooled_right: torch.Tensor | None = None,
    key_rotation: tuple[torch.Tensor, RopeTable] | None = None,
    max_abs_delta: int | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    block_rows: torch.Tensor | None = None,
    turn_blocks: torch.Tensor | None = None,
    head_reduction: str | None = "max",
    exact: bool = False,
    reps: tuple[torch.Tensor, int] | None = None,
    group_probes: bool = False,
    right_turn: tuple[int, RopeTable] | None = None,
) -> torch.Tensor:
    """SelectRep chunk scores ``[n_blocks, C]`` float32, equal to ``reference.select_rep_scores``.

    ``head_reduction`` turns the per-head scores into the ranking as
    :func:`reference.reduce_heads` does (``None``: the per-head scores ``[n_blocks, H, C]``
    are returned, for :func:`triton_topk.keep_top_blocks`); ``exact`` scores each chunk by its
    best key (every key loaded, against the left-branch queries) instead of bisecting, as the
    reference's ``exact``. ``reps = (table, sink)`` (not with ``exact``) scores each chunk by
    one key per head instead, its landmark representative: ``table [rows, n, H]`` (a block's
    request row, as ``block_rows``; ``H`` divides ``H_q``) holds it for every aligned chunk
    ``[sink + j * chunk_size, ...)`` (:func:`reference.landmark_table`), and a chunk is looked
    up by its ordinal, so candidate starts must be aligned so. This is the reference's
    ``landmarks`` for every chunk that ends before its block's key limit. ``group_probes``
    (not with ``exact``): the query heads of each KV group bisect one path, as the reference's:
    one program per (block, tile, KV head) holds the group's queries as its rows, so each probe
    key is read once for the group (``per_head_out`` is then ``[n_blocks, H_kv, C]``).

    ``q_pooled`` is ``[n_blocks, H_q, n_q, D]``, already multiplied by the softmax scale; a row
    containing NaN is an absent query (as :func:`reference.pool_queries` produces) and takes no
    part in the max over queries. ``kv_cache`` is ``[num_pages, 2, page_size, H_kv, D]`` and
    token ``t`` of one request lives at page ``block_table[t // page_size]``; blocks of several
    requests (a batch of prefill chunks) read row ``block_rows[b]`` of a ``[rows, pages]``
    ``block_table``. Chunk ``j`` of block ``b`` covers ``[starts[b, j], min(starts[b, j] + chunk_size, key_limit[b]))``; invalid
    or empty chunks score ``-inf``; the result is the max over query heads.

    RoPE remapping (§2), for keys cached already rotated at their true positions:

    - ``q_pooled_right`` (shaped like ``q_pooled``, same absent rows) scores the right-branch
      probes, as the reference's argument of that name does (relative style);
    - ``key_rotation = (base [n_blocks, C] integer, table)`` rotates every probe key of chunk
      ``j`` of block ``b``, read at true position ``t``, by ``base[b, j] - t`` before scoring.
      The reference equivalent is ``chunk_rotation = (base, table)`` applied to keys
      un-rotated to position 0. Angles come from float64-built tables
      (:mod:`kernels.triton_rope`) and are accurate to about 3e-7 at any delta up to
      ``max_abs_delta``. The default bound is ``2 * capacity + C``, where ``capacity`` is
      a row's pages times ``page_size``. That covers ``base`` in ``[-capacity, C]``, which
      holds both ``base = 0`` (relative) and ``base = j - q_pos`` (chunk-indexed). NeoX and
      GPT-J pairing and partial rotary are all supported.
    - ``turn_blocks`` (``[n_blocks]`` bool, with ``key_rotation``): only those blocks' keys
      turn; the others are scored as cached (a block at true positions, whose queries the
      caller left at their true positions too).
    - ``right_turn = (delta, table)`` (not with either option above): every right-branch probe
      key turns by the constant ``delta`` before it is scored against ``q_pooled``. Relative
      style over keys at position 0 (:func:`unrotated_key_pages`) with the left-branch queries:
      ``q_right · k = q_left · R(delta) k`` for ``delta`` the right probe's position minus the
      left one's (1), so one query set and one product per step serve both branches, where
      ``q_pooled_right`` takes a second query set and two products.

    Without either option the kernel is compiled exactly as before: no extra loads or products.

    ``precision`` picks how q·k is computed; keys are always upcast exactly first:

    - ``"fp32"`` (default): tf32x3 on tensor cores, fp32-accurate (H200, bf16 keys: every score
      within 1e-4 of the reference and identical top-k at 64K-1M keys);
    - ``"tf32"``: keys upcast exactly, one tf32 tensor-core pass (10-bit mantissas: scores move
      by about 1e-3 relative, so near-ties may descend differently);
    - ``"ieee"``: plain fp32 products, 2.5-4x slower than ``"fp32"``;
    - ``"fast"``: one tensor-core pass in the keys' dtype (bf16/fp16: queries rounded to it;
      fp32 keys: tf32). 1.5-4x faster than ``"fp32"``, but most scores move by more than
      1e-4 relative and a bisection may descend differently (H200: ~99% of the reference's
      top-k kept).

    Guarantees: the bisection path and the probed keys are the reference's (up to near-ties
    within rounding, see ``precision``). Only keys inside live chunks are read, so pages past
    ``key_limit`` need not exist in the block table. Positions must fit in int32. No host
    sync once the rotation tables are built (:func:`triton_rope.delta_tables`, cached per table
    and device); ``per_head_out`` (``[n_blocks, H_q, C]`` float32, overwritten) lets a caller
    keep the scratch preallocated.

    An fp8 cache (vLLM's uint8 storage of e4m3 keys) needs ``k_scale`` and ``v_scale`` (the
    layer's ``_k_scale`` / ``_v_scale``; only K is read here): keys are dequantized on load as
    ``float32(k) * k_scale``, and the scores equal those over the dequantized cache. Other
    caches ignore the scales. ``precision="fast"`` does not take fp8 keys.
    """
    if probe not in PROBES:
        raise ValueError(f"probe={probe!r} must be one of {PROBES}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} must be one of {PRECISIONS}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    nb, hq, nq, d = q_pooled.shape
    _, planes, page_size, hkv, dk = kv_cache.shape
    if planes not in (1, 2) or dk != d:  # one plane: keys alone (:func:`unrotated_key_pages`)
        raise ValueError(
            f"kv_cache shape {tuple(kv_cache.shape)} must be [num_pages, 2, page_size, H_kv, {d}]"
        )
    if hq % hkv:
        raise ValueError(f"H_q={hq} must be a multiple of H_kv={hkv}")
    if group_probes and not exact:
        q_pooled, q_pooled_right = ref.group_queries(q_pooled, hkv, q_pooled_right)
        nb, hq, nq, d = q_pooled.shape
    if precision == "fast" and kv_cache.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"precision='fast' needs fp16, bf16 or fp32 keys, not {kv_cache.dtype}")
    kv_cache, k_sc, _, kv_fp8 = kv_quant_args(kv_cache, k_scale, v_scale)
    c = starts.shape[1]
    if starts.shape != (nb, c) or valid.shape != (nb, c) or key_limit.shape != (nb,):
        raise ValueError(
            f"starts {tuple(starts.shape)}, valid {tuple(valid.shape)} and key_limit "
            f"{tuple(key_limit.shape)} must be [{nb}, C], [{nb}, C] and [{nb}]"
        )
    if q_pooled_right is not None:
        if q_pooled_right.shape != q_pooled.shape:
            raise ValueError(
                f"q_pooled_right {tuple(q_pooled_right.shape)} must be shaped like q_pooled "
                f"{tuple(q_pooled.shape)}"
            )
        if q_pooled_right.stride() != q_pooled.stride():  # the kernel takes one set of strides
            q_pooled, q_pooled_right = q_pooled.contiguous(), q_pooled_right.contiguous()
    if per_head_out is None:
        per_head_out = torch.empty(nb, hq, c, dtype=torch.float32, device=q_pooled.device)
    elif per_head_out.shape != (nb, hq, c) or per_head_out.dtype != torch.float32:
        raise ValueError(
            f"per_head_out is {tuple(per_head_out.shape)} {per_head_out.dtype}; "
            f"needs [{nb}, {hq}, {c}] float32"
        )
    if key_rotation is not None:
        base, rope_table = key_rotation
        check_layout(rope_table, d)
        if base.shape != (nb, c) or base.is_floating_point():
            raise ValueError(f"key_rotation base {tuple(base.shape)} must be [{nb}, {c}] integers")
        if max_abs_delta is None:
            max_abs_delta = 2 * block_table.shape[-1] * page_size + c
        tables = delta_tables(rope_table, max_abs_delta, q_pooled.device)
        if turn_blocks is None:
            turn_blocks = torch.ones(nb, dtype=torch.bool, device=base.device)
        elif turn_blocks.shape != (nb,):
            raise ValueError(f"turn_blocks {tuple(turn_blocks.shape)} must be [{nb}]")
        if turn_blocks.dtype == torch.bool:
            turn_blocks = turn_blocks.view(torch.uint8)  # same bytes; avoids i1 pointers
        rope_args = (base, turn_blocks, tables.hi, tables.lo, tables.bias, tables.n_hi)
        block_f, block_p = split_blocks(rope_table.rotary_dim, d)
        rope_meta = dict(ROPE=True, ROT_DIM=rope_table.rotary_dim, IS_NEOX=rope_table.is_neox,
                         BLOCK_F=block_f, BLOCK_P=block_p)  # fmt: skip
    else:
        # Placeholders for the compiled-out rotation (any tensor; never read).
        rope_args = (starts, starts, starts, starts, 0, 1)
        rope_meta = dict(ROPE=False, ROT_DIM=0, IS_NEOX=True, BLOCK_F=16, BLOCK_P=0)
    right_cs = starts  # placeholder; never read without RIGHT_TURN
    if right_turn is not None:
        if key_rotation is not None or q_pooled_right is not None:
            raise ValueError("right_turn takes the place of key_rotation and q_pooled_right")
        delta, turn_table = right_turn
        check_layout(turn_table, d)
        if not 0 <= delta < 1 << LO_BITS:
            raise ValueError(f"right_turn delta {delta} must be in [0, {1 << LO_BITS})")
        # cos and sin of delta * inv_freq, side by side: row delta of the cached table B
        # (float64-built, as rope.rope_cos_sin gives them), no work per call
        right_cs = delta_tables(turn_table, delta, q_pooled.device).lo[delta]
        rope_meta = dict(rope_meta, ROT_DIM=turn_table.rotary_dim, IS_NEOX=turn_table.is_neox)
    if nb == 0 or c == 0:
        return per_head_out if head_reduction is None else per_head_out.new_empty(nb, c)
    use_reps = reps is not None and not exact
    if use_reps:
        rep_table, rep_sink = reps
        if rep_table.dim() != 3 or hq % rep_table.shape[2] or rep_table.dtype != torch.int32:
            raise ValueError(f"reps table {tuple(rep_table.shape)} {rep_table.dtype} must be "
                             f"[rows, chunks, H] int32 with H dividing H_q={hq}")  # fmt: skip
        rep_strides = rep_table.stride()
        heads_per_rep = hq // rep_table.shape[2]
    else:  # placeholders; never read
        rep_table, rep_sink, rep_strides, heads_per_rep = starts, 0, (0, 0, 0), 1

    block_chunk, num_warps, num_stages = _launch_config(d, rope=key_rotation is not None)
    # tl.dot needs every dimension >= 16; padding rows are masked as absent queries.
    block_q = max(16, triton.next_power_of_2(nq))
    block_d = max(16, triton.next_power_of_2(d))
    if valid.dtype == torch.bool:
        valid = valid.view(torch.uint8)  # same bytes; avoids i1 pointers
    if block_table.stride(-1) != 1:  # the probes index a row's pages with unit stride
        block_table = block_table.contiguous()
    if block_rows is None:  # one request: every block reads the one row (stride 0)
        if block_table.dim() == 2 and block_table.shape[0] != 1:
            raise ValueError(f"block_table {tuple(block_table.shape)} has several rows: "
                             "pass block_rows")  # fmt: skip
        block_rows, stride_btr = key_limit, 0
    else:
        if block_table.dim() != 2 or block_rows.shape != (nb,):
            raise ValueError(f"block_rows {tuple(block_rows.shape)} must be [{nb}] rows of a "
                             f"[rows, pages] block_table, not {tuple(block_table.shape)}")  # fmt: skip
        stride_btr = block_table.stride(0)
    base_t, turn_t, hi_t, lo_t, bias, n_hi = rope_args
    meta = dict(
        GROUP=hq // hkv,
        PAGE_SIZE=page_size,
        CHUNK_SIZE=chunk_size,
        N_ITERS=ref.bisect_steps(chunk_size),
        EXACT=exact,
        REPS=use_reps,
        HEADS_PER_REP=heads_per_rep,
        RIGHT_TURN=right_turn is not None,
        MIDPOINT=probe == "midpoint",
        FAST_DOT=precision == "fast",
        PRECISION={"ieee": "ieee", "tf32": "tf32"}.get(precision, "tf32x3"),
        TWO_SIDED=q_pooled_right is not None,
        LO_BITS=LO_BITS,
        BLOCK_Q=block_q,
        BLOCK_D=block_d,
        KV_FP8=kv_fp8,
        num_warps=num_warps,
        **rope_meta,
    )  # fmt: skip
    # A tile that needs more shared memory than the GPU has fails when it compiles (Triton's
    # OutOfResources; on an H100 two-sided group probes, two 64-row query tiles, asked for
    # 295936 bytes at 3 stages, 278528 unpipelined and 266240 at 16 chunks, against 232448).
    # The launch is then retried unpipelined, then with half the chunk tile, neither of which
    # changes a score; past 16 chunks, over 16-bit keys, with one 16-bit product per probe
    # (``precision="fast"``: half the operand bytes; scores move by about 1e-3 relative); over
    # float32 keys it fails naming the settings that avoid it. What compiled is kept for these
    # settings.
    fits = (q_pooled.device.index, *sorted(meta.items()))
    tile = _TILE_FITS.get(fits, (block_chunk, num_stages, meta["FAST_DOT"]))
    while True:
        chunks, stages, fast = tile
        try:
            _launch_select_rep(
                q_pooled, q_pooled_right, kv_cache, block_table, block_rows, starts, valid,
                key_limit, base_t, turn_t, hi_t, lo_t, per_head_out, k_sc, rep_table, right_cs,
                nq, c, d, bias, n_hi, rep_sink, stride_btr, rep_strides, chunks, stages,
                {**meta, "FAST_DOT": fast},
            )  # fmt: skip
        except OutOfResources as err:
            if stages > 1:
                tile = (chunks, 1, fast)
            elif chunks > 16:
                tile = (chunks // 2, 1, fast)
            elif not fast and kv_cache.dtype in (torch.float16, torch.bfloat16):
                logger.warning(
                    "SelectRep with %d query rows%s does not fit this GPU's shared memory at "
                    "%s precision: scoring these launches with 16-bit products", block_q,
                    " on two sides" if q_pooled_right is not None else "", precision,
                )  # fmt: skip
                tile = (block_chunk, num_stages, True)
            elif not fast:  # float32 keys (an exact precision's turned copy): no 16-bit products
                raise RuntimeError(
                    f"SelectRep with {block_q} query rows"
                    f"{' on two sides' if q_pooled_right is not None else ''} over float32 keys "
                    "fits no chunk tile in this GPU's shared memory: score with 16-bit keys "
                    "(scoring_precision \"tf32\") or per-head probes (prefill_representatives "
                    "\"bisection\")"
                ) from err
            else:
                raise
            continue
        _TILE_FITS[fits] = tile
        if head_reduction is None:
            return per_head_out
        return ref.reduce_heads(per_head_out, head_reduction)


# settings of a SelectRep launch -> the (chunk tile, pipeline stages, 16-bit products) that
# compiled for them
_TILE_FITS: dict[tuple, tuple[int, int, bool]] = {}


def _launch_select_rep(
    q_pooled, q_pooled_right, kv_cache, block_table, block_rows, starts, valid, key_limit, base_t,
    turn_t, hi_t, lo_t, per_head_out, k_sc, rep_table, right_cs, nq, c, d, bias, n_hi,
    rep_sink, stride_btr, rep_strides, block_chunk, num_stages, meta,
) -> None:  # fmt: skip
    grid = (q_pooled.shape[0], triton.cdiv(c, block_chunk), q_pooled.shape[1])
    _select_rep_kernel[grid](
        q_pooled,
        q_pooled if q_pooled_right is None else q_pooled_right,
        kv_cache,  # the kernel reads plane 0 (K) only
        block_table,
        block_rows,
        starts,
        valid,
        key_limit,
        base_t,
        turn_t,
        hi_t,
        lo_t,
        per_head_out,
        k_sc,
        rep_table,
        right_cs,
        nq,
        c,
        d,
        bias,
        n_hi,
        rep_sink,
        *q_pooled.stride(),
        kv_cache.stride(0),
        kv_cache.stride(2),
        kv_cache.stride(3),
        kv_cache.stride(4),
        stride_btr,
        *starts.stride(),
        *valid.stride(),
        *base_t.stride(),
        *per_head_out.stride(),
        *rep_strides,
        BLOCK_CHUNK=block_chunk,
        num_stages=num_stages,
        **meta,
    )


# --------------------------------------------------------------------------- the cascade
def run_stages_paged(
    params: ref.PruneParams,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table_row: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
    start_stage: int = 0,
    start_input: ref.Candidates | None = None,
    *,
    seq_len: int | None = None,
    precision: str = "fp32",
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    reduce_scores: ref.ScoreReduce | None = None,
    landmarks: torch.Tensor | None = None,
) -> ref.PruneResult:
    """The pruning cascade of :func:`reference.run_stages` for one request, scored by the Triton
    kernel (:func:`run_stages_blocks` with the request's blocks; ``landmarks``: its landmark
    state).

    ``q`` is ``[Nq, H_q, D]`` (unscaled) at consecutive positions ``q_positions``; keys are read
    from the paged cache through ``block_table_row``. ``seq_len`` (a host int) sizes the
    stage-1 candidates: the request's context length, or any bound of it such as the allocated
    maximum, which keeps shapes static for CUDA graphs (chunks past the live context are masked
    invalid). With ``seq_len`` given, or when resuming (``start_stage > 0``), nothing syncs with
    the host; otherwise it is read from ``q_positions`` (one sync).

    Guarantees: with the same ``seq_len`` and ``"fp32"`` or ``"ieee"`` precision, the valid
    selections and each stage's valid candidates equal the reference's (up to score near-ties
    within fp32 rounding), with the reference's shapes; with ``seq_len`` given, the call is
    CUDA-graph capturable. Starts stored under ``valid == False`` are unspecified. With
    ``"chunk-indexed"`` RoPE the stage-1 candidate count, and so the query position
    ``min(p, C + sw')``, follows ``seq_len``: pass the live length to get the reference's scores
    (§2, "Caveat").
    """
    nq = q.shape[0]
    if seq_len is None and start_stage == 0:
        seq_len = int(q_positions[-1]) + 1 if nq else 0
    blocks = QueryBlocks.single(nq, q_positions[0] if nq else 0, seq_len or 0,
                                params.stages[start_stage].block_size_q, q.device)  # fmt: skip
    result = run_stages_blocks(params, q, blocks, kv_cache, block_table_row.view(1, -1), scale,
                               start_stage, start_input, precision=precision, k_scale=k_scale,
                               v_scale=v_scale, reduce_scores=reduce_scores,
                               landmarks=landmarks)  # fmt: skip

    def trim(t: torch.Tensor, block_size_q: int) -> torch.Tensor:
        return t[: -(-nq // block_size_q)]  # the request's blocks, not the coarse padding

    bq = params.block_size_q
    inputs = [
        ref.Candidates(trim(c.starts, st.block_size_q), trim(c.valid, st.block_size_q))
        for c, st in zip(result.stage_inputs, params.stages[start_stage:])
    ]
    return ref.PruneResult(trim(result.block_starts, bq), trim(result.block_valid, bq), inputs)


@triton.jit
def _turn_key_pages_kernel(
    k_ptr,
    src_pages_ptr,
    first_pos_ptr,
    out_ptr,
    k_scale_ptr,
    rope_hi_ptr,
    rope_lo_ptr,
    rope_bias,
    rope_n_hi,
    n_heads,
    head_dim,
    sink,
    chunk,
    stride_kpage,
    stride_ktok,
    stride_khead,
    stride_kd,
    stride_opage,
    stride_otok,
    stride_ohead,
    PAGE_SIZE: tl.constexpr,
    ORDINAL: tl.constexpr,
    KV_FP8: tl.constexpr,
    ROT_DIM: tl.constexpr,
    IS_NEOX: tl.constexpr,
    LO_BITS: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Output page ``p``: every key of cache page ``src_pages[p]`` (its tokens at positions
    ``first_pos[p] + i``), all heads, turned from its position to 0 (or, with ``ORDINAL``, to
    its first-stage chunk's ordinal)."""
    p = tl.program_id(0).to(tl.int64)
    src = tl.load(src_pages_ptr + p).to(tl.int64)
    first = tl.load(first_pos_ptr + p).to(tl.int32)
    r = tl.arange(0, BLOCK_T * BLOCK_H)
    tok = r // BLOCK_H
    head = r % BLOCK_H
    ok = (tok < PAGE_SIZE) & (head < n_heads)
    if KV_FP8:
        k_scale = tl.load(k_scale_ptr)
    else:
        k_scale = 1.0
    rows = k_ptr + src * stride_kpage + tok * stride_ktok + head * stride_khead
    xa, xb, xp = load_split(rows, ok, stride_kd, head_dim, k_scale, KV_FP8, ROT_DIM, IS_NEOX,
                            BLOCK_F, BLOCK_P)  # fmt: skip
    pos = first + tok
    target = tl.zeros_like(pos)
    if ORDINAL:
        target = tl.maximum(pos - sink, 0) // chunk
    ya, yb = rotate_split(xa, xb, target - pos, ok, rope_hi_ptr, rope_lo_ptr, rope_bias,
                          rope_n_hi, ROT_DIM, LO_BITS, BLOCK_F)  # fmt: skip
    out_rows = out_ptr + p * stride_opage + tok * stride_otok + head * stride_ohead
    offs_f = tl.arange(0, BLOCK_F)
    dim_a, dim_b = pair_dims(offs_f, ROT_DIM, IS_NEOX)
    m = ok[:, None] & (offs_f < ROT_DIM // 2)[None, :]
    tl.store(out_rows[:, None] + dim_a[None, :], ya, mask=m)
    tl.store(out_rows[:, None] + dim_b[None, :], yb, mask=m)
    if BLOCK_P > 0:
        offs_p = ROT_DIM + tl.arange(0, BLOCK_P)
        tl.store(out_rows[:, None] + offs_p[None, :], xp,
                 mask=ok[:, None] & (offs_p < head_dim)[None, :])  # fmt: skip


def _turned_copy(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    blocks: QueryBlocks,
    precision: str,
) -> tuple[torch.Tensor, torch.Tensor, dict[int, int]]:
    """The turned copy's buffer (uninitialised), its block table, and the pages each covered
    row of ``block_table`` copies (:func:`unrotated_key_pages`)."""
    page = kv_cache.shape[2]
    lengths = blocks.row_lengths(block_table.shape[0], block_table.shape[1] * page)
    dtype = torch.bfloat16 if ref.is_fp8_cache(kv_cache) else kv_cache.dtype
    if precision in ("fp32", "ieee"):
        dtype = torch.float32
    pages = {row: min(-(-n // page), block_table.shape[1]) for row, n in lengths.items()}
    out = torch.empty(max(sum(pages.values()), 1), 1, page, *kv_cache.shape[3:], dtype=dtype,
                      device=kv_cache.device)  # fmt: skip
    # the copy's table is the same in every layer of a step: made once, kept with the blocks
    table_key = ("unrotated_key_pages", tuple(block_table.shape), page)
    turned_table = blocks._derived.get(table_key)
    if turned_table is None:
        host_table = torch.zeros(tuple(block_table.shape), dtype=torch.int32)
        at = 0
        for row, n in pages.items():
            host_table[row, :n] = torch.arange(at, at + n, dtype=torch.int32)
            at += n
        turned_table = host_table.to(kv_cache.device, non_blocking=True)
        blocks._derived[table_key] = turned_table
    return out, turned_table, pages


def unrotated_key_pages(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    blocks: QueryBlocks,
    table: RopeTable,
    k_scale: float | torch.Tensor | None = None,
    ordinal_chunks: tuple[int, int] | None = None,
    precision: str = "fp32",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys of the requests in ``blocks`` turned back to position 0 (``R(-t) k``, what
    relative-style pruning scores every probe key at, §2); with ``ordinal_chunks = (sink,
    chunk_size)``, to the ordinal of the key's first-stage chunk instead (``(t - sink) //
    chunk_size``, where chunk-indexed style puts it in the first stage). As a K-only paged cache
    ``[n, 1, page, H_kv, D]`` and its block table, shaped and indexed like ``block_table``
    (rows no part of ``blocks`` reads point at page 0; without ``blocks.parts``, every row is
    covered up to ``blocks.max_seq_len``, or its whole capacity where that is 0).

    Pruning then reads these keys as they lie instead of rotating each probe in the kernel: a
    key is turned once here, where a 32K-query chunk's probes read it about 200 times at 512K.
    One Triton launch, one program per page (all heads), memory-bound: the angles come from
    the float64-built delta tables (:mod:`triton_rope`, within about 3e-7 of the truth at any
    position), so no angle is formed per key. In float32 (an fp8 cache dequantized with
    ``k_scale`` first), as :func:`unrotated_key_pages_reference` does with :func:`rope.rotate`.
    With ``precision`` ``"fp32"`` or ``"ieee"`` (:func:`select_rep_scores_paged`'s, scores as
    accurate as the reference's) the copy stays float32; otherwise it is rounded to a 16-bit
    cache's dtype, as a rotated cache is, or to bf16 for an fp8 cache (half the memory). Row
    ``r`` is covered up to the longest ``seq_len`` of its parts; nothing past it is probed."""
    out, turned_table, pages = _turned_copy(kv_cache, block_table, blocks, precision)
    if not pages or not any(pages.values()):
        return out, turned_table
    page, hkv, d = kv_cache.shape[2], kv_cache.shape[3], kv_cache.shape[4]
    device = kv_cache.device
    check_layout(table, d)
    src = torch.cat([block_table[row, :n].reshape(-1) for row, n in pages.items()])
    first_pos = torch.cat([torch.arange(n, device=device, dtype=torch.int32) * page
                           for n in pages.values()])  # fmt: skip
    cache, k_sc, _, fp8 = kv_quant_args(kv_cache, k_scale, k_scale)
    tables = delta_tables(table, block_table.shape[1] * page, device)
    block_f, block_p = split_blocks(table.rotary_dim, d)
    sink, chunk = ordinal_chunks or (0, 1)
    _turn_key_pages_kernel[(src.shape[0],)](
        cache, src, first_pos, out, k_sc, tables.hi, tables.lo, tables.bias, tables.n_hi, hkv,
        d, sink, chunk, cache.stride(0), cache.stride(2), cache.stride(3), cache.stride(4),
        out.stride(0), out.stride(2), out.stride(3),
        PAGE_SIZE=page, ORDINAL=ordinal_chunks is not None, KV_FP8=fp8,
        ROT_DIM=table.rotary_dim, IS_NEOX=table.is_neox, LO_BITS=LO_BITS, BLOCK_F=block_f,
        BLOCK_P=block_p, BLOCK_T=triton.next_power_of_2(page),
        BLOCK_H=triton.next_power_of_2(hkv), num_warps=4,
    )  # fmt: skip
    return out, turned_table


# Pages turned back per step of :func:`unrotated_key_pages_reference`: its fp32 temporaries
# stay near 64K tokens' worth (256 MB for 8 KV heads of 128), whatever the context.
UNROTATE_PAGES = 4096


def unrotated_key_pages_reference(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    blocks: QueryBlocks,
    table: RopeTable,
    k_scale: float | torch.Tensor | None = None,
    ordinal_chunks: tuple[int, int] | None = None,
    precision: str = "fp32",
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`unrotated_key_pages` in PyTorch: each page range turned by :func:`rope.rotate`
    (angles in float64 per key)."""
    out, turned_table, pages = _turned_copy(kv_cache, block_table, blocks, precision)
    page = kv_cache.shape[2]
    fp8 = ref.is_fp8_cache(kv_cache)
    at = 0
    for row, n in pages.items():
        for lo in range(0, n, UNROTATE_PAGES):
            hi = min(n, lo + UNROTATE_PAGES)
            k = kv_cache[block_table[row, lo:hi].long(), 0]
            if fp8:
                k = ref.dequantize_fp8(k, k_scale)
            elif out.dtype == torch.float32:  # rotate returns its input's dtype: keep fp32 here
                k = k.float()
            pos = torch.arange(lo * page, hi * page, device=k.device).view(hi - lo, page)
            target = 0
            if ordinal_chunks is not None:
                sink, chunk = ordinal_chunks
                target = (pos - sink).clamp(min=0) // chunk
            out[at + lo : at + hi, 0] = rotate(k, target - pos, table)
        at += n
    return out, turned_table


def run_stages_blocks(
    params: ref.PruneParams,
    q: torch.Tensor,
    blocks: QueryBlocks,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    start_stage: int = 0,
    start_input: ref.Candidates | None = None,
    *,
    precision: str = "fp32",
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    reduce_scores: ref.ScoreReduce | None = None,
    shared: dict | None = None,
    landmarks: torch.Tensor | None = None,
) -> ref.PruneResult:
    """The cascade of :func:`reference.run_stages` for the query blocks of one or more requests
    (a step's prefill chunks) in one set of launches.

    ``landmarks`` (the layer's landmark state, :mod:`triton_landmark`): every stage but an
    exact last one scores each chunk by its landmark representatives (one probe per chunk and
    head) instead of bisecting, as :func:`reference.run_stages` with the requests' landmark
    scores, for chunks that end before their block's key limit (every candidate does when the
    first stage's chunks are at most half the window).

    ``blocks`` (:class:`query_blocks.QueryBlocks`, in blocks of the first stage's
    ``block_size_q`` or a multiple of it) index ``q`` ``[Nq, H_q, D]`` (unscaled) and the rows
    of ``block_table`` ``[rows, pages]``. The result's rows are ``blocks.refine`` to the last
    stage's ``block_size_q``; a request's rows equal :func:`run_stages_paged` on it alone (the
    valid selections: the widths follow the longest request, and a shorter one's extra entries
    are invalid). Chunk-indexed RoPE places each block's query by its own request's candidate
    count, as the request alone would. No host sync.

    ``precision`` is :func:`select_rep_scores_paged`'s. Every stage is scored, even one where
    all live chunks survive: the survivors are then the same set, and they are re-sorted by
    position, so score ties do not matter.

    RoPE remapping (``params.rope`` with ``pruning`` ``"relative"`` or ``"chunk-indexed"``, §2)
    is done as the reference does it. The queries are un-rotated from their true positions and
    placed by torch (small tensors). Relative style puts every probe key at position 0: the
    keys are turned there once per call (:func:`unrotated_key_pages`) and the kernel reads them
    plainly against the left-branch queries, turning each right-branch probe by the probes'
    one-position gap (``right_turn``). Chunk-indexed style does the same in its first stage,
    where a key's position is its chunk's ordinal over the live context (the queries then move
    to each block's position instead of the keys); its later stages move each probe key
    in-kernel from its true position (see :func:`select_rep_scores_paged`). Blocks whose last
    query sits below the pruning's remap threshold keep true positions (queries and keys as
    given). The rotation tables are sized by the block table's capacity and built on the first
    call.

    ``k_scale`` / ``v_scale``: an fp8 cache's dequantization (:func:`select_rep_scores_paged`);
    the result then equals :func:`reference.run_stages` on the dequantized keys.
    ``reduce_scores``: as in :func:`reference.run_stages`. ``shared``: a dict kept across the
    calls of one layer over one cache (a step's kinds of part): the turned-back keys of the
    same requests at the same lengths are made once.
    """
    device = q.device
    stage_blocks = blocks.refine(params.stages[start_stage].block_size_q)
    key_limit = stage_blocks.key_limit()
    block_min_pos = stage_blocks.first_pos

    rope = params.rope
    style = "none" if rope is None else rope.pruning
    if style not in ("none", "relative", "chunk-indexed"):
        raise ValueError(f"unknown RoPE pruning style {style!r}")
    sw = params.scan_window
    if start_stage == 0:
        cand = ref.first_stage_candidates(params, blocks.max_seq_len, block_min_pos)
        cand = ref.Candidates(cand.starts, cand.valid & (key_limit > 0).view(-1, 1))
    elif start_input is None:
        raise ValueError(f"start_stage={start_stage} needs start_input, that stage's input")
    else:
        cand = start_input
    # chunk-indexed RoPE: each block's own candidate count (its request's, not the batch's)
    widths = None
    if style == "chunk-indexed":
        if start_stage == 0:
            l1 = params.stages[0].chunk_size
            widths = (stage_blocks.seq_len - params.sink_tokens).clamp(min=0).add(l1 - 1) // l1
        else:
            widths = torch.full_like(block_min_pos, cand.starts.shape[1])

    # the blocks' queries, padded, as consecutive rows: any finer blocks are a reshape
    rows, present, positions = stage_blocks.padded_queries(q)
    hq, d = q.shape[1], q.shape[2]
    true_rows = rows
    turned_keys, all_turn = None, False
    if style != "none":
        table = rope_table_on(rope.table, device)
        # Keys turned once per call where every probe of a stage would turn the same key by
        # the same angle: relative style (all stages: position 0) and chunk-indexed style's
        # first stage (the chunk's ordinal over the live context; later stages' ordinals
        # follow the surviving list).
        ordinals = None
        if style == "chunk-indexed":
            ordinals = (params.sink_tokens, params.stages[0].chunk_size)
        if style == "relative" or start_stage == 0:
            rows_key = tuple(sorted({(p.row, p.seq_len) for p in blocks.parts}))
            # without the parts (host ints) the rows' lengths, and so the key, are unknown
            turned_keys = shared_once(
                shared if blocks.parts else None, ("unrotated_key_pages", ordinals, rows_key),
                lambda: unrotated_key_pages(kv_cache, block_table, blocks, table, k_scale,
                                            ordinals, precision),
            )  # fmt: skip
            # every block turns when each part's first (finest) block reaches the threshold;
            # without the parts (host ints) that is unknown, and both launches run
            finest = min(st.block_size_q for st in params.stages[start_stage:])
            all_turn = bool(blocks.parts) and all(
                p.first_pos + min(finest, p.q_hi - p.q_lo) - 1 >= rope.pruning_threshold
                for p in blocks.parts)  # fmt: skip
        # Score un-rotated queries, placed below where the style says (as the reference).
        rows = rotate(rows.view(-1, hq, d), -positions.view(-1), table)

    # Relative style (§2) scores each left probe from a query sw' + 1 after it and each right
    # probe from one sw' after it; over keys at 0 the right probes turn by the probes' gap
    # instead of taking queries of their own (select_rep_scores_paged's right_turn)
    right_turn, left_turn = None, 0
    if style == "relative":
        rel = relative_positions(sw)
        left_turn = int(rel.query_pos - rel.left_probe_pos)
        right_turn = (int(rel.right_probe_pos - rel.left_probe_pos), table)
    stage_inputs: list[ref.Candidates] = []
    # (block size, stride) -> pooled queries: stages often share them
    pooled: dict[tuple[int, int], torch.Tensor] = {}
    n_stages = len(params.stages)
    rep_tables: dict[int, torch.Tensor] = {}
    if landmarks is not None:
        # each request's length (without the parts every row up to the longest: chunks past a
        # row's own length are invalid candidates of its blocks)
        lengths = blocks.row_lengths(block_table.shape[0],
                                     block_table.shape[1] * kv_cache.shape[2])  # fmt: skip
        sizes = [st.chunk_size for j, st in enumerate(params.stages)
                 if j >= start_stage and not (params.exact_last_stage and j == n_stages - 1)]
        # the body and tail calls of one layer read the same requests: tables made once
        rep_tables = shared_once(
            shared, ("landmark_tables", tuple(sizes), tuple(sorted(lengths.items()))),
            lambda: landmark_tables(landmarks, block_table, lengths, params.sink_tokens, sizes,
                                    hq // (landmarks.shape[2] - 1)),
        )  # fmt: skip
    # The ranking and top-k in one launch per stage (:mod:`triton_topk`), where no collective
    # combines the ranking first and the ranking is one the kernel has
    fused_top = reduce_scores is None and params.head_reduction in ("max", "z-score")
    for i in range(start_stage, n_stages):
        st = params.stages[i]
        stage_inputs.append(cand)
        scored = ref.drop_window_candidates(params, cand, block_min_pos) if i > 0 else cand
        c = cand.starts.shape[1]
        keep = min(st.keep_tokens // st.chunk_size, c)
        pooling = (st.block_size_q, st.query_stride)
        # Blocks below the trained length score their true queries against the keys as cached,
        # as without the remapping (chosen on device: no sync).
        turn = None if style == "none" else rope.prunes_remapped(stage_blocks.first_pos
                                                                 + stage_blocks.count - 1)
        if pooling not in pooled:
            shape, groups = (-1, st.block_size_q, hq, d), present.view(-1, st.block_size_q)
            qp = pool_block_queries(rows.view(shape), groups, st.query_stride) * scale
            if style == "relative":
                # the left-branch queries alone: the right probes turn by right_turn instead
                qp = rotate(qp, left_turn, table)
            if turn is not None:
                true_qp = pool_block_queries(true_rows.view(shape), groups,
                                             st.query_stride) * scale  # fmt: skip
                qp = torch.where(turn.view(-1, 1, 1, 1), qp, true_qp)
            pooled[pooling] = qp
        q_left = pooled[pooling]
        rotation = None
        if style == "chunk-indexed":  # from their true t, to the gap the style gives
            rotation = (ref.chunk_indexed_key_turn(c, block_min_pos, sw, widths), table)
        common = dict(chunk_size=st.chunk_size, probe=params.probe, precision=precision,
                      block_rows=stage_blocks.row,
                      head_reduction=None if fused_top else params.head_reduction,
                      exact=params.exact_last_stage and i == n_stages - 1,
                      group_probes=params.group_probes,
                      reps=(rep_tables[st.chunk_size], params.sink_tokens)
                      if st.chunk_size in rep_tables else None)  # fmt: skip
        if turned_keys is None or (style == "chunk-indexed" and i > 0):
            scores = select_rep_scores_paged(
                q_left, kv_cache, block_table, scored.starts, scored.valid, key_limit,
                key_rotation=rotation, k_scale=k_scale, v_scale=v_scale, turn_blocks=turn,
                **common,
            )  # fmt: skip
        else:
            # turned blocks read the turned keys; the others (below the threshold) the cache at
            # true positions, in a second launch whose other blocks exit at once
            at = turn.view(-1, 1)
            q_turned = q_left
            if style == "chunk-indexed" and c:
                # R(j - q_pos - t) k = R(-q_pos) R(j - t) k: the keys hold R(j - t) k, so each
                # block's queries move to its q_pos instead (base[:, 0] = 0 - q_pos)
                q_pos = -rotation[0][:, :1]
                q_turned = rotate(q_left.transpose(1, 2), q_pos, table).transpose(1, 2)
            scores = select_rep_scores_paged(
                q_turned, turned_keys[0], turned_keys[1], scored.starts, scored.valid & at,
                key_limit, right_turn=right_turn, **common,
            )  # fmt: skip
            if not all_turn:
                as_cached = select_rep_scores_paged(
                    q_left, kv_cache, block_table, scored.starts, scored.valid & ~at,
                    key_limit, k_scale=k_scale, v_scale=v_scale, **common,
                )  # fmt: skip
                scores = torch.where(at.view(-1, *[1] * (scores.dim() - 1)), scores, as_cached)
        if fused_top:
            kept_starts, kept_valid = keep_top_blocks(scores, scored.starts, keep,
                                                      params.head_reduction)  # fmt: skip
        else:
            if reduce_scores is not None:
                scores = reduce_scores(scores)
            kept_starts, kept_valid = ref.keep_top_chunks(scores, scored, keep)
        if i == n_stages - 1:
            return ref.PruneResult(kept_starts, kept_valid, stage_inputs)
        nxt = params.stages[i + 1]
        cand = ref.split_chunks(kept_starts, kept_valid, st.chunk_size, nxt.chunk_size, key_limit)
        if widths is not None:
            widths = widths.clamp(max=st.keep_tokens // st.chunk_size)
            widths = widths * (st.chunk_size // nxt.chunk_size)
        if nxt.block_size_q != st.block_size_q:
            factor = st.block_size_q // nxt.block_size_q
            stage_blocks = blocks.refine(nxt.block_size_q)
            key_limit = stage_blocks.key_limit()
            block_min_pos = stage_blocks.first_pos
            cand = ref.refine_blocks(cand, factor, key_limit)
            if widths is not None:
                widths = widths.repeat_interleave(factor)
    raise ValueError(f"start_stage={start_stage} leaves no stage to run (have {n_stages})")
