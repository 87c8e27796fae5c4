"""The host tier's GPU page cache (block_manager/page_cache.py) on random access sequences.

A plain-Python LRU model with the same rules (misses fill in request order, victims by
oldest stamp then lower slot, nothing used by the same call is evicted) runs beside the device
structure; after every call the tables, owners and counters must agree, the structure must be
self-consistent, and every resident page's bank copy must equal the host page (nothing lost
through fills, write-through writes and invalidations).
"""

from __future__ import annotations

import random

import pytest
import torch
from vllm_infinitehip.block_manager.page_cache import PageCache

PAGE_ELEMS = 8


class ModelLRU:
    def __init__(self, layers: int, num_slots: int) -> None:
        self.table = [dict() for _ in range(layers)]
        self.owner = [[-1] * num_slots for _ in range(layers)]
        self.stamp = [[-1] * num_slots for _ in range(layers)]
        self.clock = 0
        self.hits = [0] * layers
        self.misses = [0] * layers

    def promote(self, layer: int, pages: list[int]) -> list[tuple[int, int]]:
        self.clock += 1
        table, owner, stamp = self.table[layer], self.owner[layer], self.stamp[layer]
        wanted = list(dict.fromkeys(p for p in pages if p >= 0))  # first occurrences, in order
        used = set()
        for p in wanted:
            if p in table:
                stamp[table[p]] = self.clock
                used.add(table[p])
                self.hits[layer] += 1
            else:
                self.misses[layer] += 1
        victims = sorted((s for s in range(len(owner)) if s not in used),
                         key=lambda s: (stamp[s], s))  # fmt: skip
        fills = []
        for p, s in zip([p for p in wanted if p not in table], victims):
            if owner[s] >= 0:
                del table[owner[s]]
            owner[s], stamp[s], table[p] = p, self.clock, s
            fills.append((p, s))
        return fills

    def invalidate(self, pages: list[int]) -> None:
        for layer, table in enumerate(self.table):
            for p in pages:
                if p in table:
                    s = table.pop(p)
                    self.owner[layer][s] = -1
                    self.stamp[layer][s] = -1


def check_consistent(cache: PageCache, model: ModelLRU, host, bank) -> None:
    for layer in range(cache.layers):
        table = cache.table[layer, : cache.num_pages].tolist()
        owner = cache.owner[layer, : cache.num_slots].tolist()
        assert {p: s for p, s in enumerate(table) if s >= 0} == model.table[layer]
        assert owner == model.owner[layer]
        for s, p in enumerate(owner):
            if p >= 0:
                assert table[p] == s
                assert torch.equal(bank[layer, s], host[layer, p]), "bank copy differs from host"
        assert sum(1 for s in table if s >= 0) == sum(1 for p in owner if p >= 0)
    assert cache.hits.tolist() == model.hits and cache.misses.tolist() == model.misses


@pytest.mark.parametrize("seed", range(6))
def test_lru_matches_the_model_and_loses_nothing(seed):
    rng = random.Random(seed)
    layers, num_pages, num_slots = 2, rng.choice([12, 40]), rng.choice([1, 3, 8])
    cache = PageCache(layers, num_pages, num_slots, torch.device("cpu"))
    model = ModelLRU(layers, num_slots)
    gen = torch.Generator().manual_seed(seed)
    host = torch.randn(layers, num_pages, PAGE_ELEMS, generator=gen)
    bank = torch.zeros(layers, num_slots + 1, PAGE_ELEMS)  # + the spare slot
    # a "sink and window" every call asks for, smaller than the bank so that others rotate
    hot = rng.sample(range(num_pages), min(2, num_slots - 1))
    saw_eviction = False
    for _ in range(60):
        op = rng.random()
        layer = rng.randrange(layers)
        if op < 0.6:  # a refresh step: the pages the new masks read, with repeats and padding
            pages = hot + [rng.randrange(num_pages) for _ in range(rng.randrange(0, 10))]
            pages += [-1] * rng.randrange(0, 3)
            rng.shuffle(pages)
            before = dict(model.table[layer])
            want = model.promote(layer, pages)
            got = cache.promote(layer, torch.tensor(pages))
            fills = [(p, s) for p, s in zip(got.fill_pages.tolist(), got.fill_slots.tolist())
                     if p >= 0]  # fmt: skip
            assert sorted(fills) == sorted(want)
            asked = {p for p in pages if p >= 0}
            evicted = {p for p in before if p not in model.table[layer]}
            assert not evicted & asked, "a call evicted a page it asked for"
            assert sorted(p for p in got.evicted.tolist() if p >= 0) == sorted(evicted)
            saw_eviction |= bool(evicted)
            if len(asked) <= num_slots:
                assert asked <= set(model.table[layer]), "a page that fits was left out"
            for p, s in fills:  # the caller's copy, host -> bank
                bank[layer, s] = host[layer, p]
        elif op < 0.85:  # a KV write: host first, then the bank where the page is resident
            pages = torch.tensor([rng.randrange(num_pages) for _ in range(3)])
            where = cache.write_slots(pages)
            for i, p in enumerate(pages.tolist()):
                value = torch.randn(PAGE_ELEMS, generator=gen)
                host[:, p] = value
                for ly in range(layers):
                    if where[ly, i] >= 0:
                        bank[ly, where[ly, i]] = value
        else:  # vLLM reuses block ids for new content
            pages = [rng.randrange(num_pages) for _ in range(2)] + [-1]
            cache.invalidate(torch.tensor(pages))
            model.invalidate(pages)
        check_consistent(cache, model, host, bank)
        # a read through the table equals the host, resident or not
        probe = torch.arange(num_pages)
        for ly in range(layers):
            slots = cache.slots_of(ly, probe)
            read = torch.where((slots >= 0)[:, None], bank[ly, slots.clamp(min=0)], host[ly])
            assert torch.equal(read, host[ly])
    assert cache.occupancy().tolist() == [sum(p >= 0 for p in o) for o in model.owner]
    if num_slots < num_pages:
        assert saw_eviction


def test_least_recently_used_goes_first():
    cache = PageCache(1, 10, 2, torch.device("cpu"))
    cache.promote(0, torch.tensor([4]))
    cache.promote(0, torch.tensor([5]))
    cache.promote(0, torch.tensor([4]))  # 4 used again: 5 is now the oldest
    got = cache.promote(0, torch.tensor([6]))
    assert [p for p in got.fill_pages.tolist() if p >= 0] == [6]
    assert cache.slots_of(0, torch.tensor([4, 5, 6])).tolist()[1] == -1
    assert cache.hits.tolist() == [1] and cache.misses.tolist() == [3]


def test_a_bank_of_zero_slots_is_refused():
    with pytest.raises(ValueError, match="at least one slot"):
        PageCache(1, 4, 0, torch.device("cpu"))


def test_promoting_every_layer_at_once_equals_one_layer_at_a_time():
    rng = random.Random(11)
    cpu = torch.device("cpu")
    batched, single = PageCache(3, 40, 6, cpu), PageCache(3, 40, 6, cpu)
    for _ in range(30):
        pages = torch.tensor([[rng.choice([-1] + list(range(40))) for _ in range(9)]
                              for _ in range(3)])  # fmt: skip
        got = batched.promote_all(pages)
        for layer in range(3):
            want = single.promote(layer, pages[layer])
            assert torch.equal(got.fill_pages[layer], want.fill_pages)
            assert torch.equal(got.fill_slots[layer], want.fill_slots)
        if rng.random() < 0.2:
            gone = torch.tensor(rng.sample(range(40), 5))
            batched.invalidate(gone)
            single.invalidate(gone)
    for name in ("table", "owner", "hits", "misses"):
        assert torch.equal(getattr(batched, name), getattr(single, name)), name
