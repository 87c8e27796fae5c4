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

from .reference import FP8_DTYPE, FP8_MAX, SplitV, is_fp8_cache, split_v_pages

_BLOCK = 4096  # elements of a page one program copies


@triton.jit
def _copy_pages_kernel(src_ptr, dst_ptr, pages_ptr, slots_ptr, page_elems, BLOCK: tl.constexpr):
    # one program per entry, looping over its page: most entries are padding, and a decode
    # step's plan has hundreds per layer (H200, 128K: a program per piece cost 24 us per layer
    # and step with nothing to copy)
    entry = tl.program_id(0)
    slot = tl.load(slots_ptr + entry)
    if slot < 0:
        return
    src = src_ptr + tl.load(pages_ptr + entry).to(tl.int64) * page_elems
    dst = dst_ptr + slot.to(tl.int64) * page_elems
    for start in range(0, page_elems, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < page_elems
        tl.store(dst + offs, tl.load(src + offs, mask=ok), mask=ok)


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
    _copy_pages_kernel[(n,)](
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


# --------------------------------------------------------------------------- key rows
_ROW_BLOCK = 64  # listed rows per program iteration
_ROW_PROGRAMS = 512  # programs of a promotion launch: they stride over the list


@triton.jit
def _promote_rows_kernel(
    rows_ptr, table_ptr, owner_ptr, missed_ptr, missed_rows_ptr, state_ptr, n_slots, missed_cap,
    stride_row, head_dim, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    n = tl.minimum(tl.load(state_ptr), missed_cap)
    ring = tl.load(state_ptr + 1)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    for start in range(tl.program_id(0) * BLOCK_N, n, tl.num_programs(0) * BLOCK_N):
        i = start + tl.arange(0, BLOCK_N)
        ok = i < n
        r = tl.load(missed_ptr + i, mask=ok, other=0).to(tl.int64)
        slot = (ring + i) % n_slots
        prev = tl.load(owner_ptr + slot, mask=ok, other=-1).to(tl.int64)
        # the evicted row leaves the table only if the table still places it here (an owner
        # entry may be stale: invalidated, or refilled elsewhere since); -3: no entry holds it
        evict = ok & (prev >= 0)
        tl.atomic_cas(table_ptr + tl.where(evict, prev, 0),
                      tl.where(evict, slot, -3).to(tl.int32),
                      tl.full([BLOCK_N], -1, tl.int32), sem="relaxed")  # fmt: skip
        tl.store(owner_ptr + slot, r.to(tl.int32), mask=ok)
        m2 = ok[:, None] & d_ok[None, :]
        x = tl.load(missed_rows_ptr + i[:, None] * stride_row + offs_d[None, :], mask=m2)
        tl.store(rows_ptr + slot[:, None] * stride_row + offs_d[None, :], x, mask=m2)
        tl.store(table_ptr + r, slot.to(tl.int32), mask=ok)


@triton.jit
def _advance_ring_kernel(state_ptr, n_slots, missed_cap):
    n = tl.minimum(tl.load(state_ptr), missed_cap)
    tl.store(state_ptr + 1, (tl.load(state_ptr + 1) + n) % n_slots)
    tl.store(state_ptr + 4, tl.load(state_ptr + 4) + n)
    tl.store(state_ptr, 0)


def _check_rows(key_rows) -> int:
    n_slots = key_rows.owner.shape[0]
    if key_rows.missed.shape[0] > n_slots:
        raise ValueError("the missed-row list may not outgrow the bank: fills must be distinct")
    copies, rows = key_rows.missed_rows, key_rows.rows
    if copies.dtype != rows.dtype or copies.stride() != rows.stride():
        raise ValueError("the missed rows' copies are rows like the bank's")
    return n_slots


def promote_key_rows(key_rows) -> None:
    """Copy the rows a refresh listed (``reference.KeyRows.missed``, the first ``state[0]``,
    at most the list's length; their copies in ``missed_rows``) into the bank, in ring order:
    the i-th takes
    slot ``(state[1] + i) % slots``, evicting what that slot held (first in, first out), then
    move the ring on and empty the list. Fixed grid, no host sync: a refresh's graph holds it.

    First in, first out rather than least recently used: an exact LRU would sort millions of
    slot stamps per layer and refresh; with a bank at least the size of the probes' working
    set (the default split gives the pruning stages most of it) the ring rarely evicts a hot
    row, and one it evicts is listed again by the next refresh that misses it."""
    n_slots = _check_rows(key_rows)
    d = key_rows.rows.shape[1]
    _promote_rows_kernel[(_ROW_PROGRAMS,)](
        key_rows.rows, key_rows.table, key_rows.owner, key_rows.missed, key_rows.missed_rows,
        key_rows.state, n_slots, key_rows.missed.shape[0], key_rows.rows.stride(0), d,
        BLOCK_N=_ROW_BLOCK, BLOCK_D=triton.next_power_of_2(d),
    )  # fmt: skip
    _advance_ring_kernel[(1,)](key_rows.state, n_slots, key_rows.missed.shape[0])


def promote_key_rows_reference(key_rows) -> None:
    """The same in PyTorch (it syncs)."""
    n_slots = _check_rows(key_rows)
    n = min(int(key_rows.state[0]), key_rows.missed.shape[0])
    ring = int(key_rows.state[1])
    for i in range(n):
        r, slot = int(key_rows.missed[i]), (ring + i) % n_slots
        prev = int(key_rows.owner[slot])
        if prev >= 0 and int(key_rows.table[prev]) == slot:
            key_rows.table[prev] = -1
        key_rows.owner[slot] = r
        key_rows.rows[slot] = key_rows.missed_rows[i]
        key_rows.table[r] = slot
    key_rows.state[1] = (ring + n) % n_slots
    key_rows.state[4] += n
    key_rows.state[0] = 0


# --------------------------------------------------------------------------- split K / V writes
@triton.jit
def _write_split_kernel(
    key_ptr,
    value_ptr,
    slot_ptr,
    home_ptr,
    table_ptr,
    k_plane_ptr,
    v_dev_ptr,
    v_host_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_key,
    stride_value,
    block_size,
    tok_elems,
    FP8_MAX: tl.constexpr,
    ROW: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    # one program per token: its K row to the K plane, its V row to the block's home, and to
    # the layer's bank copy of a host page when there is one (write-through)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    block = slot // block_size
    offs = tl.arange(0, ROW)
    ok = offs < tok_elems
    k = tl.load(key_ptr + t.to(tl.int64) * stride_key + offs, mask=ok)
    v = tl.load(value_ptr + t.to(tl.int64) * stride_value + offs, mask=ok)
    if KV_FP8:
        # as vLLM's cache write: x / scale, saturated at the e4m3 range, then rounded
        k = tl.clamp(k.to(tl.float32) / tl.load(k_scale_ptr), -FP8_MAX, FP8_MAX)
        v = tl.clamp(v.to(tl.float32) / tl.load(v_scale_ptr), -FP8_MAX, FP8_MAX)
    k = k.to(k_plane_ptr.dtype.element_ty)
    v = v.to(v_dev_ptr.dtype.element_ty)
    # pages are [block_size, H, D] contiguous in every plane
    in_page = (slot % block_size) * tok_elems + offs
    page_elems = block_size * tok_elems
    tl.store(k_plane_ptr + block * page_elems + in_page, k, mask=ok)
    home = tl.load(home_ptr + block).to(tl.int64)
    if home >= 0:
        tl.store(v_dev_ptr + home * page_elems + in_page, v, mask=ok)
    else:
        tl.store(v_host_ptr + (-1 - home) * page_elems + in_page, v, mask=ok)
        copy = tl.load(table_ptr + block).to(tl.int64)
        if copy >= 0:
            tl.store(v_dev_ptr + copy * page_elems + in_page, v, mask=ok)


def write_split_kv(
    k_plane: torch.Tensor,
    split: SplitV,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """``reference.write_paged_kv(k_plane, key, value, slot_mapping, split=split)`` in one launch
    with no host sync: K to the plane ``[num_blocks, 1, block, H, D]``, V to each block's home
    and to its bank copy. ``key`` / ``value`` ``[T, H, D]`` may be rows of a wider tensor (vLLM's
    fused qkv), with each row's heads contiguous. Negative slots are skipped. An fp8 plane
    (uint8 storage) stores e4m3 of ``x / scale``, saturated, as vLLM's write does."""
    n = slot_mapping.shape[0]
    if n == 0:
        return
    _, _, block_size, h, d = k_plane.shape
    fp8 = is_fp8_cache(k_plane)
    for name, t in (("key", key), ("value", value)):
        if t.stride(-1) != 1 or t.stride(-2) != d:
            raise ValueError(f"{name} rows must hold their heads contiguously, got {t.stride()}")
    if not (k_plane.is_contiguous() and split.v_dev.is_contiguous()
            and split.v_host.is_contiguous()):  # fmt: skip
        raise ValueError("the K plane and V pages must be contiguous")
    if fp8 and (k_scale is None or v_scale is None):
        raise ValueError("an fp8 cache needs k_scale and v_scale to be written")
    planes = [t.view(FP8_DTYPE) if fp8 else t for t in (k_plane, split.v_dev, split.v_host)]
    scales = (k_scale, v_scale) if fp8 else (slot_mapping, slot_mapping)
    _write_split_kernel[(n,)](
        key, value, slot_mapping, split.home, split.table, *planes, *scales,
        key.stride(0), value.stride(0), block_size, h * d, FP8_MAX=FP8_MAX,
        ROW=triton.next_power_of_2(h * d), KV_FP8=fp8,
    )  # fmt: skip


@triton.jit
def _gather_split_kernel(
    k_plane_ptr, v_dev_ptr, v_host_ptr, table_ptr, dst_ptr, pages_ptr, slots_ptr, half_elems,
    BLOCK: tl.constexpr,
):
    # one program per entry: the block's K page from the plane, its V page from where the
    # layer's table places it, into the two planes of a whole page
    entry = tl.program_id(0)
    slot = tl.load(slots_ptr + entry)
    if slot < 0:
        return
    page = tl.load(pages_ptr + entry).to(tl.int64)
    where = tl.load(table_ptr + page).to(tl.int64)
    dst = dst_ptr + slot.to(tl.int64) * 2 * half_elems
    k_src = k_plane_ptr + page * half_elems
    if where >= 0:
        v_src = v_dev_ptr + where * half_elems
    else:
        v_src = v_host_ptr + (-1 - where) * half_elems
    for start in range(0, half_elems, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < half_elems
        tl.store(dst + offs, tl.load(k_src + offs, mask=ok), mask=ok)
        tl.store(dst + half_elems + offs, tl.load(v_src + offs, mask=ok), mask=ok)


def gather_split_pages(
    k_plane: torch.Tensor, split: SplitV, dst: torch.Tensor, fill_pages: torch.Tensor,
    fill_slots: torch.Tensor,
) -> None:
    """``dst[fill_slots[i]] = (K, V) of block fill_pages[i]`` wherever ``fill_slots[i] >= 0``:
    whole pages ``[n, 2, block, H, D]`` (the prefill staging) from a split cache, no host sync."""
    half = _check_split_gather(k_plane, split, dst)
    n = fill_slots.shape[0]
    if n:
        _gather_split_kernel[(n,)](
            k_plane, split.v_dev, split.v_host, split.table, dst, fill_pages.contiguous(),
            fill_slots.contiguous(), half, BLOCK=_BLOCK,
        )  # fmt: skip


def gather_split_pages_reference(
    k_plane: torch.Tensor, split: SplitV, dst: torch.Tensor, fill_pages: torch.Tensor,
    fill_slots: torch.Tensor,
) -> None:
    """The same in PyTorch (the CPU path; it syncs to drop the padding)."""
    _check_split_gather(k_plane, split, dst)
    take = fill_slots >= 0
    pages, slots = fill_pages[take].long(), fill_slots[take].long()
    dst[slots, 0] = k_plane[pages, 0]
    dst[slots, 1] = split_v_pages(split, pages).view(dst.dtype)


def _check_split_gather(k_plane: torch.Tensor, split: SplitV, dst: torch.Tensor) -> int:
    half = k_plane[0].numel()
    tensors = (k_plane, split.v_dev, split.v_host, dst)
    if not all(t.is_contiguous() and t.dtype == dst.dtype for t in tensors):
        raise ValueError("gather_split_pages needs contiguous planes and pages of one dtype")
    if k_plane.shape[1] != 1 or dst[0].numel() != 2 * half or split.v_dev[0].numel() != half:
        raise ValueError("a K plane [n, 1, ...], V pages and whole pages [n, 2, ...] of one page")
    return half
