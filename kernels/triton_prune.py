"""Triton SelectRep (one pruning stage's scoring) reading keys straight from vLLM's paged cache.

:func:`select_rep_scores_paged` computes exactly what :func:`reference.select_rep_scores` does
(shared/docs/INFINITEHIP.md §1.4) without gathering the request's keys first: each probe key is
read through the block table where it lies. :func:`run_stages_paged` is the N-stage cascade of
:func:`reference.run_stages` on top of it; the between-stage top-k / sort / split stay torch ops
with static shapes (§1.5), so the whole cascade runs without a host sync once ``seq_len`` is
given.

Kernel layout (§4): one program per (query block, tile of ``BLOCK_CHUNK`` chunks, query head).
Every bisection step loads a ``[BLOCK_CHUNK, D]`` tile of probe keys per half and multiplies it
with the block's ``[n_q, D]`` pooled queries; the per-head scores go to a ``[n_blocks, H_q, C]``
buffer that torch max-reduces over heads, so programs never race and need no atomics.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import reference as ref

PROBES = ("midpoint", "first")
PRECISIONS = ("fp32", "ieee", "fast")


@triton.jit
def _probe_scores(
    k_head_ptr,
    block_table_ptr,
    pos,
    mask,
    q_t,
    q_absent,
    offs_d,
    d_in,
    stride_kpage,
    stride_ktok,
    stride_kd,
    PAGE_SIZE: tl.constexpr,
    FAST_DOT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Per position in ``pos``: max over the block's present queries of q·k at that key."""
    page = tl.load(block_table_ptr + pos // PAGE_SIZE, mask=mask, other=0).to(tl.int64)
    # int64: a large cache spans more than 2**31 elements.
    row = page * stride_kpage + (pos % PAGE_SIZE).to(tl.int64) * stride_ktok
    k = tl.load(
        k_head_ptr + row[:, None] + offs_d[None, :] * stride_kd,
        mask=mask[:, None] & d_in[None, :],
        other=0.0,
    )
    if FAST_DOT:
        # Tensor-core precision: 16-bit keys as stored (q_t was cast to match), or tf32.
        s = tl.dot(k, q_t)
    else:
        # fp32 like the reference: exact upcast of the keys, then IEEE products (FMA) or
        # tf32x3, whose split operands reach fp32 accuracy on tensor cores.
        s = tl.dot(k.to(tl.float32), q_t, input_precision=PRECISION)
    s = tl.where(q_absent[None, :], float("-inf"), s)
    return tl.max(s, axis=1)


@triton.jit
def _select_rep_kernel(
    q_ptr,
    k_ptr,
    block_table_ptr,
    starts_ptr,
    valid_ptr,
    key_limit_ptr,
    out_ptr,
    n_q,
    n_chunks,
    head_dim,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_qd,
    stride_kpage,
    stride_ktok,
    stride_khead,
    stride_kd,
    stride_sb,
    stride_sc,
    stride_vb,
    stride_vc,
    stride_ob,
    stride_oh,
    stride_oc,
    GROUP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    CHUNK_SIZE: tl.constexpr,
    N_ITERS: tl.constexpr,
    MIDPOINT: tl.constexpr,
    FAST_DOT: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_CHUNK: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    blk = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    head = tl.program_id(2)

    offs_c = tile * BLOCK_CHUNK + tl.arange(0, BLOCK_CHUNK)
    c_in = offs_c < n_chunks
    offs_q = tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, BLOCK_D)
    d_in = offs_d < head_dim

    # Queries transposed to [D, n_q] so each probe is one [BLOCK_CHUNK, D] x [D, n_q] product.
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
    # its scores instead (padding rows past n_q are absent too).
    q_nan = q_t != q_t  # noqa: PLR0124 (the NaN test)
    q_absent = (tl.max(q_nan.to(tl.int32), axis=0) > 0) | (offs_q >= n_q)
    q_t = tl.where(q_nan, 0.0, q_t)
    if FAST_DOT:
        q_t = q_t.to(k_ptr.dtype.element_ty)

    limit = tl.load(key_limit_ptr + blk).to(tl.int32)
    start = tl.load(starts_ptr + blk * stride_sb + offs_c * stride_sc, mask=c_in, other=0)
    start = start.to(tl.int32)
    flag = tl.load(valid_ptr + blk * stride_vb + offs_c * stride_vc, mask=c_in, other=0)
    valid = (flag != 0) & c_in & (start < limit)

    left = start
    right = tl.minimum(start + CHUNK_SIZE, limit)
    best = tl.full([BLOCK_CHUNK], float("-inf"), tl.float32)
    k_head_ptr = k_ptr + (head // GROUP).to(tl.int64) * stride_khead  # K plane: index 0

    # Tiles past the live context (static shapes: the allocated maximum) skip the bisection.
    n_iters = tl.where(tl.max(valid.to(tl.int32), axis=0) > 0, N_ITERS, 0)
    for _ in range(n_iters):
        live = valid & (right - left > 1)
        mid = (left + right) // 2
        if MIDPOINT:
            p_left = (left + mid) // 2
            p_right = (mid + right) // 2
        else:  # the paper's Algorithm 3: the first key of each half
            p_left = left
            p_right = mid
        # Both halves' probes in one [2 * BLOCK_CHUNK, D] tile: one product per step.
        pos = tl.reshape(tl.join(p_left, p_right), [2 * BLOCK_CHUNK])
        need = tl.reshape(tl.join(live, live), [2 * BLOCK_CHUNK])
        s = _probe_scores(
            k_head_ptr, block_table_ptr, pos, need, q_t, q_absent, offs_d, d_in,
            stride_kpage, stride_ktok, stride_kd, PAGE_SIZE, FAST_DOT, PRECISION,
        )  # fmt: skip
        s_left, s_right = tl.split(tl.reshape(s, [BLOCK_CHUNK, 2]))
        # Strictly greater goes left, so a tie descends right, as in the reference.
        go_left = s_left > s_right
        best = tl.where(live, tl.maximum(best, tl.where(go_left, s_left, s_right)), best)
        right = tl.where(live & go_left, mid, right)
        left = tl.where(live & ~go_left, mid, left)

    # A chunk that was one key wide from the start never probed: that key is its score.
    single = valid & (best == float("-inf"))
    if tl.max(single.to(tl.int32), axis=0) > 0:
        s_single = _probe_scores(
            k_head_ptr, block_table_ptr, left, single, q_t, q_absent, offs_d, d_in,
            stride_kpage, stride_ktok, stride_kd, PAGE_SIZE, FAST_DOT, PRECISION,
        )  # fmt: skip
        best = tl.where(single, s_single, best)
    # Invalid chunks were never live nor single, so they still hold -inf.
    tl.store(out_ptr + blk * stride_ob + head * stride_oh + offs_c * stride_oc, best, mask=c_in)


def _launch_config(head_dim: int) -> tuple[int, int]:
    """(BLOCK_CHUNK, num_warps): two [BLOCK_CHUNK, D] key tiles per step must fit in registers.

    On an H200 (D=128, 64K-1M keys, decode and 16-block prefill) 64 chunks with 8 warps was
    within noise of the best of {16, 32, 64} x {2, 4, 8}; fewer warps spill in the fp32 modes
    (``"ieee"`` ran 6-8x slower with 4 warps than with 8).
    """
    return (32 if head_dim > 128 else 64), 8


def _bisect_steps(chunk_size: int) -> int:
    return max(1, math.ceil(math.log2(max(chunk_size, 2))))


def select_rep_scores_paged(
    q_pooled: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table_row: torch.Tensor,
    starts: torch.Tensor,
    valid: torch.Tensor,
    key_limit: torch.Tensor,
    *,
    chunk_size: int,
    probe: str = "midpoint",
    per_head_out: torch.Tensor | None = None,
    precision: str = "fp32",
) -> torch.Tensor:
    """SelectRep chunk scores ``[n_blocks, C]`` float32, equal to ``reference.select_rep_scores``.

    ``q_pooled`` is ``[n_blocks, H_q, n_q, D]``, already multiplied by the softmax scale; a row
    containing NaN is an absent query (as :func:`reference.pool_queries` produces) and takes no
    part in the max over queries. ``kv_cache`` is ``[num_pages, 2, page_size, H_kv, D]`` and
    token ``t`` of one request lives at page ``block_table_row[t // page_size]``. Chunk ``j`` of
    block ``b`` covers ``[starts[b, j], min(starts[b, j] + chunk_size, key_limit[b]))``; invalid
    or empty chunks score ``-inf``; the result is the max over query heads.

    ``precision`` picks how q·k is computed; keys are always upcast exactly first:

    - ``"fp32"`` (default): tf32x3 on tensor cores, fp32-accurate (H200, bf16 keys: every score
      within 1e-4 of the reference and identical top-k at 64K-1M keys);
    - ``"ieee"``: plain fp32 products, 2.5-4x slower than ``"fp32"``;
    - ``"fast"``: one tensor-core pass in the keys' dtype (bf16/fp16: queries rounded to it;
      fp32 keys: tf32). 1.5-4x faster than ``"fp32"``, but most scores move by more than
      1e-4 relative and a bisection may descend differently (H200: ~99% of the reference's
      top-k kept).

    Guarantees: the bisection path and the probed keys are the reference's (up to near-ties
    within rounding, see ``precision``). Only keys inside live chunks are read, so pages past
    ``key_limit`` need not exist in ``block_table_row``. Positions must fit in int32. No host
    sync; ``per_head_out`` (``[n_blocks, H_q, C]`` float32, overwritten) lets a caller keep the
    scratch preallocated.
    """
    if probe not in PROBES:
        raise ValueError(f"probe={probe!r} must be one of {PROBES}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} must be one of {PRECISIONS}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    nb, hq, nq, d = q_pooled.shape
    _, two, page_size, hkv, dk = kv_cache.shape
    if two != 2 or dk != d:
        raise ValueError(
            f"kv_cache shape {tuple(kv_cache.shape)} must be [num_pages, 2, page_size, H_kv, {d}]"
        )
    if hq % hkv:
        raise ValueError(f"H_q={hq} must be a multiple of H_kv={hkv}")
    if precision == "fast" and kv_cache.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"precision='fast' needs fp16, bf16 or fp32 keys, not {kv_cache.dtype}")
    c = starts.shape[1]
    if starts.shape != (nb, c) or valid.shape != (nb, c) or key_limit.shape != (nb,):
        raise ValueError(
            f"starts {tuple(starts.shape)}, valid {tuple(valid.shape)} and key_limit "
            f"{tuple(key_limit.shape)} must be [{nb}, C], [{nb}, C] and [{nb}]"
        )
    if per_head_out is None:
        per_head_out = torch.empty(nb, hq, c, dtype=torch.float32, device=q_pooled.device)
    elif per_head_out.shape != (nb, hq, c) or per_head_out.dtype != torch.float32:
        raise ValueError(
            f"per_head_out is {tuple(per_head_out.shape)} {per_head_out.dtype}; "
            f"needs [{nb}, {hq}, {c}] float32"
        )
    if nb == 0 or c == 0:
        return per_head_out.new_empty(nb, c)

    block_chunk, num_warps = _launch_config(d)
    # tl.dot needs every dimension >= 16; padding rows are masked as absent queries.
    block_q = max(16, triton.next_power_of_2(nq))
    block_d = max(16, triton.next_power_of_2(d))
    if valid.dtype == torch.bool:
        valid = valid.view(torch.uint8)  # same bytes; avoids i1 pointers
    grid = (nb, triton.cdiv(c, block_chunk), hq)
    _select_rep_kernel[grid](
        q_pooled,
        kv_cache,  # the kernel reads plane 0 (K) only
        block_table_row,
        starts,
        valid,
        key_limit,
        per_head_out,
        nq,
        c,
        d,
        *q_pooled.stride(),
        kv_cache.stride(0),
        kv_cache.stride(2),
        kv_cache.stride(3),
        kv_cache.stride(4),
        *starts.stride(),
        *valid.stride(),
        *per_head_out.stride(),
        GROUP=hq // hkv,
        PAGE_SIZE=page_size,
        CHUNK_SIZE=chunk_size,
        N_ITERS=_bisect_steps(chunk_size),
        MIDPOINT=probe == "midpoint",
        FAST_DOT=precision == "fast",
        PRECISION="ieee" if precision == "ieee" else "tf32x3",
        BLOCK_CHUNK=block_chunk,
        BLOCK_Q=block_q,
        BLOCK_D=block_d,
        num_warps=num_warps,
    )
    return per_head_out.amax(dim=1)


# --------------------------------------------------------------------------- the cascade
def _keep_top(
    scores: torch.Tensor, cand: ref.Candidates, keep: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``keep`` chunks per block, sorted by start with the invalid ones last (§1.5)."""
    top_scores, top_idx = torch.topk(scores, keep, dim=1)
    kept_valid = ~torch.isneginf(top_scores)
    kept_starts = torch.gather(cand.starts, 1, top_idx)
    # Ordinals feed chunk-indexed RoPE, so the order must be by position, and stable.
    order_key = torch.where(kept_valid, kept_starts, torch.full_like(kept_starts, 1 << 62))
    order = torch.argsort(order_key, dim=1, stable=True)
    return torch.gather(kept_starts, 1, order), torch.gather(kept_valid, 1, order)


def _split(
    starts: torch.Tensor, valid: torch.Tensor, chunk: int, sub: int, key_limit: torch.Tensor
) -> ref.Candidates:
    """Each surviving ``chunk``-wide chunk becomes ``chunk // sub`` sub-chunks (§1.5)."""
    n_blocks, kept = starts.shape
    split = chunk // sub
    offs = torch.arange(split, device=starts.device) * sub
    # Explicit widths (not -1): a request with no query block still has a well-defined shape.
    sub_starts = (starts.unsqueeze(-1) + offs).reshape(n_blocks, kept * split)
    sub_valid = valid.unsqueeze(-1).expand(-1, -1, split).reshape(n_blocks, kept * split)
    sub_valid = sub_valid & (sub_starts < key_limit.view(-1, 1))
    return ref.Candidates(sub_starts, sub_valid)


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
) -> ref.PruneResult:
    """The pruning cascade of :func:`reference.run_stages`, scored by the Triton kernel.

    ``q`` is ``[Nq, H_q, D]`` (unscaled), positions ascending and the request's last ones; keys
    are read from the paged cache through ``block_table_row``. ``seq_len`` (a host int) sizes
    the stage-1 candidates: the request's context length, or any bound of it such as the
    allocated maximum, which keeps shapes static for CUDA graphs (chunks past the live context
    are masked invalid). With ``seq_len`` given, or when resuming (``start_stage > 0``), nothing
    syncs with the host; otherwise it is read from ``q_positions`` (one sync).

    ``precision`` is :func:`select_rep_scores_paged`'s. Guarantees: with the same ``seq_len``
    and ``"fp32"`` or ``"ieee"`` precision, the valid selections and each stage's valid
    candidates equal the reference's (up to score near-ties within fp32 rounding); with
    ``seq_len`` given, the call is CUDA-graph capturable. Every stage is scored, even one where all live chunks survive: the survivors
    are then the same set, and they are re-sorted by position, so score ties do not matter.
    Starts stored under ``valid == False`` are unspecified.
    """
    nq = q.shape[0]
    bq = params.block_size_q
    n_blocks = -(-nq // bq)
    device = q.device
    if seq_len is None and start_stage == 0:
        seq_len = int(q_positions[-1]) + 1 if nq else 0
    blk = torch.arange(nq, device=device) // bq
    # Every block holds a query, so the fill never survives the min.
    fill = torch.iinfo(torch.long).max
    block_min_pos = torch.full((n_blocks,), fill, dtype=torch.long, device=device)
    block_min_pos = block_min_pos.scatter_reduce(0, blk, q_positions.long(), reduce="amin")
    key_limit = block_min_pos + 1  # positions < seq_len, so the reference's clamp is a no-op

    if start_stage == 0:
        cand = ref.first_stage_candidates(params, seq_len, block_min_pos)
    else:
        if start_input is None:
            raise ValueError(f"start_stage={start_stage} needs start_input, that stage's input")
        cand = start_input

    stage_inputs: list[ref.Candidates] = []
    pooled: dict[int, torch.Tensor] = {}  # stages often share a stride
    n_stages = len(params.stages)
    for i in range(start_stage, n_stages):
        st = params.stages[i]
        stage_inputs.append(cand)
        keep = min(st.keep_tokens // st.chunk_size, cand.starts.shape[1])
        if st.query_stride not in pooled:
            pooled[st.query_stride] = ref.pool_queries(q, bq, st.query_stride) * scale
        scores = select_rep_scores_paged(
            pooled[st.query_stride],
            kv_cache,
            block_table_row,
            cand.starts,
            cand.valid,
            key_limit,
            chunk_size=st.chunk_size,
            probe=params.probe,
            precision=precision,
        )
        kept_starts, kept_valid = _keep_top(scores, cand, keep)
        if i == n_stages - 1:
            return ref.PruneResult(kept_starts, kept_valid, stage_inputs)
        cand = _split(kept_starts, kept_valid, st.chunk_size, params.stages[i + 1].chunk_size,
                      key_limit)  # fmt: skip
    raise ValueError(f"start_stage={start_stage} leaves no stage to run (have {n_stages})")
