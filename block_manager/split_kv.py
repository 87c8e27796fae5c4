"""The KV of the host tier's GPU + host layout, for one attention group (``placement`` decides,
this holds the bytes and applies the decisions).

- ``k_plane [L, N, 1, block, H, D]`` (GPU): every block's K, by block id;
- ``v_dev [L, gpu_pages, block, H, D]`` (GPU): the V pages of GPU-homed blocks;
- ``v_host [L, host_pages, block, H, D]`` (pinned host memory, seen by the GPU): the rest;
- ``home [N]`` int32 (GPU; :class:`~.placement.VHomes` holds the host copy): where each block's V
  lives, and ``table [L, N]`` int32, what each layer's kernels read (``reference.SplitV``): the
  home, or a copy of a host-homed page in the layer's V bank.
- the V bank (``bank_slots`` per layer, optional): ``v_dev`` pages ``gpu_pages..`` are a
  :class:`~.bank.Bank` of copies of the host-homed V pages decode attention reads, each layer
  its own, least recently used out first.

Per step, before the forward (:meth:`SplitKV.place`, the worker): the step's new blocks get GPU
homes, each victim's V goes to the host page the new block leaves (one copy per spill, all
layers at once, on the step's stream), and both tables follow. Then (:meth:`SplitKV.plan_reads`,
the attention builder) the host-homed pages the decode rows' masks read are promoted into the
bank, copied there and entered in the tables, every layer at once. The kernels then write K to
the plane and V to its home and its bank copy (``triton_bank.write_split_kv``: write-through,
so a copy never differs from its home) and read V wherever the table says.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from vllm_infinitehip.block_manager.bank import Bank
from vllm_infinitehip.block_manager.placement import Spill, VHomes, Victims
from vllm_infinitehip.kernels.reference import SplitV


class SplitKV:
    def __init__(
        self, num_layers: int, num_blocks: int, gpu_pages: int, page_shape: tuple[int, ...],
        dtype: torch.dtype, device: torch.device, host_alloc=None, bank_slots: int = 0,
    ) -> None:  # fmt: skip
        """``page_shape``: one plane of a page, ``(block, H, D)``. ``host_alloc(shape, dtype)``
        makes the host pages (pinned and mapped on a GPU); by default ``torch.zeros`` on
        ``device`` (the CPU, where host memory is the device's). ``bank_slots``: V bank pages
        per layer (0: none)."""
        self.homes = VHomes(num_blocks, gpu_pages)
        self.victims = Victims(self.homes)
        host_pages = num_blocks - gpu_pages
        self.k_plane = torch.zeros(num_layers, num_blocks, 1, *page_shape, dtype=dtype,
                                   device=device)  # fmt: skip
        # the GPU homes, then the bank's slots and its spare (padding fills land there)
        bank_pages = bank_slots + 1 if bank_slots else 0
        self.v_dev = torch.zeros(num_layers, gpu_pages + bank_pages, *page_shape, dtype=dtype,
                                 device=device)  # fmt: skip
        self.bank = None
        if bank_slots:
            self.bank = Bank(num_layers, num_blocks, bank_slots, page_shape, dtype, device,
                             pages=self.v_dev[:, gpu_pages:])  # fmt: skip
        shape = (num_layers, host_pages, *page_shape)
        if host_alloc is not None:
            self.v_host = host_alloc(shape, dtype)
        else:
            self.v_host = torch.zeros(shape, dtype=dtype, device=device)
        self.home = torch.tensor(self.homes.home, dtype=torch.int32, device=device)
        self.table = self.home.repeat(num_layers, 1)
        self.spilled_blocks = 0

    def layer(self, i: int) -> tuple[torch.Tensor, SplitV]:
        """Layer ``i``'s K plane (a cache of one plane) and V, as the kernels take them."""
        return self.k_plane[i], SplitV(self.v_dev[i], self.v_host[i], self.table[i], self.home)

    def place(
        self, new_blocks: Sequence[int], held: Mapping[str, Sequence[int]],
        freed: Iterable[int] = (), taken: Iterable[int] = (),
    ) -> list[Spill]:  # fmt: skip
        """Home this step's new blocks on the GPU, spilling victims' V to the host; returns the
        spills. ``held``: request id -> its blocks; ``freed`` / ``taken``: the blocks the step's
        output freed and handed out (:class:`~.placement.Victims`)."""
        self.victims.follow(freed, taken)
        spills = self.homes.place(new_blocks, self.victims.order(held))
        self.victims.spilled(spills)
        if not spills:
            return spills
        dev = self.home.device
        layers, host_pages = self.v_host.shape[:2]
        layer = torch.arange(layers, device=dev).view(layers, 1)
        gpu = torch.tensor([s.gpu_page for s in spills], dtype=torch.long, device=dev)
        host = torch.tensor([s.host_page for s in spills], dtype=torch.long, device=dev)
        # the victims' V, every layer, to the host pages the new blocks leave; enqueued before
        # the step writes the new blocks into those GPU pages. Whole pages per program, in wide
        # stores: an indexed assignment writes host memory an element at a time over the bus
        page = self.v_dev.shape[2:]
        copy_pages(
            self.v_dev.view(-1, *page), self.v_host.view(-1, *page),
            (layer * self.v_dev.shape[1] + gpu).view(-1), (layer * host_pages + host).view(-1),
        )  # fmt: skip
        moved = [s.block for s in spills] + [int(self.homes.gpu_block[s.gpu_page])
                                             for s in spills]  # fmt: skip
        blocks = torch.tensor(moved, dtype=torch.long, device=dev)
        homes = torch.as_tensor(self.homes.home[moved], dtype=torch.int32).to(dev)
        self.home[blocks] = homes
        self.table[:, blocks] = homes
        if self.bank is not None:
            # only host-homed pages have copies: a block that gets a GPU home (a new one) drops
            # its copy before the step writes the block anew
            self.bank.cache.invalidate(blocks)
        self.spilled_blocks += len(spills)
        return spills

    def plan_reads(
        self, pages: torch.Tensor, promote: torch.Tensor, refreshing: torch.Tensor,
        fill_entries: int,
    ) -> None:  # fmt: skip
        """Once per step with decode rows, for every layer (device ops, no host sync): the V
        bank keeps the host-homed pages the rows read. ``pages [L, B, P]``: the block ids each
        layer's attention reads per row (``bank.decode_read_pages``); ``promote [B]``: rows whose
        masks are what they will read; ``refreshing [B]``: rows that rerun their stages (for
        the counters). Copies the fills (the first ``fill_entries`` of each layer's plan), then
        points each layer's table at its copies. Until a first spill no block a request can
        read is homed on the host (new blocks get GPU homes): nothing to do."""
        if not self.spilled_blocks:
            return
        bank = self.bank
        valid = pages >= 0
        on_host = valid & (self.home[pages.clamp(min=0).long()] < 0)
        promotion = bank.plan_promotion(torch.where(on_host, pages, -1), promote, refreshing)
        layers, host_pages = self.v_host.shape[:2]
        fill_blocks = bank.fill_pages[:, :fill_entries]
        fill_slots = bank.fill_slots[:, :fill_entries]
        take = fill_slots >= 0
        layer = torch.arange(layers, device=pages.device).view(layers, 1)
        src = layer * host_pages - 1 - self.home[fill_blocks.clamp(min=0)].long()
        dst = layer * self.v_dev.shape[1] + self.homes.gpu_pages + fill_slots
        page = self.v_dev.shape[2:]
        copy_pages(
            self.v_host.view(-1, *page), self.v_dev.view(-1, *page),
            torch.where(take, src, 0).view(-1), torch.where(take, dst, -1).view(-1),
        )  # fmt: skip
        self._retable(torch.cat([promotion.evicted, promotion.fill_pages], 1))

    def _retable(self, blocks: torch.Tensor) -> None:
        """Each layer reads a host-homed block from its bank copy when it has one, for the
        blocks ``[L, n]`` whose copies a promotion filled or evicted (-1 padding): the only
        entries it changed, so the step's cost follows its reads, not the pool's size."""
        # padding recomputes block 0's entry, which it leaves as it is
        idx = blocks.clamp(min=0)
        copies = self.bank.cache.table.gather(1, idx)
        home = self.home[idx]
        self.table.scatter_(1, idx, torch.where((home < 0) & (copies >= 0),
                                                copies + self.homes.gpu_pages, home))  # fmt: skip

    def zero(self, blocks: Sequence[int]) -> None:
        """vLLM's ``new_block_ids_to_zero``, through the homes."""
        for b in blocks:
            self.k_plane[:, b] = 0
            self._v_page(b).zero_()
        self._forget(blocks)

    def copy_blocks(self, sources: Sequence[int], destinations: Sequence[int]) -> None:
        """vLLM's ``kv_cache_block_copies`` (copy-on-write), through the homes."""
        for src, dst in zip(sources, destinations):
            self.k_plane[:, dst] = self.k_plane[:, src]
            self._v_page(dst).copy_(self._v_page(src))
        self._forget(destinations)

    def _forget(self, blocks: Sequence[int]) -> None:
        """Bank copies of ``blocks`` leave (their homes were written outside the kernels)."""
        if self.bank is None or not blocks:
            return
        idx = torch.tensor(list(blocks), dtype=torch.long, device=self.home.device)
        self.bank.cache.invalidate(idx)
        self.table[:, idx] = self.home[idx]

    def _v_page(self, block: int) -> torch.Tensor:
        h = int(self.homes.home[block])
        return self.v_dev[:, h] if h >= 0 else self.v_host[:, -1 - h]


def copy_pages(src: torch.Tensor, dst: torch.Tensor, pages: torch.Tensor,
               slots: torch.Tensor) -> None:  # fmt: skip
    """``dst[slots[i]] = src[pages[i]]`` where ``slots[i] >= 0``: on a GPU one program per entry
    that returns at once on padding (no host sync), on the CPU the PyTorch reference."""
    if dst.device.type == "cuda":
        from vllm_infinitehip.kernels.triton_bank import copy_pages as kernel

        kernel(src, dst, pages, slots)
    else:
        from vllm_infinitehip.kernels.triton_bank import copy_pages_reference

        copy_pages_reference(src, dst, pages, slots)
