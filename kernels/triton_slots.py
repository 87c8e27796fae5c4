"""The step's slot matching (:meth:`state.DecodeSlots.assign`) as one Triton program.

The PyTorch version in :mod:`vllm_infinitehip.state` is the spec and the CPU path: about sixty
small ops, each costing host time in the builder, which runs once per step on the critical path
of a batch-1 decode (vLLM's host work and ours then set the step time, not the GPU). This kernel
is one launch: a single program walks the rows twice, keeping the slot arrays in registers.

- pass 1, row by row: the first slot whose key is the row's previous-token block and whose length
  is ``seq_len - 1``; the row keeps it unless an earlier row did;
- pass 2, row by row: a sparse row that kept nothing takes the lowest slot no row kept or took;
- then the slot arrays are rewritten (unkept slots freed) and the per-row slots, levels and
  lengths are stored in the builder's persistent buffers, with one byte saying whether any row
  reruns a pruning stage (the flag that lets a decode graph skip the cascade,
  :mod:`kernels.graph_if`).

Rows are few (at most ``max_num_seqs``), so the sequential walk is cheap next to the launches
it replaces.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _assign_slots_kernel(
    bt_ptr,
    seq_lens_ptr,
    key_ptr,
    len_ptr,
    step_ptr,
    intervals_ptr,
    level_counts_ptr,
    refreshing_ptr,
    out_slot_ptr,
    out_level_ptr,
    out_seq_len_ptr,
    out_stale_ptr,
    rows,
    num_slots,
    threshold,
    block_size,
    stride_btb,
    stride_btp,
    N_STAGES: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    offs = tl.arange(0, BLOCK_S)
    valid = offs < num_slots
    keys = tl.load(key_ptr + offs, mask=valid, other=-1)
    lens = tl.load(len_ptr + offs, mask=valid, other=-1)
    steps = tl.load(step_ptr + offs, mask=valid, other=0)
    used = offs < 0  # slots kept or taken this step

    # pass 1: matched rows keep their slot; the kept slot (or -1) parks in out_slot
    for r in range(0, rows):
        sl = tl.load(seq_lens_ptr + r)
        row = bt_ptr + r * stride_btb
        prev_blk = tl.load(row + (tl.maximum(sl - 2, 0) // block_size) * stride_btp)
        match = valid & (keys >= 0) & (keys == prev_blk) & (lens == sl - 1) & (sl > threshold)
        first = tl.min(tl.where(match, offs, BLOCK_S), axis=0)
        taken = tl.sum((used & (offs == first)).to(tl.int32), axis=0) > 0
        kept = (first < BLOCK_S) & ~taken
        used = used | (kept & (offs == first))
        tl.store(out_slot_ptr + r, tl.where(kept, first, -1))
    tl.debug_barrier()  # pass 2 reads what pass 1 stored

    # pass 2: new rows take the lowest free slot; per-slot results collect in registers
    new_keys = tl.full([BLOCK_S], -1, tl.int32)
    new_lens = tl.zeros([BLOCK_S], tl.int32)
    new_steps = tl.zeros([BLOCK_S], tl.int32)
    offs_l = tl.arange(0, BLOCK_L)
    counts = tl.zeros([BLOCK_L], tl.int64)
    refreshing = 0
    for r in range(0, rows):
        sl = tl.load(seq_lens_ptr + r)
        row = bt_ptr + r * stride_btb
        cur_blk = tl.load(row + (tl.maximum(sl - 1, 0) // block_size) * stride_btp)
        kept_slot = tl.load(out_slot_ptr + r)
        kept = kept_slot >= 0
        free = tl.min(tl.where(valid & ~used, offs, BLOCK_S), axis=0)
        new = (sl > threshold) & ~kept & (free < BLOCK_S)
        used = used | (new & (offs == free))
        slot = tl.where(kept, kept_slot, tl.where(new, free, -1))
        old_step = tl.sum(tl.where(offs == kept_slot, steps, 0), axis=0)
        step = tl.where(kept, old_step + 1, 0)
        here = (offs == slot) & (slot >= 0)
        new_keys = tl.where(here, cur_blk, new_keys)
        new_lens = tl.where(here, sl, new_lens)
        new_steps = tl.where(here, step, new_steps)
        # refresh level (state.refresh_level): the first stage whose interval divides the step
        # and the steps since the final blocks were chosen (state.stale_steps)
        level = N_STAGES
        stale = step
        for j in tl.static_range(N_STAGES):
            i = N_STAGES - 1 - j
            interval = tl.load(intervals_ptr + i)
            level = tl.where(step % interval == 0, i, level)
            stale = tl.minimum(stale, step % interval)
        level = tl.where(step == 0, 0, level)
        level = tl.where(slot >= 0, level, -1)
        stale = tl.where(slot >= 0, stale, 0)
        counts += (offs_l == tl.where(level >= 0, level, N_STAGES + 1)).to(tl.int64)
        refreshing = refreshing | ((level >= 0) & (level < N_STAGES)).to(tl.int32)
        tl.store(out_slot_ptr + r, slot)
        tl.store(out_level_ptr + r, level)
        tl.store(out_seq_len_ptr + r, sl)
        tl.store(out_stale_ptr + r, stale)

    tl.store(key_ptr + offs, new_keys, mask=valid)
    tl.store(len_ptr + offs, new_lens, mask=valid)
    tl.store(step_ptr + offs, new_steps, mask=valid)
    tl.store(refreshing_ptr, refreshing.to(tl.uint8))
    l_ok = offs_l < N_STAGES + 2
    tl.store(level_counts_ptr + offs_l, tl.load(level_counts_ptr + offs_l, mask=l_ok) + counts,
             mask=l_ok)  # fmt: skip


def assign_slots(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    threshold: int,
    block_size: int,
    key_block: torch.Tensor,
    slot_seq_len: torch.Tensor,
    slot_step: torch.Tensor,
    intervals: torch.Tensor,
    level_counts: torch.Tensor,
    refreshing: torch.Tensor,
    out_slots: torch.Tensor,
    out_levels: torch.Tensor,
    out_seq_lens: torch.Tensor,
    out_stale_steps: torch.Tensor,
) -> None:
    """One launch of the matching; see :meth:`state.DecodeSlots.assign` for the contract.

    Slot arrays are int32 ``[num_slots (+ spare)]``; ``seq_lens`` int32 ``[B]``; the outputs
    int32 ``[>= B]``. ``intervals`` is int32 ``[n_stages]`` on the device. ``refreshing`` (one
    byte) is set to whether any row reruns a stage this step."""
    rows = seq_lens.shape[0]
    num_slots = key_block.shape[0] - 1
    n_stages = intervals.shape[0]
    _assign_slots_kernel[(1,)](
        block_table, seq_lens, key_block, slot_seq_len, slot_step, intervals, level_counts,
        refreshing.view(torch.uint8), out_slots, out_levels, out_seq_lens, out_stale_steps, rows,
        num_slots,
        threshold, block_size,
        *block_table.stride(), N_STAGES=n_stages, BLOCK_S=triton.next_power_of_2(num_slots),
        BLOCK_L=triton.next_power_of_2(n_stages + 2), num_warps=4,
    )  # fmt: skip
