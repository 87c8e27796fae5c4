"""The host tier's GPU + host layout with real bytes (block_manager.split_kv): random traffic of
requests that come, grow and leave, written and read through the kernels' reference, against a
whole cache that is never split. Every block written reads back from where its table places it,
K from the plane, and vLLM's zeroing and copy-on-write land on the homes."""

from __future__ import annotations

import random

import pytest
import torch

from vllm_infinitehip.block_manager.split_kv import SplitKV
from vllm_infinitehip.kernels import reference as ref

PAGE, H, D, LAYERS = 4, 2, 8, 3


def test_blocks_start_on_the_gpu_in_order_and_the_tables_say_so():
    kv = SplitKV(LAYERS, 10, 4, (PAGE, H, D), torch.float32, torch.device("cpu"))
    assert kv.home.tolist() == [0, 1, 2, 3, -1, -2, -3, -4, -5, -6]
    assert torch.equal(kv.table, kv.home.repeat(LAYERS, 1))
    plane, split = kv.layer(1)
    assert plane.shape == (10, 1, PAGE, H, D) and split.v_host.shape == (6, PAGE, H, D)


@pytest.mark.parametrize("bank_slots", [0, 5])
@pytest.mark.parametrize("seed", range(3))
def test_random_traffic_reads_back_what_the_whole_cache_holds(seed, bank_slots):
    """With a V bank, every step also promotes some host-homed blocks per layer (as decode
    reads would) and rewrites tokens of blocks anywhere: a copy must follow its home."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    n, gpu_pages = 24, 8
    kv = SplitKV(LAYERS, n, gpu_pages, (PAGE, H, D), torch.float32, torch.device("cpu"),
                 bank_slots=bank_slots)  # fmt: skip
    if bank_slots:
        kv.bank.allocate_plan(8, 0)
    copies_read = 0
    whole = torch.zeros(LAYERS, n, 2, PAGE, H, D)
    held: dict[str, list[int]] = {}
    free_lru = list(range(n))
    written: set[int] = set()
    for step in range(120):
        freed = []
        for req in list(held):
            if rng.random() < 0.15:
                freed += held.pop(req)
        free_lru += freed
        new = [free_lru.pop(0) for _ in range(min(rng.randint(1, 3), len(free_lru)))]
        req = rng.choice([*held, f"r{step}"])
        held.setdefault(req, []).extend(new)
        kv.place(new, held, freed, new)
        # the step writes its new blocks, every token and layer (a new block's page holds
        # another block's bytes until then, and vLLM reads no token before writing it)
        slots = torch.tensor([b * PAGE + o for b in new for o in range(PAGE)])
        slots = slots[torch.randperm(slots.numel(), generator=gen)]
        for layer in range(LAYERS):
            key, value = torch.randn(2, slots.numel(), H, D, generator=gen)
            plane, split = kv.layer(layer)
            ref.write_paged_kv(plane, key, value, slots, split=split)
            ref.write_paged_kv(whole[layer], key, value, slots)
        written.update(new)
        assert all(kv.homes.on_gpu(b) for b in new)
        # vLLM zeroes a block, or copies one into another (copy-on-write)
        if rng.random() < 0.2:
            b = rng.choice(sorted(written))
            kv.zero([b])
            whole[:, b] = 0
        if len(written) > 1 and rng.random() < 0.3:
            src, dst = rng.sample(sorted(written), 2)
            kv.copy_blocks([src], [dst])
            whole[:, dst] = whole[:, src]
        if bank_slots and written:
            # each layer reads a few blocks (some host-homed), one row, all promoted
            pages = torch.tensor([[rng.choice(sorted(written)) for _ in range(8)]
                                  for _ in range(LAYERS)]).view(LAYERS, 1, 8)  # fmt: skip
            pages[:, :, -1] = -1  # padding
            kv.plan_reads(pages, torch.tensor([True]), torch.tensor([rng.random() < 0.5]), 8)
            on_host = kv.home < 0
            # the tables follow the homes and the bank's copies over the whole pool, though
            # each step rewrites only what its promotion changed
            copy = kv.bank.cache.table[:, :n]
            want = torch.where(on_host & (copy >= 0), copy + gpu_pages, kv.home)
            assert torch.equal(kv.table, want), step
            copies = (kv.table >= gpu_pages) & on_host
            copies_read += int(copies.sum())
            # a layer's table holds a copy only of a host-homed block it promoted and kept
            assert not ((kv.table >= gpu_pages) & ~on_host).any()
            assert torch.equal(kv.table[:, ~on_host], kv.home[~on_host].expand(LAYERS, -1))
            # a decode write lands in a block anywhere (home and copy alike)
            b = rng.choice(sorted(written))
            slots = torch.tensor([b * PAGE + rng.randrange(PAGE)])
            for layer in range(LAYERS):
                key, value = torch.randn(2, 1, H, D, generator=gen)
                plane, split = kv.layer(layer)
                ref.write_paged_kv(plane, key, value, slots, split=split)
                ref.write_paged_kv(whole[layer], key, value, slots)
        # every block, live or freed (the prefix cache may hit it), reads what was written
        blocks = torch.arange(n)
        for layer in range(LAYERS):
            plane, split = kv.layer(layer)
            k, v = ref.gather_paged_kv(plane, blocks, n * PAGE, split=split)
            want_k, want_v = ref.gather_paged_kv(whole[layer], blocks, n * PAGE)
            assert torch.equal(k, want_k) and torch.equal(v, want_v), (step, layer)
    assert kv.spilled_blocks > 30
    if bank_slots:  # the copies were read, and the bank counted host-homed reads
        stats = kv.bank.stats()
        assert copies_read > 100 and stats["filled_pages"] > 20
        assert stats["attn_bank_pages_refresh"] + stats["attn_bank_pages_reuse"] > 0


def test_the_split_layout_stages_only_dense_prefill_chunks():
    """On a GPU the host layout reads every prefill chunk that re-reads its context from a GPU
    copy of the request's pages; the split layout only the dense ones (FlashAttention reads
    whole pages): the sparse kernels read K and each V where they are, so a long prompt is not
    copied whole at every chunk and layer."""
    from types import SimpleNamespace

    from vllm_infinitehip.backend import stages_chunk

    host = SimpleNamespace(staging=object(), split=None)
    split = SimpleNamespace(staging=object(), split=object())
    assert stages_chunk(host, 2048, 64, dense=False) and stages_chunk(host, 2048, 64, dense=True)
    assert stages_chunk(split, 2048, 64, dense=True)
    assert not stages_chunk(split, 2048, 64, dense=False)
    assert not stages_chunk(host, 64, 64, dense=True)  # one query block: read in place
    assert not stages_chunk(SimpleNamespace(staging=None, split=None), 2048, 64, dense=True)


def test_the_staging_holds_one_dense_prefill_not_a_max_model_len_request():
    """Only dense chunks are staged in the split layout, so its staging (on a GPU) holds one
    request's pages up to the longest dense context: HBM that would otherwise sit idle at
    millions of tokens is left to V."""
    from types import SimpleNamespace

    from vllm_infinitehip.backend import split_staging_pages
    from vllm_infinitehip.config import CPU_DENSE_PREFILL_CROSSOVER, InfiniteHiPConfig

    def vllm_config(max_len: int):
        model = SimpleNamespace(max_model_len=max_len,
                                hf_text_config=SimpleNamespace(max_position_embeddings=max_len))
        return SimpleNamespace(model_config=model, cache_config=SimpleNamespace(cache_dtype="auto"))

    config, cpu = InfiniteHiPConfig.from_user({}), torch.device("cpu")
    assert split_staging_pages(config, vllm_config(1 << 20), cpu, 16) == (
        CPU_DENSE_PREFILL_CROSSOVER // 16)
    assert split_staging_pages(config, vllm_config(4000), cpu, 16) == 250
