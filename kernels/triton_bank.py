"""Copies into the host tier's GPU bank: the pages a promotion decided, host view -> bank slot.

A promotion (``block_manager.page_cache.PageCache.promote``) returns fixed-shape fill lists,
mostly padding (-1). ``index_copy_`` would copy a page for every padding entry too; one program
per (entry, piece of a page) that returns at once on padding copies only the real fills, with no
host sync, so it runs inside a captured decode graph. The source may be a GPU view of pinned host
memory: each program then reads its piece straight over the bus.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096  # elements of a page one program copies


@triton.jit
def _copy_pages_kernel(src_ptr, dst_ptr, pages_ptr, slots_ptr, page_elems, BLOCK: tl.constexpr):
    entry = tl.program_id(0)
    slot = tl.load(slots_ptr + entry)
    if slot < 0:
        return
    page = tl.load(pages_ptr + entry)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < page_elems
    x = tl.load(src_ptr + page.to(tl.int64) * page_elems + offs, mask=ok)
    tl.store(dst_ptr + slot.to(tl.int64) * page_elems + offs, x, mask=ok)


def _check(kv_cache: torch.Tensor, bank_pages: torch.Tensor) -> int:
    page_elems = kv_cache[0].numel()
    if not (kv_cache.is_contiguous() and bank_pages.is_contiguous()):
        raise ValueError("copy_pages needs contiguous cache and bank pages")
    if bank_pages.dtype != kv_cache.dtype or bank_pages[0].numel() != page_elems:
        raise ValueError("bank pages must have the cache's dtype and page shape")
    return page_elems


def copy_pages(
    kv_cache: torch.Tensor, bank_pages: torch.Tensor, fill_pages: torch.Tensor,
    fill_slots: torch.Tensor,
) -> None:
    """``bank_pages[fill_slots[i]] = kv_cache[fill_pages[i]]`` wherever ``fill_slots[i] >= 0``."""
    page_elems = _check(kv_cache, bank_pages)
    n = fill_slots.shape[0]
    if n == 0:
        return
    grid = (n, triton.cdiv(page_elems, _BLOCK))
    _copy_pages_kernel[grid](
        kv_cache, bank_pages, fill_pages.contiguous(), fill_slots.contiguous(), page_elems,
        BLOCK=_BLOCK,
    )  # fmt: skip


def copy_pages_reference(
    kv_cache: torch.Tensor, bank_pages: torch.Tensor, fill_pages: torch.Tensor,
    fill_slots: torch.Tensor,
) -> None:
    """The same in PyTorch (the CPU path; it syncs to drop the padding)."""
    _check(kv_cache, bank_pages)
    take = fill_slots >= 0
    bank_pages[fill_slots[take].long()] = kv_cache[fill_pages[take].long()]
