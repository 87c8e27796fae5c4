"""The KV of the host tier's GPU + host layout, for one attention group (``placement`` decides,
this holds the bytes and applies the decisions).

- ``k_plane [L, N, 1, block, H, D]`` (GPU): every block's K, by block id;
- ``v_dev [L, gpu_pages, block, H, D]`` (GPU): the V pages of GPU-homed blocks;
- ``v_host [L, host_pages, block, H, D]`` (pinned host memory, seen by the GPU): the rest;
- ``home [N]`` int32 (GPU; :class:`~.placement.VHomes` holds the host copy): where each block's V
  lives, and ``table [L, N]`` int32, what each layer's kernels read (``reference.SplitV``); the
  two are equal until a bank keeps GPU copies of host pages.

Per step, before the forward (:meth:`SplitKV.place`): the step's new blocks get GPU homes, each
victim's V goes to the host page the new block leaves (one copy per spill, all layers at once,
on the step's stream), and both tables follow. Then the kernels write K to the plane and V to its
home (``triton_bank.write_split_kv``) and read V wherever the table says.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from vllm_infinitehip.block_manager.placement import Spill, VHomes, Victims
from vllm_infinitehip.kernels.reference import SplitV


class SplitKV:
    def __init__(
        self, num_layers: int, num_blocks: int, gpu_pages: int, page_shape: tuple[int, ...],
        dtype: torch.dtype, device: torch.device, host_alloc=None,
    ) -> None:  # fmt: skip
        """``page_shape``: one plane of a page, ``(block, H, D)``. ``host_alloc(shape, dtype)``
        makes the host pages (pinned and mapped on a GPU); by default ``torch.zeros`` on
        ``device`` (the CPU, where host memory is the device's)."""
        self.homes = VHomes(num_blocks, gpu_pages)
        self.victims = Victims(self.homes)
        host_pages = num_blocks - gpu_pages
        self.k_plane = torch.zeros(num_layers, num_blocks, 1, *page_shape, dtype=dtype,
                                   device=device)  # fmt: skip
        self.v_dev = torch.zeros(num_layers, gpu_pages, *page_shape, dtype=dtype, device=device)
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
        gpu = torch.tensor([s.gpu_page for s in spills], dtype=torch.long, device=dev)
        host = torch.tensor([s.host_page for s in spills], dtype=torch.long,
                            device=self.v_host.device)  # fmt: skip
        # the victims' V, every layer, to the host pages the new blocks leave; enqueued before
        # the step writes the new blocks into those GPU pages
        self.v_host[:, host] = self.v_dev[:, gpu].to(self.v_host.device)
        moved = [s.block for s in spills] + [int(self.homes.gpu_block[s.gpu_page])
                                             for s in spills]  # fmt: skip
        blocks = torch.tensor(moved, dtype=torch.long, device=dev)
        homes = torch.as_tensor(self.homes.home[moved], dtype=torch.int32).to(dev)
        self.home[blocks] = homes
        self.table[:, blocks] = homes
        self.spilled_blocks += len(spills)
        return spills

    def zero(self, blocks: Sequence[int]) -> None:
        """vLLM's ``new_block_ids_to_zero``, through the homes."""
        for b in blocks:
            self.k_plane[:, b] = 0
            self._v_page(b).zero_()

    def copy_blocks(self, sources: Sequence[int], destinations: Sequence[int]) -> None:
        """vLLM's ``kv_cache_block_copies`` (copy-on-write), through the homes."""
        for src, dst in zip(sources, destinations):
            self.k_plane[:, dst] = self.k_plane[:, src]
            self._v_page(dst).copy_(self._v_page(src))

    def _v_page(self, block: int) -> torch.Tensor:
        h = int(self.homes.home[block])
        return self.v_dev[:, h] if h >= 0 else self.v_host[:, -1 - h]
