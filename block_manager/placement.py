"""Where each KV block's V lives when the host tier's capacity is GPU plus host memory.

vLLM sees one pool of ``num_blocks`` blocks. Every block keeps its K in HBM, indexed by block
id, so the pruning stages never wait on the host. Its V has one *home*: one of ``gpu_pages``
V pages in HBM or one of the ``num_blocks - gpu_pages`` pages of pinned host memory. The homes
are a permutation of the pages: a block always has exactly one, and no two blocks share one.
This module is the placement policy alone, on host ints (numpy), with no copy of its own: the
worker applies what it returns (``split_kv.SplitKV``), and the kernels read V through the
homes.

A step's newly allocated blocks hold nothing worth keeping (vLLM writes them now) and are read at
every later step, so they are given GPU homes. A new block homed on the host swaps homes with a
*victim* on the GPU (:meth:`VHomes.place`): the victim's V is copied to the new block's host
page (a :class:`Spill`, enqueued before the step's forward on its stream), and the new block
takes the victim's GPU page without a copy. No V is lost, only moved: a spilled block that a
request or the prefix cache still holds is read from the host afterwards.

Victims, best first (:class:`Victims`): GPU-homed blocks no running request holds (free,
perhaps prefix-cached), least recently freed first; then held blocks by their distance from the
nearer end of their request, farthest first (the sink and the window are read at every step,
the middle only where a mask selects it).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Spill:
    """Copy ``block``'s V from GPU page ``gpu_page`` to host page ``host_page`` before the step
    writes the block that takes ``gpu_page``."""

    block: int
    gpu_page: int
    host_page: int


class VHomes:
    """The V home of every block: ``home[b] >= 0`` is GPU page ``home[b]``, ``home[b] < 0`` is
    host page ``-1 - home[b]``. Blocks start homed in order: the first ``gpu_pages`` on the GPU,
    so when every block fits (``gpu_pages == num_blocks``) the layout is the tier off's."""

    def __init__(self, num_blocks: int, gpu_pages: int) -> None:
        if not 0 < gpu_pages <= num_blocks:
            raise ValueError(f"gpu_pages={gpu_pages} must be in [1, num_blocks={num_blocks}]")
        self.home = np.arange(num_blocks, dtype=np.int64)
        self.home[gpu_pages:] = -1 - np.arange(num_blocks - gpu_pages)
        # the inverse: which block each page homes
        self.gpu_block = np.arange(gpu_pages, dtype=np.int64)
        self.host_block = np.arange(gpu_pages, num_blocks, dtype=np.int64)

    @property
    def num_blocks(self) -> int:
        return len(self.home)

    @property
    def gpu_pages(self) -> int:
        return len(self.gpu_block)

    def on_gpu(self, block: int) -> bool:
        return bool(self.home[block] >= 0)

    def place(self, new_blocks: Sequence[int], victims: Iterable[int]) -> list[Spill]:
        """Give every block of ``new_blocks`` (allocated this step) a GPU home; return the copies
        that keep the victims' V. ``victims``: candidates best first (:meth:`Victims.order`);
        new blocks and blocks already on the host are passed over. Raises ``RuntimeError`` when
        the candidates run out: more blocks are new in one step than the GPU holds pages."""
        new = set(new_blocks)
        candidates = iter(victims)
        spills: list[Spill] = []
        for block in dict.fromkeys(new_blocks):
            if self.home[block] >= 0:
                continue
            victim = next((v for v in candidates if v not in new and self.home[v] >= 0), None)
            if victim is None:
                raise RuntimeError(
                    f"no GPU page for block {block}: {len(new)} blocks are new in one step and "
                    f"the GPU holds {self.gpu_pages} V pages"
                )
            gpu_page, host_page = int(self.home[victim]), int(-1 - self.home[block])
            spills.append(Spill(victim, gpu_page, host_page))
            self.home[victim], self.home[block] = -1 - host_page, gpu_page
            self.gpu_block[gpu_page], self.host_block[host_page] = block, victim
        return spills


class Victims:
    """GPU-homed blocks whose V may move to the host, best first, kept across steps so that
    finding a victim costs no Python loop over what the GPU holds:

    1. free blocks (no running request holds them; perhaps prefix-cached), least recently freed
       first: an ordered dict of exactly the free GPU-homed blocks, followed from what each step
       frees and hands out (:meth:`follow`) and what it spills (:meth:`spilled`);
    2. then the blocks ``held`` by requests (request id -> its blocks in order) by distance
       from the nearer end of their request, farthest first (the sink and the window are read
       at every step, the middle only where a mask selects it); ties go to the earlier request,
       then the earlier block. Each request's blocks are kept as a numpy array that grows with
       its list (vLLM only appends to a running request's blocks; a resumed request's list is
       a new list), and ranked, filtered and merged in numpy, lazily: only when the free
       blocks run out.

    A block may come more than once (shared prefixes); :meth:`VHomes.place` passes over those
    already moved."""

    def __init__(self, homes: VHomes) -> None:
        self.homes = homes
        self.free: OrderedDict[int, None] = OrderedDict()
        # request id -> (the list the worker holds, its blocks as an array so far)
        self._held: dict[str, tuple[Sequence[int], np.ndarray]] = {}

    def follow(self, freed: Iterable[int], taken: Iterable[int]) -> None:
        """One step's output: ``freed`` (no live request holds them now, least recently freed
        first) and ``taken`` (handed to requests: new blocks and prefix-cache hits)."""
        for block in freed:
            if self.homes.on_gpu(block):
                self.free[block] = None
                self.free.move_to_end(block)
        for block in taken:
            self.free.pop(block, None)

    def spilled(self, spills: Iterable[Spill]) -> None:
        for s in spills:
            self.free.pop(s.block, None)

    def order(self, held: Mapping[str, Sequence[int]]) -> Iterator[int]:
        yield from self.free
        ranked = [self._ranked(req, blocks) for req, blocks in held.items()]
        for req in self._held.keys() - held.keys():
            del self._held[req]
        for _, block in heapq.merge(*ranked, key=lambda rank_block: rank_block[0]):
            yield int(block)

    def _ranked(self, req: str, blocks: Sequence[int]) -> Iterator[tuple[int, int]]:
        """``req``'s GPU-homed blocks as (-rank, block), best first."""
        kept, arr = self._held.get(req, (None, None))
        if kept is not blocks or arr is None or len(arr) > len(blocks):
            arr = np.asarray(blocks, dtype=np.int64)
        elif len(arr) < len(blocks):
            arr = np.concatenate([arr, np.asarray(blocks[len(arr):], dtype=np.int64)])
        self._held[req] = (blocks, arr)
        n = len(arr)
        # middle out: rank r holds blocks r and n-1-r (one block when they meet, n odd)
        r = np.arange((n - 1) // 2, -1, -1)
        idx = np.stack([r, n - 1 - r], axis=1).ravel()[n % 2:]
        on_gpu = self.homes.home[arr[idx]] >= 0
        idx = idx[on_gpu]
        # lazily: a step takes a few victims of tens of thousands
        return zip(iter(-np.minimum(idx, n - 1 - idx)), iter(arr[idx]))


@dataclass(frozen=True)
class SplitCapacity:
    """How many blocks vLLM may hand out (``num_blocks``) and how many of their V pages live on
    the GPU (``gpu_pages``) and on the host (``host_pages``)."""

    num_blocks: int
    gpu_pages: int
    host_pages: int


def split_capacity(
    gpu_bytes: int, host_bytes: int, k_block_bytes: int, v_block_bytes: int, min_gpu_pages: int
) -> SplitCapacity:
    """The most blocks that fit when every block's K is in HBM (``k_block_bytes`` each, all
    layers) and its V (``v_block_bytes``) on one of the two sides: ``num_blocks * K +
    gpu_pages * V <= gpu_bytes`` and ``host_pages * V <= host_bytes``. At least
    ``min_gpu_pages`` V pages stay on the GPU (a step's new blocks are homed there). When
    everything fits the GPU the host holds nothing. Raises ``ValueError`` when the GPU cannot
    hold ``min_gpu_pages`` blocks."""
    if min(k_block_bytes, v_block_bytes, min_gpu_pages) <= 0:
        raise ValueError("block sizes and min_gpu_pages must be positive")
    block = k_block_bytes + v_block_bytes
    if gpu_bytes < min_gpu_pages * block:
        raise ValueError(
            f"{gpu_bytes} bytes on the GPU hold fewer than {min_gpu_pages} blocks of "
            f"{block} bytes"
        )
    # K for every block and V for the rest of the GPU: N K + (N - h) V <= G, h V <= H
    host = host_bytes // v_block_bytes
    n = min((gpu_bytes + host * v_block_bytes) // block,
            (gpu_bytes - min_gpu_pages * v_block_bytes) // k_block_bytes)  # fmt: skip
    n = max(n, gpu_bytes // block)  # never fewer than the GPU alone holds
    gpu_pages = min(n, (gpu_bytes - n * k_block_bytes) // v_block_bytes)
    return SplitCapacity(num_blocks=n, gpu_pages=gpu_pages, host_pages=n - gpu_pages)
