"""The host tier's bank on CUDA: the step's plan makes no host sync, a layer's share replays in a
CUDA graph, and both equal the same work on the CPU. CPU twin: tests/test_bank.py."""

from __future__ import annotations

import pytest
import torch
from vllm_infinitehip.block_manager.bank import Bank, decode_read_pages

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PAGE, HKV, D, LAYERS, SLOTS = 16, 2, 32, 3, 10


def _plan_and_run(device, cache, table, seq_lens, final, counts, steps, graph: bool):
    from vllm_infinitehip.kernels import triton_bank

    copy = triton_bank.copy_pages if device.type == "cuda" else triton_bank.copy_pages_reference
    bank = Bank(LAYERS, cache.shape[0], SLOTS, tuple(cache.shape[1:]), cache.dtype, device)
    b = table.shape[0]
    bank.allocate_plan(b * 64, b)
    caches = [cache.clone().to(device) for _ in range(LAYERS)]
    table, seq_lens = table.to(device), seq_lens.to(device)
    final, counts = final.to(device), counts.to(device)
    slots = torch.arange(b, dtype=torch.int32, device=device)
    k = torch.ones(b, HKV, D, device=device)

    def write(pages, s):
        # graph-safe (vLLM's kernel on the GPU skips -1; here padding lands on the spare slot)
        s = torch.where(s >= 0, s, SLOTS * PAGE)
        pages[s // PAGE, 0, s % PAGE] = k

    def layer_step():
        for layer in range(LAYERS):
            bank.layer_work(layer, caches[layer], b, copy, write, fill_entries=b * 64)

    captured = None
    for step in range(steps):
        pages = decode_read_pages(table, seq_lens, slots, final[step], counts[step], 16, 64, PAGE)
        promote = torch.ones(b, dtype=torch.bool, device=device)
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("error")
        try:
            bank.plan_promotion(pages, promote, promote)
            bank.plan_writes(table[:, 0].long() * PAGE + step % PAGE)
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
        if graph and captured is None:
            layer_step()  # warm up (compiles), then capture once and replay every step
            captured = torch.cuda.CUDAGraph()
            with torch.cuda.graph(captured):
                layer_step()
        if captured is not None:
            captured.replay()
        else:
            layer_step()
    return bank, caches


def test_the_plan_is_sync_free_and_a_graph_replays_the_layer_work_as_the_cpu_does():
    gen = torch.Generator().manual_seed(2)
    b, steps = 2, 6
    cache = torch.randn(40, 2, PAGE, HKV, D, generator=gen)
    table = torch.randperm(40, generator=gen)[: b * 18].view(b, 18).to(torch.int32)
    seq_lens = torch.tensor([250, 280], dtype=torch.int32)
    final = (torch.randint(0, 240, (steps, LAYERS, b, 8), generator=gen) // 8 * 8).int()
    counts = torch.randint(4, 9, (steps, LAYERS, b), generator=gen).int()
    want, want_caches = _plan_and_run(torch.device("cpu"), cache, table, seq_lens, final,
                                      counts, steps, graph=False)  # fmt: skip
    got, got_caches = _plan_and_run(torch.device("cuda"), cache, table, seq_lens, final, counts,
                                    steps, graph=True)  # fmt: skip
    assert torch.equal(got.cache.table.cpu(), want.cache.table)
    assert torch.equal(got.pages.cpu(), want.pages)
    assert torch.equal(got.counters.cpu(), want.counters)
    for g, w in zip(got_caches, want_caches):
        assert torch.equal(g.cpu(), w)
    assert int(want.counters[4]) > 0  # pages were filled
