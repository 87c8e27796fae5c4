"""The GPU cache of the host KV tier: which host pages each layer keeps in a device bank, and LRU.

The host holds every page (the capacity tier); the bank holds copies of the hot ones. A kernel
reads a page from the bank when the layer's residency table has a slot for it, and from the host
view otherwise, so what is resident changes only where bytes are read from, never the bytes. Writes
go to the host, and to the bank where the page is resident (:meth:`PageCache.write_slots`).

All state lives in device tensors and every update has a fixed shape (padding entries are -1 and
land on a spare table entry / spare slot), so a step plans promotions with no host sync:

- ``table[layer, page]``: the slot holding ``page``, or -1;
- ``owner[layer, slot]``: the page in ``slot``, or -1 (empty);
- ``stamp[layer, slot]``: the clock at the slot's last use; empty slots are -1, so they fill first.

:meth:`PageCache.promote` is what a refresh step runs for the pages its new masks read: pages
already resident are hits and get the new stamp; each missing page, in the order the call lists
them (callers put what matters most first: sink and window pages), takes the least recently used
slot that no page of the same call uses (ties: the lower slot), so the pages a step asks for
never evict each other. Misses beyond the bank stay on the host and are read there. The caller
copies the returned ``(pages, slots)`` pairs from host to bank. :meth:`PageCache.promote_all`
does it for every layer at once (the bank plans each decode step so, block_manager/bank.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_NEVER = torch.iinfo(torch.int64).max  # the sort key of a slot a call must not evict


@dataclass
class Promotion:
    """What one :meth:`PageCache.promote` call decided, as fixed-shape device tensors of the
    request's length ``N`` (``[layers, N]`` for :meth:`PageCache.promote_all`): the fills to copy
    (``fill_pages[i] -> fill_slots[i]``, -1 where entry ``i`` fills nothing), the page each fill
    evicted (``evicted[i]``, -1 where it took an empty slot or fills nothing), and the hit and
    miss counts over the call's distinct pages. The fills and the evictions are every change
    the call made to the table."""

    fill_pages: torch.Tensor
    fill_slots: torch.Tensor
    evicted: torch.Tensor
    hits: torch.Tensor
    misses: torch.Tensor


class PageCache:
    """Residency, ownership and LRU stamps of a bank of ``num_slots`` pages per layer."""

    def __init__(self, layers: int, num_pages: int, num_slots: int, device: torch.device) -> None:
        if num_slots < 1:
            raise ValueError(f"a page cache needs at least one slot, got {num_slots}")
        self.layers, self.num_pages, self.num_slots = layers, num_pages, num_slots
        i32 = dict(dtype=torch.int32, device=device)
        # one spare table entry (index num_pages) and one spare slot (index num_slots) take the
        # scatters of padding entries
        self.table = torch.full((layers, num_pages + 1), -1, **i32)
        self.owner = torch.full((layers, num_slots + 1), -1, **i32)
        self.stamp = torch.full((layers, num_slots + 1), -1, dtype=torch.int64, device=device)
        self.clock = torch.zeros((), dtype=torch.int64, device=device)
        self.hits = torch.zeros(layers, dtype=torch.int64, device=device)
        self.misses = torch.zeros(layers, dtype=torch.int64, device=device)

    # ------------------------------------------------------------------ reads and writes
    def slots_of(self, layer: int, pages: torch.Tensor) -> torch.Tensor:
        """The slot of each page (-1: read it from the host); ``pages`` -1 gives -1."""
        return self.table[layer, self._table_index(pages)]

    def write_slots(self, pages: torch.Tensor) -> torch.Tensor:
        """``[layers, N]``: where a write to ``pages`` must also go in each layer's bank (-1:
        host only). Writes always go to the host first: the bank is write-through."""
        return self.table[:, self._table_index(pages)]

    def invalidate(self, pages: torch.Tensor) -> None:
        """Forget ``pages`` in every layer (vLLM handed these block ids to new content, or copied
        into them): their slots become empty and are the first to refill."""
        idx = self._table_index(pages)
        slots = self.table[:, idx].long()  # [layers, N]
        at = torch.where(slots >= 0, slots, self.num_slots)
        self.owner.scatter_(1, at, -1)
        self.stamp.scatter_(1, at, -1)
        self.table[:, idx] = -1
        self._reset_spares()

    # ------------------------------------------------------------------ promotion
    def promote(self, layer: int, pages: torch.Tensor) -> Promotion:
        """Make ``pages`` (int ``[N]``, -1 padding, repeats allowed) resident in ``layer`` as far
        as the bank allows, evicting least recently used slots that this call does not use.
        Updates the table, owners, stamps and counters; returns the fills to copy."""
        p = self._promote(slice(layer, layer + 1), pages.view(1, -1))
        return Promotion(p.fill_pages[0], p.fill_slots[0], p.evicted[0], p.hits[0], p.misses[0])

    def promote_all(self, pages: torch.Tensor) -> Promotion:
        """:meth:`promote` for every layer at once: ``pages`` is ``[layers, N]``, and so are the
        returned fills (hits and misses ``[layers]``)."""
        return self._promote(slice(None), pages)

    def _promote(self, rows: slice, pages: torch.Tensor) -> Promotion:
        n_slots = self.num_slots
        self.clock += 1
        now = self.clock
        # views of the promoted layers' rows: the scatters below update the cache in place
        table, owner, stamp = self.table[rows], self.owner[rows], self.stamp[rows]
        pages = pages.long()
        r, n = pages.shape
        device = pages.device
        stamps_now = now.expand(r, n)
        # each requested page's first occurrence, in request order: a stable sort puts the
        # earliest of equal pages first (padding sorts last as a huge key and is dropped)
        key = torch.where(pages >= 0, pages, _NEVER)
        sorted_pages, order = torch.sort(key, dim=1, stable=True)
        first = torch.ones(r, n, dtype=torch.bool, device=device)
        first[:, 1:] = sorted_pages[:, 1:] != sorted_pages[:, :-1]
        wanted = torch.zeros(r, n, dtype=torch.bool, device=device)
        wanted.scatter_(1, order, first & (sorted_pages != _NEVER))
        page_idx = torch.where(wanted, pages, self.num_pages)
        slot = table.gather(1, page_idx).long()
        hit = wanted & (slot >= 0)
        miss = wanted & (slot < 0)
        # hits: refresh their stamps; they and every empty-or-old slot not used here are victims
        hit_slot = torch.where(hit, slot, n_slots)
        stamp.scatter_(1, hit_slot, stamps_now)
        used = torch.zeros(r, n_slots + 1, dtype=torch.bool, device=device)
        used.scatter_(1, hit_slot, True)
        order_key = torch.where(used[:, :n_slots], _NEVER, stamp[:, :n_slots])
        # stable: equal stamps (e.g. empty slots) go in slot order
        victims = torch.sort(order_key, dim=1, stable=True).indices
        free = order_key.gather(1, victims) != _NEVER
        # the r-th miss (request order) takes the r-th victim, while victims last
        misses_so_far = torch.cumsum(miss, 1)
        rank = (misses_so_far - 1).clamp(0, n_slots - 1)
        victim = victims.gather(1, rank)
        take = miss & free.gather(1, rank) & (misses_so_far <= n_slots)
        fill_slot = torch.where(take, victim, n_slots)
        fill_page = torch.where(take, pages, self.num_pages)
        # the evicted pages leave the table, then the new ones enter
        old = owner.gather(1, fill_slot).long()
        evicted = take & (old >= 0)
        table.scatter_(1, torch.where(evicted, old, self.num_pages), -1)
        table.scatter_(1, fill_page, fill_slot.to(torch.int32))
        owner.scatter_(1, fill_slot, fill_page.to(torch.int32))
        stamp.scatter_(1, fill_slot, stamps_now)
        self._reset_spares()
        n_hits, n_misses = hit.sum(dim=1), miss.sum(dim=1)
        self.hits[rows] += n_hits
        self.misses[rows] += n_misses
        return Promotion(
            torch.where(take, pages, -1), torch.where(take, victim, -1),
            torch.where(evicted, old, -1), n_hits, n_misses,
        )  # fmt: skip

    def _table_index(self, pages: torch.Tensor) -> torch.Tensor:
        """Table columns of ``pages``; padding (-1) maps to the spare column."""
        return torch.where(pages >= 0, pages, self.num_pages).long()

    def _reset_spares(self) -> None:
        self.table[:, self.num_pages] = -1
        self.owner[:, self.num_slots] = -1
        self.stamp[:, self.num_slots] = -1

    # ------------------------------------------------------------------ introspection
    def occupancy(self) -> torch.Tensor:
        """Filled slots per layer (a device tensor)."""
        return (self.owner[:, : self.num_slots] >= 0).sum(dim=1)
