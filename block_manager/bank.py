"""The GPU bank of one attention group: copies of hot host pages per layer, and what moves them.

vLLM's KV cache tensor holds every page (on the GPU it is a view of pinned host memory, see
:mod:`block_manager.host_store`); the bank holds copies of the pages decode reads, in slots that
a :class:`PageCache` assigns. The decode kernels take ``(pages, table)`` of a layer
(:meth:`Bank.layer`) and read a page from the bank when the table holds a slot for it, else from
the cache. Three things keep the copies equal to the host, so greedy output cannot change:

- writes go to the cache and, for resident pages, to the bank (:meth:`Bank.write_through`);
- a refresh step promotes the pages its new masks read and copies the fills
  (:meth:`Bank.promote`);
- pages that vLLM frees or rewrites outside attention are invalidated (``tier.HostTier.release``).

Everything is fixed-shape device work, so it runs inside captured decode graphs.

Prefill chunks read a request's whole context again for every query block, far too often to
read it over the bus, so a chunk of more than one query block first copies the request's pages
into :class:`PrefillStaging` (one request's worth of GPU memory, shared by the layers, which run
one after another) and reads them there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from vllm_infinitehip.block_manager.page_cache import PageCache

# Bank.counters entries: pages the decode attention read from the bank / the host, on refresh
# steps and on reuse steps; pages copied into the bank; decode layer-steps counted.
COUNTER_NAMES = (
    "attn_bank_pages_refresh", "attn_host_pages_refresh", "attn_bank_pages_reuse",
    "attn_host_pages_reuse", "filled_pages", "decode_layer_steps",
)  # fmt: skip


def decode_read_pages(
    block_table: torch.Tensor, seq_lens: torch.Tensor, slots: torch.Tensor,
    final_starts: torch.Tensor, final_counts: torch.Tensor, sink_tokens: int, window_tokens: int,
    page_size: int,
) -> torch.Tensor:
    """``[B, P]`` page ids a sparse decode row's attention reads, most valuable first: sink,
    window (newest first: it is read until the window passes it), final blocks. -1 padding;
    repeats possible. Rows without a state slot (dense) read nothing here."""
    device = block_table.device
    b, max_pages = block_table.shape
    seq_lens = seq_lens.long()
    row_slot = slots.long().clamp(min=0)
    width = final_starts.shape[1]
    valid_final = torch.arange(width, device=device) < final_counts[row_slot].view(b, 1)
    final_idx = torch.where(valid_final, final_starts[row_slot].long() // page_size, -1)
    sink_n = -(-sink_tokens // page_size)
    sink_idx = torch.arange(sink_n, device=device).expand(b, sink_n)
    win_n = -(-window_tokens // page_size) + 1
    first_win = (seq_lens - window_tokens).clamp(min=0) // page_size
    last = ((seq_lens - 1) // page_size).view(b, 1)
    win_idx = last - torch.arange(win_n, device=device)
    win_idx = torch.where(win_idx >= first_win.view(b, 1), win_idx, -1)
    idx = torch.cat([sink_idx, win_idx, final_idx], dim=1)
    valid = (idx >= 0) & (idx <= last) & (slots >= 0).view(b, 1)
    pages = block_table.gather(1, idx.clamp(0, max_pages - 1)).long()
    return torch.where(valid, pages, -1)


class Bank:
    """Page copies ``[layers, slots + 1, *page]`` (the last slot takes padding writes), their
    :class:`PageCache`, and device counters (:data:`COUNTER_NAMES`)."""

    def __init__(
        self, layers: int, num_pages: int, num_slots: int, page_shape: tuple[int, ...],
        dtype: torch.dtype, device: torch.device,
    ) -> None:
        self.cache = PageCache(layers, num_pages, num_slots, device)
        self.pages = torch.zeros(layers, num_slots + 1, *page_shape, dtype=dtype, device=device)
        self.page_size = page_shape[1]  # [2, block_size, H, D]
        self.counters = torch.zeros(len(COUNTER_NAMES), dtype=torch.int64, device=device)

    @classmethod
    def sized(
        cls, bank_bytes: int, layers: int, num_pages: int, page_shape: tuple[int, ...],
        dtype: torch.dtype, device: torch.device,
    ) -> Bank:
        """As many slots per layer as ``bank_bytes`` holds (at least one)."""
        page_bytes = torch.Size(page_shape).numel() * torch.empty((), dtype=dtype).element_size()
        slots = max(1, bank_bytes // (layers * page_bytes) - 1)
        return cls(layers, num_pages, min(slots, num_pages), page_shape, dtype, device)

    @property
    def num_slots(self) -> int:
        return self.cache.num_slots

    @property
    def page_bytes(self) -> int:
        return self.pages[0, 0].numel() * self.pages.element_size()

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What the kernels take: the layer's pages and residency table (int32, one entry per
        cache page plus the spare)."""
        return self.pages[layer], self.cache.table[layer]

    # ------------------------------------------------------------------ per step
    def write_through(
        self, layer: int, slot_mapping: torch.Tensor,
        write: Callable[[torch.Tensor, torch.Tensor], None],
    ) -> None:
        """Repeat a KV write into the bank for tokens whose page is resident: ``write(cache,
        slot_mapping)`` is the same writer the host cache got, aimed at the bank's pages."""
        bs = self.page_size
        page = torch.div(slot_mapping, bs, rounding_mode="floor")
        slot = self.cache.slots_of(layer, torch.where(slot_mapping >= 0, page, -1)).long()
        bank_slots = torch.where((slot_mapping >= 0) & (slot >= 0), slot * bs + slot_mapping % bs, -1)
        write(self.pages[layer], bank_slots)

    def promote(
        self, layer: int, kv_cache: torch.Tensor, pages: torch.Tensor, refreshing: torch.Tensor,
        copy: Callable[..., None],
    ) -> None:
        """A decode step's bank work for one layer. Rows that refreshed their masks
        (``refreshing[b]``) promote the pages they now read (``pages[b]``, from
        :func:`decode_read_pages`) and the fills are copied from the cache
        (``copy(kv_cache, bank_pages, fill_pages, fill_slots)``); then every row's reads are
        counted as bank or host reads."""
        # column by column: every row's sink pages, then windows, then final blocks, so that one
        # row's final blocks never take the slots another row's window needs
        wanted = torch.where(refreshing.view(-1, 1), pages, -1).t().reshape(-1)
        promotion = self.cache.promote(layer, wanted)
        copy(kv_cache, self.pages[layer], promotion.fill_pages, promotion.fill_slots)
        valid = pages >= 0
        resident = valid & (self.cache.slots_of(layer, pages) >= 0)
        host = valid & ~resident
        refresh_rows = refreshing.view(-1, 1)
        c = self.counters
        c[0] += (resident & refresh_rows).sum()
        c[1] += (host & refresh_rows).sum()
        c[2] += (resident & ~refresh_rows).sum()
        c[3] += (host & ~refresh_rows).sum()
        c[4] += (promotion.fill_slots >= 0).sum()
        c[5] += 1

    # ------------------------------------------------------------------ introspection
    def stats(self, reset: bool = False) -> dict[str, int]:
        """Counters, promotion hits and misses, and occupancy (all layers), read back to the
        host; ``reset`` zeroes the counters (not the residency)."""
        out = dict(zip(COUNTER_NAMES, self.counters.tolist()))
        out["promote_hits"] = int(self.cache.hits.sum())
        out["promote_misses"] = int(self.cache.misses.sum())
        out["resident_pages"] = int(self.cache.occupancy().sum())
        out["bank_slots"] = self.num_slots * self.cache.layers
        out["layers"] = self.cache.layers
        out["page_bytes"] = self.page_bytes
        if reset:
            self.counters.zero_()
            self.cache.hits.zero_()
            self.cache.misses.zero_()
        return out


class PrefillStaging:
    """GPU room for one request's pages, ``[max_pages, *page]``, and the identity block table
    that addresses them there."""

    def __init__(
        self, max_pages: int, page_shape: tuple[int, ...], dtype: torch.dtype,
        device: torch.device,
    ) -> None:  # fmt: skip
        self.pages = torch.empty(max_pages, *page_shape, dtype=dtype, device=device)
        self.table = torch.arange(max_pages, dtype=torch.int32, device=device)
        self.page_size = page_shape[1]

    @staticmethod
    def bytes_for(max_pages: int, page_shape: tuple[int, ...], dtype: torch.dtype) -> int:
        return max_pages * torch.Size(page_shape).numel() * torch.empty((), dtype=dtype).element_size()

    def stage(
        self, kv_cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int,
        copy: Callable[..., None],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the request's first ``seq_len`` tokens' pages here; returns the cache and
        block-table row to read them through."""
        n = -(-seq_len // self.page_size)
        copy(kv_cache, self.pages, block_table_row[:n], self.table[:n])
        return self.pages, self.table
