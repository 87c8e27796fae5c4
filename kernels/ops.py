"""The attention work of one layer, by device: the PyTorch reference or the Triton kernels.

:class:`AttentionOps` is the interface the backend calls; :func:`ops_for` picks the
implementation. Prefill works on all of a step's chunks at once: the dense ones as one varlen
call (:class:`query_blocks.DenseRows`), the sparse ones as query blocks of several requests
(:class:`query_blocks.QueryBlocks`), one cascade and one attention launch per kind of part. The
reference runs them request by request (:class:`RequestKV`: its block-table row and length),
which the single-request methods also serve. Decode works on all decode rows of a step at once
(:class:`decode.DecodeRows`), through the masks kept per state slot
(:class:`decode.DecodeMasks`). All read the paged cache ``[num_blocks, 2, block_size, H_kv, D]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from vllm_infinitehip.kernels import decode as dec
from vllm_infinitehip.kernels import reference as ref
from vllm_infinitehip.kernels.query_blocks import (
    DenseRows,
    LandmarkTiles,
    QueryBlocks,
    shared_once,
)


@dataclass
class RequestKV:
    """One request's view of a layer's paged KV cache. ``k_scale`` / ``v_scale``: the layer's
    ``_k_scale`` / ``_v_scale``, which dequantize an fp8 cache (other caches ignore them);
    ``split``: ``kv_cache`` is the host tier's K plane and V is where ``split`` places it."""

    kv_cache: torch.Tensor
    block_table_row: torch.Tensor
    seq_len: int
    _kv: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    k_scale: float | torch.Tensor | None = field(default=None, kw_only=True)
    v_scale: float | torch.Tensor | None = field(default=None, kw_only=True)
    split: ref.SplitV | None = field(default=None, kw_only=True)

    def contiguous(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``k, v`` as ``[seq_len, H_kv, D]``, gathered once per request and layer (an fp8
        cache dequantized, in float32: :func:`reference.gather_paged_kv`)."""
        if self._kv is None:
            self._kv = ref.gather_paged_kv(self.kv_cache, self.block_table_row, self.seq_len,
                                           k_scale=self.k_scale, v_scale=self.v_scale,
                                           split=self.split)  # fmt: skip
        return self._kv


@dataclass
class DecodeScratch:
    """Preallocated buffers of a step's decode work (owned by the builder, shared by layers)."""

    scores: list[torch.Tensor]  # per stage [max rows, W_i] float32 at -inf
    workspace: torch.Tensor | None  # flat float32 split partials (GPU)
    # int32 [max rows] at zero, left so: the fused top-k's arrival counters (GPU)
    arrivals: torch.Tensor | None = None
    placement: object | None = None  # triton_decode.QueryPlacement of the layer
    # the layer's host-tier bank (pages, residency table): decode reads resident pages there
    bank: tuple[torch.Tensor, torch.Tensor] | None = None
    # the layer's key-row bank (reference.KeyRows, GPU): the pruning stages' probes read and
    # promote there
    key_rows: ref.KeyRows | None = None
    # the step's cascade gate (graph_if.GraphIf, GPU): a captured decode graph skips the
    # layer's cascade, region ``gate_region``, when no row refreshes
    gate: object | None = None
    gate_region: int = 0
    # the cascade runs on refresh steps only (the refresh body of a branched decode graph):
    # each stage's top-k then takes a launch of its own, as behind a gate (faster at refresh)
    refresh_only: bool = False
    # float32 [2, max rows, H_q, D] (GPU, RoPE extension on): the queries the pruning stages
    # score with, placed by the layer's RoPE style inside the gate (nothing allocated there)
    queries: torch.Tensor | None = None


class AttentionOps(Protocol):
    """What the backend asks of a device. Pair counts are ints or 0-dim device tensors (the
    GPU path counts on device, so nothing syncs). An fp8 cache's scales come with the request
    (:class:`RequestKV`) in prefill and as ``k_scale`` / ``v_scale`` in decode."""

    def dense(self, req: RequestKV, q: torch.Tensor, positions: torch.Tensor,
              scale: float) -> torch.Tensor: ...  # fmt: skip

    def prune(self, params: ref.PruneParams, req: RequestKV, q: torch.Tensor,
              positions: torch.Tensor, scale: float) -> ref.PruneResult: ...  # fmt: skip

    def attend(self, params: ref.PruneParams, req: RequestKV, q: torch.Tensor,
               positions: torch.Tensor, scale: float, prune: ref.PruneResult,
               slice_end: int) -> tuple[torch.Tensor, int | torch.Tensor]: ...  # fmt: skip

    def dense_rows(self, rows: DenseRows, q: torch.Tensor, out: torch.Tensor,
                   kv_cache: torch.Tensor, block_table: torch.Tensor, scale: float, *,
                   k_scale: float | torch.Tensor | None = None,
                   v_scale: float | torch.Tensor | None = None,
                   split: ref.SplitV | None = None) -> None: ...  # fmt: skip

    def prune_blocks(self, params: ref.PruneParams, blocks: QueryBlocks, q: torch.Tensor,
                     kv_cache: torch.Tensor, block_table: torch.Tensor, scale: float, *,
                     k_scale: float | torch.Tensor | None = None,
                     v_scale: float | torch.Tensor | None = None,
                     shared: dict | None = None,
                     split: ref.SplitV | None = None,
                     landmarks: torch.Tensor | None = None) -> ref.PruneResult:  # fmt: skip
        """``shared``: one dict for the calls of one layer over one cache (a batch's kinds of
        part), where an implementation keeps what they can reuse (the turned-back keys).
        ``split`` (here and below): ``kv_cache`` is the host tier's K plane, V is where
        ``split`` places it (``reference.SplitV``). ``landmarks``: the layer's landmark state
        (``triton_landmark``): stages before an exact last one score each chunk by its
        landmark representatives."""
        ...

    def add_landmarks(self, tiles: LandmarkTiles, q: torch.Tensor, kv_cache: torch.Tensor,
                      block_table: torch.Tensor, state: torch.Tensor, scale: float, window: int,
                      *, k_scale: float | torch.Tensor | None = None,
                      v_scale: float | torch.Tensor | None = None,
                      split: ref.SplitV | None = None) -> None:  # fmt: skip
        """Add each prefill chunk's queries (``tiles.chunks``, their keys written) to the
        landmark state, each to its own keys and the ``window`` keys before them."""
        ...

    def attend_blocks(self, params: ref.PruneParams, blocks: QueryBlocks, q: torch.Tensor,
                      kv_cache: torch.Tensor, block_table: torch.Tensor, scale: float,
                      prune: ref.PruneResult, out: torch.Tensor, *,
                      k_scale: float | torch.Tensor | None = None,
                      v_scale: float | torch.Tensor | None = None,
                      split: ref.SplitV | None = None) -> int | torch.Tensor: ...  # fmt: skip

    def refresh_decode(self, params: ref.PruneParams, masks: dec.DecodeMasks, q: torch.Tensor,
                       kv_cache: torch.Tensor, rows: dec.DecodeRows, scale: float,
                       scratch: DecodeScratch, *, k_scale: float | torch.Tensor | None = None,
                       v_scale: float | torch.Tensor | None = None,
                       split: ref.SplitV | None = None) -> None: ...  # fmt: skip

    def attend_decode(self, params: ref.PruneParams, masks: dec.DecodeMasks, q: torch.Tensor,
                      kv_cache: torch.Tensor, rows: dec.DecodeRows, scale: float,
                      out: torch.Tensor, pairs: torch.Tensor,
                      scratch: DecodeScratch, *, k_scale: float | torch.Tensor | None = None,
                      v_scale: float | torch.Tensor | None = None,
                      split: ref.SplitV | None = None) -> None: ...  # fmt: skip


class ReferenceOps:
    """The PyTorch reference: the CPU path. ``reduce_scores``: see :func:`ops_for`."""

    def __init__(self, reduce_scores: ref.ScoreReduce | None = None) -> None:
        self.reduce_scores = reduce_scores

    def dense(self, req, q, positions, scale):
        k, v = req.contiguous()
        return ref.dense_attention(q, k, v, positions, scale)

    def prune(self, params, req, q, positions, scale, landmarks=None):
        k, _ = req.contiguous()
        return ref.run_stages(params, q, k, positions, scale, reduce_scores=self.reduce_scores,
                              landmarks=landmarks)  # fmt: skip

    def attend(self, params, req, q, positions, scale, prune, slice_end):
        """Block-sparse attention; also the exact number of (query, key) pairs attended."""
        k, v = req.contiguous()
        out, _, attended = ref.sparse_attention(params, q, k, v, positions, scale, prune=prune)
        return out, attended

    # A step's chunks, request by request: the oracle of the batched kernels.
    def dense_rows(self, rows, q, out, kv_cache, block_table, scale, *, k_scale=None,
                   v_scale=None, split=None):  # fmt: skip
        for p in rows.parts:
            req, positions = _part_request(p, kv_cache, block_table, k_scale, v_scale, split)
            out[p.q_lo : p.q_hi] = self.dense(req, q[p.q_lo : p.q_hi], positions, scale)

    def prune_blocks(self, params, blocks, q, kv_cache, block_table, scale, *, k_scale=None,
                     v_scale=None, shared=None, split=None, landmarks=None):  # fmt: skip
        """Each part's cascade alone, stacked into the batch's final blocks (a part's padding
        blocks and extra entries invalid; stage inputs are not kept)."""
        fine = blocks.refine(params.block_size_q)
        results = []
        for p in blocks.parts:
            req, positions = _part_request(p, kv_cache, block_table, k_scale, v_scale, split)
            scores = None
            if landmarks is not None:
                # a chunk's body and tail parts read one request's scores: gathered once
                scores = shared_once(
                    shared, ("landmark_means", p.row, p.seq_len),
                    lambda p=p: ref.landmark_means_paged(landmarks, block_table[p.row], p.seq_len,
                                                         q.shape[1] // (landmarks.shape[2] - 1)),
                )  # fmt: skip
            results.append(self.prune(params, req, q[p.q_lo : p.q_hi], positions, scale,
                                      scores))  # fmt: skip
        width = max((r.block_starts.shape[1] for r in results), default=0)
        starts = torch.zeros(fine.num_blocks, width, dtype=torch.long, device=q.device)
        valid = torch.zeros(fine.num_blocks, width, dtype=torch.bool, device=q.device)
        for lo, r in zip(fine.part_blocks, results):
            n, w = r.block_starts.shape
            starts[lo : lo + n, :w] = r.block_starts
            valid[lo : lo + n, :w] = r.block_valid
        return ref.PruneResult(starts, valid, [])

    def add_landmarks(self, tiles, q, kv_cache, block_table, state, scale, window, *,
                      k_scale=None, v_scale=None, split=None):  # fmt: skip
        for p in tiles.chunks:
            ref.landmark_accumulate_paged(q[p.q_lo : p.q_hi], kv_cache, block_table[p.row],
                                          p.first_pos, state, scale, window=window,
                                          k_scale=k_scale, v_scale=v_scale)  # fmt: skip

    def attend_blocks(self, params, blocks, q, kv_cache, block_table, scale, prune, out, *,
                      k_scale=None, v_scale=None, split=None):  # fmt: skip
        fine = blocks.refine(params.block_size_q)
        attended = 0
        for lo, p in zip(fine.part_blocks, blocks.parts):
            req, positions = _part_request(p, kv_cache, block_table, k_scale, v_scale, split)
            hi = lo + -(-(p.q_hi - p.q_lo) // params.block_size_q)
            part = ref.PruneResult(prune.block_starts[lo:hi], prune.block_valid[lo:hi], [])
            o, pairs = self.attend(params, req, q[p.q_lo : p.q_hi], positions, scale, part,
                                   p.slice_end)  # fmt: skip
            out[p.q_lo : p.q_hi] = o
            attended += pairs
        return attended

    def refresh_decode(self, params, masks, q, kv_cache, rows, scale, scratch, *, k_scale=None,
                       v_scale=None, split=None):  # fmt: skip
        dec.refresh_masks_reference(params, masks, q, kv_cache, rows, scale, scratch.bank,
                                    k_scale=k_scale, v_scale=v_scale,
                                    reduce_scores=self.reduce_scores,
                                    key_rows=scratch.key_rows, split=split)  # fmt: skip

    def attend_decode(self, params, masks, q, kv_cache, rows, scale, out, pairs, scratch, *,
                      k_scale=None, v_scale=None, split=None):  # fmt: skip
        o, attended = dec.attend_reference(params, masks, q, kv_cache, rows, scale, scratch.bank,
                                           k_scale=k_scale, v_scale=v_scale,
                                           split=split)  # fmt: skip
        out.copy_(o)
        context = sum(t for t, s in zip(rows.seq_lens.tolist(), rows.slots.tolist()) if s >= 0)
        pairs += torch.tensor([attended, context], dtype=pairs.dtype)


class TritonOps:
    """Triton kernels over the paged cache: the GPU path; dense prefill runs vLLM's
    FlashAttention. RoPE remapping (§2) runs in the kernels: relative and chunk-indexed pruning
    and streaming BSA, for any pairing layout and partial rotary.
    ``precision`` is the prefill pruning's (``triton_prune.select_rep_scores_paged``);
    ``reduce_scores``: see :func:`ops_for`."""

    def __init__(self, precision: str = "fp32", reduce_scores: ref.ScoreReduce | None = None,
                 ) -> None:  # fmt: skip
        self.precision = precision
        self.reduce_scores = reduce_scores

    def dense(self, req, q, positions, scale):
        """vLLM's own FlashAttention over the paged cache where it runs (fp16/bf16 on CUDA,
        checked once per device and cache kind by :func:`flash_attention_works`), else a gather
        (an fp8 cache dequantized) and SDPA."""
        if req.split is None and _flash_serves(q, req.kv_cache):
            return _flash_dense(req, q, scale)
        k, v = req.contiguous()
        return ref.dense_attention(q, k, v, positions, scale)

    def dense_rows(self, rows, q, out, kv_cache, block_table, scale, *, k_scale=None,
                   v_scale=None, split=None):  # fmt: skip
        """All dense chunks in one varlen FlashAttention call where it serves (else one gather
        and SDPA per chunk, as :meth:`dense`; so too a split cache's, which FlashAttention
        cannot read: the backend stages the chunks that re-read their context)."""
        if split is not None or not _flash_serves(q, kv_cache):
            return ReferenceOps.dense_rows(self, rows, q, out, kv_cache, block_table, scale,
                                           k_scale=k_scale, v_scale=v_scale,
                                           split=split)  # fmt: skip
        lo, hi = rows.q_range
        q_rows = q[lo:hi] if rows.token_index is None else q.index_select(0, rows.token_index)
        o = _flash_varlen(q_rows, kv_cache, block_table.index_select(0, rows.rows),
                          rows.cu_seqlens_q, rows.seqused_k, rows.max_q, rows.max_k, scale,
                          k_scale, v_scale)  # fmt: skip
        if rows.token_index is None:
            out[lo:hi] = o
        else:
            out.index_copy_(0, rows.token_index, o)

    def prune_blocks(self, params, blocks, q, kv_cache, block_table, scale, *, k_scale=None,
                     v_scale=None, shared=None, split=None, landmarks=None):  # fmt: skip
        """The stages read K only: a split cache's K plane is a cache of one plane to them."""
        from vllm_infinitehip.kernels.triton_prune import run_stages_blocks

        return run_stages_blocks(params, q, blocks, kv_cache, block_table, scale,
                                 precision=self.precision, k_scale=k_scale, v_scale=v_scale,
                                 reduce_scores=self.reduce_scores, shared=shared,
                                 landmarks=landmarks)  # fmt: skip

    def add_landmarks(self, tiles, q, kv_cache, block_table, state, scale, window, *,
                      k_scale=None, v_scale=None, split=None):  # fmt: skip
        """Every chunk in one launch."""
        from vllm_infinitehip.kernels.triton_landmark import landmark_accumulate_tiles

        landmark_accumulate_tiles(q, kv_cache, block_table, tiles, state, scale, window=window,
                                  k_scale=k_scale, v_scale=v_scale)  # fmt: skip

    def attend_blocks(self, params, blocks, q, kv_cache, block_table, scale, prune, out, *,
                      k_scale=None, v_scale=None, split=None):  # fmt: skip
        """One launch for every block; the pair count is the budget, as in :meth:`attend`."""
        from vllm_infinitehip.kernels import triton_bsa

        fine = blocks.refine(params.block_size_q)
        streaming = params.rope is not None and params.rope.bsa == "streaming"
        triton_bsa.sparse_prefill_attention_blocks(
            q, kv_cache, block_table, fine, prune.block_starts.to(torch.int32), prune.block_valid,
            block_size_k=params.block_size_k, sink_tokens=params.sink_tokens,
            window_tokens=params.window_tokens, scale=scale, out=out,
            rope=params.rope.table if streaming else None, k_scale=k_scale, v_scale=v_scale,
            trained_context=params.remap_from, split=split,
        )  # fmt: skip
        present, positions = fine.query_rows()
        return _budget_pairs(params, streaming, present, positions, fine.first_pos,
                             prune.block_valid)  # fmt: skip

    def prune(self, params, req, q, positions, scale):
        from vllm_infinitehip.kernels.triton_prune import run_stages_paged

        return run_stages_paged(params, q, req.kv_cache, req.block_table_row, positions, scale,
                                seq_len=req.seq_len, precision=self.precision,
                                k_scale=req.k_scale, v_scale=req.v_scale,
                                reduce_scores=self.reduce_scores)  # fmt: skip

    def attend(self, params, req, q, positions, scale, prune, slice_end):
        """As the reference; the pair count is the budget (sink, window, selected blocks), an
        upper bound, since counting exactly would need the whole key mask.

        The kernels take the queries to be the last ``len(q)`` positions of a sequence. A
        prefill chunk is attended in slices (body, tail), and keys after a slice's last query
        are its future, so the slice's sequence ends at ``slice_end`` (from the host: no sync).
        """
        from vllm_infinitehip.kernels import triton_bsa

        streaming = params.rope is not None and params.rope.bsa == "streaming"
        n_valid = prune.block_valid.sum(dim=1, dtype=torch.int32)
        out = triton_bsa.sparse_prefill_attention(
            q, req.kv_cache, req.block_table_row, slice_end, prune.block_starts.to(torch.int32),
            prune.block_valid, block_size_q=params.block_size_q,
            block_size_k=params.block_size_k, sink_tokens=params.sink_tokens,
            window_tokens=params.window_tokens, scale=scale,
            rope=params.rope.table if streaming else None, k_scale=req.k_scale,
            v_scale=req.v_scale, trained_context=params.remap_from,
        )  # fmt: skip
        blk = torch.arange(q.shape[0], device=q.device) // params.block_size_q
        first = positions[blk * params.block_size_q]
        return out, _budget_pairs(params, streaming, None, positions, first, n_valid, blk)

    def refresh_decode(self, params, masks, q, kv_cache, rows, scale, scratch, *, k_scale=None,
                       v_scale=None, split=None):  # fmt: skip
        """(The stages read K only: a split cache's K plane serves them as it is.)"""
        from vllm_infinitehip.kernels import triton_decode

        # With a gate or a branch, steps that refresh nothing skip the launches, so the top-k
        # gets its own (faster at refresh); otherwise it rides in SelectRep (fewer no-op
        # launches).
        gate = scratch.gate
        triton_decode.refresh_masks(params, masks, q, kv_cache, rows, scale, scratch.scores,
                                    scratch.placement, bank=scratch.bank, k_scale=k_scale,
                                    v_scale=v_scale, reduce_scores=self.reduce_scores,
                                    arrivals=scratch.arrivals,
                                    gate=gate.region(scratch.gate_region) if gate else None,
                                    fuse_top=gate is None and not scratch.refresh_only,
                                    query_buffers=scratch.queries,
                                    key_rows=scratch.key_rows)  # fmt: skip

    def attend_decode(self, params, masks, q, kv_cache, rows, scale, out, pairs, scratch, *,
                      k_scale=None, v_scale=None, split=None):  # fmt: skip
        from vllm_infinitehip.kernels import triton_bsa

        streaming = params.rope is not None and params.rope.bsa == "streaming"
        triton_bsa.sparse_decode_attention(
            q, kv_cache, rows.block_table, rows.seq_lens, masks.final, masks.final_counts(),
            block_size_k=params.block_size_k, sink_tokens=params.sink_tokens,
            window_tokens=params.window_tokens, scale=scale, out=out,
            rope=params.rope.table if streaming else None, row_slots=rows.slots, stats=pairs,
            workspace=scratch.workspace, bank=scratch.bank, k_scale=k_scale, v_scale=v_scale,
            trained_context=params.remap_from,
            stale_steps=rows.stale_steps if params.extend_reused_blocks else None, split=split,
        )  # fmt: skip


def _part_request(p, kv_cache: torch.Tensor, block_table: torch.Tensor,
                  k_scale: float | torch.Tensor | None, v_scale: float | torch.Tensor | None,
                  split: ref.SplitV | None = None) -> tuple[RequestKV, torch.Tensor]:  # fmt: skip
    """A planned part (:class:`query_blocks.RequestPart`) as the single-request calls take it:
    its request's KV view and its queries' positions."""
    req = RequestKV(kv_cache, block_table[p.row], p.seq_len, k_scale=k_scale, v_scale=v_scale,
                    split=split)  # fmt: skip
    return req, torch.arange(p.first_pos, p.slice_end, device=kv_cache.device)


def _budget_pairs(
    params: ref.PruneParams, streaming: bool, present: torch.Tensor | None,
    positions: torch.Tensor, block_first: torch.Tensor, n_valid: torch.Tensor,
    blk: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """(query, key) pairs a prefill chunk's queries may attend, as a 0-dim device tensor: sink,
    window and selected blocks, an upper bound. ``positions`` per query with ``blk`` its block,
    or per block row ``[blocks, b_q]`` with ``present`` its real queries; ``block_first``: each
    query's block's first position; ``n_valid``: each block's valid selections (or the mask)."""
    if n_valid.dim() == 2:
        n_valid = n_valid.sum(dim=1)
    budget = params.sink_tokens + params.window_tokens
    if blk is None:  # block rows
        first, selected = block_first.view(-1, 1), (n_valid.long() * params.block_size_k)[:, None]
    else:
        first, selected = block_first, (n_valid.long() * params.block_size_k)[blk]
    if streaming:  # a query sees its whole block's window, from the block's first query
        budget = budget + (positions - first)
    per_query = torch.clamp(positions + 1, max=budget) + selected
    return (per_query if present is None else per_query * present).sum()


def _flash_serves(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    kv_fp8 = ref.is_fp8_cache(kv_cache)
    return q.dtype in (torch.float16, torch.bfloat16) and flash_attention_works(q.device, kv_fp8)


def _descale(scale: float | torch.Tensor, n_seqs: int, hkv: int,
             device: torch.device) -> torch.Tensor:  # fmt: skip
    """A per-tensor scale as FA3's ``*_descale`` ``[num_seqs, H_kv]`` (vLLM's FA backend
    expands the layer's scale the same way)."""
    scale = torch.as_tensor(scale, dtype=torch.float32, device=device)
    return scale.reshape(1, 1).expand(n_seqs, hkv)


def _flash_dense(req: RequestKV, q: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last ``len(q)`` positions of one request with vLLM's FA."""
    # host-built lengths: prefill runs eagerly, so these small copies are fine
    n, device = q.shape[0], q.device
    cu_q = torch.tensor([0, n], dtype=torch.int32, device=device)
    seqused_k = torch.tensor([req.seq_len], dtype=torch.int32, device=device)
    return _flash_varlen(q, req.kv_cache, req.block_table_row.view(1, -1), cu_q, seqused_k, n,
                         req.seq_len, scale, req.k_scale, req.v_scale)  # fmt: skip


def _flash_varlen(
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
    seqused_k: torch.Tensor, max_q: int, max_k: int, scale: float,
    k_scale: float | torch.Tensor | None, v_scale: float | torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    """Causal attention of several requests' last queries (concatenated, ``cu_seqlens_q``) over
    their pages (``block_tables`` ``[requests, pages]``) with vLLM's FA, in one call.

    An fp8 cache goes through FA3's fp8 path, as in vLLM's own FLASH_ATTN backend: the planes
    viewed as float8_e4m3fn with ``k_descale`` / ``v_descale`` the layer's scales. FA3 multiplies
    fp8 by fp8 only, so q is quantized too. vLLM's layer does it with its static ``_q_scale``
    (1.0 unless calibrated); here it is per call, ``amax|q| / 448``, so nothing saturates. FA3
    also rounds the softmax weights to fp8 for P·V, so this path is not the Triton kernels'
    arithmetic (bf16 q, bf16 products): :func:`flash_attention_works` checks it with its own
    tolerance. Its fp8 output is bf16 whatever q's dtype, hence the buffer and the cast.
    """
    from vllm.v1.attention.backends.fa_utils import (
        flash_attn_varlen_func,
        get_flash_attn_version,
    )

    device, dtype = q.device, q.dtype
    kv, fp8 = kv_cache, ref.is_fp8_cache(kv_cache)
    extra = {}
    if fp8:
        hkv = kv.shape[3]
        kv = kv.view(ref.FP8_DTYPE)
        if k_scale is None or v_scale is None:
            raise ValueError("an fp8 KV cache needs the request's k_scale and v_scale")
        q_scale = q.abs().amax().float().clamp(min=1e-30) / ref.FP8_MAX
        q = ref.quantize_fp8(q, q_scale)
        n_seqs = seqused_k.shape[0]
        extra = {
            "q_descale": _descale(q_scale, n_seqs, hkv, device),
            "k_descale": _descale(k_scale, n_seqs, hkv, device),
            "v_descale": _descale(v_scale, n_seqs, hkv, device),
        }
        out = torch.empty(q.shape, dtype=torch.bfloat16, device=device)
    else:
        out = torch.empty_like(q)
    flash_attn_varlen_func(
        q=q, k=kv[:, 0], v=kv[:, 1], out=out, cu_seqlens_q=cu_seqlens_q,
        max_seqlen_q=max_q, seqused_k=seqused_k, max_seqlen_k=max_k, softmax_scale=scale,
        causal=True, block_table=block_tables.to(torch.int32),
        fa_version=get_flash_attn_version(head_size=q.shape[-1]), **extra,
    )  # fmt: skip
    return out.to(dtype)


# per (device, cache kind): None when vLLM's FlashAttention reads our layout right, else why not
_FLASH_PROBLEM: dict[str, str | None] = {}
# fp8 through FA3 quantizes q and the softmax weights (see _flash_dense): its error on the
# check's case is set by e4m3 rounding, not a layout misread (which is off by O(1)). H200, FA3,
# 2026-12-01: max 0.030, mean 0.0045 on this case (against q quantized the same way, a 6K
# context's max error fell from 0.14 to 0.023: what is left is the softmax weights' rounding).
_FP8_FLASH_TOL = {"max_abs": 0.15, "mean_abs": 0.02}


def flash_attention_works(device: torch.device, kv_fp8: bool = False) -> bool:
    """Whether vLLM's FlashAttention reads this plugin's cache layout right on ``device``: one
    small paged case against the reference, once per device and cache kind. The K and V planes
    of ``[blocks, 2, block_size, H, D]`` are strided views, which FA's paged path takes; if a
    build cannot, the backend keeps dense prefill below the dense threshold (logged).

    ``kv_fp8``: the same for an fp8 cache (vLLM's ``--kv-cache-dtype fp8``), which needs FA3's
    fp8 path (FA3 on Hopper, as vLLM's own backend requires); elsewhere it is False, and dense
    prefill over an fp8 cache gathers, dequantizes and runs SDPA."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:0": one check
        device = torch.device("cuda", torch.cuda.current_device())
    key = f"{device}/fp8" if kv_fp8 else str(device)
    if key not in _FLASH_PROBLEM:
        problem: str | None = None
        try:
            gen = torch.Generator(device="cpu").manual_seed(0)
            # device="cpu": vLLM builds models under a CUDA default device
            kv = torch.randn(9, 2, 16, 2, 64, generator=gen, device="cpu")
            table = torch.tensor([3, 7, 1, 5, 0, 8], dtype=torch.int32, device=device)
            if kv_fp8:  # vLLM's storage (uint8), scales that differ per plane
                stored = torch.stack([ref.quantize_fp8(kv[:, 0], 0.5),
                                      ref.quantize_fp8(kv[:, 1], 2.0)], dim=1)  # fmt: skip
                req = RequestKV(stored.view(torch.uint8).to(device), table, 90, k_scale=0.5,
                                v_scale=2.0)  # fmt: skip
            else:
                req = RequestKV(kv.to(device, torch.bfloat16), table, 90)
            q = torch.randn(20, 8, 64, generator=gen, device="cpu").to(device, torch.bfloat16)
            got = _flash_dense(req, q, 0.125).float()
            k, v = req.contiguous()
            want = ref.dense_attention(q, k, v, torch.arange(70, 90, device=device), 0.125)
            err = (got - want.float()).abs()
            if kv_fp8:
                ok = bool(err.max() <= _FP8_FLASH_TOL["max_abs"]) and bool(
                    err.mean() <= _FP8_FLASH_TOL["mean_abs"]
                )
            else:
                ok = torch.allclose(got, want.float(), atol=2e-2)
            if not ok:
                problem = f"its output differs from the reference (max {float(err.max()):.3g})"
        except Exception as e:  # noqa: BLE001 - any failure means: do not use it
            problem = f"{type(e).__name__}: {e}"[:300]
        _FLASH_PROBLEM[key] = problem
        if problem is not None:
            import logging

            logging.getLogger("vllm.vllm_infinitehip").warning(
                "vLLM's FlashAttention cannot serve this cache layout%s (%s); dense prefill "
                "stays below the dense threshold", " with an fp8 KV cache" if kv_fp8 else "",
                problem,
            )  # fmt: skip
    return _FLASH_PROBLEM[key] is None


def ops_for(device: torch.device, precision: str = "fp32",
            reduce_scores: ref.ScoreReduce | None = None) -> AttentionOps:  # fmt: skip
    """The device's ops. ``reduce_scores`` combines each pruning stage's head-reduced scores
    across processes before its top-k (:func:`reference.run_stages`); ``None``: this process's
    heads alone."""
    if device.type == "cuda":
        return TritonOps(precision, reduce_scores)
    return ReferenceOps(reduce_scores)
