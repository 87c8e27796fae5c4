"""Per-request decode state in persistent device buffers, matched to each step's rows on device.

The attention builder sees batches, not request ids, and must not read the block table back to
the host. A running request is recognised by the block that held its previous token: that block
was being written at the previous step, so that request owned it alone, and ``(block, length)``
identifies it from one step to the next. :meth:`DecodeSlots.assign` does the matching on the
device, no host sync (one Triton launch on CUDA):

- a decode row whose previous-token block and length ``seq_len - 1`` match a slot keeps it and
  advances its decode step;
- any other sparse decode row takes a free slot, at decode step 0 (a full refresh);
- every slot that no row kept is freed. A request that finished, was aborted or was preempted is
  in no later step's batch, so its slot is free after the next step; a preempted request that
  resumes gets a fresh slot and recomputes its mask.

Two rows may match one slot only when a newer request shares the block by prefix caching and has
the same length; the earlier row keeps the slot and the other starts afresh, so a mask is never
shared. Slots index the per-layer mask buffers (:class:`kernels.decode.DecodeMasks`).
"""

from __future__ import annotations

import torch

# refresh level of a row that does no sparse decode work this step
LEVEL_NONE = -1


def refresh_level(decode_step: int, intervals: tuple[int, ...]) -> int:
    """First stage to rerun at this decode step; ``len(intervals)`` means reuse the mask.

    Step 0 reruns everything; otherwise the first stage ``i`` with ``step % intervals[i] == 0``
    reruns from its cached input, and later stages follow. The spec of
    :func:`refresh_levels`, which computes the same on device.
    """
    if decode_step == 0:
        return 0
    for i, interval in enumerate(intervals):
        if decode_step % interval == 0:
            return i
    return len(intervals)


def refresh_levels(steps: torch.Tensor, intervals: tuple[int, ...]) -> torch.Tensor:
    """:func:`refresh_level` of every entry of ``steps`` (int32, on its device)."""
    level = torch.full_like(steps, len(intervals))
    for i in reversed(range(len(intervals))):
        level = torch.where(steps % intervals[i] == 0, i, level)
    return torch.where(steps == 0, 0, level)


def stale_steps(steps: torch.Tensor, intervals: tuple[int, ...]) -> torch.Tensor:
    """Decode steps since each entry's final blocks were last chosen: every refresh, whatever
    its level, reruns the last stage, and step 0 refreshes everything, so this is the smallest
    ``step % interval`` (no stage's interval need divide another's)."""
    stale = steps.clone()
    for interval in intervals:
        stale = torch.minimum(stale, steps % interval)
    return stale


class DecodeSlots:
    """Which running request owns which state slot, and its decode step; all on one device.

    Slot arrays have one spare entry at index ``num_slots``, where scatters of rows without a
    slot land, so no op needs a data-dependent shape.
    """

    def __init__(self, num_slots: int, intervals: tuple[int, ...], device: torch.device) -> None:
        self.num_slots = num_slots
        self.intervals = tuple(intervals)
        self.n_stages = n_stages = len(self.intervals)
        i32 = dict(dtype=torch.int32, device=device)
        self.key_block = torch.full((num_slots + 1,), -1, **i32)
        self.seq_len = torch.zeros(num_slots + 1, **i32)
        self.step = torch.zeros(num_slots + 1, **i32)
        # decode rows by refresh level, 0..N-1 and N = reuse (entry N + 1: rows with no slot)
        self.level_counts = torch.zeros(n_stages + 2, dtype=torch.int64, device=device)
        # whether any row of the last assign reruns a pruning stage: a captured decode graph
        # skips the cascade when it is 0 (kernels/graph_if.py)
        self.refreshing = torch.zeros(1, dtype=torch.bool, device=device)
        self._slot_ids = torch.arange(num_slots, dtype=torch.int64, device=device)
        # made here, not in a step: nothing is copied from the host while graphs are captured
        self._intervals_dev = torch.tensor(self.intervals, **i32)

    def live(self) -> int:
        """Slots owned now (a host read: for tests and metrics, not the step)."""
        return int((self.key_block[: self.num_slots] >= 0).sum())

    def assign(
        self,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        threshold: int,
        block_size: int,
        out: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots and refresh levels of this step's decode rows; frees every slot not kept.

        ``block_table`` ``[B, P]`` and ``seq_lens`` ``[B]`` (int32) are device tensors; rows
        longer than ``threshold`` decode sparsely and get slots. Returns int32 ``slots`` (-1: no
        slot) and ``levels`` (``LEVEL_NONE`` for rows without a slot). ``out``: int32 buffers
        ``(slots, levels, seq_lens, stale_steps)`` of at least ``B`` entries that receive the
        rows' slots, levels, lengths and the decode steps since each row's final blocks were
        chosen (:func:`stale_steps`; 0 without a slot): the builder's persistent per-row
        buffers, which captured graphs read. The returned tensors are views of the first two.
        :attr:`refreshing` becomes whether any row reruns a stage. On CUDA this is one Triton
        launch (:mod:`kernels.triton_slots`); elsewhere the PyTorch ops below, its spec.
        """
        batch = seq_lens.shape[0]
        if out is None:
            out = tuple(torch.empty(batch, dtype=torch.int32, device=seq_lens.device)
                        for _ in range(4))  # fmt: skip
        out_slots, out_levels, out_seq_lens, out_stale = (o[:batch] for o in out)
        if seq_lens.is_cuda:
            from vllm_infinitehip.kernels.triton_slots import assign_slots

            assign_slots(
                block_table, seq_lens, threshold, block_size, self.key_block, self.seq_len,
                self.step, self._intervals_dev, self.level_counts, self.refreshing, out_slots,
                out_levels, out_seq_lens, out_stale,
            )  # fmt: skip
            return out_slots, out_levels
        slots, levels, stale = self._assign_reference(block_table, seq_lens,
                                                      seq_lens > threshold, block_size)  # fmt: skip
        out_slots.copy_(slots)
        out_levels.copy_(levels)
        out_seq_lens.copy_(seq_lens)
        out_stale.copy_(stale)
        return out_slots, out_levels

    def _assign_reference(
        self,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        sparse: torch.Tensor,
        block_size: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n_slots = self.num_slots
        batch = seq_lens.shape[0]
        device = seq_lens.device
        sl = seq_lens.to(torch.int64)
        prev_blk = block_table.gather(1, ((sl - 2).clamp(min=0) // block_size).view(-1, 1))[:, 0]
        cur_blk = block_table.gather(1, ((sl - 1).clamp(min=0) // block_size).view(-1, 1))[:, 0]
        keys, lens = self.key_block[:n_slots], self.seq_len[:n_slots]
        match = (
            (keys.view(1, -1) == prev_blk.view(-1, 1).to(torch.int32))
            & (lens.view(1, -1) == (seq_lens.view(-1, 1) - 1))
            & (keys >= 0).view(1, -1)
            & sparse.view(-1, 1)
        )
        has = match.any(dim=1)
        claimed = torch.where(has, match.to(torch.int8).argmax(dim=1), n_slots)
        rows = torch.arange(batch, device=device)
        first_row = torch.full((n_slots + 1,), batch, dtype=torch.int64, device=device)
        first_row = first_row.scatter_reduce(0, claimed, rows, reduce="amin")
        kept = has & (first_row[claimed] == rows)
        used = torch.zeros(n_slots + 1, dtype=torch.bool, device=device)
        used = used.scatter(0, torch.where(kept, claimed, n_slots), True)[:n_slots]
        free = ~used
        free_list = torch.full((n_slots + 1,), -1, dtype=torch.int64, device=device)
        free_rank = torch.where(free, torch.cumsum(free, 0) - 1, n_slots)
        # unfree slots land on the spare entry with -1, which overflowing new rows then read
        free_list = free_list.scatter(0, free_rank, torch.where(free, self._slot_ids, -1))
        new = sparse & ~kept
        new_rank = (torch.cumsum(new, 0) - 1).clamp(0, n_slots)
        slots = torch.where(kept, claimed, torch.where(new, free_list[new_rank], -1))
        steps = torch.where(kept, self.step[claimed] + 1, 0).to(torch.int32)

        self.key_block.fill_(-1)
        at = torch.where(slots >= 0, slots, n_slots)
        self.key_block.scatter_(0, at, cur_blk.to(torch.int32))
        self.seq_len.scatter_(0, at, seq_lens.to(torch.int32))
        self.step.scatter_(0, at, steps)
        self.key_block[n_slots] = -1
        levels = torch.where(slots >= 0, refresh_levels(steps, self.intervals), LEVEL_NONE)
        bins = torch.where(levels >= 0, levels, self.n_stages + 1).to(torch.int64)
        self.level_counts.index_add_(0, bins, torch.ones_like(bins))
        self.refreshing.copy_(((levels >= 0) & (levels < self.n_stages)).any().view(1))
        stale = torch.where(slots >= 0, stale_steps(steps, self.intervals), 0)
        return slots.to(torch.int32), levels.to(torch.int32), stale.to(torch.int32)

    def release_all(self) -> None:
        """A step with no decode rows keeps nothing."""
        self.key_block.fill_(-1)
