"""The worker of the host KV tier (``infinitehip.offload``): vLLM's KV blocks live in host memory.

:func:`vllm_infinitehip.compat.use_host_tier_worker` sets ``parallel_config.worker_cls`` to one of
these classes when offload is on; they subclass vLLM's own worker of the platform and change three
things, each through a method vLLM already calls:

- ``determine_available_memory``: vLLM profiles as usual; the KV budget it finds on the device
  becomes the bank's (the GPU cache of hot pages), and vLLM is told the host tier's size instead.
  Its block count, its startup check that ``max_model_len`` fits, the scheduler, preemption and
  prefix caching then all work on host-backed blocks, unchanged. The tier is installed in
  :mod:`vllm_infinitehip.block_manager.tier` for the attention builders of this process.
- ``initialize_from_config`` (GPU): the KV buffers vLLM allocates there come from
  :class:`~vllm_infinitehip.block_manager.host_store.HostKVStore` (pinned host memory, seen through
  UVA) instead of ``torch.zeros`` on the device; see :func:`host_kv_allocation`. On the CPU the KV
  already is host memory.
- ``execute_model``: before a step runs, the block ids vLLM freed (finished, aborted, preempted
  requests) or rewrites outside attention (zeroing, copy-on-write copies) are released from the
  banks (:class:`BlockOwners`, :meth:`HostTier.release`).

The CPU worker class is built on first access: importing ``vllm.v1.worker.cpu_worker`` replaces
``torch.cuda`` streams and events process-wide, which must never happen in a CUDA worker.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

import psutil
import torch
from vllm.logger import init_logger
from vllm.v1.worker.gpu_worker import Worker

from vllm_infinitehip.block_manager.host_store import HostKVStore
from vllm_infinitehip.block_manager.placement import split_capacity
from vllm_infinitehip.block_manager.tier import HostTier, current, install
from vllm_infinitehip.config import InfiniteHiPConfig, InfiniteHiPConfigError, OffloadConfig
from vllm_infinitehip.metrics import InfiniteHiPWorkerExtension

logger = init_logger(__name__)

GIB = 1 << 30
HOST_DEFAULT_SHARE = 0.8  # of the host memory available at startup
CPU_BANK_DEFAULT_DIVISOR = 8  # on the CPU the bank is host memory too: a small share of the tier
# The split layout's V bank, of the GPU's KV memory when V spills. A decode row reads about 600
# pages per layer and step (sink, window, final blocks and their extension); at Llama-3-8B fp8
# shapes a sixteenth of an H200's KV memory holds some 14K pages per layer, a few refreshes'
# worth for every row of a batch of a few, and costs a sixteenth of the GPU's V homes.
SPLIT_BANK_DEFAULT_SHARE = 1 / 16


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB"


def _host_bytes(offload: OffloadConfig, available_host: int, workers_on_host: int) -> int:
    """Host memory for KV per worker: ``host_gib``, or a share of what is available."""
    where = "infinitehip.offload"
    if offload.host_gib is None:
        host_bytes = int(HOST_DEFAULT_SHARE * available_host) // workers_on_host
    else:
        host_bytes = int(offload.host_gib * GIB)
        if host_bytes * workers_on_host > available_host:
            per_worker = f" per worker, {workers_on_host} workers" if workers_on_host > 1 else ""
            raise InfiniteHiPConfigError(
                f"`{where}.host_gib`={offload.host_gib} asks for {_gib(host_bytes)} of host "
                f"memory for KV{per_worker}, but this machine has {_gib(available_host)} "
                f"available (after loading the model): lower it, or leave it unset for "
                f"{HOST_DEFAULT_SHARE:.0%} of what is available"
            )
    if host_bytes <= 0:
        raise InfiniteHiPConfigError(
            f"`{where}`: no host memory is available for KV ({_gib(available_host)} available)"
        )
    return host_bytes


def _within_profiled(name: str, gib: float, device_budget: int) -> int:
    """``gib`` of the GPU as bytes, refused (naming ``offload.<name>``) past what vLLM's memory
    profiling left for KV."""
    nbytes = int(gib * GIB)
    if nbytes > device_budget:
        raise InfiniteHiPConfigError(
            f"`infinitehip.offload.{name}`={gib} ({_gib(nbytes)}) exceeds the "
            f"{_gib(max(device_budget, 0))} that vLLM's memory profiling left for KV on the GPU "
            f"(gpu_memory_utilization, or kv_cache_memory_bytes): lower it, leave it unset for "
            f"all of that, or raise gpu_memory_utilization"
        )
    return nbytes


def size_host_tier(
    offload: OffloadConfig,
    *,
    device_budget: int,
    available_host: int,
    workers_on_host: int = 1,
    bank_on_host: bool = False,
) -> HostTier:
    """The tier's two sizes, from the config and what the machine has.

    ``device_budget``: the KV bytes vLLM's profiling found on the device (the bank's budget).
    ``available_host``: host memory available now. ``workers_on_host``: worker processes of this
    engine on this machine, which share it. ``bank_on_host``: the device is the CPU, so the bank
    is carved from host memory as well and is at most the tier. Raises
    :class:`InfiniteHiPConfigError` naming the field that does not fit.
    """
    where = "infinitehip.offload"
    host_bytes = _host_bytes(offload, available_host, workers_on_host)

    if bank_on_host:
        if offload.bank_gib is None:
            bank_bytes = host_bytes // CPU_BANK_DEFAULT_DIVISOR
        else:
            bank_bytes = int(offload.bank_gib * GIB)
            if bank_bytes > host_bytes:
                raise InfiniteHiPConfigError(
                    f"`{where}.bank_gib`={offload.bank_gib} ({_gib(bank_bytes)}) exceeds the "
                    f"host tier ({_gib(host_bytes)}, `{where}.host_gib`): on the CPU the bank "
                    f"is host memory too and caches part of the tier, so it must not exceed it"
                )
        return HostTier(host_bytes=host_bytes, bank_bytes=bank_bytes)

    if offload.bank_gib is None:
        bank_bytes = device_budget
    else:
        bank_bytes = _within_profiled("bank_gib", offload.bank_gib, device_budget)
    if bank_bytes <= 0:
        raise InfiniteHiPConfigError(
            f"`{where}`: vLLM's memory profiling left no GPU memory for the bank "
            f"({_gib(device_budget)}); raise gpu_memory_utilization"
        )
    return HostTier(host_bytes=host_bytes, bank_bytes=bank_bytes, device_budget=device_budget)


def size_split_tier(
    offload: OffloadConfig,
    *,
    device_budget: int,
    available_host: int,
    block_bytes: int,
    min_gpu_pages: int,
    workers_on_host: int = 1,
    gpu_block_extra: int = 0,
) -> HostTier:
    """The ``"split"`` layout's sizes: every block's K on the GPU, V on the GPU first and on the
    host past it (:func:`~vllm_infinitehip.block_manager.placement.split_capacity`).
    ``block_bytes``: one block's K and V over every layer. ``min_gpu_pages``: the V pages one
    step's new blocks may need. ``gpu_block_extra``: what else every block keeps on the GPU
    beside its K (its landmark scores). Raises :class:`InfiniteHiPConfigError` naming the
    field."""
    where = "infinitehip.offload"
    host = _host_bytes(offload, available_host, workers_on_host)
    gpu_bytes = device_budget
    if offload.gpu_gib is not None:
        gpu_bytes = _within_profiled("gpu_gib", offload.gpu_gib, device_budget)
    half = block_bytes // 2
    v_block = block_bytes - half

    def capacity(kv_bytes: int):
        return split_capacity(kv_bytes, host, half + gpu_block_extra, v_block, min_gpu_pages)

    try:
        cap = capacity(gpu_bytes)
    except ValueError:
        raise InfiniteHiPConfigError(
            f"`{where}`: the split layout keeps every block's K and the V of one step's new "
            f"blocks ({min_gpu_pages} blocks of {_gib(block_bytes)}) on the GPU, but "
            f"{_gib(gpu_bytes)} is left for KV there (`{where}.gpu_gib`, or vLLM's profiling)"
        ) from None
    pages = 0  # the V bank's: its slots and a spare that padding fills land on (SplitKV)
    if cap.host_pages and offload.bank_gib != 0:  # a V bank only where V spills
        if offload.bank_gib is None:
            wanted = int(gpu_bytes * SPLIT_BANK_DEFAULT_SHARE)
        else:
            wanted = _within_profiled("bank_gib", offload.bank_gib, gpu_bytes)
        # At most one page per host page. That also keeps the GPU's minimum: with K and V
        # halves of a block, G = N h + g h and the bank's (N - g) h leave 2 g h >= g blocks.
        pages = min(wanted // v_block, cap.host_pages)
        if pages >= 2:  # one slot at least
            cap = capacity(gpu_bytes - pages * v_block)
        else:
            pages = 0
    return HostTier(host_bytes=cap.host_pages * v_block, bank_bytes=pages * v_block,
                    device_budget=gpu_bytes, layout="split", num_blocks=cap.num_blocks,
                    gpu_pages=cap.gpu_pages, bank_pages=max(pages - 1, 0))  # fmt: skip


class BlockOwners:
    """Which live request holds which KV block, kept from the scheduler's outputs alone.

    The worker sees every block assignment in the ``SchedulerOutput`` stream (new requests' block
    ids, running requests' appended ones, a resumed request's replacement list), so it needs no
    runner internals: the V1 runner keeps block ids per request on the host, the V2 runner only in
    staged device block tables. A block is freed when its last holder finishes, is aborted
    (``finished_req_ids``) or is preempted (``preempted_req_ids``); a block that another live
    request still holds (a shared prefix) stays in the bank.
    """

    def __init__(self) -> None:
        self.blocks: dict[str, list[int]] = {}
        self.holders: Counter[int] = Counter()
        self.freed: list[int] = []  # the blocks the last step's output freed
        self.taken: list[int] = []  # the blocks it handed to requests (new, appended, hits)
        self.preempted = 0  # requests vLLM preempted, over the engine's life

    def _drop(self, req_id: str) -> list[int]:
        ids = self.blocks.pop(req_id, [])
        self.holders.subtract(ids)
        return ids

    def _hold(self, req_id: str, block_ids: Iterable[Iterable[int]]) -> None:
        # one block pool serves every KV cache group, so ids are unique across groups
        ids = [b for group in block_ids for b in group]
        self.blocks.setdefault(req_id, []).extend(ids)
        self.holders.update(ids)
        self.taken.extend(ids)

    def released_by(self, scheduler_output: Any) -> list[int]:
        """Follow one step's output; return the block ids to release before it runs: the blocks
        vLLM freed since the last step (no live request holds them), and the blocks it zeroes or
        copies into this step."""
        so = scheduler_output
        cached = so.scheduled_cached_reqs
        leaving = [*so.finished_req_ids, *(so.preempted_req_ids or ())]
        self.preempted += len(so.preempted_req_ids or ())
        # a resumed request's list is replaced, not appended to; a streaming request is re-added
        # with all its blocks
        leaving += [r for r in cached.req_ids if r in cached.resumed_req_ids]
        leaving += [new.req_id for new in so.scheduled_new_reqs]
        let_go = [b for req_id in leaving for b in self._drop(req_id)]
        # vLLM frees a block when its last holder lets go, before it hands blocks out again, so
        # a block freed and reassigned within one scheduling step is released too
        freed = {b for b in let_go if self.holders[b] <= 0}
        for b in freed:
            del self.holders[b]
        self.freed = sorted(freed)
        self.taken = []
        for new in so.scheduled_new_reqs:
            self._hold(new.req_id, new.block_ids)
        for req_id, new_block_ids in zip(cached.req_ids, cached.new_block_ids):
            if new_block_ids is not None:
                self._hold(req_id, new_block_ids)
        rewritten = list(so.new_block_ids_to_zero or ())
        rewritten += [c.dst_block_id for c in so.kv_cache_block_copies or ()]
        return sorted(freed.union(rewritten))


def _in_host_memory(raw: dict[str, torch.Tensor], store: HostKVStore | None,
                    ) -> dict[str, torch.Tensor]:  # fmt: skip
    """vLLM's per-layer raw KV buffers (allocated on the meta device, so sized and aliased by
    vLLM's own code) re-made in host memory, keeping which layers share a buffer."""
    if store is None:  # the split layout: vLLM's tensors stay shapes (see _unbind_meta_kv)
        return raw
    made: dict[int, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for layer, meta in raw.items():
        if meta.dtype != torch.int8 or meta.dim() != 1:
            raise RuntimeError(
                f"vLLM's raw KV buffer of {layer} is {meta.dtype} {tuple(meta.shape)}; the host "
                f"tier expects flat int8 buffers (vLLM 0.26's layout)"
            )
        if id(meta) not in made:
            made[id(meta)] = store.zeros(meta.numel())
        out[layer] = made[id(meta)]
    return out


@contextlib.contextmanager
def host_kv_allocation(runner: Any, v2_runner: bool, store: HostKVStore | None,
                       ) -> Iterator[None]:  # fmt: skip
    """While open, the runner's KV allocation takes its buffers from ``store`` (``None``: they
    stay on the ``meta`` device, for the split layout, whose KV the attention groups own).

    vLLM has no allocator hook for KV; each runner allocates in one small function, then reshapes
    and binds what it got, and both steps work on any int8 device tensor. So only that function is
    replaced, and only for the duration of the worker's ``initialize_from_config`` (the GPU KV of
    vLLM's CUDA-graph memory profiling, earlier, stays on the device):

    - V1 runner (``vllm/v1/worker/gpu_model_runner.py``): ``GPUModelRunner._allocate_kv_cache_tensors``,
      overridden on this runner instance; it allocates on ``runner.device``, set to ``meta`` for the
      call so vLLM's own code decides sizes and sharing.
    - V2 runner (``vllm/v1/worker/gpu/``, the default for dense models): ``attn_utils._allocate_kv_cache``,
      a module function that ``init_kv_cache`` looks up at call time; called with the ``meta`` device.

    Subclassing the runner instead would mean copying ``Worker.init_device`` (which constructs it)
    and, for V2, ``initialize_kv_cache`` (which calls ``init_kv_cache`` directly).
    """
    meta = torch.device("meta")
    if v2_runner:
        from vllm.v1.worker.gpu import attn_utils

        original_v2 = attn_utils._allocate_kv_cache

        def allocate_v2(kv_cache_config, shared_layers, device):
            return _in_host_memory(original_v2(kv_cache_config, shared_layers, meta), store)

        attn_utils._allocate_kv_cache = allocate_v2
        try:
            yield
        finally:
            attn_utils._allocate_kv_cache = original_v2
        return

    original_v1 = runner._allocate_kv_cache_tensors

    def allocate_v1(kv_cache_config):
        device, runner.device = runner.device, meta
        try:
            raw = original_v1(kv_cache_config)
        finally:
            runner.device = device
        return _in_host_memory(raw, store)

    runner._allocate_kv_cache_tensors = allocate_v1
    try:
        yield
    finally:
        del runner._allocate_kv_cache_tensors


class _HostTierWorker:
    """What both workers add to vLLM's worker of their platform (see the module docstring)."""

    vllm_config: Any
    parallel_config: Any
    device: torch.device

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._block_owners = BlockOwners()
        self._host_store: HostKVStore | None = None
        # the split layout: whether the model needs vLLM's zeroing of new blocks (the scheduler
        # lists new blocks for the placement either way)
        self._zero_new_blocks = False
        install(None)  # a tier of an earlier engine in this process is not ours

    def _split_layout(self) -> bool:
        tier = current()
        return tier is not None and tier.layout == "split"

    def _unbind_meta_kv(self, kv_cache_config: Any) -> None:
        """The split layout's attention groups own their KV; vLLM's per-layer tensors were
        made on ``meta`` (no memory) and are rebound to empty tensors of the device, which is
        all vLLM's forward uses them for (the device and dtype of a dependency token)."""
        self._zero_new_blocks = bool(kv_cache_config.needs_kv_cache_zeroing)
        context = self.model_runner.compilation_config.static_forward_context  # type: ignore[attr-defined]
        for layer in context.values():
            kv = getattr(layer, "kv_cache", None)
            if isinstance(kv, torch.Tensor) and kv.device.type == "meta":
                layer.kv_cache = torch.empty(0, dtype=kv.dtype, device=self.device)

    def _available_host_bytes(self) -> int:
        return psutil.virtual_memory().available

    def determine_available_memory(self) -> int:
        device_budget = super().determine_available_memory()  # type: ignore[misc]
        config = InfiniteHiPConfig.from_vllm_config(self.vllm_config)
        offload = config.offload
        if offload.layout == "split":
            return self._size_split(config, device_budget)
        tier = size_host_tier(
            offload,
            device_budget=device_budget,
            available_host=self._available_host_bytes(),
            workers_on_host=self.parallel_config.local_world_size,
            bank_on_host=self.device.type == "cpu",
        )
        install(tier)
        logger.info(
            "InfiniteHiP host tier: %s of host memory for KV (vLLM's capacity), a %s bank on %s",
            _gib(tier.host_bytes), _gib(tier.bank_bytes), self.device,
        )  # fmt: skip
        return tier.host_bytes

    def _size_split(self, config: InfiniteHiPConfig, device_budget: int) -> int:
        specs = self.get_kv_cache_spec()  # type: ignore[attr-defined]
        block_bytes = sum(spec.page_size_bytes for spec in specs.values())
        block_size = next(iter(specs.values())).block_size
        sched = self.vllm_config.scheduler_config
        # a step allocates at most its tokens' blocks plus one per request crossing a boundary
        min_gpu_pages = math.ceil(sched.max_num_batched_tokens / block_size) + sched.max_num_seqs
        if self.device.type == "cuda":
            # the staging of one request's whole pages, one layer at a time, for the dense
            # prefill chunks FlashAttention reads (backend._setup_split)
            from vllm_infinitehip.backend import split_staging_pages

            layer_page = next(iter(specs.values())).page_size_bytes
            device_budget -= layer_page * split_staging_pages(config, self.vllm_config,
                                                              self.device, block_size)  # fmt: skip
        landmark_bytes = 0
        if config.prefill_representatives == "landmark":
            # the landmark scores of every slot and layer stay on the GPU (backend._landmark_state)
            landmark_bytes = sum(4 * block_size * (spec.num_kv_heads + 1)
                                 for spec in specs.values())  # fmt: skip
        tier = size_split_tier(
            config.offload, device_budget=device_budget,
            available_host=self._available_host_bytes(),
            block_bytes=block_bytes, min_gpu_pages=min_gpu_pages,
            workers_on_host=self.parallel_config.local_world_size,
            gpu_block_extra=landmark_bytes,
        )  # fmt: skip
        install(tier)
        logger.info(
            "InfiniteHiP split KV: %d blocks (%d tokens); K of all and V of %d on %s (%s), V of "
            "%d on the host (%s); a V bank of %d pages per layer (%s)", tier.num_blocks,
            tier.num_blocks * block_size, tier.gpu_pages, self.device,
            _gib(tier.num_blocks * block_bytes // 2 + tier.gpu_pages * block_bytes // 2),
            tier.num_blocks - tier.gpu_pages, _gib(tier.host_bytes), tier.bank_pages,
            _gib(tier.bank_bytes),
        )  # fmt: skip
        return tier.num_blocks * block_bytes

    def execute_model(self, scheduler_output: Any) -> Any:
        released = self._block_owners.released_by(scheduler_output)
        tier = current()
        if tier is not None and tier.layout == "split":
            scheduler_output = self._place_split(tier, scheduler_output)
        elif released and tier is not None:
            tier.release(released)
        return super().execute_model(scheduler_output)  # type: ignore[misc]

    def _place_split(self, tier: HostTier, so: Any) -> Any:
        """Before the step: its new blocks' V homes (victims' V to the host), then vLLM's
        zeroing and copy-on-write through the homes. vLLM's own code indexes its (unbacked)
        tensors by block id, so both lists leave the output the runner sees."""
        owners = self._block_owners
        new = list(so.new_block_ids_to_zero or ())
        tier.place(new, owners.blocks, owners.freed, owners.taken)
        if self._zero_new_blocks and new:
            tier.zero(new)
        copies = so.kv_cache_block_copies or ()
        if copies:
            tier.copy_blocks([c.src_block_id for c in copies], [c.dst_block_id for c in copies])
        return dataclasses.replace(so, new_block_ids_to_zero=None, kv_cache_block_copies=None)

    def shutdown(self) -> None:
        super().shutdown()  # type: ignore[misc]
        if self._host_store is not None:
            self._host_store.close()
            self._host_store = None
        install(None)


# The named methods are a base of the tier's workers, not only injected by vLLM: in one process
# an earlier engine's injection into Worker / CPUWorker would make vLLM see them as a conflict.
class InfiniteHiPWorker(_HostTierWorker, Worker, InfiniteHiPWorkerExtension):
    """vLLM's GPU worker with the host tier; its KV buffers are pinned host memory."""

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        if self._split_layout():
            store = self._host_store = HostKVStore(self.device)

            def host_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
                nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
                if nbytes == 0:
                    return torch.empty(shape, dtype=dtype, device=self.device)
                return store.zeros(nbytes).view(dtype).view(shape)

            current().host_alloc = host_pages
            with host_kv_allocation(self.model_runner, self.use_v2_model_runner, None):
                super().initialize_from_config(kv_cache_config)
            self._unbind_meta_kv(kv_cache_config)
            return
        self._host_store = HostKVStore(self.device)
        with host_kv_allocation(self.model_runner, self.use_v2_model_runner, self._host_store):
            super().initialize_from_config(kv_cache_config)
        logger.info("InfiniteHiP host tier: %s of pinned host memory holds vLLM's KV",
                    _gib(self._host_store.mapped_bytes))  # fmt: skip


def _make_cpu_worker() -> type:
    from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info
    from vllm.v1.worker.cpu_worker import CPUWorker

    class InfiniteHiPCPUWorker(_HostTierWorker, CPUWorker, InfiniteHiPWorkerExtension):
        """vLLM's CPU worker with the host tier (its KV is host memory already)."""

        def _available_host_bytes(self) -> int:
            # as CPUWorker measures it: the memory node its first CPU allocates from
            node = get_allowed_cpu_list()[0].numa_node
            return get_memory_node_info(node).available_memory

        def initialize_from_config(self, kv_cache_config: Any) -> None:
            if not self._split_layout():  # the KV is host memory already
                return super().initialize_from_config(kv_cache_config)
            v2 = getattr(self, "use_v2_model_runner", False)
            with host_kv_allocation(self.model_runner, v2, None):
                super().initialize_from_config(kv_cache_config)
            self._unbind_meta_kv(kv_cache_config)

    InfiniteHiPCPUWorker.__module__ = __name__
    InfiniteHiPCPUWorker.__qualname__ = "InfiniteHiPCPUWorker"
    return InfiniteHiPCPUWorker


def __getattr__(name: str) -> Any:
    if name == "InfiniteHiPCPUWorker":
        cls = globals()[name] = _make_cpu_worker()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
