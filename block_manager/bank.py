"""The GPU bank of one attention group: copies of hot host pages per layer, and what moves them.

vLLM's KV cache tensor holds every page (on the GPU it is a view of pinned host memory, see
:mod:`block_manager.host_store`); the bank holds copies of the pages decode reads, in slots that
a :class:`PageCache` assigns. The decode kernels take ``(pages, table)`` of a layer
(:meth:`Bank.layer`) and read a page from the bank when the table holds a slot for it, else from
the cache. Three things keep the copies equal to the host, so greedy output cannot change:

- writes go to the cache and, for resident pages, to the bank (:meth:`Bank.plan_writes`);
- every decode step promotes the pages its rows' masks read (:meth:`Bank.plan_promotion`), and
  each layer copies its fills before it reads (:meth:`Bank.layer_work`);
- pages that vLLM frees or rewrites outside attention are invalidated (``tier.HostTier.release``).

The builder plans all of it once per step for every layer at once (a few dozen device ops, run
eagerly before the step's graph); a layer only launches its copy and its bank write, both
fixed-shape, so decode still replays as one CUDA graph. A row's promotion uses the masks it
starts the step with: pages a refresh newly selects are read from the host at that step and
promoted at the next.

Prefill chunks read a request's whole context again for every query block, far too often to
read it over the bus, so a chunk of more than one query block first copies the request's pages
into :class:`PrefillStaging` (one request's worth of GPU memory, shared by the layers, which run
one after another) and reads them there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from vllm_infinitehip.block_manager.page_cache import PageCache, Promotion

# Bank.counters entries: pages the sparse decode rows read from the bank / the host (counted when
# the step is planned, from the masks it starts with), for rows that refresh this step and rows
# that reuse their masks; pages copied into the bank; decode layer-steps counted.
COUNTER_NAMES = (
    "attn_bank_pages_refresh", "attn_host_pages_refresh", "attn_bank_pages_reuse",
    "attn_host_pages_reuse", "filled_pages", "decode_layer_steps",
)  # fmt: skip


def decode_read_pages(
    block_table: torch.Tensor, seq_lens: torch.Tensor, slots: torch.Tensor,
    final_starts: torch.Tensor, final_counts: torch.Tensor, sink_tokens: int, window_tokens: int,
    page_size: int,
    block_ends: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[L, B, P]`` page ids each layer's attention reads for a sparse decode row, most
    valuable first: sink, window (newest first: it is read until the window passes it), final
    blocks (``final_starts [L, slots, W]`` token starts, ``final_counts [L, slots]`` valid).
    ``block_ends`` (``[B]``, blocks read past their start's page: ``PruneParams``'
    ``extend_reused_blocks``): per row, how many tokens each block is read from its start;
    the page of each block's last token is listed after the starts' (``P`` grows by ``W``).
    -1 padding; repeats possible. Rows without a state slot (dense) read nothing here."""
    device = block_table.device
    b, max_pages = block_table.shape
    layers, _, width = final_starts.shape
    seq_lens = seq_lens.long()
    row_slot = slots.long().clamp(min=0)
    valid_final = torch.arange(width, device=device) < final_counts[:, row_slot].unsqueeze(2)
    starts = final_starts[:, row_slot].long()
    final_idx = torch.where(valid_final, starts // page_size, -1)
    if block_ends is not None:
        last_tok = starts + block_ends.long().view(1, b, 1) - 1
        final_idx = torch.cat([final_idx, torch.where(valid_final, last_tok // page_size, -1)], 2)
    sink_n = -(-sink_tokens // page_size)
    sink_idx = torch.arange(sink_n, device=device).expand(b, sink_n)
    win_n = -(-window_tokens // page_size) + 1
    first_win = (seq_lens - window_tokens).clamp(min=0) // page_size
    last = ((seq_lens - 1) // page_size).view(b, 1)
    win_idx = last - torch.arange(win_n, device=device)
    win_idx = torch.where(win_idx >= first_win.view(b, 1), win_idx, -1)
    shared = torch.cat([sink_idx, win_idx], dim=1).expand(layers, b, sink_n + win_n)
    idx = torch.cat([shared, final_idx], dim=2)
    valid = (idx >= 0) & (idx <= last) & (slots >= 0).view(1, b, 1)
    table = block_table.expand(layers, b, max_pages)
    pages = table.gather(2, idx.clamp(0, max_pages - 1)).long()
    return torch.where(valid, pages, -1)


class Bank:
    """Page copies ``[layers, slots + 1, *page]`` (the last slot takes padding writes), their
    :class:`PageCache`, and device counters (:data:`COUNTER_NAMES`). ``pages``: where the slots
    live when they are part of other memory (the split layout's V pages,
    :class:`~.split_kv.SplitKV`); by default a tensor of their own."""

    def __init__(
        self, layers: int, num_pages: int, num_slots: int, page_shape: tuple[int, ...],
        dtype: torch.dtype, device: torch.device, pages: torch.Tensor | None = None,
    ) -> None:  # fmt: skip
        self.cache = PageCache(layers, num_pages, num_slots, device)
        shape = (layers, num_slots + 1, *page_shape)
        if pages is not None and (tuple(pages.shape) != shape or pages.dtype != dtype):
            raise ValueError(f"bank pages must be {shape} {dtype}, got {tuple(pages.shape)} "
                             f"{pages.dtype}")  # fmt: skip
        self.pages = torch.zeros(shape, dtype=dtype, device=device) if pages is None else pages
        self.page_size = page_shape[-3]  # [2, block_size, H, D], or V alone [block_size, H, D]
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
    def allocate_plan(self, max_entries: int, max_tokens: int) -> None:
        """Persistent per-step buffers a captured graph reads (rewritten every step): each
        layer's fills to copy, and each layer's bank slot for every token the step writes."""
        i64 = dict(dtype=torch.int64, device=self.pages.device)
        layers = self.cache.layers
        self.fill_pages = torch.full((layers, max_entries), -1, **i64)
        self.fill_slots = torch.full((layers, max_entries), -1, **i64)
        self.write_slots = torch.full((layers, max_tokens), -1, **i64)
        # every entry at or past these is padding (-1): a step resets only what the last one
        # wrote past its own length, not the whole buffer (sized for max_num_seqs rows, every
        # layer: tens of MB to rewrite at every decode step)
        self._fills_to = 0
        self._writes_to = 0

    def plan_promotion(self, pages: torch.Tensor, promote: torch.Tensor,
                       refreshing: torch.Tensor) -> Promotion:  # fmt: skip
        """Once per decode step, for every layer: rows with ``promote[b]`` make the pages they
        read (``pages [L, B, P]``, from :func:`decode_read_pages`) resident, and the fills land
        in :attr:`fill_pages` / :attr:`fill_slots` for each layer to copy before it reads. Then
        the rows' reads are counted as bank or host reads (``refreshing[b]``: this step reruns
        the row's stages). Returns the promotion (what changed in the residency tables)."""
        layers, b, p = pages.shape
        # column by column: every row's sink pages, then windows, then final blocks, so that one
        # row's final blocks never take the slots another row's window needs
        wanted = torch.where(promote.view(1, b, 1), pages, -1)
        wanted = wanted.transpose(1, 2).reshape(layers, -1)
        promotion = self.cache.promote_all(wanted)
        n = wanted.shape[1]
        if self._fills_to > n:
            self.fill_pages[:, n : self._fills_to] = -1
            self.fill_slots[:, n : self._fills_to] = -1
        self.fill_pages[:, :n] = promotion.fill_pages
        self.fill_slots[:, :n] = promotion.fill_slots
        self._fills_to = n
        valid = pages >= 0
        at = torch.where(valid, pages, self.cache.num_pages).view(layers, -1)
        slot = self.cache.table.gather(1, at)
        resident = valid & (slot.view(layers, b, p) >= 0)
        host = valid & ~resident
        refresh_rows = refreshing.view(1, b, 1)
        counts = torch.stack([
            (resident & refresh_rows).sum(), (host & refresh_rows).sum(),
            (resident & ~refresh_rows).sum(), (host & ~refresh_rows).sum(),
            (promotion.fill_slots >= 0).sum(),
            torch.full((), layers, dtype=torch.int64, device=pages.device),
        ])  # fmt: skip
        self.counters += counts
        return promotion

    def clear_fills(self) -> None:
        self.fill_pages[:, : self._fills_to] = -1
        self.fill_slots[:, : self._fills_to] = -1
        self._fills_to = 0

    def clear_writes(self) -> None:
        self.write_slots[:, : self._writes_to] = -1
        self._writes_to = 0

    def plan_writes(self, slot_mapping: torch.Tensor) -> None:
        """Once per step, for every layer: the bank slot of each token the step writes (-1:
        the page is not resident, the write goes to the host only)."""
        n = slot_mapping.shape[0]
        bs, layers = self.page_size, self.cache.layers
        page = torch.div(slot_mapping, bs, rounding_mode="floor")
        page = torch.where(slot_mapping >= 0, page, self.cache.num_pages).view(1, n)
        slot = self.cache.table.gather(1, page.expand(layers, n)).long()
        if self._writes_to > n:
            self.write_slots[:, n : self._writes_to] = -1
        self.write_slots[:, :n] = torch.where(slot >= 0, slot * bs + slot_mapping % bs, -1)
        self._writes_to = n

    def layer_work(
        self, layer: int, kv_cache: torch.Tensor, n_tokens: int, copy: Callable[..., None],
        write: Callable[[torch.Tensor, torch.Tensor], None], fill_entries: int,
    ) -> None:  # fmt: skip
        """A layer's share of the step's plan, before it reads: copy its fills from the cache
        (the first ``fill_entries`` of the plan: the decode rows' share, or at capture the
        graph's batch), then repeat the KV write into its resident pages
        (``write(bank_pages, bank_slot_mapping)``, the writer the host cache got)."""
        if fill_entries:
            copy(
                kv_cache, self.pages[layer], self.fill_pages[layer, :fill_entries],
                self.fill_slots[layer, :fill_entries],
            )  # fmt: skip
        write(self.pages[layer], self.write_slots[layer, :n_tokens])

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
        # with this bank's page size: summed over groups, bytes stay right where pages would not
        out["host_read_bytes"] = self.page_bytes * (
            out["attn_host_pages_refresh"] + out["attn_host_pages_reuse"] + out["filled_pages"]
        )
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
        element = torch.empty((), dtype=dtype).element_size()
        return max_pages * torch.Size(page_shape).numel() * element

    def stage(
        self, kv_cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int,
        copy: Callable[..., None],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the request's first ``seq_len`` tokens' pages here; returns the cache and
        block-table row to read them through."""
        n = -(-seq_len // self.page_size)
        copy(kv_cache, self.pages, block_table_row[:n], self.table[:n])
        return self.pages, self.table
