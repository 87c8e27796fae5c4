"""The host tier's GPU bank (block_manager/bank.py) in a decode loop, against the tier off.

Decode steps append a token to each request, refresh masks on the schedule, promote the pages the
new masks read into a bank much smaller than what the rows read, and attend through it. Outputs
and masks must equal a run without a bank exactly, every resident page's copy must equal the
host page after every step (write-through and fills), and the counters must count what happened.
The page copy kernel runs in Triton's interpreter without a GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from triton.runtime.interpreter import InterpretedFunction
from vllm_infinitehip.block_manager.bank import (
    Bank,
    PrefillStaging,
    decode_read_pages,
)
from vllm_infinitehip.kernels import decode as dec
from vllm_infinitehip.kernels import reference as ref
from vllm_infinitehip.kernels import triton_bank

from vllm_infinitehip.state import refresh_level

PAGE, HKV, HQ, D = 16, 2, 4, 32
INTERVALS = (8, 4, 2)


def small_params() -> ref.PruneParams:
    stages = (
        ref.StageParams(64, 512, 32, 4),
        ref.StageParams(16, 256, 32, 4),
        ref.StageParams(8, 64, 32, 1),
    )
    return ref.PruneParams(sink_tokens=16, window_tokens=128, stages=stages)


def paged(seq_lens: list[int], extra: int, gen: torch.Generator):
    """A cache with room for ``extra`` more tokens per row, pages shuffled, and its table."""
    need = [-(-(t + extra) // PAGE) for t in seq_lens]
    num_pages = sum(need) + 2
    cache = torch.randn(num_pages, 2, PAGE, HKV, D, generator=gen)
    perm = torch.randperm(num_pages, generator=gen)
    table = torch.zeros(len(seq_lens), max(need), dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[at : at + n]
        at += n
    return cache, table


@pytest.mark.parametrize("extend", [None, [3, 8, 1]], ids=["as-chosen", "read-past-the-end"])
def test_decode_read_pages_are_sink_window_and_final_blocks(extend):
    """With ``block_ends`` (blocks reused past their end) the pages of the extra tokens too."""
    gen = torch.Generator().manual_seed(3)
    params = small_params()
    seq_lens = [700, 1100, 50]
    _, table = paged(seq_lens, 0, gen)
    final = torch.randint(0, 600, (3, 8), generator=gen, dtype=torch.int32) // 8 * 8
    counts = torch.tensor([8, 5, 0], dtype=torch.int32)
    slots = torch.tensor([1, 0, -1], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    ends = None if extend is None else torch.tensor(extend, dtype=torch.int32) + 8
    got = decode_read_pages(table, lens, slots, final[None], counts[None], params.sink_tokens,
                            params.window_tokens, PAGE, ends)[0]  # fmt: skip
    for b, (t, s) in enumerate(zip(seq_lens, slots.tolist())):
        want = set()
        if s >= 0:
            keys = set(range(params.sink_tokens)) | set(range(t - params.window_tokens, t))
            for start in final[s, : int(counts[s])].tolist():
                keys |= set(range(start, start + (8 if ends is None else int(ends[b]))))
            want = {int(table[b, k // PAGE]) for k in keys}
        assert {p for p in got[b].tolist() if p >= 0} == want, b


def _write_tokens(cache, bank, table, lens, k, v, fill_entries=0):
    """The step's KV write as the backend does it: the host, then the layer's planned fills
    (the rows' share of the plan) and its bank write."""
    slots = torch.stack([table[b, t // PAGE].long() * PAGE + t % PAGE for b, t in enumerate(lens)])
    if bank is not None:
        bank.plan_writes(slots)
    ref.write_paged_kv(cache, k, v, slots)
    if bank is not None:
        write = lambda pages, s: ref.write_paged_kv(pages, k, v, s)
        bank.layer_work(
            0, cache, len(lens), triton_bank.copy_pages_reference, write,
            fill_entries=fill_entries,
        )  # fmt: skip


def _decode_loop(bank: Bank | None, steps: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    params = small_params()
    seq_lens = [700, 1100]
    cache, table = paged(seq_lens, steps, gen)
    masks = dec.DecodeMasks.allocate(params, 64, 2, torch.device("cpu"))
    outs = []
    lens = list(seq_lens)
    if bank is not None:
        bank.allocate_plan(4 * 64, 2)  # room for more rows than run: only their share is copied
    for step in range(steps):
        level = refresh_level(step, INTERVALS)
        i32 = dict(dtype=torch.int32)
        rows = dec.DecodeRows(table, torch.tensor([t + 1 for t in lens], **i32),
                              torch.tensor([0, 1], **i32),
                              torch.tensor([level] * 2, **i32))  # fmt: skip
        if bank is not None:  # the builder's plan: promote what the rows' masks read now
            pages = decode_read_pages(table, rows.seq_lens, rows.slots, masks.final[None],
                                      masks.final_counts()[None], params.sink_tokens,
                                      params.window_tokens, PAGE)  # fmt: skip
            bank.plan_promotion(pages, torch.full((2,), level > 0),
                                torch.full((2,), level < len(INTERVALS)))  # fmt: skip
        k, v = torch.randn(2, 2, HKV, D, generator=gen)
        share = pages.shape[1] * pages.shape[2] if bank is not None else 0
        _write_tokens(cache, bank, table, lens, k, v, share)
        lens = [t + 1 for t in lens]
        q = torch.randn(2, HQ, D, generator=gen)
        view = bank.layer(0) if bank is not None else None
        dec.refresh_masks_reference(params, masks, q, cache, rows, D**-0.5, view)
        if bank is not None:
            resident = (bank.cache.table[0, :-1] >= 0).nonzero().flatten()
            slots = bank.cache.table[0, resident].long()
            assert torch.equal(bank.pages[0, slots], cache[resident]), f"step {step}"
        o, _ = dec.attend_reference(params, masks, q, cache, rows, D**-0.5, view)
        outs.append(o)
    return torch.stack(outs), masks


def test_decode_through_a_small_bank_equals_the_tier_off():
    steps = 12
    want, want_masks = _decode_loop(None, steps, seed=5)
    num_pages = 2 + sum(-(-(t + steps) // PAGE) for t in (700, 1100))
    bank = Bank(1, num_pages, 12, (2, PAGE, HKV, D), torch.float32, torch.device("cpu"))
    got, got_masks = _decode_loop(bank, steps, seed=5)
    assert torch.equal(got, want)
    assert torch.equal(got_masks.final, want_masks.final)
    stats = bank.stats()
    # each row reads ~18 pages, both ~36: the 12 slots fill, and the rest is read on the host
    # (a step's promotion uses the masks it starts with: refreshed pages come in a step later)
    assert stats["resident_pages"] == stats["bank_slots"] == 12
    assert stats["filled_pages"] >= 12
    assert stats["attn_host_pages_refresh"] > 0 and stats["attn_bank_pages_refresh"] > 0
    assert stats["attn_bank_pages_reuse"] > 0  # odd steps reuse the masks
    assert stats["decode_layer_steps"] == steps
    assert stats["promote_hits"] + stats["promote_misses"] > 0


_RUNNABLE = torch.cuda.is_available() or isinstance(
    triton_bank._copy_pages_kernel, InterpretedFunction
)


@pytest.mark.skipif(not _RUNNABLE, reason="triton was imported compiled without a GPU: run "
                    "this file alone")  # fmt: skip
def test_a_smaller_step_leaves_only_padding_past_its_plan():
    """Each step rewrites its own fills and writes and resets only what the step before wrote
    past them: after a larger batch, every entry past a smaller step's plan is padding again,
    as a graph captured for the larger batch reads it; clearing empties what was written."""
    layers, pages, slots = 3, 40, 6
    bank = Bank(layers, pages, slots, (PAGE, HKV, D), torch.float32, torch.device("cpu"))
    bank.allocate_plan(4 * 5, 64)
    gen = torch.Generator().manual_seed(0)
    no = torch.zeros(4, dtype=torch.bool)
    for rows, tokens in ((4, 50), (1, 7), (3, 30), (2, 60)):
        read = torch.randint(0, pages, (layers, rows, 5), generator=gen)
        bank.plan_promotion(read, torch.ones(rows, dtype=torch.bool), no[:rows])
        bank.plan_writes(torch.randint(0, pages * PAGE, (tokens,), generator=gen))
        n = rows * 5
        assert (bank.fill_slots[:, :n] >= 0).any()
        assert (bank.fill_slots[:, n:] == -1).all() and (bank.fill_pages[:, n:] == -1).all()
        assert (bank.write_slots[:, tokens:] == -1).all()
    bank.clear_fills()
    bank.clear_writes()
    assert (bank.fill_slots == -1).all() and (bank.write_slots == -1).all()


def test_page_copy_kernel_copies_the_fills_and_skips_padding():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(9)
    cache = torch.randn(10, 2, PAGE, HKV, D, generator=gen).to(device)
    want = torch.randn(6, 2, PAGE, HKV, D, generator=gen).to(device)
    got = want.clone()
    fill_pages = torch.tensor([3, -1, 7, 0, -1], device=device)
    fill_slots = torch.tensor([4, -1, 0, 2, -1], device=device)
    triton_bank.copy_pages(cache, got, fill_pages, fill_slots)
    triton_bank.copy_pages_reference(cache, want, fill_pages, fill_slots)
    assert torch.equal(got, want)
    assert torch.equal(got[4], cache[3]) and torch.equal(got[0], cache[7])


def test_prefill_staging_holds_the_request_in_block_table_order():
    gen = torch.Generator().manual_seed(4)
    cache, table = paged([700, 1100], 0, gen)
    staging = PrefillStaging(80, (2, PAGE, HKV, D), torch.float32, torch.device("cpu"))
    for b, seq_len in enumerate([700, 1100]):
        kv, row = staging.stage(cache, table[b], seq_len, triton_bank.copy_pages_reference)
        got = ref.gather_paged_kv(kv, row, seq_len)
        want = ref.gather_paged_kv(cache, table[b], seq_len)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
