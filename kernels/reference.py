"""Pure-PyTorch InfiniteHiP: the CPU execution path and the oracle for the Triton kernels.

Everything here follows shared/docs/INFINITEHIP.md §1 and works on one request at a time, on keys
and values gathered contiguously from vLLM's paged cache (``[T, H_kv, D]``). Positions are 0-based
and the queries of a request are its last ``Nq`` positions.

The functions are small and composable so that each step can be tested alone:

- :func:`gather_paged_kv` reads a request's K/V out of the paged cache;
- :func:`pool_queries` groups queries into blocks and average-pools them by a stage stride;
- :func:`select_rep_scores` is one SelectRep pass (one pruning stage's scoring);
- :func:`run_stages` is the N-stage cascade with the between-stage top-k / sort / split, and it
  returns each stage's input so decode can resume from any stage (the mask cache);
- :func:`sparse_key_mask` turns selected blocks into the per-query key set (sink + window +
  selected, causal, each key once);
- :func:`masked_attention` / :func:`dense_attention` compute attention over a key set.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vllm_infinitehip.kernels.rope import (
    RopeTable,
    apply_rotation,
    chunk_indexed_positions,
    relative_positions,
    rope_cos_sin,
    rotate,
)

NEG_INF = float("-inf")
# combines a stage's scores [blocks or rows, chunks] across processes (same shape back)
ScoreReduce = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class StageParams:
    """One pruning stage as the kernels see it (``keep_tokens`` may differ per layer)."""

    chunk_size: int
    keep_tokens: int
    block_size_q: int
    query_stride: int


@dataclass(frozen=True)
class RopePlan:
    """Position remapping of one layer (INFINITEHIP.md §2) for keys cached already rotated.

    ``pruning``: ``"relative"`` (query at sw'+1, left probe at 0, right probe at 1),
    ``"chunk-indexed"`` (key at its chunk's ordinal, query at min(p, C + sw')) or ``"none"``.
    ``bsa``: ``"streaming"`` (sink and selected keys laid out just left of the window) or ``"none"``.
    ``trained_context``: a query block whose last query sits below it is scored and attends at
    true positions, as with ``"none"``; only blocks (decode: rows) reaching it are remapped.
    Inside the trained length true positions are what the model learned, and the remapping
    costs accuracy there (RULER at 1x on Qwen2.5-Coder-0.5B: niah_multikey_1 40 -> 75 without
    it). 0 remaps every query.
    """

    table: RopeTable
    pruning: str = "relative"
    bsa: str = "streaming"
    trained_context: int = 0
    # the first query position the pruning stages score at remapped positions; None: the
    # trained length, as attention. 0 scores every query remapped while attention below the
    # trained length keeps true positions (``remap_pruning: "always"``).
    pruning_from: int | None = None

    def remaps(self, last_pos: torch.Tensor) -> torch.Tensor:
        """Which query blocks (by their last query's position) attend remapped."""
        return last_pos >= self.trained_context

    def prunes_remapped(self, last_pos: torch.Tensor) -> torch.Tensor:
        """Which query blocks (by their last query's position) score at remapped positions."""
        return last_pos >= self.pruning_threshold

    @property
    def pruning_threshold(self) -> int:
        return self.trained_context if self.pruning_from is None else self.pruning_from


@dataclass(frozen=True)
class PruneParams:
    """What the pruning cascade and block-sparse attention need for one layer."""

    sink_tokens: int
    window_tokens: int
    stages: tuple[StageParams, ...]
    probe: str = "midpoint"
    rope: RopePlan | None = None
    # How a stage's per-head chunk scores become the layer's one ranking (HEAD_REDUCTIONS):
    # "max" (the paper's) and "z-score" are in the kernels and the config; "log-softmax" is a
    # research setting of the reference (benchmarks/needle_decode.py).
    head_reduction: str = "max"
    # The last stage scores a chunk by its best key instead of bisecting (every key loaded).
    exact_last_stage: bool = False
    # Every stage does: the chunk-max rule without representatives, what a mask could keep at
    # its budgets. A research setting of the reference (benchmarks/needle_decode.py).
    exact_every_stage: bool = False
    # Stages after the first drop candidates that start inside the window (:func:`run_stages`).
    drop_window_candidates: bool = False
    # Decode reads each selected block as many tokens past its end as steps have passed since
    # it was chosen, at most one block more (:func:`sparse_attention`'s ``extend_blocks``).
    extend_reused_blocks: bool = False
    # The query heads of a KV group bisect one path per chunk (select_rep_scores'
    # ``group_probes``): each probe key is read once for the group, not once per head.
    group_probes: bool = False

    @property
    def block_size_q(self) -> int:
        """The final blocks' query block: block-sparse attention's (the last stage's). An earlier
        stage may score coarser blocks, a multiple of the next stage's (:func:`run_stages`)."""
        return self.stages[-1].block_size_q

    @property
    def block_size_k(self) -> int:
        return self.stages[-1].chunk_size

    @property
    def scan_window(self) -> int:
        """sw' of §1.3: the window shrunk by one stage-1 chunk during the scan."""
        return self.window_tokens - self.stages[0].chunk_size

    @property
    def prune_remap_from(self) -> int:
        """The first query position the pruning stages score remapped; 0 without a remapping."""
        return self.rope.pruning_threshold if self.rope is not None else 0

    @property
    def remap_from(self) -> int:
        """The first query position the layer remaps (``RopePlan.trained_context``); 0 without a
        remapping, as the kernels take it (they only read it with a RoPE table)."""
        return self.rope.trained_context if self.rope is not None else 0


@dataclass
class Candidates:
    """The chunks a stage scores, per query block: starts ``[n_blocks, C]`` and a valid mask."""

    starts: torch.Tensor
    valid: torch.Tensor


@dataclass
class PruneResult:
    """Final selected blocks per query block and every stage's input (for mask refresh)."""

    block_starts: torch.Tensor  # [n_blocks, K] int64, ascending; invalid entries at the end
    block_valid: torch.Tensor  # [n_blocks, K] bool
    stage_inputs: list[Candidates]  # stage_inputs[i] is the input of stage i


# --------------------------------------------------------------------------- paged KV access
# vLLM's ``--kv-cache-dtype fp8`` (e4m3): the cache is allocated as uint8 and the backends view
# it as float8_e4m3fn; a layer's ``_k_scale`` / ``_v_scale`` (float32) dequantize it.
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448


def is_fp8_cache(kv_cache: torch.Tensor) -> bool:
    """Whether ``kv_cache`` holds fp8 e4m3 values (vLLM's uint8 storage or the fp8 view)."""
    return kv_cache.dtype in (torch.uint8, FP8_DTYPE)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor as its bytes: indexing and ``where`` work on uint8 on every device."""
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def _scale_of(scale: float | torch.Tensor | None, name: str, device: torch.device) -> torch.Tensor:
    if scale is None:
        raise ValueError(f"an fp8 KV cache needs {name} (the layer's _{name}) to be dequantized")
    return torch.as_tensor(scale, dtype=torch.float32, device=device).reshape(())


def dequantize_fp8(
    stored: torch.Tensor, scale: float | torch.Tensor, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``float32(stored) * scale`` (what every kernel computes on load), then ``out_dtype``."""
    x = stored.view(FP8_DTYPE).float() * _scale_of(scale, "scale", stored.device)
    return x.to(out_dtype)


def quantize_fp8(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """``x / scale`` as e4m3, saturated at +-448 like vLLM's cache write on the GPU (Triton's
    fp32 -> fp8 store is ``satfinite``; torch's cast would turn an overflow into NaN)."""
    x = x.float() / _scale_of(scale, "scale", x.device)
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


@dataclass(frozen=True)
class KeyRows:
    """One layer's key-row bank of the host tier (``block_manager.key_rows``): GPU copies of
    single K rows (one token of one KV head), which is what the pruning stages probe.

    - ``rows [slots + 1, D]``: the copies, in the cache's dtype (the last slot is spare);
    - ``table [R + 1]`` int32: the slot of cache row ``r = (page * block_size + offset) * H_kv +
      kv_head``, ``-1`` when absent, ``-2`` while a refresh has listed it as missed (read from
      the cache as absent); the last entry is spare;
    - ``owner [slots]`` int32: the row each slot holds (``-1``: empty; may be stale, the table
      decides);
    - ``missed [cap]`` int32: rows the last refresh read from the cache, to promote, and
      ``missed_rows [cap, D]`` their copies (read once from the host, by the refresh);
    - ``state`` int64 ``[5]``: missed rows listed (may exceed ``cap``), the ring position of the
      next fill, hits and misses counted by the pruning kernels, and rows copied in.
    """

    rows: torch.Tensor
    table: torch.Tensor
    owner: torch.Tensor
    missed: torch.Tensor
    missed_rows: torch.Tensor
    state: torch.Tensor


@dataclass(frozen=True)
class SplitV:
    """Where one layer's V pages are when the host tier splits K from V
    (``block_manager.placement``): K stays in a plane indexed by block id (``kv_cache`` of shape
    ``[num_blocks, 1, block_size, H_kv, D]``), each block's V has one home, on the GPU or on the
    host, and a GPU bank may hold copies of host pages.

    - ``v_dev [S, block_size, H_kv, D]``: GPU pages, the GPU homes and the bank's slots;
    - ``v_host [N_h, block_size, H_kv, D]``: host pages (the GPU's view of pinned memory);
    - ``table [num_blocks]`` int32, this layer's reads: ``>= 0`` a page of ``v_dev`` (the home,
      or a bank copy of a host page), ``< 0`` host page ``-1 - table[b]``;
    - ``home [num_blocks]`` int32, shared by the layers, where writes go: ``>= 0`` a page of
      ``v_dev``, ``< 0`` host page ``-1 - home[b]``. A write to a block whose ``table`` entry is
      a bank copy (``table >= 0 > home``) goes to the copy as well.

    fp8 pages are uint8 like the cache."""

    v_dev: torch.Tensor
    v_host: torch.Tensor
    table: torch.Tensor
    home: torch.Tensor


def split_v_pages(split: SplitV, blocks: torch.Tensor) -> torch.Tensor:
    """The V pages ``[n, block_size, H_kv, D]`` of ``blocks`` (int64), each read where
    ``split.table`` places it."""
    slot = split.table[blocks].long()
    dev = _bytes(split.v_dev).index_select(0, slot.clamp(min=0))
    host = _bytes(split.v_host).index_select(0, (-1 - slot).clamp(min=0))
    return torch.where((slot >= 0).view(-1, 1, 1, 1), dev, host)


def gather_paged_kv(
    kv_cache: torch.Tensor,
    block_table_row: torch.Tensor,
    seq_len: int,
    bank: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    key_rows: KeyRows | None = None,
    split: SplitV | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one request as contiguous ``[seq_len, H_kv, D]`` tensors.

    ``kv_cache`` is this plugin's layout ``[num_blocks, 2, block_size, H_kv, D]``; with ``split``
    (:class:`SplitV`) it is the K plane ``[num_blocks, 1, block_size, H_kv, D]`` and V is read
    where ``split`` places each block. With
    ``bank = (pages, table)`` (the host tier's GPU cache, as the kernels take it) a page whose
    ``table`` entry holds a slot is read from ``pages`` instead; with ``key_rows``
    (:class:`KeyRows`, what the pruning stages read) a K row that it holds is read there.

    An fp8 cache (uint8 storage or float8_e4m3fn; the bank's pages in the same dtype) is
    dequantized after the bank/cache choice: ``float32(stored) * k_scale`` (``v_scale`` for V),
    as the kernels do on load, returned in ``out_dtype`` (default float32, the dtype the kernels
    hold dequantized rows in until their products). Other caches ignore the scales (vLLM's
    layers hold scales of 1 whatever the cache dtype) and return the cache's dtype, or
    ``out_dtype`` when given.
    """
    fp8 = is_fp8_cache(kv_cache)
    if fp8:  # fail before any work, and on the caller's line
        k_scale = _scale_of(k_scale, "k_scale", kv_cache.device)
        v_scale = _scale_of(v_scale, "v_scale", kv_cache.device)
    block_size = kv_cache.shape[2]
    n_blocks = (seq_len + block_size - 1) // block_size
    blocks = block_table_row[:n_blocks].long()
    kv = _bytes(kv_cache).index_select(0, blocks)  # [n, 2, bs, H, D]
    if split is not None:
        if bank is not None or kv_cache.shape[1] != 1:
            raise ValueError("a split cache is a K plane [num_blocks, 1, ...] without a page bank")
        kv = torch.stack([kv[:, 0], split_v_pages(split, blocks)], dim=1)
    if bank is not None:
        pages, table = bank
        slot = table[blocks].long()
        resident = (slot >= 0).view(-1, 1, 1, 1, 1)
        kv = torch.where(resident, _bytes(pages).index_select(0, slot.clamp(min=0)), kv)
    k = kv[:, 0].reshape(n_blocks * block_size, *kv.shape[-2:])[:seq_len]
    v = kv[:, 1].reshape(n_blocks * block_size, *kv.shape[-2:])[:seq_len]
    if key_rows is not None:
        h = kv.shape[-2]
        tok = torch.arange(seq_len, device=k.device)
        first = (blocks[tok // block_size] * block_size + tok % block_size) * h
        r = first.view(-1, 1) + torch.arange(h, device=k.device)
        slot = key_rows.table[r].long()
        k = torch.where((slot >= 0).unsqueeze(-1),
                        _bytes(key_rows.rows)[slot.clamp(min=0)], k)  # fmt: skip
    if fp8:
        out_dtype = out_dtype or torch.float32
        return dequantize_fp8(k, k_scale, out_dtype), dequantize_fp8(v, v_scale, out_dtype)
    if out_dtype is not None:
        k, v = k.to(out_dtype), v.to(out_dtype)
    return k, v


def write_paged_kv(
    kv_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    split: SplitV | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
) -> None:
    """Store new tokens' K/V at their slots; negative slots (padding) are skipped. An fp8 cache
    stores :func:`quantize_fp8` of ``key / k_scale`` and ``value / v_scale``, as vLLM's
    ``triton_reshape_and_cache_flash`` does on the GPU; other caches ignore the scales.

    With ``split`` (:class:`SplitV`) ``kv_cache`` is the K plane: V goes to the block's home,
    and to its bank copy where the layer's table reads one."""
    if split is not None:
        _write_split_kv(kv_cache, split, key, value, slot_mapping, k_scale, v_scale)
        return
    fp8 = is_fp8_cache(kv_cache)
    if fp8:
        k_scale = _scale_of(k_scale, "k_scale", kv_cache.device)
        v_scale = _scale_of(v_scale, "v_scale", kv_cache.device)
    n = slot_mapping.shape[0]
    key, value = key[:n], value[:n]
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
    block_size = kv_cache.shape[2]
    slots = slot_mapping.long()
    blocks, offsets = slots // block_size, slots % block_size
    if fp8:
        cache = _bytes(kv_cache)
        cache[blocks, 0, offsets] = _bytes(quantize_fp8(key, k_scale))
        cache[blocks, 1, offsets] = _bytes(quantize_fp8(value, v_scale))
        return
    kv_cache[blocks, 0, offsets] = key.to(kv_cache.dtype)
    kv_cache[blocks, 1, offsets] = value.to(kv_cache.dtype)


def _write_split_kv(
    k_plane: torch.Tensor,
    split: SplitV,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float | torch.Tensor | None,
    v_scale: float | torch.Tensor | None,
) -> None:
    n = slot_mapping.shape[0]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    key, value = key[:n][keep], value[:n][keep]
    if is_fp8_cache(k_plane):
        key = _bytes(quantize_fp8(key, _scale_of(k_scale, "k_scale", key.device)))
        value = _bytes(quantize_fp8(value, _scale_of(v_scale, "v_scale", key.device)))
    else:
        key, value = key.to(k_plane.dtype), value.to(k_plane.dtype)
    block_size = k_plane.shape[2]
    blocks, offsets = slots // block_size, slots % block_size
    _bytes(k_plane)[blocks, 0, offsets] = key
    home = split.home[blocks].long()
    on_dev = home >= 0
    _bytes(split.v_dev)[home[on_dev], offsets[on_dev]] = value[on_dev]
    _bytes(split.v_host)[-1 - home[~on_dev], offsets[~on_dev]] = value[~on_dev]
    copy = split.table[blocks].long()
    banked = ~on_dev & (copy >= 0)
    _bytes(split.v_dev)[copy[banked], offsets[banked]] = value[banked]


# --------------------------------------------------------------------------- query blocks
def query_block_ids(num_queries: int, block_size_q: int) -> torch.Tensor:
    """Block index of each query: consecutive groups of ``block_size_q`` from the first query."""
    return torch.arange(num_queries) // block_size_q


def pool_queries(q: torch.Tensor, block_size_q: int, stride: int) -> torch.Tensor:
    """``[Nq, H, D]`` -> ``[n_blocks, H, block_size_q // stride, D]``.

    Each pooled row is the mean of ``stride`` consecutive queries of a block (fewer for a final
    partial group). Rows that hold no query at all (past the end) are NaN and are ignored by the
    max over queries in :func:`select_rep_scores`.
    """
    nq, h, d = q.shape
    n_blocks = (nq + block_size_q - 1) // block_size_q
    padded = n_blocks * block_size_q
    qf = q.float()
    real = torch.ones(nq, dtype=torch.float32, device=q.device)
    if padded != nq:
        qf = torch.cat([qf, qf.new_zeros(padded - nq, h, d)])
        real = torch.cat([real, real.new_zeros(padded - nq)])
    groups = block_size_q // stride
    qf = qf.view(n_blocks, groups, stride, h, d).sum(2)
    count = real.view(n_blocks, groups, stride).sum(2)
    pooled = qf / count[:, :, None, None]  # NaN where a group holds no query
    return pooled.permute(0, 2, 1, 3).contiguous()  # [n_blocks, H, groups, D]


# --------------------------------------------------------------------------- SelectRep
# Bytes of one product in :func:`key_score_table`. Larger products are fresh pages every time
# (glibc maps blocks past its mmap threshold anew) and leave the cache: on 2 CPU cores, a
# 16K-token SmolLM2 stage (128 blocks, 16 pooled queries, 9 heads) took 2.29 s as products of 8
# blocks (75 MB each) and 0.45 s at this size, with bitwise the same table.
KEY_TABLE_STEP_BYTES = 4 << 20


def key_score_table(q_pooled: torch.Tensor, k: torch.Tensor, num_keys: int) -> torch.Tensor:
    """``[n_blocks, H_q, num_keys]``: each key's best score over a block's (pooled) queries.

    ``q_pooled`` is ``[n_blocks, H_q, n_q, D]`` (scaled; NaN rows are absent queries), ``k`` is
    ``[T, H_kv, D]``. SelectRep only ever asks for ``max_q <q, k_t>``, so one GQA matmul per group
    of blocks answers every probe of a stage. The groups (and, past one block, key tiles) keep
    each product near ``KEY_TABLE_STEP_BYTES``; every score is the same dot product whatever
    the grouping.
    """
    nb, hq, nq, d = q_pooled.shape
    hkv = k.shape[1]
    group = hq // hkv
    kt = k[:num_keys].float().permute(1, 2, 0)  # [H_kv, D, T]
    qz = _fill_absent_queries(q_pooled)
    table = q_pooled.new_empty(nb, hq, num_keys)
    per_key = hq * nq * 4
    blocks = max(1, KEY_TABLE_STEP_BYTES // max(1, per_key * num_keys))
    tile = max(1, min(num_keys, KEY_TABLE_STEP_BYTES // per_key))
    for lo in range(0, nb, blocks):
        hi = min(nb, lo + blocks)
        qg = qz[lo:hi].reshape(hi - lo, hkv, group * nq, d)
        for t0 in range(0, num_keys, tile):
            t1 = min(num_keys, t0 + tile)
            scores = torch.matmul(qg, kt[:, :, t0:t1])
            table[lo:hi, :, t0:t1] = scores.view(hi - lo, hq, nq, t1 - t0).amax(dim=2)
    return table


# Bytes of gathered probe keys one pass of :func:`select_rep_scores` holds at a time.
SELECT_REP_GROUP_BYTES = 1 << 20


def select_rep_scores(
    q_pooled: torch.Tensor,
    k: torch.Tensor,
    cand: Candidates,
    chunk_size: int,
    key_limit: torch.Tensor,
    probe: str = "midpoint",
    q_pooled_right: torch.Tensor | None = None,
    chunk_rotation: tuple[torch.Tensor, RopeTable] | None = None,
    head_reduction: str = "max",
    exact: bool = False,
    landmarks: torch.Tensor | None = None,
    group_probes: bool = False,
) -> torch.Tensor:
    """Score every candidate chunk of every query block with SelectRep (§1.4).

    ``exact``: score each chunk by its best key (every key probed, against the left-branch
    queries) instead of bisecting; meant for the last stage, whose chunks are a few keys.
    ``landmarks`` (``[T, H]``, ``H`` dividing ``H_q``: :func:`landmark_scores`; not with
    ``exact``): score each chunk by one key per head, its representative (the chunk's key of
    the highest landmark score in that head's column; :func:`landmark_representatives`),
    instead of bisecting.

    RoPE remapping (§2): ``q_pooled_right`` scores right-branch probes with other queries (the
    relative style puts the left and right probe keys at different positions); with
    ``chunk_rotation = (delta [n_blocks, C], table)`` every probe key of chunk ``j`` is rotated by
    ``delta[:, j]`` first (the chunk-indexed style).

    ``q_pooled`` is ``[n_blocks, H_q, n_q, D]`` and already multiplied by the softmax scale;
    ``k`` is ``[T, H_kv, D]``. Chunk ``j`` of block ``b`` covers
    ``[starts[b, j], min(starts[b, j] + chunk_size, key_limit[b]))``. Each head bisects its own
    path: at each step it probes one key per half (the half's midpoint, or its first key) and
    descends into the half whose probe scores higher (max over the block's queries). The chunk
    score is the best probe score seen, max-reduced over heads, so all heads of a layer share the
    ranking (``head_reduction``: see :func:`reduce_heads`). Invalid or empty chunks score
    ``-inf``. Returns ``[n_blocks, C]`` float32.

    ``group_probes`` (not with ``exact``, which scores per head as before): the query heads of
    each KV group bisect one path per chunk, as if they were one head holding all their
    queries: each step descends into the half whose probe scores higher over every query of
    the group, and the group's best probe is its score, so the ranking reduces over KV heads.
    A probe key is then read once for the group instead of once per query head.

    Query blocks are independent, so they are scored a group at a time, with the gathered
    probe keys of a group near ``SELECT_REP_GROUP_BYTES``: intermediates that size are reused
    by the allocator and stay in cache, where whole-request ones are fresh pages every bisection
    step (on 2 CPU cores that cost more than the arithmetic).
    """
    if group_probes and not exact:
        q_pooled, q_pooled_right = group_queries(q_pooled, k.shape[1], q_pooled_right)
    nb, hq, _, d = q_pooled.shape
    c = cand.starts.shape[1]
    if c == 0:
        return q_pooled.new_empty(nb, 0)
    num_keys = int(key_limit.max())
    # Score just the probed keys when keys turn per chunk or when probes are few next to the
    # keys, else look them up in a whole-context table. Decided once per call, so that every
    # group computes its products the same way (the two ways round differently).
    probes = 1 if landmarks is not None and not exact else 4 * bisect_steps(chunk_size)
    use_table = chunk_rotation is None and probes * c >= num_keys
    group = max(1, SELECT_REP_GROUP_BYTES // (hq * c * d * 4))
    parts = []
    for lo in range(0, nb, group):
        sl = slice(lo, min(nb, lo + group))
        parts.append(_select_rep_group(
            q_pooled[sl], k, Candidates(cand.starts[sl], cand.valid[sl]), chunk_size,
            key_limit[sl], probe, None if q_pooled_right is None else q_pooled_right[sl],
            None if chunk_rotation is None else (chunk_rotation[0][sl], chunk_rotation[1]),
            num_keys, use_table, head_reduction, exact, landmarks,
        ))  # fmt: skip
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def group_queries(
    q_pooled: torch.Tensor, num_kv_heads: int, q_pooled_right: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pooled queries ``[n_blocks, H_q, n_q, D]`` as ``[n_blocks, H_kv, G * n_q, D]``: the G
    query heads of each KV group (query head ``h`` reads KV head ``h // G``) as one head
    holding all their rows (``select_rep_scores``' ``group_probes``); the right-branch queries
    alike."""
    nb, hq, nq, d = q_pooled.shape
    if hq % num_kv_heads:
        raise ValueError(f"H_q={hq} must be a multiple of H_kv={num_kv_heads}")
    shape = (nb, num_kv_heads, hq // num_kv_heads * nq, d)
    right = None if q_pooled_right is None else q_pooled_right.reshape(shape)
    return q_pooled.reshape(shape), right


def _select_rep_group(
    q_pooled: torch.Tensor,
    k: torch.Tensor,
    cand: Candidates,
    chunk_size: int,
    key_limit: torch.Tensor,
    probe: str,
    q_pooled_right: torch.Tensor | None,
    chunk_rotation: tuple[torch.Tensor, RopeTable] | None,
    num_keys: int,
    use_table: bool,
    head_reduction: str,
    exact: bool = False,
    landmarks: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`select_rep_scores` for one group of query blocks (``num_keys``: the call's)."""
    nb, hq = q_pooled.shape[:2]
    c = cand.starts.shape[1]
    n_steps = bisect_steps(chunk_size)
    if not use_table:
        hkv = k.shape[1]
        head_kv = (torch.arange(hq, device=k.device) // (hq // hkv)).view(1, hq, 1)
        # one flat row per (token, kv head): index_select is the fastest gather on every device
        k_rows = k[:num_keys].float().reshape(num_keys * hkv, -1)
        # absent pooled rows (NaN) copy the block's first row, so the max over queries is the
        # max over present ones without masking the large score tensor
        sides = [
            _fill_absent_queries(qs).transpose(-1, -2)
            for qs in (q_pooled, q_pooled if q_pooled_right is None else q_pooled_right)
        ]
        if chunk_rotation is not None:
            delta, rope_table = chunk_rotation
            # every probe of a chunk turns by the same delta: cos/sin once per stage
            cos, sin = rope_cos_sin(delta.view(nb, 1, c), rope_table.to(k.device))

        def probe_score(pos: torch.Tensor, right: bool = False) -> torch.Tensor:
            rows = pos.clamp(0, num_keys - 1) * hkv + head_kv
            keys = k_rows.index_select(0, rows.reshape(-1)).view(*rows.shape, -1)
            if chunk_rotation is not None:
                keys = apply_rotation(keys, cos, sin, rope_table)
            # [nb, hq, c, D] @ [nb, hq, D, n_q]: the max over queries runs along the last dim
            return torch.matmul(keys, sides[int(right)]).amax(dim=-1)
    else:
        left_table = key_score_table(q_pooled, k, num_keys).view(-1)
        right_table = (
            left_table
            if q_pooled_right is None
            else key_score_table(q_pooled_right, k, num_keys).view(-1)
        )
        row = (torch.arange(nb * hq, device=k.device) * num_keys).view(nb, hq, 1)

        def probe_score(pos: torch.Tensor, right: bool = False) -> torch.Tensor:
            return (right_table if right else left_table)[row + pos.clamp(0, num_keys - 1)]

    left = cand.starts.view(nb, 1, c).expand(nb, hq, c).clone()
    right = torch.minimum(cand.starts + chunk_size, key_limit.view(nb, 1)).view(nb, 1, c)
    right = right.expand(nb, hq, c).clone()
    valid = (cand.valid & (cand.starts < key_limit.view(nb, 1))).view(nb, 1, c).expand(nb, hq, c)
    best = torch.full((nb, hq, c), NEG_INF, device=k.device)
    if exact:
        # every key of the chunk, in order; a valid chunk holds at least one (start < limit)
        for j in range(chunk_size):
            pos = left + j
            live = valid & (pos < right)
            if not bool(live.any()):
                break
            best = torch.where(live, torch.maximum(best, probe_score(pos)), best)
        n_steps = 0
    elif landmarks is not None:
        reps = landmark_representatives(landmarks[:num_keys], left, right, chunk_size)
        best = torch.where(valid, probe_score(reps), best)
        n_steps = 0
    for _ in range(n_steps):
        live = valid & (right - left > 1)
        if not bool(live.any()):
            break
        mid = (left + right) // 2
        if probe == "midpoint":
            p_left, p_right = (left + mid) // 2, (mid + right) // 2
        else:  # "first": the paper's Algorithm 3 probes the first index of each branch
            p_left, p_right = left, mid
        s_left, s_right = probe_score(p_left), probe_score(p_right, right=True)
        go_left = s_left > s_right
        best = torch.where(live, torch.maximum(best, torch.where(go_left, s_left, s_right)), best)
        right = torch.where(live & go_left, mid, right)
        left = torch.where(live & ~go_left, mid, left)

    # A chunk of one key (or a partial chunk narrowed to one) is scored by that key alone.
    single = valid & torch.isneginf(best)
    best = torch.where(single, probe_score(left), best)
    best = best.masked_fill(~valid, NEG_INF)
    return reduce_heads(best, head_reduction)


# The queries after a key that its landmark score averages (the authors' later releases).
LANDMARK_WINDOW = 512


def landmark_sums(
    q: torch.Tensor, k: torch.Tensor, scale: float, q_start: int = 0,
    window: int = LANDMARK_WINDOW, per_group: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """What one call's queries add to the keys' landmark scores: ``(sums [T, H], counts [T])``.

    ``q``: ``[Nq, H_q, D]`` at positions ``q_start ..`` (unscaled, rotated as cached); ``k``:
    ``[T, H_kv, D]`` at ``0 ..``. Query ``p`` adds ``scale * q_p . k_t`` to key ``t`` when
    ``t < p <= t + window``; ``counts[t]`` is how many queries did. ``H`` is ``H_q`` (a score
    per query head), or with ``per_group`` ``H_kv`` (summed over the group's query heads: one
    score, and so one representative, per KV head). Calls add up: the keys of a prompt
    prefilled in chunks get the same sums as in one call."""
    nq, hq, d = q.shape
    t_keys, hkv = k.shape[:2]
    qs = (q.float() * scale).view(nq, hkv, hq // hkv, d)
    sums = torch.zeros(t_keys, hkv if per_group else hq, device=k.device)
    counts = torch.zeros(t_keys, dtype=torch.int64, device=k.device)
    for a in range(max(0, q_start - window), t_keys, window):  # a tile reads two of queries
        b = min(t_keys, a + window)
        p0, p1 = max(a + 1, q_start), min(b + window, q_start + nq)
        if p1 <= p0:
            continue
        s = torch.einsum("mhgd,nhd->nhgm", qs[p0 - q_start : p1 - q_start], k[a:b].float())
        pos = torch.arange(p0, p1, device=k.device)
        t = torch.arange(a, b, device=k.device).view(-1, 1)
        band = (pos > t) & (pos <= t + window)  # [n, m]
        tile = s.masked_fill(~band.view(b - a, 1, 1, -1), 0.0).sum(-1)  # [n, H_kv, g]
        sums[a:b] = tile.sum(-1) if per_group else tile.reshape(b - a, hq)
        counts[a:b] = band.sum(-1)
    return sums, counts


def landmark_means(sums: torch.Tensor, counts: torch.Tensor, group: int = 1) -> torch.Tensor:
    """Landmark scores from :func:`landmark_sums` (summed over ``group`` query heads per
    column): the mean logit, ``-inf`` for a key that no query followed."""
    n = counts.view(-1, 1).to(sums.dtype) * group
    return torch.where(n > 0, sums / n.clamp(min=1), NEG_INF)


def landmark_scores(
    q: torch.Tensor, k: torch.Tensor, scale: float, q_start: int = 0,
    window: int = LANDMARK_WINDOW, per_group: bool = False,
) -> torch.Tensor:  # fmt: skip
    """``[T, H]``: each key's landmark score, the mean of its scaled logits over the queries
    that follow it within ``window`` (:func:`landmark_sums`; per query head, or with
    ``per_group`` over the query heads of its KV head), ``-inf`` where none does.
    Query-independent: how much the text right after a key reads it, so a chunk's best-scored
    key stands for the chunk (:func:`landmark_representatives`) where bisection may miss a
    sharp one."""
    sums, counts = landmark_sums(q, k, scale, q_start, window, per_group)
    return landmark_means(sums, counts, q.shape[1] // k.shape[1] if per_group else 1)


def landmark_representatives(
    landmarks: torch.Tensor, left: torch.Tensor, right: torch.Tensor, chunk_size: int
) -> torch.Tensor:
    """Per query head, the key of ``[left, right)`` (``[..., H_q, C]``, at most ``chunk_size``
    keys) with the highest landmark score (``[T, H]``: ``H`` divides ``H_q``, and query head
    ``h`` reads column ``h // (H_q / H)``); the first key where none scores."""
    span = torch.arange(chunk_size, device=left.device)
    pos = left.unsqueeze(-1) + span  # [..., H_q, C, l]
    inside = pos < right.unsqueeze(-1)
    hq = left.shape[-2]
    column = (torch.arange(hq, device=left.device) // (hq // landmarks.shape[1])).view(hq, 1, 1)
    scores = landmarks.t()[column, pos.clamp(0, landmarks.shape[0] - 1)]
    scores = scores.masked_fill(~inside, NEG_INF)
    return left + scores.argmax(-1)


def landmark_table(
    landmarks: torch.Tensor, sink: int, chunk_size: int, n_chunks: int
) -> torch.Tensor:
    """``[..., n_chunks, H]`` int32: the representative of every aligned chunk ``[sink + j l,
    sink + (j + 1) l)`` (cut at the ``T`` keys of ``landmarks [..., T, H]``, one request's or a
    batch of them) per landmark column, what :func:`landmark_representatives` picks for a chunk
    that ends before its block's key limit; the kernels read it by chunk ordinal."""
    *batch, t_keys, h = landmarks.shape
    padded = torch.full((*batch, n_chunks * chunk_size, h), NEG_INF, device=landmarks.device)
    n = max(0, min(t_keys - sink, n_chunks * chunk_size))
    padded[..., :n, :] = landmarks[..., sink : sink + n, :]
    best = padded.view(*batch, n_chunks, chunk_size, h).argmax(-2)
    starts = sink + chunk_size * torch.arange(n_chunks, device=landmarks.device).view(-1, 1)
    return (starts + best).to(torch.int32)


def check_landmark_state(state: torch.Tensor, kv_cache: torch.Tensor, hq: int) -> int:
    """The state's landmark columns ``H`` (``H_q`` or ``H_kv``); raises on a bad shape."""
    pages, page_size = kv_cache.shape[0], kv_cache.shape[2]
    hkv = kv_cache.shape[3]
    if (state.dim() != 3 or state.shape[:2] != (pages, page_size)
            or state.shape[2] - 1 not in (hq, hkv) or state.dtype != torch.float32):  # fmt: skip
        raise ValueError(
            f"landmark state {tuple(state.shape)} {state.dtype} must be [{pages}, {page_size}, "
            f"H + 1] float32 with H = {hq} (per query head) or {hkv} (per KV head)"
        )
    return state.shape[2] - 1


def landmark_accumulate_paged(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table_row: torch.Tensor,
    q_start: int,
    state: torch.Tensor,
    scale: float,
    *,
    window: int = LANDMARK_WINDOW,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
) -> None:
    """:func:`landmark_sums` of a prefill chunk (``q [n, H_q, D]`` at positions ``q_start ..``,
    its keys already in the cache) over the request's keys, added in place to the landmark
    ``state`` ``[pages, page_size, H + 1]``: sums in columns ``:H``, counts in column ``H``
    (``triton_landmark``)."""
    n, hq, _ = q.shape
    h = check_landmark_state(state, kv_cache, hq)
    if n == 0:
        return
    end = q_start + n
    page_size = kv_cache.shape[2]
    blocks = block_table_row[: -(-end // page_size)].long()
    # K alone: plane 0 of a cache, or the split layout's K plane (a cache of one plane)
    k = _bytes(kv_cache).index_select(0, blocks)[:, 0].reshape(-1, *kv_cache.shape[-2:])[:end]
    k = dequantize_fp8(k, k_scale) if is_fp8_cache(kv_cache) else k
    sums, counts = landmark_sums(q, k, scale, q_start, window, per_group=h != hq)
    lo = max(0, q_start - window)
    t = torch.arange(lo, end, device=kv_cache.device)
    slots = blocks[t // page_size] * page_size + t % page_size
    flat = state.view(-1, h + 1)
    flat[slots, :h] += sums[lo:]
    flat[slots, h] += counts[lo:].to(state.dtype)


def landmark_means_paged(
    state: torch.Tensor, block_table_row: torch.Tensor, seq_len: int, group: int
) -> torch.Tensor:
    """``[seq_len, H]``: a request's landmark scores from the state (``group``: query heads
    summed per column), ``-inf`` where no query has followed a key yet."""
    page_size = state.shape[1]
    t = torch.arange(seq_len, device=state.device)
    slots = block_table_row[t // page_size].long() * page_size + t % page_size
    cells = state.view(-1, state.shape[2])[slots]
    return landmark_means(cells[:, :-1], cells[:, -1], group)


HEAD_REDUCTIONS = ("max", "log-softmax", "z-score")


def reduce_heads(scores: torch.Tensor, how: str = "max") -> torch.Tensor:
    """One ranking ``[n_blocks, C]`` from per-head chunk scores ``[n_blocks, H_q, C]`` (scaled
    logits, ``-inf`` where invalid): ``"max"`` over heads of the raw scores (the paper's);
    ``"log-softmax"``: the max over heads of each head's log-softmax over the chunks (a chunk
    ranks by the largest share any head gives it); ``"z-score"``: the max over heads of each
    head's standardized scores (how far a chunk stands out in some head)."""
    if how == "max":
        return scores.amax(dim=1)
    valid = torch.isfinite(scores)
    if how == "log-softmax":
        norm = scores - torch.logsumexp(scores, dim=-1, keepdim=True)
    elif how == "z-score":
        n = valid.sum(-1, keepdim=True).clamp(min=1)
        x = scores.masked_fill(~valid, 0.0)
        dev = x - x.sum(-1, keepdim=True) / n
        var = (dev.masked_fill(~valid, 0.0) ** 2).sum(-1, keepdim=True) / n
        norm = dev / var.sqrt().clamp(min=1e-6)
    else:
        raise ValueError(f"head_reduction {how!r}: one of {HEAD_REDUCTIONS}")
    # a block with no valid chunk has NaN from the log-softmax; invalid chunks stay -inf
    return norm.masked_fill(~valid, NEG_INF).amax(dim=1)


def bisect_steps(chunk_size: int) -> int:
    """SelectRep's bisection steps for a chunk: enough to narrow it to one key (at least one)."""
    return max(1, math.ceil(math.log2(max(chunk_size, 2))))


def _fill_absent_queries(q_pooled: torch.Tensor) -> torch.Tensor:
    """Pooled queries with each absent (NaN) row replaced by its block's first row (present)."""
    absent = torch.isnan(q_pooled[..., :1])
    if not bool(absent.any()):
        return q_pooled
    return torch.where(absent, q_pooled[:, :, :1], q_pooled)


# --------------------------------------------------------------------------- the cascade
def first_stage_candidates(
    params: PruneParams, seq_len: int, block_min_pos: torch.Tensor
) -> Candidates:
    """Stage-1 chunks over the live context: chunk j covers [n_sink + j*l_c1, ... + l_c1).

    A chunk is active for a query block when it starts at or before ``min_pos - sw'`` (§1.3), so
    chunks straddling the window edge compete while the window itself is left to the window.
    """
    l1 = params.stages[0].chunk_size
    n_chunks = max(0, math.ceil((seq_len - params.sink_tokens) / l1))
    starts = params.sink_tokens + torch.arange(n_chunks, device=block_min_pos.device) * l1
    starts = starts.view(1, -1).expand(block_min_pos.shape[0], -1)
    valid = starts <= (block_min_pos - params.scan_window).view(-1, 1)
    return Candidates(starts.contiguous(), valid)


def run_stages(
    params: PruneParams,
    q: torch.Tensor,
    k: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
    start_stage: int = 0,
    start_input: Candidates | None = None,
    reduce_scores: ScoreReduce | None = None,
    landmarks: torch.Tensor | None = None,
) -> PruneResult:
    """The N-stage hierarchical pruning for every query block of one request (§1.1, §1.5).

    ``q`` is ``[Nq, H_q, D]`` (unscaled), positions ascending. With ``start_stage > 0`` the
    cascade resumes from ``start_input``, the cached input of that stage (decode refresh, §1.6).
    ``reduce_scores`` combines every stage's head-reduced scores across processes before its
    top-k (``tp_mask: "global"``: the max over all tensor-parallel ranks' heads); it runs once
    per stage whatever the branch, so that every rank makes the same collective calls.
    ``landmarks`` (``[T, H]``, :func:`landmark_scores`): every stage but an exact last one
    scores each chunk by its landmark representatives instead of bisecting.
    """
    seq_len = k.shape[0]
    rope = params.rope
    remap = rope is not None and rope.pruning != "none"
    true_qk = (q, k)
    # (a request still inside the trained length needs no un-rotated copies at all)
    if remap and q_positions.numel() and bool(rope.prunes_remapped(q_positions.max())):
        # Score with un-rotated queries and keys, then place them where the style says.
        q = rotate(q.float(), -q_positions.long(), rope.table)
        k = rotate(k.float(), -torch.arange(seq_len, device=k.device), rope.table)

    stage_inputs: list[Candidates] = []
    n_stages = len(params.stages)
    block_min_pos, key_limit = block_bounds(q_positions, params.stages[start_stage].block_size_q)
    block_last = block_last_pos(q_positions, params.stages[start_stage].block_size_q)
    if start_stage == 0:
        cand = first_stage_candidates(params, seq_len, block_min_pos)
    else:
        assert start_input is not None
        cand = start_input
    for i in range(start_stage, n_stages):
        st = params.stages[i]
        stage_inputs.append(cand)
        scored = drop_window_candidates(params, cand, block_min_pos) if i > 0 else cand
        keep = min(st.keep_tokens // st.chunk_size, cand.starts.shape[1])
        live = scored.valid & (scored.starts < key_limit.view(-1, 1))
        if live.numel() == 0 or int(live.sum(1).max()) <= keep:
            # Every live chunk survives the top-k, so the scores cannot change the outcome.
            scores = torch.where(live, 0.0, NEG_INF)
        else:
            exact = params.exact_every_stage or (params.exact_last_stage and i == n_stages - 1)
            scores = _block_scores(params, q, k, true_qk, st, scale, scored, key_limit,
                                   block_min_pos, block_last, exact, landmarks)  # fmt: skip
        if reduce_scores is not None:
            scores = reduce_scores(scores)
        kept_starts, kept_valid = keep_top_chunks(scores, scored, keep)
        if i == n_stages - 1:
            return PruneResult(kept_starts, kept_valid, stage_inputs)
        nxt = params.stages[i + 1]
        cand = split_chunks(kept_starts, kept_valid, st.chunk_size, nxt.chunk_size, key_limit)
        if nxt.block_size_q != st.block_size_q:
            block_min_pos, key_limit = block_bounds(q_positions, nxt.block_size_q)
            block_last = block_last_pos(q_positions, nxt.block_size_q)
            cand = refine_blocks(cand, st.block_size_q // nxt.block_size_q, key_limit)
    raise AssertionError("unreachable: at least one stage runs")


def drop_window_candidates(
    params: PruneParams, cand: Candidates, block_min_pos: torch.Tensor
) -> Candidates:
    """``cand`` less the chunks that start inside every query's window ``(p - n_stream, p]``
    of their block (with ``params.drop_window_candidates``; else ``cand``). Stage 1's rule
    (``start <= p - sw'``) lets a chunk straddle the window edge, so its sub-chunks may lie
    inside it: block-sparse attention would drop them, and they would hold budget for nothing.
    The stored stage inputs keep them; only scoring and the top-k skip them."""
    if not params.drop_window_candidates:
        return cand
    edge = (block_min_pos.long() - params.window_tokens).view(-1, 1)
    return Candidates(cand.starts, cand.valid & (cand.starts <= edge))


def block_bounds(
    q_positions: torch.Tensor, block_size_q: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query block of ``block_size_q`` queries (counted from the first): its smallest
    position, and its key limit, the keys every query of the block may see (that + 1)."""
    nq = q_positions.shape[0]
    device = q_positions.device
    blk = query_block_ids(nq, block_size_q).to(device)
    # every block holds a query, so the fill never survives the min
    fill = torch.iinfo(torch.long).max
    min_pos = torch.full((-(-nq // block_size_q),), fill, dtype=torch.long, device=device)
    min_pos = min_pos.scatter_reduce(0, blk, q_positions.long(), reduce="amin")
    return min_pos, min_pos + 1


def block_last_pos(q_positions: torch.Tensor, block_size_q: int) -> torch.Tensor:
    """Per query block of ``block_size_q`` queries (counted from the first): its largest
    position, which decides whether the block is remapped (:meth:`RopePlan.remaps`)."""
    blk = query_block_ids(q_positions.shape[0], block_size_q).to(q_positions.device)
    fill = torch.iinfo(torch.long).min
    last = torch.full((-(-q_positions.shape[0] // block_size_q),), fill, dtype=torch.long,
                      device=q_positions.device)  # fmt: skip
    return last.scatter_reduce(0, blk, q_positions.long(), reduce="amax")


def refine_blocks(cand: Candidates, factor: int, key_limit: torch.Tensor) -> Candidates:
    """A coarse stage's survivors handed to each of its ``factor`` finer query blocks (§1.5,
    step 6: the neighbouring blocks share the coarse stage's work). ``key_limit`` is per fine
    block; a fine block sees at least its coarse block's keys, so the mask only trims the rows
    past the last query."""
    n_fine = key_limit.shape[0]
    starts = cand.starts.repeat_interleave(factor, dim=0)[:n_fine]
    valid = cand.valid.repeat_interleave(factor, dim=0)[:n_fine]
    return Candidates(starts, valid & (starts < key_limit.view(-1, 1)))


def keep_top_chunks(
    scores: torch.Tensor, cand: Candidates, keep: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``keep`` chunks per block by score, sorted by start with the invalid ones last (§1.5).

    Realigning to chunk starts is implicit (narrowed ranges are never stored). The sort is by
    position and stable, so the ordinals chunk-indexed RoPE reads are the same every time.
    Static shapes, no host sync.
    """
    top_scores, top_idx = torch.topk(scores, keep, dim=1)
    kept_valid = ~torch.isneginf(top_scores)
    kept_starts = torch.gather(cand.starts, 1, top_idx)
    order_key = torch.where(kept_valid, kept_starts, torch.full_like(kept_starts, 1 << 62))
    order = torch.argsort(order_key, dim=1, stable=True)
    return torch.gather(kept_starts, 1, order), torch.gather(kept_valid, 1, order)


def split_chunks(
    starts: torch.Tensor, valid: torch.Tensor, chunk: int, sub: int, key_limit: torch.Tensor
) -> Candidates:
    """Each surviving ``chunk``-wide chunk becomes ``chunk // sub`` sub-chunks (§1.5); those
    starting at or past a block's ``key_limit`` are invalid."""
    n_blocks, kept = starts.shape
    split = chunk // sub
    offs = torch.arange(split, device=starts.device) * sub
    # Explicit widths (not -1): a request with no query block still has a well-defined shape.
    sub_starts = (starts.unsqueeze(-1) + offs).reshape(n_blocks, kept * split)
    sub_valid = valid.unsqueeze(-1).expand(-1, -1, split).reshape(n_blocks, kept * split)
    return Candidates(sub_starts, sub_valid & (sub_starts < key_limit.view(-1, 1)))


def _stage_scores(
    params: PruneParams,
    qp: torch.Tensor,
    k: torch.Tensor,
    cand: Candidates,
    chunk_size: int,
    key_limit: torch.Tensor,
    block_min_pos: torch.Tensor,
    exact: bool = False,
    landmarks: torch.Tensor | None = None,
) -> torch.Tensor:
    """SelectRep scores of one stage, with the layer's RoPE style (§2) when it has one."""
    rope = params.rope
    how = params.head_reduction
    kw = dict(head_reduction=how, exact=exact, landmarks=landmarks,
              group_probes=params.group_probes)  # fmt: skip
    if rope is None or rope.pruning == "none":
        return select_rep_scores(qp, k, cand, chunk_size, key_limit, params.probe, **kw)
    sw = params.scan_window
    if rope.pruning == "relative":
        q_left, q_right = relative_queries(qp, rope.table, sw)
        return select_rep_scores(q_left, k, cand, chunk_size, key_limit, params.probe,
                                 q_pooled_right=q_right, **kw)  # fmt: skip
    delta = chunk_indexed_key_turn(cand.starts.shape[1], block_min_pos, sw)
    return select_rep_scores(qp, k, cand, chunk_size, key_limit, params.probe,
                             chunk_rotation=(delta, rope.table), **kw)  # fmt: skip


def _block_scores(
    params: PruneParams,
    q: torch.Tensor,
    k: torch.Tensor,
    true_qk: tuple[torch.Tensor, torch.Tensor],
    st: StageParams,
    scale: float,
    cand: Candidates,
    key_limit: torch.Tensor,
    block_min_pos: torch.Tensor,
    block_last: torch.Tensor,
    exact: bool = False,
    landmarks: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`_stage_scores` for the query blocks the layer remaps (``q``, ``k`` un-rotated to
    position 0 then) and true-position scores for the others (``true_qk``: the queries and keys
    as given), each block scored exactly as its path alone would score it."""
    rope = params.rope

    def true_scores() -> torch.Tensor:
        qp = pool_queries(true_qk[0], st.block_size_q, st.query_stride) * scale
        return select_rep_scores(qp, true_qk[1], cand, st.chunk_size, key_limit, params.probe,
                                 head_reduction=params.head_reduction, exact=exact,
                                 landmarks=landmarks,
                                 group_probes=params.group_probes)  # fmt: skip

    if rope is None or rope.pruning == "none":
        return true_scores()
    remapped = rope.prunes_remapped(block_last)
    if not bool(remapped.any()):
        return true_scores()
    qp = pool_queries(q, st.block_size_q, st.query_stride) * scale
    scores = _stage_scores(params, qp, k, cand, st.chunk_size, key_limit, block_min_pos, exact,
                           landmarks)
    if bool(remapped.all()):
        return scores
    # only a chunk whose blocks lie on both sides of the trained length pays for both
    return torch.where(remapped.view(-1, 1), scores, true_scores())


def relative_queries(
    qp: torch.Tensor, table: RopeTable, scan_window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Un-rotated pooled queries placed for relative-style scoring (§2), against keys at
    position 0: for left probes (query at sw'+1, probe at 0) and right probes (probe at 1)."""
    pos = relative_positions(scan_window)
    left = int(pos.query_pos - pos.left_probe_pos)
    right = int(pos.query_pos - pos.right_probe_pos)
    return rotate(qp, left, table), rotate(qp, right, table)


def chunk_indexed_key_turn(
    n_candidates: int, block_min_pos: torch.Tensor, scan_window: int,
    block_candidates: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """``[n_blocks, C]``: chunk-indexed style (§2) puts chunk ``j``'s keys at ``j`` and the
    query at ``min(p, C + sw')``. Only the gap matters, so keys at position 0 turn by this
    (ordinal minus query position) and the queries stay at 0. ``block_candidates``
    (``[n_blocks]``): each block's own ``C`` where blocks of several requests share a wider
    candidate list (their extra entries are invalid)."""
    key_pos, q_pos = chunk_indexed_positions(n_candidates, block_min_pos, scan_window)
    if block_candidates is not None:
        q_pos = torch.minimum(block_min_pos.long(), block_candidates.long() + scan_window)
    return key_pos.view(1, -1) - q_pos.view(-1, 1)


# --------------------------------------------------------------------------- attention
def sparse_key_mask(
    params: PruneParams,
    seq_len: int,
    q_positions: torch.Tensor,
    block_starts: torch.Tensor,
    block_valid: torch.Tensor,
    extend_blocks: int = 0,
) -> torch.Tensor:
    """``[Nq, T]`` bool: the keys each query attends to in block-sparse attention (§1.7).

    The union of the sink ``[0, n_sink)``, the query's window ``(p - n_stream, p]`` and its
    block's selected blocks, each ``extend_blocks`` tokens longer than ``block_size_k``;
    causal; a key in two sources counts once.
    """
    device = q_positions.device
    nq = q_positions.shape[0]
    bk = params.block_size_k + extend_blocks
    n_blocks = block_starts.shape[0]
    selected = torch.zeros(n_blocks, seq_len + bk, dtype=torch.bool, device=device)
    if block_starts.numel():
        tok = block_starts.unsqueeze(-1) + torch.arange(bk, device=device)  # [nb, K, bk]
        tok = torch.where(block_valid.unsqueeze(-1), tok, torch.full_like(tok, seq_len))
        selected.scatter_(1, tok.reshape(n_blocks, -1).clamp(max=seq_len + bk - 1), True)
    selected = selected[:, :seq_len]
    blk = query_block_ids(nq, params.block_size_q).to(device)
    t = torch.arange(seq_len, device=device).view(1, -1)
    p = q_positions.long().view(-1, 1)
    mask = selected[blk] | (t < params.sink_tokens) | (t > p - params.window_tokens)
    return mask & (t <= p)


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    is_causal: bool = False,
) -> torch.Tensor:
    """Softmax attention of ``q [Nq, Hq, D]`` over ``k, v [T, Hkv, D]`` where ``mask [Nq, T]``
    (or causal from the first key when ``is_causal``)."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0).to(q.dtype),
        v.transpose(0, 1).unsqueeze(0).to(q.dtype),
        attn_mask=mask,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.squeeze(0).transpose(0, 1)


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """Exact causal attention of the last ``Nq`` positions over all ``T`` keys."""
    if q.shape[0] == k.shape[0]:  # a whole prompt: the fused causal kernel
        return masked_attention(q, k, v, None, scale, is_causal=True)
    t = torch.arange(k.shape[0], device=q.device).view(1, -1)
    return masked_attention(q, k, v, t <= q_positions.long().view(-1, 1), scale)


def attention_recall(
    q: torch.Tensor, k: torch.Tensor, q_positions: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """``[Nq, H_q]``: the share of each query head's dense causal softmax mass on ``mask``.

    ``mask`` is ``[Nq, T]`` (the keys sparse attention attends, e.g. :func:`sparse_key_mask`).
    Dense scores use the cached keys at their true positions, so this measures how much of
    exact attention the selection keeps, not the remapped positions' effect.
    """
    nq, hq, d = q.shape
    hkv = k.shape[1]
    # GQA by view: a group's query heads share their KV head, no repeated copy of the keys
    qg = q.float().view(nq, hkv, hq // hkv, d) * scale
    scores = torch.einsum("qhgd,thd->qhgt", qg, k.float()).reshape(nq, hq, -1)
    t = torch.arange(k.shape[0], device=q.device)
    causal = t.view(1, 1, -1) <= q_positions.long().view(-1, 1, 1)
    probs = scores.masked_fill(~causal, NEG_INF).softmax(dim=-1)
    return (probs * mask.unsqueeze(1)).sum(-1)


def remapped_attention_recall(
    params: PruneParams,
    q: torch.Tensor,
    k: torch.Tensor,
    q_positions: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """:func:`attention_recall` against dense attention under the layer's position remapping.

    Past the trained length the true-position reference sees distances the model never saw.
    Here the keys of each query's window ``(p - n_stream, p]`` keep their true positions, and
    every other key is placed as the layer's pruning style places it (§2): ``relative``, at
    distance ``sw' + 1`` from the query (its content alone decides, as for a left-branch probe);
    ``chunk-indexed``, at the ordinal of its stage-0 chunk (sink keys at 0) with the query at
    ``min(p, C + sw')``. So the number says what the selection missed of what it was ranking.
    Without a remapping it is :func:`attention_recall`, and so it is for a query below the
    plan's ``trained_context``, which keeps its true positions. ``[Nq, H_q]``; meant for the few
    queries the recall log follows (one pass over the keys per query).
    """
    rope = params.rope
    if rope is None or rope.pruning == "none":
        return attention_recall(q, k, q_positions, mask, scale)
    table = rope.table
    nq, hq, d = q.shape
    t_len, hkv = k.shape[0], k.shape[1]
    t = torch.arange(t_len, device=k.device)
    kf = k.float()
    k0 = rotate(kf, -t, table)  # every key back at position 0
    sw = params.scan_window
    l0 = params.stages[0].chunk_size
    ordinal = torch.clamp(t - params.sink_tokens, min=0) // l0  # chunk-indexed key positions

    def scores(qq: torch.Tensor, kk: torch.Tensor) -> torch.Tensor:
        qg = qq.view(hkv, hq // hkv, d) * scale
        return torch.einsum("hgd,thd->hgt", qg, kk).reshape(hq, t_len)

    # rows below the trained length are scored and attended at true positions (RopePlan): they
    # come from attention_recall itself, bit for bit (one query scored alone can round
    # differently from the batch on some CPUs)
    out = attention_recall(q, k, q_positions, mask, scale)
    for i in range(nq):
        p = int(q_positions[i])
        if p < rope.trained_context:
            continue
        qi = q[i : i + 1].float()
        q0 = rotate(qi, -p, table)
        if rope.pruning == "relative":
            far_q, far_k = rotate(q0, sw + 1, table), k0
        else:  # chunk-indexed: only the gap matters, so the keys turn and the query stays at 0
            n_chunks = max(1, math.ceil((p + 1 - params.sink_tokens) / l0))
            q_pos = int(chunk_indexed_positions(n_chunks, torch.tensor(p), sw).query_pos)
            far_q, far_k = q0, rotate(k0, ordinal - q_pos, table)
        window = t > p - params.window_tokens
        s = torch.where(window, scores(qi, kf), scores(far_q, far_k))
        probs = s.masked_fill(t > p, NEG_INF).softmax(dim=-1)
        out[i] = (probs * mask[i]).sum(-1)
    return out


def sparse_attention(
    params: PruneParams,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
    prune: PruneResult | None = None,
    query_group: int = 256,
    extend_blocks: int = 0,
) -> tuple[torch.Tensor, PruneResult, int]:
    """Prune (unless ``prune`` is given), then block-sparse attention for one request.

    ``extend_blocks``: every selected block is read that many tokens past its end (a decode
    mask reused ``extend_blocks`` steps after it was chosen, with
    ``PruneParams.extend_reused_blocks``: a copy walking through the text it found keeps
    reading the next tokens until the mask is refreshed).

    Returns the output ``[Nq, Hq, D]``, the pruning result and the number of (query, key)
    pairs attended, for the counters. Queries are processed ``query_group`` at a time (a whole
    number of query blocks); each group gathers only the keys some of its queries attend to,
    so the work follows the sparsity rather than the context length. With a streaming plan
    (§2), only the query blocks :meth:`RopePlan.remaps` takes are attended at streaming
    positions; the others attend as without one.
    """
    if prune is None:
        prune = run_stages(params, q, k, q_positions, scale)
    rope = params.rope
    remapped = None
    if rope is not None and rope.bsa == "streaming":
        remapped = rope.remaps(block_last_pos(q_positions, params.block_size_q))
        if bool(remapped.all()):
            out, attended = _streaming_attention(params, q, k, v, q_positions, scale, prune,
                                                 extend_blocks=extend_blocks)  # fmt: skip
            return out, prune, attended
    out, per_query = _true_position_attention(params, q, k, v, q_positions, scale, prune,
                                              query_group, extend_blocks)  # fmt: skip
    if remapped is None or not bool(remapped.any()):
        return out, prune, int(per_query.sum())
    # blocks on both sides of the trained length: each block takes its own path's result
    row_remapped = remapped[query_block_ids(q.shape[0], params.block_size_q).to(q.device)]
    streamed, attended = _streaming_attention(params, q, k, v, q_positions, scale, prune,
                                              remapped, extend_blocks)  # fmt: skip
    out = torch.where(row_remapped.view(-1, 1, 1), streamed, out)
    return out, prune, attended + int(per_query[~row_remapped].sum())


def _true_position_attention(
    params: PruneParams,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
    prune: PruneResult,
    query_group: int,
    extend_blocks: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse attention over :func:`sparse_key_mask` at true positions: the output and
    the keys each query attended."""
    out = torch.empty_like(q)
    per_query = torch.zeros(q.shape[0], dtype=torch.long, device=q.device)
    bq = params.block_size_q
    step = max(bq, (query_group // bq) * bq)
    for lo in range(0, q.shape[0], step):
        hi = min(q.shape[0], lo + step)
        b_lo, b_hi = lo // bq, (hi + bq - 1) // bq
        mask = sparse_key_mask(
            params,
            k.shape[0],
            q_positions[lo:hi],
            prune.block_starts[b_lo:b_hi],
            prune.block_valid[b_lo:b_hi],
            extend_blocks,
        )
        per_query[lo:hi] = mask.sum(1)
        cols = mask.any(0).nonzero().squeeze(1)
        out[lo:hi] = masked_attention(q[lo:hi], k[cols], v[cols], mask[:, cols], scale)
    return out, per_query


def _streaming_attention(
    params: PruneParams,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
    prune: PruneResult,
    blocks: torch.Tensor | None = None,
    extend_blocks: int = 0,
) -> tuple[torch.Tensor, int]:
    """Block-sparse attention with StreamingLLM-style positions (§2), per query block.

    Queries and the block's window ``(p_min - n_stream, p]`` keep their true positions; the
    sink tokens and then the selected blocks, in index order, are moved to contiguous positions
    ending just left of the window, so every distance stays near the budget, not the context.
    ``blocks`` (bool per query block): only those are attended (the others' rows are left
    unset and count no pairs).
    """
    from vllm_infinitehip.kernels.rope import streaming_positions

    table = params.rope.table
    bq, bk = params.block_size_q, params.block_size_k
    seq_len = k.shape[0]
    out = torch.empty_like(q)
    attended = 0
    sink = torch.arange(min(params.sink_tokens, seq_len), device=k.device)
    offs = torch.arange(bk + extend_blocks, device=k.device)
    for b in range(prune.block_starts.shape[0]):
        if blocks is not None and not bool(blocks[b]):
            continue
        lo, hi = b * bq, min(q.shape[0], (b + 1) * bq)
        pos = q_positions[lo:hi].long()
        p_min, p_max = int(pos[0]), int(pos[-1])
        window_start = max(0, p_min - params.window_tokens + 1)
        starts = prune.block_starts[b][prune.block_valid[b]]
        selected = (starts.view(-1, 1) + offs).reshape(-1)
        far = torch.cat([sink, selected])
        new_pos = streaming_positions(
            params.sink_tokens, params.window_tokens, selected.numel(), torch.tensor(p_min),
            num_slots=params.sink_tokens + selected.numel(),
        )[: far.numel()].to(k.device)  # fmt: skip
        keep = far < min(window_start, seq_len)  # window keys stay at their true positions
        far, new_pos = far[keep], new_pos[keep]
        window = torch.arange(window_start, p_max + 1, device=k.device)
        keys = torch.cat([rotate(k[far], new_pos - far, table), k[window]])
        values = torch.cat([v[far], v[window]])
        mask = torch.cat(
            [
                torch.ones(hi - lo, far.numel(), dtype=torch.bool, device=k.device),
                window.view(1, -1) <= pos.view(-1, 1),
            ],
            dim=1,
        )
        attended += int(mask.sum())
        out[lo:hi] = masked_attention(q[lo:hi], keys, values, mask, scale)
    return out, attended
