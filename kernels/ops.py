"""The attention work of one layer, by device: the PyTorch reference or the Triton kernels.

:class:`AttentionOps` is the interface the backend calls; :func:`ops_for` picks the
implementation. Prefill works on one request at a time (:class:`RequestKV`: its block-table row
and length); decode works on all decode rows of a step at once (:class:`decode.DecodeRows`),
through the masks kept per state slot (:class:`decode.DecodeMasks`). Both read the paged cache
``[num_blocks, 2, block_size, H_kv, D]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from vllm_infinitehip.kernels import decode as dec
from vllm_infinitehip.kernels import reference as ref


@dataclass
class RequestKV:
    """One request's view of a layer's paged KV cache."""

    kv_cache: torch.Tensor
    block_table_row: torch.Tensor
    seq_len: int
    _kv: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    def contiguous(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``k, v`` as ``[seq_len, H_kv, D]``, gathered once per request and layer."""
        if self._kv is None:
            self._kv = ref.gather_paged_kv(self.kv_cache, self.block_table_row, self.seq_len)
        return self._kv


@dataclass
class DecodeScratch:
    """Preallocated buffers of a step's decode work (owned by the builder, shared by layers)."""

    scores: list[torch.Tensor]  # per stage [max rows, W_i] float32 at -inf
    workspace: torch.Tensor | None  # flat float32 split partials (GPU)
    placement: object | None = None  # triton_decode.QueryPlacement of the layer
    # the layer's host-tier bank (pages, residency table): decode reads resident pages there
    bank: tuple[torch.Tensor, torch.Tensor] | None = None


class AttentionOps(Protocol):
    """What the backend asks of a device. Pair counts are ints or 0-dim device tensors (the
    GPU path counts on device, so nothing syncs)."""

    def dense(self, req: RequestKV, q: torch.Tensor, positions: torch.Tensor,
              scale: float) -> torch.Tensor: ...  # fmt: skip

    def prune(self, params: ref.PruneParams, req: RequestKV, q: torch.Tensor,
              positions: torch.Tensor, scale: float) -> ref.PruneResult: ...  # fmt: skip

    def attend(self, params: ref.PruneParams, req: RequestKV, q: torch.Tensor,
               positions: torch.Tensor, scale: float, prune: ref.PruneResult,
               slice_end: int) -> tuple[torch.Tensor, int | torch.Tensor]: ...  # fmt: skip

    def refresh_decode(self, params: ref.PruneParams, masks: dec.DecodeMasks, q: torch.Tensor,
                       kv_cache: torch.Tensor, rows: dec.DecodeRows, scale: float,
                       scratch: DecodeScratch) -> None: ...  # fmt: skip

    def attend_decode(self, params: ref.PruneParams, masks: dec.DecodeMasks, q: torch.Tensor,
                      kv_cache: torch.Tensor, rows: dec.DecodeRows, scale: float,
                      out: torch.Tensor, pairs: torch.Tensor,
                      scratch: DecodeScratch) -> None: ...  # fmt: skip


class ReferenceOps:
    """The PyTorch reference: the CPU path."""

    def dense(self, req, q, positions, scale):
        k, v = req.contiguous()
        return ref.dense_attention(q, k, v, positions, scale)

    def prune(self, params, req, q, positions, scale):
        k, _ = req.contiguous()
        return ref.run_stages(params, q, k, positions, scale)

    def attend(self, params, req, q, positions, scale, prune, slice_end):
        """Block-sparse attention; also the exact number of (query, key) pairs attended."""
        k, v = req.contiguous()
        out, _, attended = ref.sparse_attention(params, q, k, v, positions, scale, prune=prune)
        return out, attended

    def refresh_decode(self, params, masks, q, kv_cache, rows, scale, scratch):
        dec.refresh_masks_reference(params, masks, q, kv_cache, rows, scale, scratch.bank)

    def attend_decode(self, params, masks, q, kv_cache, rows, scale, out, pairs, scratch):
        o, attended = dec.attend_reference(params, masks, q, kv_cache, rows, scale, scratch.bank)
        out.copy_(o)
        context = sum(t for t, s in zip(rows.seq_lens.tolist(), rows.slots.tolist()) if s >= 0)
        pairs += torch.tensor([attended, context], dtype=pairs.dtype)


class TritonOps:
    """Triton kernels over the paged cache: the GPU path; dense prefill runs vLLM's
    FlashAttention. RoPE remapping (§2) runs in the kernels: relative and chunk-indexed pruning
    and streaming BSA, for any pairing layout and partial rotary.
    ``precision`` is the prefill pruning's (``triton_prune.select_rep_scores_paged``)."""

    def __init__(self, precision: str = "fp32") -> None:
        self.precision = precision

    def dense(self, req, q, positions, scale):
        """vLLM's own FlashAttention over the paged cache where it runs (fp16/bf16 on CUDA,
        checked once per device by :func:`flash_attention_works`), else a gather and SDPA."""
        if q.dtype in (torch.float16, torch.bfloat16) and flash_attention_works(q.device):
            return _flash_dense(req, q, scale)
        k, v = req.contiguous()
        return ref.dense_attention(q, k, v, positions, scale)

    def prune(self, params, req, q, positions, scale):
        from vllm_infinitehip.kernels.triton_prune import run_stages_paged

        return run_stages_paged(params, q, req.kv_cache, req.block_table_row, positions, scale,
                                seq_len=req.seq_len, precision=self.precision)  # fmt: skip

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
            rope=params.rope.table if streaming else None,
        )  # fmt: skip
        blk = torch.arange(q.shape[0], device=q.device) // params.block_size_q
        budget = params.sink_tokens + params.window_tokens
        if streaming:  # a query sees its whole block's window, from the block's first query
            budget = budget + (positions - positions[blk * params.block_size_q])
        per_query = torch.clamp(positions + 1, max=budget)
        selected = (n_valid.long() * params.block_size_k)[blk]
        return out, (per_query + selected).sum()

    def refresh_decode(self, params, masks, q, kv_cache, rows, scale, scratch):
        from vllm_infinitehip.kernels import triton_decode

        triton_decode.refresh_masks(params, masks, q, kv_cache, rows, scale, scratch.scores,
                                    scratch.placement, bank=scratch.bank)  # fmt: skip

    def attend_decode(self, params, masks, q, kv_cache, rows, scale, out, pairs, scratch):
        from vllm_infinitehip.kernels import triton_bsa

        streaming = params.rope is not None and params.rope.bsa == "streaming"
        triton_bsa.sparse_decode_attention(
            q, kv_cache, rows.block_table, rows.seq_lens, masks.final, masks.final_counts(),
            block_size_k=params.block_size_k, sink_tokens=params.sink_tokens,
            window_tokens=params.window_tokens, scale=scale, out=out,
            rope=params.rope.table if streaming else None, row_slots=rows.slots, stats=pairs,
            workspace=scratch.workspace, bank=scratch.bank,
        )  # fmt: skip


def _flash_dense(req: RequestKV, q: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last ``len(q)`` positions of one request with vLLM's FA."""
    from vllm.v1.attention.backends.fa_utils import (
        flash_attn_varlen_func,
        get_flash_attn_version,
    )

    n, device = q.shape[0], q.device
    out = torch.empty_like(q)
    # host-built lengths: prefill runs eagerly, so these small copies are fine
    cu_q = torch.tensor([0, n], dtype=torch.int32, device=device)
    seqused_k = torch.tensor([req.seq_len], dtype=torch.int32, device=device)
    flash_attn_varlen_func(
        q=q, k=req.kv_cache[:, 0], v=req.kv_cache[:, 1], out=out, cu_seqlens_q=cu_q,
        max_seqlen_q=n, seqused_k=seqused_k, max_seqlen_k=req.seq_len, softmax_scale=scale,
        causal=True, block_table=req.block_table_row.view(1, -1).to(torch.int32),
        fa_version=get_flash_attn_version(head_size=q.shape[-1]),
    )  # fmt: skip
    return out


# per device: None when vLLM's FlashAttention reads our layout right, else why not
_FLASH_PROBLEM: dict[str, str | None] = {}


def flash_attention_works(device: torch.device) -> bool:
    """Whether vLLM's FlashAttention reads this plugin's cache layout right on ``device``: one
    small paged case against the reference, once per device. The K and V planes of
    ``[blocks, 2, block_size, H, D]`` are strided views, which FA's paged path takes; if a
    build cannot, the backend keeps dense prefill below the dense threshold (logged)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:0": one check
        device = torch.device("cuda", torch.cuda.current_device())
    key = str(device)
    if key not in _FLASH_PROBLEM:
        problem: str | None = None
        try:
            gen = torch.Generator(device="cpu").manual_seed(0)
            # device="cpu": vLLM builds models under a CUDA default device
            kv = torch.randn(9, 2, 16, 2, 64, generator=gen, device="cpu")
            kv = kv.to(device, torch.bfloat16)
            table = torch.tensor([3, 7, 1, 5, 0, 8], dtype=torch.int32, device=device)
            req = RequestKV(kv, table, 90)
            q = torch.randn(20, 8, 64, generator=gen, device="cpu").to(device, torch.bfloat16)
            got = _flash_dense(req, q, 0.125)
            k, v = req.contiguous()
            want = ref.dense_attention(q, k, v, torch.arange(70, 90, device=device), 0.125)
            if not torch.allclose(got.float(), want.float(), atol=2e-2):
                problem = "its output differs from the reference"
        except Exception as e:  # noqa: BLE001 - any failure means: do not use it
            problem = f"{type(e).__name__}: {e}"[:300]
        _FLASH_PROBLEM[key] = problem
        if problem is not None:
            import logging

            logging.getLogger("vllm.vllm_infinitehip").warning(
                "vLLM's FlashAttention cannot serve this cache layout (%s); dense prefill stays "
                "below the dense threshold", problem,
            )  # fmt: skip
    return _FLASH_PROBLEM[key] is None


def ops_for(device: torch.device, precision: str = "fp32") -> AttentionOps:
    return TritonOps(precision) if device.type == "cuda" else ReferenceOps()
