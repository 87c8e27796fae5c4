"""Decode masks kept per request slot, and the PyTorch reference of the batched decode step.

A step's decode rows (one query each) are pruned and attended as one batch. Each running request
owns a *state slot*; a layer's :class:`DecodeMasks` holds, per slot, the input of every pruning
stage after the first and the final blocks (INFINITEHIP.md §1.6), so a refresh at level ``i``
reruns stages ``i..N-1`` from what is stored. :class:`DecodeRows` says, per row, which slot and
which level.

:func:`refresh_masks_reference` and :func:`attend_reference` are the CPU path and the oracle of
:mod:`kernels.triton_decode` and ``triton_bsa.sparse_decode_attention``: they run
:func:`reference.run_stages` and :func:`reference.sparse_attention` row by row on the same stored
inputs. Pure PyTorch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import reference as ref


@dataclass
class DecodeMasks:
    """One layer's decode masks for every state slot (int32 tensors on the cache's device).

    ``inputs[i]`` (``i >= 1``; ``inputs[0]`` is None: stage 0 always scans the live context) is
    ``[slots, W_i]``: stage ``i``'s candidate chunk starts, ascending, the first
    ``counts[slot, i]`` valid. ``final`` is ``[slots, W_f]``, the first ``counts[slot, N]``
    valid. ``widths[slot, i]`` is the width of stage ``i``'s candidate list as the reference
    builds it (``min(keep, C) * split`` of the stage before): chunk-indexed RoPE counts ordinals
    in it.
    """

    inputs: tuple[torch.Tensor | None, ...]
    final: torch.Tensor
    counts: torch.Tensor
    widths: torch.Tensor

    @classmethod
    def allocate(
        cls, params: ref.PruneParams, final_keep_max: int, num_slots: int, device: torch.device
    ) -> DecodeMasks:
        stages = params.stages
        n = len(stages)
        inputs: list[torch.Tensor | None] = [None]
        for i in range(1, n):
            width = stages[i - 1].keep_tokens // stages[i].chunk_size
            inputs.append(torch.zeros(num_slots, width, dtype=torch.int32, device=device))
        final = torch.zeros(
            num_slots, final_keep_max // params.block_size_k, dtype=torch.int32, device=device
        )
        counts = torch.zeros(num_slots, n + 1, dtype=torch.int32, device=device)
        return cls(tuple(inputs), final, counts, torch.zeros_like(counts))

    def final_counts(self) -> torch.Tensor:
        """``[slots]``: valid final blocks per slot (a strided view)."""
        return self.counts[:, -1]

    def prune_result(self, slot: int) -> ref.PruneResult:
        """A slot's final blocks as the reference's one-query-block result (host reads)."""
        n = int(self.counts[slot, -1])
        starts = self.final[slot, :n].long().view(1, n)
        return ref.PruneResult(starts, torch.ones_like(starts, dtype=torch.bool), [])


@dataclass(frozen=True)
class DecodeRows:
    """The decode rows of one step (device tensors, ``[B]`` each, ``block_table`` ``[B, P]``)."""

    block_table: torch.Tensor
    seq_lens: torch.Tensor  # int32; the row's query sits at seq_len - 1
    slots: torch.Tensor  # int32 state slot; -1: a dense row (short context, or padding)
    levels: torch.Tensor  # int32 first stage to rerun; N: reuse the mask; -1: no sparse work
    # int32 decode steps since the row's final blocks were chosen (0 on a refresh); None: 0
    stale_steps: torch.Tensor | None = None


def block_extension(
    params: ref.PruneParams, stale_steps: torch.Tensor | None
) -> torch.Tensor | None:
    """Per row, the tokens each selected block is read past its end
    (``PruneParams.extend_reused_blocks``): the rows' ``stale_steps`` (:class:`DecodeRows`),
    at most ``block_size_k``; None when blocks are read as chosen."""
    if not params.extend_reused_blocks or stale_steps is None:
        return None
    return stale_steps.clamp(max=params.block_size_k)


def stage_widths(params: ref.PruneParams, max_seq_len: int) -> list[int]:
    """The most candidate chunks each stage can score (the scratch width of its scores)."""
    l0 = params.stages[0].chunk_size
    widths = [max(1, math.ceil(max(max_seq_len - params.sink_tokens, 0) / l0))]
    for i in range(1, len(params.stages)):
        widths.append(params.stages[i - 1].keep_tokens // params.stages[i].chunk_size)
    return widths


def allocate_scores(
    widths: list[int], rows: int, device: torch.device, heads: int | None = None
) -> list[torch.Tensor]:
    """Per-stage score scratch ``[rows, W_i]`` float32 at -inf, the state the kernels leave;
    with ``heads`` (``head_reduction`` ``"z-score"``: each head's scores are kept until the
    row's ranking standardises them) ``[rows, heads, W_i]``."""
    shape = (rows,) if heads is None else (rows, heads)
    return [torch.full((*shape, w), float("-inf"), dtype=torch.float32, device=device)
            for w in widths]  # fmt: skip


def _compact(cand: ref.Candidates) -> torch.Tensor:
    """The valid starts of a one-block candidate list (valid entries come first)."""
    return cand.starts[0][cand.valid[0]]


def refresh_masks_reference(
    params: ref.PruneParams,
    masks: DecodeMasks,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    rows: DecodeRows,
    scale: float,
    bank: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    reduce_scores: ref.ScoreReduce | None = None,
    key_rows: ref.KeyRows | None = None,
    split: ref.SplitV | None = None,
) -> None:
    """What ``triton_decode.refresh_masks`` computes, with :func:`reference.run_stages` per row
    (keys read through ``bank``, or through ``key_rows`` which takes its place, and an fp8
    cache dequantized with ``k_scale``, as :func:`reference.gather_paged_kv` does; ``split``:
    ``kv_cache`` is the host tier's K plane). The reference reads every key, so it lists no
    misses for ``key_rows``."""
    n = len(params.stages)
    for b, (slot, level, seq_len) in enumerate(
        zip(rows.slots.tolist(), rows.levels.tolist(), rows.seq_lens.tolist())
    ):
        if slot < 0 or level < 0 or level >= n:
            continue
        k, _ = ref.gather_paged_kv(kv_cache, rows.block_table[b], seq_len,
                                   None if key_rows is not None else bank, k_scale=k_scale,
                                   v_scale=v_scale, key_rows=key_rows, split=split)  # fmt: skip
        pos = torch.tensor([seq_len - 1], device=q.device)
        start_input = None
        if level > 0:
            width, count = int(masks.widths[slot, level]), int(masks.counts[slot, level])
            starts = masks.inputs[level][slot, :width].long().view(1, width)
            valid = (torch.arange(width, device=q.device) < count).view(1, width)
            start_input = ref.Candidates(starts, valid)
        result = ref.run_stages(params, q[b : b + 1], k, pos, scale, level, start_input,
                                reduce_scores)  # fmt: skip
        for j in range(level + 1, n):
            cand = result.stage_inputs[j - level]
            starts = _compact(cand)
            masks.inputs[j][slot, : starts.numel()] = starts.to(torch.int32)
            masks.counts[slot, j] = starts.numel()
            masks.widths[slot, j] = cand.starts.shape[1]
        final = result.block_starts[0][result.block_valid[0]]
        masks.final[slot, : final.numel()] = final.to(torch.int32)
        masks.counts[slot, n] = final.numel()


def attend_reference(
    params: ref.PruneParams,
    masks: DecodeMasks,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    rows: DecodeRows,
    scale: float,
    bank: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    split: ref.SplitV | None = None,
) -> tuple[torch.Tensor, int]:
    """Decode attention of every row: dense for rows without a slot, block-sparse over the
    slot's final blocks otherwise (read past their ends by :func:`block_extension`). Returns
    ``[B, H_q, D]`` and the (query, key) pairs the sparse rows attended. ``bank``: read
    through the host tier's GPU cache, as the kernels do; ``k_scale`` / ``v_scale`` dequantize
    an fp8 cache; ``split``: ``kv_cache`` is the tier's K plane (:func:`reference.gather_paged_kv`)."""
    out = torch.zeros_like(q)
    attended = 0
    extension = block_extension(params, rows.stale_steps)
    for b, (slot, seq_len) in enumerate(zip(rows.slots.tolist(), rows.seq_lens.tolist())):
        if seq_len <= 0:
            continue
        k, v = ref.gather_paged_kv(kv_cache, rows.block_table[b], seq_len, bank,
                                   k_scale=k_scale, v_scale=v_scale, split=split)  # fmt: skip
        pos = torch.tensor([seq_len - 1], device=q.device)
        if slot < 0:
            out[b : b + 1] = ref.dense_attention(q[b : b + 1], k, v, pos, scale)
            continue
        o, _, pairs = ref.sparse_attention(
            params, q[b : b + 1], k, v, pos, scale, prune=masks.prune_result(slot),
            extend_blocks=0 if extension is None else int(extension[b]),
        )
        out[b : b + 1] = o
        attended += pairs
    return out, attended
