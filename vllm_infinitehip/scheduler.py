"""vLLM's schedulers without the per-step scan for cascade attention's common prefix.

Every step, vLLM 0.26's ``Scheduler.schedule`` walks one running request's whole block list to
count the blocks every request shares (``KVCacheManager.get_num_common_prefix_blocks``). Only
cascade attention reads the count, and ``InfiniteHiPBackend.use_cascade_attention`` is always
False (the V2 model runner, the H200's default, reads it nowhere). With one request the walk
covers every block of its context: 3.0 ms per step at 512K tokens, 4.6 ms at 900K, in Python on
the engine core's critical path (2 CPU cores; ``benchmarks/scheduler_host.py``). A 512K
infinitehip decode step keeps the GPU busy for about 5.6 ms, so on such a host the walk alone is
half of it; FLASH_ATTN's 20 ms steps hide it.

These subclasses answer zero for every group without walking, which is exact for a model whose
attention never cascades. :func:`vllm_infinitehip.compat.use_scheduler` picks the one matching
``async_scheduling`` when the user named no scheduler class.
"""

from __future__ import annotations

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler


class _NoCommonPrefixScan:
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        groups = len(self.kv_cache_config.kv_cache_groups)
        # an instance attribute: the scheduler's own call site stays vLLM's
        self.kv_cache_manager.get_num_common_prefix_blocks = (
            lambda running_request_id: [0] * groups
        )


class InfiniteHiPScheduler(_NoCommonPrefixScan, Scheduler):
    """vLLM's ``Scheduler`` (``async_scheduling`` off)."""


class InfiniteHiPAsyncScheduler(_NoCommonPrefixScan, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` (``async_scheduling`` on, the default where supported)."""
