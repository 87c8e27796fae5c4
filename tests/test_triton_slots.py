"""The one-launch slot matching (kernels/triton_slots.py) against DecodeSlots' PyTorch spec.

Random request traffic (decoding, finishing, joining on recycled blocks, prefix-shared blocks,
short rows below the threshold, more rows than slots) drives two DecodeSlots side by side: one
through the PyTorch ops, one through the kernel (Triton's CPU interpreter without a GPU, compiled
with one). Every step's rows and the whole slot state must agree.
"""

from __future__ import annotations

import os
import random

import torch

if not torch.cuda.is_available():
    os.environ["_TRITON_INTERPRET_BEFORE"] = os.environ.get("TRITON_INTERPRET", "<unset>")
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
from vllm_infinitehip.kernels import triton_slots
from vllm_infinitehip.state import DecodeSlots

_SAVED_INTERPRET = os.environ.pop("_TRITON_INTERPRET_BEFORE", None)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BLOCK = 16
THRESHOLD = 20
INTERVALS = (8, 4, 2)


@pytest.fixture(autouse=True, scope="module")
def _interpreter_only_here():
    yield
    if _SAVED_INTERPRET == "<unset>":
        os.environ.pop("TRITON_INTERPRET", None)
    elif _SAVED_INTERPRET is not None:
        os.environ["TRITON_INTERPRET"] = _SAVED_INTERPRET


class Traffic:
    """Requests as (block list, length); a step advances, drops and adds some of them."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.free_blocks = list(range(1, 400))
        self.reqs: list[list] = []

    def _block(self) -> int:
        return self.free_blocks.pop(self.rng.randrange(len(self.free_blocks)))

    def _join(self) -> None:
        n = self.rng.randrange(2, 60)
        if self.reqs and self.rng.random() < 0.3:
            # a prefix-cache hit: share the full blocks of a running request
            other = self.rng.choice(self.reqs)
            full = other[1] // BLOCK
            if full:
                shared = other[0][: self.rng.randrange(1, full + 1)]
                n = len(shared) * BLOCK + self.rng.randrange(1, 3)
                self.reqs.append([shared + [self._block()], n])
                return
        self.reqs.append([[self._block() for _ in range((n + BLOCK - 1) // BLOCK)], n])

    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        rng = self.rng
        kept = []
        for blocks, n in self.reqs:
            if rng.random() < 0.15:  # finished, aborted or preempted: its own blocks recycle
                self.free_blocks.extend(blocks[-1:])
                continue
            if n % BLOCK == 0:
                blocks = blocks + [self._block()]
            kept.append([blocks, n + 1])
        self.reqs = kept
        for _ in range(rng.randrange(0, 3)):
            self._join()
        rng.shuffle(self.reqs)
        width = max([len(b) for b, _ in self.reqs] + [1])
        table = torch.zeros(len(self.reqs), width, dtype=torch.int32)
        for i, (blocks, _) in enumerate(self.reqs):
            table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        lens = torch.tensor([n for _, n in self.reqs], dtype=torch.int32)
        return table, lens


def _kernel_assign(slots: DecodeSlots, table: torch.Tensor, lens: torch.Tensor):
    b = lens.shape[0]
    out = [torch.full((b + 2,), 99, dtype=torch.int32, device=DEVICE) for _ in range(4)]
    triton_slots.assign_slots(
        table.to(DEVICE), lens.to(DEVICE), THRESHOLD, BLOCK, slots.key_block, slots.seq_len,
        slots.step, slots._intervals_dev, slots.level_counts, slots.refreshing,
        *(o[:b] for o in out),
    )  # fmt: skip
    assert all((o[b:] == 99).all() for o in out), "wrote past the batch"
    return [o[:b].cpu() for o in out]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kernel_matches_the_pytorch_spec_on_random_traffic(seed):
    rng = random.Random(seed)
    traffic = Traffic(rng)
    spec = DecodeSlots(5, INTERVALS, torch.device("cpu"))
    kern = DecodeSlots(5, INTERVALS, DEVICE)
    seen_levels, seen_flags, seen_stale = set(), set(), set()
    for _ in range(40):
        table, lens = traffic.step()
        if lens.numel() == 0:
            continue
        want = [torch.zeros(lens.shape[0], dtype=torch.int32) for _ in range(4)]
        want_slots, want_levels = spec.assign(table, lens, THRESHOLD, BLOCK, out=want)
        got_slots, got_levels, got_lens, got_stale = _kernel_assign(kern, table, lens)
        assert got_slots.tolist() == want_slots.tolist()
        assert got_levels.tolist() == want_levels.tolist()
        assert got_lens.tolist() == lens.tolist()
        assert got_stale.tolist() == want[3].tolist()
        # a refreshing row's blocks are this step's; a reusing row's are older
        assert all((st == 0) == (0 <= lv < len(INTERVALS))
                   for st, lv in zip(got_stale.tolist(), want_levels.tolist()) if lv >= 0)
        seen_stale.update(got_stale.tolist())
        refreshing = any(0 <= lv < len(INTERVALS) for lv in want_levels.tolist())
        assert bool(spec.refreshing) == refreshing
        assert bool(kern.refreshing.cpu()) == refreshing
        seen_flags.add(refreshing)
        live = spec.key_block >= 0
        assert kern.key_block.cpu().tolist() == spec.key_block.tolist()
        assert kern.seq_len.cpu()[live].tolist() == spec.seq_len[live].tolist()
        assert kern.step.cpu()[live].tolist() == spec.step[live].tolist()
        seen_levels.update(want_levels.tolist())
    assert kern.level_counts.cpu().tolist() == spec.level_counts.tolist()
    # the traffic exercised every level, rows without a slot, and slot overflow
    assert seen_levels >= {-1, 0, 1, 2, 3}
    assert seen_flags == {False, True}  # steps where no row refreshes, and steps where one does
    assert seen_stale == {0, 1}  # blocks of this step and of the step before (interval 2)


def _table(rows):
    width = max(len(r) for r in rows)
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)


@pytest.mark.parametrize("num_slots", [1, 4])
def test_kernel_matches_the_spec_when_rows_claim_one_slot(num_slots):
    """Two rows on one shared block at one length (the earlier keeps the slot), and, with one
    slot, more sparse rows than slots."""
    spec = DecodeSlots(num_slots, INTERVALS, torch.device("cpu"))
    kern = DecodeSlots(num_slots, INTERVALS, DEVICE)
    steps = [([[1, 2]], [30]), ([[1, 2], [1, 2]], [31, 31]), ([[1, 2], [1, 2], [3, 4]], [32, 32, 25])]
    for rows, lens in steps:
        table, lens = _table(rows), torch.tensor(lens, dtype=torch.int32)
        want_slots, want_levels = spec.assign(table, lens, THRESHOLD, BLOCK)
        got_slots, got_levels, _, _ = _kernel_assign(kern, table, lens)
        assert got_slots.tolist() == want_slots.tolist()
        assert got_levels.tolist() == want_levels.tolist()
        assert bool(kern.refreshing.cpu()) == bool(spec.refreshing)
        assert kern.key_block.cpu().tolist() == spec.key_block.tolist()
    assert kern.level_counts.cpu().tolist() == spec.level_counts.tolist()
