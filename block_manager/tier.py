"""The host KV tier of one worker process: its budget, and the GPU caches that read through it.

The worker (:mod:`vllm_infinitehip.worker`) sizes the tier when vLLM asks it how much KV memory it
has, and installs it here; the attention builders of the same process then size their banks from
it and register their :class:`PageCache`, and the worker tells the tier
which block ids vLLM freed or rewrote behind the kernels' back (:meth:`HostTier.release`). One tier
per process: a worker process drives one device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from vllm_infinitehip.block_manager.page_cache import PageCache


@dataclass
class HostTier:
    """What the worker decided: bytes of host KV (the capacity vLLM's scheduler sees) and of
    the GPU bank; and the page caches of this process's attention groups.

    With ``layout == "split"`` (``block_manager.split_kv``) vLLM's ``num_blocks`` blocks keep K
    on the GPU and V on ``gpu_pages`` GPU pages and the host; the attention groups register
    their :class:`~.split_kv.SplitKV`, and the worker places each step's new blocks through
    :meth:`place` before the step runs."""

    host_bytes: int
    bank_bytes: int
    # what vLLM's profiling left for KV on the GPU: the bank and the prefill staging share it
    device_budget: int = 0
    caches: list[PageCache] = field(default_factory=list)
    # distinct block ids of each release() call, summed over calls: what the worker reported
    released_blocks: int = 0
    layout: str = "host"
    num_blocks: int = 0
    gpu_pages: int = 0
    # the split layout's V bank: pages per layer for copies of host-homed V (0: none), and
    # its spare (bank_bytes counts both)
    bank_pages: int = 0
    groups: list = field(default_factory=list)  # SplitKV of each attention group
    # (shape, dtype) -> a tensor in pinned host memory that the GPU reads (the split layout's
    # host pages, on a GPU; None on the CPU, where host memory is the device's)
    host_alloc: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None

    def register_split(self, group) -> None:
        self.groups.append(group)

    def place(self, new_blocks, held, freed, taken) -> None:
        """The split layout's step: GPU homes for ``new_blocks``, victims' V to the host
        (``SplitKV.place``)."""
        for group in self.groups:
            group.place(new_blocks, held, freed, taken)

    def zero(self, blocks) -> None:
        for group in self.groups:
            group.zero(blocks)

    def copy_blocks(self, sources, destinations) -> None:
        for group in self.groups:
            group.copy_blocks(sources, destinations)

    def register(self, cache: PageCache) -> None:
        self.caches.append(cache)

    def release(self, block_ids: Iterable[int]) -> None:
        """Forget these blocks in every bank: vLLM freed them (a finished, aborted or preempted
        request) or is about to write them outside attention (zeroing, block copies)."""
        ids = sorted({int(b) for b in block_ids})
        self.released_blocks += len(ids)
        if not ids or not self.caches:
            return
        for cache in self.caches:
            # filtered on the host: a boolean index on the device would sync
            valid = [i for i in ids if i < cache.num_pages]
            if valid:
                cache.invalidate(torch.tensor(valid, dtype=torch.int64).to(cache.table.device))


_TIER: HostTier | None = None


def install(tier: HostTier | None) -> None:
    global _TIER
    _TIER = tier


def current() -> HostTier | None:
    """The tier of this process, or None when offload is off (or not sized yet)."""
    return _TIER
