"""One request's attention over the paged cache, by device: PyTorch reference or Triton kernels.

The backend asks the same four questions on every device (dense attention, prune, attend with a
mask) and gets the same answers; :func:`ops_for` picks the implementation. Both take the paged
cache ``[num_blocks, 2, block_size, H_kv, D]``, one request's block-table row and its length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

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


class ReferenceOps:
    """The PyTorch reference: the CPU path."""

    def dense(self, req: RequestKV, q: torch.Tensor, positions: torch.Tensor, scale: float):
        k, v = req.contiguous()
        return ref.dense_attention(q, k, v, positions, scale)

    def prune(
        self,
        params: ref.PruneParams,
        req: RequestKV,
        q: torch.Tensor,
        positions: torch.Tensor,
        scale: float,
        start_stage: int = 0,
        start_input: ref.Candidates | None = None,
    ) -> ref.PruneResult:
        k, _ = req.contiguous()
        return ref.run_stages(params, q, k, positions, scale, start_stage, start_input)

    def attend(
        self,
        params: ref.PruneParams,
        req: RequestKV,
        q: torch.Tensor,
        positions: torch.Tensor,
        scale: float,
        prune: ref.PruneResult,
    ) -> tuple[torch.Tensor, int]:
        """Block-sparse attention; also the exact number of (query, key) pairs attended."""
        k, v = req.contiguous()
        out, _, attended = ref.sparse_attention(params, q, k, v, positions, scale, prune=prune)
        return out, attended


class TritonOps(ReferenceOps):
    """Triton kernels over the paged cache: the GPU path. Dense stays on SDPA (short sequences).

    RoPE remapping (§2) runs in the kernels too: relative and chunk-indexed pruning, and
    streaming BSA, for any pairing layout and partial rotary.
    """

    def prune(self, params, req, q, positions, scale, start_stage=0, start_input=None):
        from vllm_infinitehip.kernels.triton_prune import run_stages_paged

        return run_stages_paged(
            params, q, req.kv_cache, req.block_table_row, positions, scale,
            start_stage, start_input, seq_len=req.seq_len,
        )  # fmt: skip

    def attend(self, params, req, q, positions, scale, prune):
        """As the reference; the pair count is the budget (sink, window, selected blocks), an
        upper bound, since counting exactly would need the whole key mask."""
        from vllm_infinitehip.kernels import triton_bsa

        streaming = params.rope is not None and params.rope.bsa == "streaming"
        # The kernels take the queries to be the last len(q) positions of a sequence. A prefill
        # chunk is attended in slices (body, tail), and keys after a slice's last query are its
        # future, so the slice's sequence ends at its last position (one host sync per slice).
        seq_len = req.seq_len if q.shape[0] == 1 else int(positions[-1]) + 1
        starts = prune.block_starts.to(torch.int32)
        n_valid = prune.block_valid.sum(dim=1, dtype=torch.int32)
        common = dict(
            block_size_k=params.block_size_k,
            sink_tokens=params.sink_tokens,
            window_tokens=params.window_tokens,
            scale=scale,
            rope=params.rope.table if streaming else None,
        )
        if q.shape[0] == 1:
            seq_lens = torch.full((1,), seq_len, dtype=torch.int32, device=q.device)
            out = triton_bsa.sparse_decode_attention(
                q, req.kv_cache, req.block_table_row.view(1, -1), seq_lens, starts, n_valid,
                **common,
            )  # fmt: skip
        else:
            out = triton_bsa.sparse_prefill_attention(
                q, req.kv_cache, req.block_table_row, seq_len, starts, prune.block_valid,
                block_size_q=params.block_size_q, **common,
            )  # fmt: skip
        blk = ref.query_block_ids(q.shape[0], params.block_size_q).to(q.device)
        budget = params.sink_tokens + params.window_tokens
        if streaming:  # a query sees its whole block's window, from the block's first query
            budget = budget + (positions - positions[blk * params.block_size_q])
        per_query = torch.clamp(positions + 1, max=budget)
        selected = (n_valid.long() * params.block_size_k)[blk]
        return out, int((per_query + selected).sum())


def ops_for(device: torch.device) -> ReferenceOps:
    return TritonOps() if device.type == "cuda" else ReferenceOps()
