"""vLLM's schedulers without the per-step scan for cascade attention's common prefix, and with
prefill chunks on the pruning's query-block grid.

Every step, vLLM 0.26's ``Scheduler.schedule`` walks one running request's whole block list to
count the blocks every request shares (``KVCacheManager.get_num_common_prefix_blocks``). Only
cascade attention reads the count, and ``InfiniteHiPBackend.use_cascade_attention`` is always
False (the V2 model runner, which vLLM 0.26 chose on the H200 measured, reads it nowhere). With
one request the walk covers every block of its context: on a 2-core CPU, 3.0 ms per step at 512K
tokens and 4.6 ms at 900K, in Python on the engine core's critical path
(``benchmarks/scheduler_host.py``). A 512K infinitehip decode step kept an H200 busy for about
5.6 ms, so on such a host the walk alone is half of it; FLASH_ATTN's 20 ms steps hide it.

These subclasses answer zero for every group without walking, which is exact for a model whose
attention never cascades.

The pruning scores queries in blocks of ``block_size_q`` counted from a chunk's first query, so
which queries share a block, and so every mask, would depend on where vLLM cut the prompt into
chunks: on the token budget other requests left, and on how long a prefix-cache hit was. A
prompt would get different greedy tokens alone than in a batch. So here every prefill chunk
starts and ends on a multiple of ``block_size_q`` (absolute positions) but the prompt's last:
- a prefix-cache hit is shortened to the grid, and to leave at least the prompt's last
  ``block_size_q`` tokens to compute (the prefill tail, a block of its own: the config's
  ``prefill_tail_window``), through the kv cache manager's ``get_computed_blocks``; this
  recomputes fewer than ``block_size_q + lcm(block_size_q, block_size)`` more tokens than
  vLLM's own hit would;
- a chunk that is not the request's last ends on the grid, through the scheduler's own chunk-end
  hook (``_mamba_block_aligned_split``, which vLLM calls for models with Mamba layers in
  "align" cache mode; this model has none). A chunk whose budget does not reach the next grid
  point waits a step, as vLLM's Mamba alignment does.

With the host tier's split layout (``offload.layout`` "split") they also have vLLM record each
step's newly allocated block ids, which the worker homes on the GPU (``block_manager.split_kv``).

:func:`vllm_infinitehip.compat.use_scheduler` picks the one matching ``async_scheduling`` when
the user named no scheduler class.
"""

from __future__ import annotations

import math

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler


class _InfiniteHiPScheduling:
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        from vllm_infinitehip.config import InfiniteHiPConfig

        manager = self.kv_cache_manager
        groups = len(self.kv_cache_config.kv_cache_groups)
        # instance attributes: the scheduler's own call sites stay vLLM's
        manager.get_num_common_prefix_blocks = lambda running_request_id: [0] * groups
        config = InfiniteHiPConfig.from_vllm_config(self.vllm_config)
        if config.offload.enabled and config.offload.layout == "split":
            # the split layout homes each step's new blocks on the GPU: the worker needs their
            # ids, which vLLM sends only to be zeroed (the worker zeroes them only where the
            # model needs it, and hides the list from vLLM's runner)
            self.needs_kv_cache_zeroing = True
            for single in manager.coordinator.single_type_managers:
                single._record_new_block_ids = True
        self.query_block = config.stages[0].block_size_q
        # a hit is whole KV blocks: the grid both fall on
        hit_grid = math.lcm(self.query_block, self.block_size)
        if self.has_mamba_layers:  # vLLM's own alignment is the one such a model needs
            return
        self.need_mamba_block_aligned_split = True
        find_hit = manager.get_computed_blocks

        def get_computed_blocks(request):
            blocks, num_tokens, shared_prefix_boundary = find_hit(request)
            # a hit on the grid that leaves the prompt's last block_size_q queries to compute:
            # the prefill tail (the config's prefill_tail_window) is those, a block of its own
            aligned = min(num_tokens, request.num_tokens - self.query_block)
            aligned = max(0, aligned) // hit_grid * hit_grid
            if aligned == num_tokens:
                return blocks, num_tokens, shared_prefix_boundary
            # the hit's blocks are not referenced until allocate_slots: dropping some is free
            kept = [list(g[: aligned // self.block_size]) for g in blocks.blocks]
            return manager.create_kv_cache_blocks(tuple(kept)), aligned, shared_prefix_boundary

        manager.get_computed_blocks = get_computed_blocks

    def _mamba_block_aligned_split(self, request, num_new_tokens: int,
                                   num_new_local_computed_tokens: int = 0,
                                   num_external_computed_tokens: int = 0) -> int:  # fmt: skip
        if self.has_mamba_layers:
            return super()._mamba_block_aligned_split(
                request, num_new_tokens, num_new_local_computed_tokens,
                num_external_computed_tokens,
            )  # fmt: skip
        start = (request.num_computed_tokens + num_new_local_computed_tokens
                 + num_external_computed_tokens)  # fmt: skip
        end = start + num_new_tokens
        if end >= request.num_tokens:  # the last chunk (or a decode step) ends where it ends
            return num_new_tokens
        return max(0, end // self.query_block * self.query_block - start)


class InfiniteHiPScheduler(_InfiniteHiPScheduling, Scheduler):
    """vLLM's ``Scheduler`` (``async_scheduling`` off)."""


class InfiniteHiPAsyncScheduler(_InfiniteHiPScheduling, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` (``async_scheduling`` on, the default where supported)."""
