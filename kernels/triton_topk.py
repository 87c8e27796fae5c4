"""A stage's ranking and top-k inside Triton programs: the z-score (or max) over heads and the
bisection top-k that decode's masks (:mod:`triton_decode`) and prefill's cascade
(:func:`keep_top_blocks`) share.

:func:`keep_top_blocks` is :func:`reference.reduce_heads` followed by
:func:`reference.keep_top_chunks` in one launch, one program per query block: the block's
per-head scores are standardised a tile of heads at a time in registers, max-reduced, and its top
``keep`` chunks are written in position order. In torch the same takes about twenty launches and
several passes over the per-head buffer (``[blocks, H, C]`` float32: 134 MB for a 32K-query
chunk at 512K on Llama-3-8B's 32 query heads).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def head_ranking(
    score_row,
    stride_sh,
    n_heads,
    offs,
    listed,
    HEAD_SCORES: tl.constexpr,
    STANDARDIZE: tl.constexpr,
    HEAD_BLOCK: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """One row's ranking ``[BLOCK_C]`` of the chunks ``offs`` (``-inf`` where not ``listed`` or
    invalid). With ``HEAD_SCORES`` the row holds per-head scores ``[H, C]`` (``stride_sh``
    apart): the max over heads of each head's z-score with ``STANDARDIZE``, else of the raw
    scores (:func:`reference.reduce_heads`' ``"z-score"`` and ``"max"``). Without, the row is
    one max-reduced score per chunk."""
    if HEAD_SCORES:
        s = tl.full([BLOCK_C], float("-inf"), tl.float32)
        offs_h = tl.arange(0, HEAD_BLOCK)
        for h0 in range(0, n_heads, HEAD_BLOCK):
            # One program ranks the row, so its time is its reductions' latency: a tile of
            # heads standardises them all with the reductions one head took.
            heads = h0 + offs_h
            m = (heads < n_heads)[:, None] & listed[None, :]
            # .cg: other programs' stores, in L2; an L1 line of them could be stale
            x = tl.load(score_row + heads[:, None] * stride_sh + offs[None, :], mask=m,
                        other=float("-inf"), cache_modifier=".cg")  # fmt: skip
            if STANDARDIZE:
                ok = x > float("-inf")
                n = tl.maximum(tl.sum(ok.to(tl.float32), axis=1), 1.0)
                x0 = tl.where(ok, x, 0.0)
                dev = x0 - (tl.sum(x0, axis=1) / n)[:, None]
                var = tl.sum(tl.where(ok, dev * dev, 0.0), axis=1) / n
                z = dev / tl.maximum(tl.sqrt(var), 1e-6)[:, None]
                x = tl.where(ok, z, float("-inf"))
            s = tl.maximum(s, tl.max(x, axis=0))
    else:
        # .cg: the scores may be other programs' atomics, in L2; an L1 line could be stale
        s = tl.load(score_row + offs, mask=listed, other=float("-inf"), cache_modifier=".cg")
    return s


@triton.jit
def top_by_bisection(s, valid, keep):
    """The top ``keep`` of the ``valid`` entries of ``s`` (ties to the earlier entry), as a mask
    and each selected entry's rank among the selected in index order. The ``n_sel``-th largest
    score is found by bisection over order-preserving integer keys; everything above it and the
    first ties are taken."""
    n_sel = tl.minimum(keep, tl.sum(valid.to(tl.int32), axis=0))
    bits = s.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
    lo = tl.min(key, axis=0)
    hi = tl.max(key, axis=0)
    for _ in range(33):
        mid = (lo + hi + 1) >> 1
        enough = tl.sum((key >= mid).to(tl.int32), axis=0) >= n_sel
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid - 1)
    above = valid & (key > lo)
    tie = valid & (key == lo)
    tie_rank = tl.cumsum(tie.to(tl.int32), axis=0)
    sel = above | (tie & (tie_rank <= n_sel - tl.sum(above.to(tl.int32), axis=0)))
    rank = tl.cumsum(sel.to(tl.int32), axis=0) - 1
    return sel, rank


def head_block(scores: torch.Tensor, block_c: int) -> int:
    """Heads :func:`head_ranking` takes at once over ``block_c`` chunks: a tile of about 2048
    scores, which the warps hold in registers beside the ranking's own."""
    if scores.dim() != 3:
        return 1
    return max(1, min(triton.next_power_of_2(scores.shape[1]), 2048 // block_c))


def top_num_warps(block_c: int) -> int:
    """Warps of a program that ranks ``block_c`` chunks (the bisection's sums over the row)."""
    return 4 if block_c <= 1024 else 8 if block_c <= 4096 else 16


@triton.jit
def _keep_top_blocks_kernel(
    scores_ptr,
    starts_ptr,
    out_starts_ptr,
    out_valid_ptr,
    n_chunks,
    n_heads,
    keep,
    stride_sb,
    stride_sh,
    stride_cb,
    stride_cc,
    stride_ob,
    stride_vb,
    STANDARDIZE: tl.constexpr,
    HEAD_SCORES: tl.constexpr,
    HEAD_BLOCK: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    in_c = offs < n_chunks
    s = head_ranking(scores_ptr + b * stride_sb, stride_sh, n_heads, offs, in_c, HEAD_SCORES,
                     STANDARDIZE, HEAD_BLOCK, BLOCK_C)  # fmt: skip
    sel, rank = top_by_bisection(s, s > float("-inf"), keep)
    start = tl.load(starts_ptr + b * stride_cb + offs * stride_cc, mask=sel, other=0)
    tl.store(out_starts_ptr + b * stride_ob + rank, start, mask=sel)
    n_sel = tl.sum(sel.to(tl.int32), axis=0)
    offs_k = tl.arange(0, BLOCK_K)
    tail = (offs_k >= n_sel) & (offs_k < keep)
    tl.store(out_starts_ptr + b * stride_ob + offs_k, tl.zeros([BLOCK_K], tl.int32), mask=tail)
    tl.store(out_valid_ptr + b * stride_vb + offs_k, (offs_k < n_sel).to(tl.int8),
             mask=offs_k < keep)  # fmt: skip


def keep_top_blocks(
    scores: torch.Tensor, starts: torch.Tensor, keep: int, head_reduction: str = "max"
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`reference.keep_top_chunks` of :func:`reference.reduce_heads` in one launch.

    ``scores``: per-head chunk scores ``[n_blocks, H, C]`` float32 (``-inf`` where invalid),
    ranked by ``head_reduction`` (``"max"`` or ``"z-score"``), or one ranking ``[n_blocks, C]``
    already reduced. ``starts`` ``[n_blocks, C]`` integer: the candidates' starts, whose valid
    entries (finite scores) must ascend with their index, as every stage's candidates do (a
    stage splits its survivors in position order). Returns ``(kept_starts [n_blocks, keep]
    in the starts' dtype, kept_valid bool)``: each block's top ``keep`` valid chunks by score in position
    order, the invalid entries last (their starts 0). The kept set equals the reference's up
    to score ties (here ties go to the earlier chunk) and, with z-scores, to near-ties within
    fp32 rounding (the sums run in another order). No host sync."""
    if head_reduction not in ("max", "z-score"):
        raise ValueError(f"head_reduction {head_reduction!r}: the fused top-k ranks by 'max' or "
                         "'z-score'")  # fmt: skip
    if scores.dim() not in (2, 3) or scores.dtype != torch.float32:
        raise ValueError(f"scores {tuple(scores.shape)} {scores.dtype}: need [n_blocks, (H,) C] "
                         "float32")  # fmt: skip
    nb, c = scores.shape[0], scores.shape[-1]
    if starts.shape != (nb, c):
        raise ValueError(f"starts {tuple(starts.shape)} must be [{nb}, {c}] like the scores")
    if not 0 <= keep <= c:
        raise ValueError(f"keep={keep} must be in [0, C={c}]")
    kept_starts = torch.empty(nb, keep, dtype=starts.dtype, device=scores.device)
    kept_valid = torch.empty(nb, keep, dtype=torch.bool, device=scores.device)
    if nb == 0 or keep == 0:
        return kept_starts, kept_valid
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    per_head = scores.dim() == 3
    block_c = triton.next_power_of_2(c)
    _keep_top_blocks_kernel[(nb,)](
        scores, starts, kept_starts, kept_valid.view(torch.int8), c,
        scores.shape[1] if per_head else 1, keep, scores.stride(0),
        scores.stride(1) if per_head else 0, starts.stride(0), starts.stride(1),
        kept_starts.stride(0), kept_valid.stride(0),
        STANDARDIZE=head_reduction == "z-score", HEAD_SCORES=per_head,
        HEAD_BLOCK=head_block(scores, block_c), BLOCK_C=block_c,
        BLOCK_K=triton.next_power_of_2(keep), num_warps=top_num_warps(block_c),
    )  # fmt: skip
    return kept_starts, kept_valid
