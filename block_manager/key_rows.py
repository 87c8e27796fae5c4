"""The host tier's GPU cache for the pruning stages: single K rows, the size of one probe.

SelectRep probes one key (one token of one KV head: 256 bytes in bf16 at ``head_dim`` 128) at
a time, scattered over the whole context. Read from pinned host memory such rows arrive at
about 9 GB/s (a page-sized read reaches 51), and a page bank would have to hold every K page of
the context to serve them, since stage 0's probes touch every page. The rows a row's probes
read change slowly from one refresh to the next, so a bank of rows (the paper's "mask cache",
INFINITEHIP.md §3) serves them: at 512K, about 3/4 of a million rows per layer.

Per layer (``reference.KeyRows``): the copies, a table from cache row to slot, each slot's
owner, the list of rows the last refresh missed, and ``[listed, ring, hits, misses, filled]``.

- The select kernel reads a row the table places in the bank from there, else from the cache,
  and lists each missed row once (``triton_decode._key_row_rows``).
- The lister keeps a copy of each listed row beside the list; after a layer's stages,
  :func:`kernels.triton_bank.promote_key_rows` moves them in, in ring order (first in, first
  out), inside the refresh's graph: refresh steps only, no host sync, and each missed row
  crosses the bus once.
- Rows of pages vLLM frees or rewrites leave the table (:meth:`KeyRowBank.invalidate`, through
  ``tier.HostTier.release``), and so do rows a step writes (:meth:`KeyRowBank.forget_writes`):
  a slot's copy always equals its row in the cache, so reading it changes nothing.
"""

from __future__ import annotations

import torch
from vllm_infinitehip.kernels.reference import KeyRows

# table entries: the row is absent; absent and listed by the running refresh
ABSENT, LISTED = -1, -2


# rows one refresh of a layer may list and promote: their copies are kept beside the list
# (16 MiB per layer in bf16 at head_dim 128); a refresh that misses more promotes these, and the
# next refresh lists the rest again
MAX_LISTED = 65536


class KeyRowBank:
    """``layers`` key-row banks of ``num_slots`` rows of ``head_dim`` over a cache of
    ``num_pages`` pages of ``page_size`` tokens and ``kv_heads`` heads; a refresh of a layer
    promotes at most :data:`MAX_LISTED` rows (or the bank's slots, if fewer)."""

    def __init__(
        self, layers: int, num_pages: int, page_size: int, kv_heads: int, head_dim: int,
        num_slots: int, dtype: torch.dtype, device: torch.device,
    ) -> None:  # fmt: skip
        if num_slots < 1:
            raise ValueError(f"a key-row bank needs at least one slot, got {num_slots}")
        listed = min(num_slots, MAX_LISTED)
        self.layers, self.num_pages, self.num_slots = layers, num_pages, num_slots
        self.rows_per_page = page_size * kv_heads
        n_rows = num_pages * self.rows_per_page
        i32 = dict(dtype=torch.int32, device=device)
        self.rows = torch.zeros(layers, num_slots + 1, head_dim, dtype=dtype, device=device)
        self.table = torch.full((layers, n_rows + 1), ABSENT, **i32)
        self.owner = torch.full((layers, num_slots), -1, **i32)
        self.missed = torch.zeros(layers, listed, **i32)
        self.missed_rows = torch.zeros(layers, listed, head_dim, dtype=dtype, device=device)
        self.state = torch.zeros(layers, 5, dtype=torch.int64, device=device)
        self.row_bytes = head_dim * self.rows.element_size()
        self._heads = torch.arange(kv_heads, device=device)
        self.write_columns = torch.empty(0, dtype=torch.int64, device=device)

    @staticmethod
    def bytes_per_slot(head_dim: int, dtype: torch.dtype) -> int:
        """A slot's row and its owner entry."""
        return head_dim * torch.empty((), dtype=dtype).element_size() + 4

    @classmethod
    def sized(
        cls, nbytes: int, layers: int, num_pages: int, page_size: int, kv_heads: int,
        head_dim: int, dtype: torch.dtype, device: torch.device,
    ) -> KeyRowBank | None:  # fmt: skip
        """As many slots per layer as ``nbytes`` holds once the tables are paid for (at most a
        row per cache row); None when that is not even a page's worth of rows per layer."""
        n_rows = num_pages * page_size * kv_heads
        per_slot = cls.bytes_per_slot(head_dim, dtype)
        per_listed = per_slot + 4  # a listed row's id and copy
        room = nbytes // layers - (n_rows + 1) * 4 - 2 * per_slot  # less the table, spares
        slots = (room - MAX_LISTED * per_listed) // per_slot
        if slots < MAX_LISTED:  # a list as long as the bank
            slots = room // (per_slot + per_listed)
        if slots < page_size * kv_heads:
            return None
        return cls(layers, num_pages, page_size, kv_heads, head_dim, int(min(slots, n_rows)),
                   dtype, device)  # fmt: skip

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.rows, self.table, self.owner, self.missed, self.missed_rows,
                             self.state))  # fmt: skip

    def layer(self, layer: int) -> KeyRows:
        return KeyRows(self.rows[layer], self.table[layer], self.owner[layer],
                       self.missed[layer], self.missed_rows[layer], self.state[layer])  # fmt: skip

    # ------------------------------------------------------------------ invalidation
    def invalidate(self, pages: torch.Tensor) -> None:
        """Every row of ``pages`` leaves every layer's table (vLLM freed or rewrote them).
        Their slots keep stale owners: the ring refills them in turn, and the table decides."""
        r = pages.long().view(-1, 1) * self.rows_per_page
        r = (r + torch.arange(self.rows_per_page, device=r.device)).view(-1)
        self.table.index_fill_(1, r, ABSENT)

    # ------------------------------------------------------------------ per step
    def allocate_plan(self, max_tokens: int) -> None:
        """The persistent buffer a captured graph reads (rewritten every step): the table
        columns of the rows the step writes."""
        spare = self.table.shape[1] - 1
        self.write_columns = torch.full((max_tokens * self._heads.numel(),), spare,
                                        dtype=torch.int64, device=self.table.device)  # fmt: skip

    def plan_writes(self, slot_mapping: torch.Tensor | None) -> None:
        """Once per step, for every layer: the table columns of the rows the step writes
        (every KV head of each written token); padding, and everything at capture (``None``),
        maps to the spare column."""
        spare = self.table.shape[1] - 1
        if slot_mapping is None:
            self.write_columns.fill_(spare)
            return
        r = slot_mapping.long().view(-1, 1) * self._heads.numel() + self._heads
        columns = torch.where(slot_mapping.view(-1, 1) >= 0, r, spare).view(-1)
        self.write_columns[: columns.numel()] = columns
        self.write_columns[columns.numel() :] = spare

    def forget_writes(self, layer: int, n_tokens: int) -> None:
        """The rows the step's first ``n_tokens`` write (:meth:`plan_writes`) leave the
        layer's table: the cache now holds what the bank's copy may not. Fixed shape: inside
        the step's graph."""
        columns = self.write_columns[: n_tokens * self._heads.numel()]
        self.table[layer].index_fill_(0, columns, ABSENT)

    # ------------------------------------------------------------------ introspection
    def occupancy(self) -> torch.Tensor:
        """Slots per layer whose row the table still places there (a device tensor)."""
        owner = self.owner.long()
        placed = self.table.gather(1, owner.clamp(min=0)).long()
        slots = torch.arange(self.num_slots, device=owner.device)
        return ((owner >= 0) & (placed == slots)).sum(dim=1)

    def stats(self, reset: bool = False) -> dict[str, int]:
        """The pruning stages' probes served by the bank and by the host (hits, misses), rows
        copied in, and what is resident; ``reset`` zeroes the counts (not the residency)."""
        hits, misses, filled = (int(x) for x in self.state[:, 2:5].sum(dim=0).tolist())
        out = {"key_row_hits": hits, "key_row_misses": misses, "key_rows_filled": filled,
               "key_rows_resident": int(self.occupancy().sum()),
               "key_row_slots": self.num_slots * self.layers,
               # what missed probes read from the host (promotions copy what they read)
               "key_row_host_bytes": misses * self.row_bytes}  # fmt: skip
        if reset:
            self.state[:, 2:5].zero_()
        return out
