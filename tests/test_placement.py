"""The GPU + host placement of V (block_manager.placement), against a simulated memory: every
block is read back from its one home, new blocks land on the GPU, and a spill keeps the V it
moves."""

from __future__ import annotations

import random

import numpy as np

import pytest

from vllm_infinitehip.block_manager.placement import VHomes, Victims, split_capacity


def brute_force_victims(h: VHomes, held, free_lru) -> list[int]:
    """The victim order by its definition, an independent oracle: free GPU-homed blocks least
    recently freed first, then every held GPU-homed block by its distance from the nearer end
    of its request, farthest first, ties in request then block order (a stable sort)."""
    ranked = sorted(
        ((min(i, len(blocks) - 1 - i), block) for blocks in held.values()
         for i, block in enumerate(blocks)),
        key=lambda rank: -rank[0],
    )  # fmt: skip
    return [b for b in free_lru if h.on_gpu(b)] + [b for _, b in ranked if h.on_gpu(b)]


def assert_homes_are_a_permutation(h: VHomes) -> None:
    gpu = sorted(int(x) for x in h.home if x >= 0)
    host = sorted(int(-1 - x) for x in h.home if x < 0)
    assert gpu == list(range(h.gpu_pages))
    assert host == list(range(h.num_blocks - h.gpu_pages))
    for block, x in enumerate(h.home.tolist()):
        owner = h.gpu_block[x] if x >= 0 else h.host_block[-1 - x]
        assert owner == block


def test_blocks_start_in_order_and_fit_all_on_the_gpu_as_the_tier_off():
    h = VHomes(8, 8)
    assert h.home.tolist() == list(range(8))
    h = VHomes(8, 3)
    assert h.home.tolist() == [0, 1, 2, -1, -2, -3, -4, -5]
    assert_homes_are_a_permutation(h)
    with pytest.raises(ValueError, match="gpu_pages=0"):
        VHomes(8, 0)


@pytest.mark.parametrize("seed", range(4))
def test_random_traffic_reads_every_block_from_its_one_home(seed):
    """Requests come, grow and leave; vLLM hands out the least recently freed block. The kept
    victim order equals the brute-force one at every step. After
    every step's placement and copies, each block written so far (freed ones too: the prefix
    cache may hit them) reads back what was written, and the step's new blocks are on the GPU."""
    rng = random.Random(seed)
    n, pages = 64, 16
    h = VHomes(n, pages)
    gpu_mem: list[object] = [None] * pages
    host_mem: list[object] = [None] * (n - pages)
    written: dict[int, object] = {}
    held: dict[str, list[int]] = {}
    free_lru = list(range(n))
    victims = Victims(h)
    victims.follow(free_lru, ())
    spilled = 0
    for step in range(300):
        freed = []
        for req in list(held):
            if rng.random() < 0.1:
                freed += held.pop(req)
                if freed and rng.random() < 0.3:  # preempted and resumed: a new, shorter list
                    held[req] = [freed.pop()]
        free_lru += freed
        new = [free_lru.pop(0) for _ in range(min(rng.randint(1, 6), len(free_lru)))]
        req = rng.choice([*held, f"r{step}"])
        held.setdefault(req, []).extend(new)
        taken = new + [b for blocks in held.values() for b in blocks if b in freed]

        victims.follow(freed, taken)
        assert list(victims.order(held)) == brute_force_victims(h, held, free_lru)
        spills = h.place(new, victims.order(held))
        victims.spilled(spills)
        for s in spills:  # the copies run before the step writes
            assert s.block not in new and gpu_mem[s.gpu_page] == written.get(s.block)
            host_mem[s.host_page] = gpu_mem[s.gpu_page]
        for block in new:
            assert h.on_gpu(block)
            written[block] = (step, block)
            gpu_mem[h.home[block]] = written[block]
        spilled += len(spills)

        assert_homes_are_a_permutation(h)
        for block, value in written.items():
            x = h.home[block]
            assert (gpu_mem[x] if x >= 0 else host_mem[-1 - x]) == value, (step, block)
    assert spilled > 100  # the traffic did move V to the host


def test_victims_are_free_blocks_first_then_the_middle_of_requests():
    h = VHomes(12, 12)
    held = {"a": [0, 1, 2, 3, 4, 5, 6], "b": [7, 8, 9]}
    victims = Victims(h)
    victims.follow([11, 10], ())
    order = list(victims.order(held))
    assert order[:2] == [11, 10]
    assert order[2] == 3  # the middle of "a": 3 blocks from either end
    assert set(order[3:5]) == {2, 4}
    assert set(order[-4:]) == {0, 6, 7, 9}  # the ends (sink, window) last


def test_too_many_new_blocks_for_the_gpu_is_an_error():
    h = VHomes(8, 2)
    with pytest.raises(RuntimeError, match="3 blocks are new in one step"):
        victims = Victims(h)
        victims.follow([0, 1], ())
        h.place([5, 6, 7], victims.order({"a": [5, 6, 7]}))


def brute_force_capacity(gpu, host, k, v, min_gpu):
    """The largest N (and its most GPU pages) by trying every split, an independent oracle."""
    best = None
    for n in range(0, gpu // k + 1):
        for g in range(min(n, (gpu - n * k) // v) if n * k <= gpu else -1, -1, -1):
            if g >= min_gpu and (n - g) * v <= host:
                best = (n, g) if best is None or n > best[0] else best
                break
    return best


@pytest.mark.parametrize("seed", range(40))
def test_split_capacity_is_the_largest_block_count_that_fits(seed):
    rng = np.random.default_rng(seed)
    k, v = int(rng.integers(1, 6)), int(rng.integers(1, 6))
    min_gpu = int(rng.integers(1, 4))
    gpu = int(rng.integers(min_gpu * (k + v), 120))
    host = int(rng.integers(0, 120))
    cap = split_capacity(gpu, host, k, v, min_gpu)
    n, g = brute_force_capacity(gpu, host, k, v, min_gpu)
    assert (cap.num_blocks, cap.gpu_pages) == (n, g)
    assert cap.host_pages == n - g
    assert cap.num_blocks * k + cap.gpu_pages * v <= gpu and cap.host_pages * v <= host


def test_split_capacity_of_3m_tokens_on_an_h200():
    """Llama-3-8B fp8 (16-token blocks: 512 KiB of K and of V over 32 layers), 116 GiB of GPU
    and 100 GiB of pinned host for KV: all 216 GiB hold KV, about 3.5M tokens."""
    gib, kib = 1 << 30, 1 << 10
    cap = split_capacity(116 * gib, 100 * gib, 512 * kib, 512 * kib, 1024)
    assert cap.num_blocks == 216 * gib // (1024 * kib)
    assert 3_500_000 < cap.num_blocks * 16 < 3_600_000
    assert cap.host_pages * 512 * kib <= 100 * gib
    # what fits the GPU alone stays there
    assert split_capacity(116 * gib, 0, 512 * kib, 512 * kib, 1024).host_pages == 0
    with pytest.raises(ValueError, match="fewer than"):
        split_capacity(100 * kib, gib, 512 * kib, 512 * kib, 1)
