"""The ``INFINITEHIP`` attention backend for vLLM 0.26, modelled on ``triton_attn.py``.

Four classes in data-flow order, shaped like FlashInfer's plan/run:

- the per-step metadata;
- its builder, which plans the step once for all layers: decode rows first, each sparse decode
  row's state slot and refresh level matched on the device (:mod:`vllm_infinitehip.state`), and
  the scratch every layer shares, preallocated for ``max_num_seqs``. No block-table row crosses
  to the host;
- the backend (what vLLM asks before it runs);
- the impl, which runs each layer: write KV, then one batched pruning cascade and one split-K
  block-sparse launch for all decode rows (no host work, so vLLM captures it in CUDA graphs),
  then the prefill chunks as the builder planned them: the dense ones in one varlen
  FlashAttention call, the sparse ones in one cascade and one attention launch per kind of
  part (chunk bodies; chunk tails and final queries), whatever the number of requests.

The compute lives in ``vllm_infinitehip.kernels``; this file decides what to run.

KV cache layout: ``[num_blocks, 2, block_size, num_kv_heads, head_size]`` on every device, so the
PyTorch reference (CPU) and the GPU kernels read the same cache.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec

from vllm_infinitehip import step_branches
from vllm_infinitehip.block_manager import tier as host_tier
from vllm_infinitehip.block_manager.bank import Bank, PrefillStaging, decode_read_pages
from vllm_infinitehip.block_manager.split_kv import SplitKV
from vllm_infinitehip.block_manager.key_rows import KeyRowBank
from vllm_infinitehip.config import (
    CPU_DENSE_PREFILL_CROSSOVER,
    DENSE_DECODE_CROSSOVER,
    DENSE_PREFILL_CROSSOVER,
    InfiniteHiPConfig,
    trained_and_extension,
)
from vllm_infinitehip.kernels import decode as dec
from vllm_infinitehip.kernels import reference as ref
from vllm_infinitehip.kernels.ops import AttentionOps, DecodeScratch, RequestKV, ops_for
from vllm_infinitehip.kernels.query_blocks import DenseRows, LandmarkTiles, QueryBlocks, RequestPart
from vllm_infinitehip.state import DecodeSlots

# Under the "vllm" namespace so that vLLM's logging configuration (handlers, level) applies.
logger = init_logger(f"vllm.{__name__}")


def layer_prune_params(
    config: InfiniteHiPConfig, layer_index: int, rope: ref.RopePlan | None = None,
    prefill: bool = False,
) -> ref.PruneParams:  # fmt: skip
    """A layer's pruning parameters: the config's stages, its final budget (§1.2). Decode's are
    those of ``config.for_decode()``; ``prefill`` adds what only prefill's stages do
    (``prefill_representatives`` ``"group-bisection"``)."""
    stages = [
        ref.StageParams(s.chunk_size, s.keep_tokens, s.block_size_q, s.query_stride)
        for s in config.stages
    ]
    last = stages[-1]
    stages[-1] = dataclasses.replace(last, keep_tokens=config.final_keep_for_layer(layer_index))
    return ref.PruneParams(
        sink_tokens=config.sink_tokens,
        window_tokens=config.window_tokens,
        stages=tuple(stages),
        probe=config.probe,
        rope=rope,
        head_reduction=config.head_reduction,
        exact_last_stage=config.exact_last_stage,
        drop_window_candidates=config.drop_window_candidates,
        extend_reused_blocks=config.extend_reused_blocks,
        group_probes=prefill and config.prefill_group_probes,
    )


def prefill_threshold(
    config: InfiniteHiPConfig, device: torch.device, extension: bool, trained: int,
    kv_fp8: bool = False,
) -> int:  # fmt: skip
    """Longest context prefilled densely, by the config's rule and the device's crossover: on a
    GPU where vLLM's FlashAttention reads our cache layout (fp8 caches: its fp8 path; checked
    once, before any graph capture) :data:`config.DENSE_PREFILL_CROSSOVER`; on a GPU without it
    none (a gather and SDPA there is never cheaper than the sparse kernels); on the CPU, where
    the reference's sparse prefill costs more than SDPA up to 16K,
    :data:`config.CPU_DENSE_PREFILL_CROSSOVER`."""
    if device.type != "cuda":
        return config.prefill_threshold(CPU_DENSE_PREFILL_CROSSOVER, extension, trained)
    from vllm_infinitehip.kernels.ops import flash_attention_works

    crossover = DENSE_PREFILL_CROSSOVER if flash_attention_works(device, kv_fp8) else None
    return config.prefill_threshold(crossover, extension, trained)


def decode_threshold(config: InfiniteHiPConfig, device: torch.device, kv_fp8: bool = False) -> int:
    """Longest context decoded densely: the config's rule with the device's crossover (a GPU
    where vLLM's FlashAttention reads our cache layout: :data:`config.DENSE_DECODE_CROSSOVER`)."""
    if device.type != "cuda":
        return config.decode_threshold(None)
    from vllm_infinitehip.kernels.ops import flash_attention_works

    return config.decode_threshold(
        DENSE_DECODE_CROSSOVER if flash_attention_works(device, kv_fp8) else None)


def is_fp8_kv(cache_dtype: str) -> bool:
    return cache_dtype in ("fp8", "fp8_e4m3")


def _current_device(vllm_config: VllmConfig) -> torch.device:
    device = torch.device(vllm_config.device_config.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _current_plan(layer_name: str) -> StepPlan | None:
    """The running step's plan of this layer's group (None in the profiling run, which has no
    metadata): ``do_kv_cache_update`` gets no metadata from vLLM."""
    from vllm.forward_context import get_forward_context

    metadata = get_forward_context().attn_metadata
    m = metadata.get(layer_name) if isinstance(metadata, dict) else None
    return None if m is None else m.plan


def _page_copier(device: torch.device):
    if device.type == "cuda":
        from vllm_infinitehip.kernels.triton_bank import copy_pages

        return copy_pages
    from vllm_infinitehip.kernels.triton_bank import copy_pages_reference

    return copy_pages_reference


def _layer_index(layer_name: str) -> int:
    from vllm.model_executor.models.utils import extract_layer_index

    return extract_layer_index(layer_name)


def _make_bank(
    config: InfiniteHiPConfig, vllm_config: VllmConfig, spec: AttentionSpec, layers: int,
    device: torch.device,
) -> tuple[Bank, KeyRowBank | None, PrefillStaging | None]:
    """This group's bank and, on a GPU, its key-row bank and prefill staging, sized from the
    GPU memory the tier's worker set aside (vLLM's profiled KV budget): staging first, the
    banks the rest, split by ``offload.key_row_share``. On the CPU the pruning stages run the
    reference, which reads every key of a request anyway: no key-row bank there."""
    tier = host_tier.current()
    if tier is None:
        raise RuntimeError(
            "infinitehip.offload is on but no host tier was sized in this process: vLLM did not "
            "run the plugin's worker (parallel_config.worker_cls was overridden?)"
        )
    num_pages = vllm_config.cache_config.num_gpu_blocks
    page_shape = (2, spec.block_size, spec.num_kv_heads, spec.head_size)
    bank_bytes, staging = tier.bank_bytes, None
    if device.type == "cuda":  # on the CPU the host store is where prefill computes anyway
        max_pages = -(-vllm_config.model_config.max_model_len // spec.block_size)
        staging_bytes = PrefillStaging.bytes_for(max_pages, page_shape, spec.dtype)
        if bank_bytes + staging_bytes > tier.device_budget:
            bank_bytes = tier.device_budget - staging_bytes
            if config.offload.bank_gib is not None or bank_bytes <= 0:
                raise host_tier_error(tier, bank_bytes + staging_bytes, staging_bytes)
        staging = PrefillStaging(max_pages, page_shape, spec.dtype, device)
    key_rows = None
    if device.type == "cuda":
        row_bytes = int(bank_bytes * config.offload.key_row_share)
        key_rows = KeyRowBank.sized(row_bytes, layers, num_pages, spec.block_size,
                                    spec.num_kv_heads, spec.head_size, spec.dtype, device)  # fmt: skip
        if key_rows is None:  # the row table alone outgrows the share: pages take it all
            logger.warning(
                "InfiniteHiP host tier: offload.key_row_share of the bank (%.3f GiB) cannot hold "
                "the key-row table of %d host pages; the pruning stages read through the page "
                "bank", row_bytes / 2**30, num_pages,
            )  # fmt: skip
        else:
            bank_bytes -= key_rows.nbytes
            tier.register(key_rows)
    bank = Bank.sized(bank_bytes, layers, num_pages, page_shape, spec.dtype, device)
    tier.register(bank.cache)
    gib = 2**30
    logger.info(
        "InfiniteHiP host tier: %.1f GiB of KV on the host (%d pages); on the GPU a bank of %d "
        "pages per layer (%.2f GiB), %d key rows per layer for pruning (%.2f GiB), prefill "
        "staging %.2f GiB", tier.host_bytes / gib, num_pages, bank.num_slots,
        bank.pages.numel() * bank.pages.element_size() / gib,
        0 if key_rows is None else key_rows.num_slots, 0 if key_rows is None else key_rows.nbytes / gib,
        0 if staging is None else staging.pages.numel() * staging.pages.element_size() / gib,
    )  # fmt: skip
    return bank, key_rows, staging


def host_tier_error(tier: host_tier.HostTier, wanted: int, staging: int) -> Exception:
    from vllm_infinitehip.config import InfiniteHiPConfigError

    gib = 2**30
    return InfiniteHiPConfigError(
        f"`infinitehip.offload.bank_gib`: the bank ({tier.bank_bytes / gib:.2f} GiB) and the "
        f"prefill staging of one max_model_len request ({staging / gib:.2f} GiB) need "
        f"{max(wanted, staging) / gib:.2f} GiB, but vLLM's profiling left "
        f"{tier.device_budget / gib:.2f} GiB for KV on the GPU: lower bank_gib or "
        f"max_model_len, or raise gpu_memory_utilization"
    )


@dataclass
class StepCounters:
    """What the builder counted, per step and identical for every layer of its group (host
    ints: vLLM hands the lengths over on the host), plus decode rows by refresh level (device,
    in :class:`DecodeSlots`)."""

    dense_queries: int = 0
    sparse_prefill_queries: int = 0
    sparse_decode_queries: int = 0

    def reset(self) -> None:
        self.dense_queries = self.sparse_prefill_queries = self.sparse_decode_queries = 0


@dataclass
class StepPlan:
    """State the builder owns and every layer of its group reads: request slots, each layer's
    masks per slot, scratch, counters."""

    slots: DecodeSlots
    masks: dict[str, dec.DecodeMasks]
    scratch: DecodeScratch
    # longest context whose prefill chunks run dense (:func:`prefill_threshold`)
    prefill_threshold: int
    counters: StepCounters = field(default_factory=StepCounters)
    # the host tier's GPU bank of this group (offload on), and each layer's index in it
    bank: Bank | None = None
    bank_layers: dict[str, int] = field(default_factory=dict)
    # the pruning stages' key rows (GPU)
    key_rows: KeyRowBank | None = None
    staging: PrefillStaging | None = None
    # how many planned fill entries this step's layers scan (set by the builder): the decode
    # rows' share of the plan, not its capacity, since every entry is a program even when empty
    bank_fill_entries: int = 0
    # each layer's place in the group (its cascade's region of the gate in DecodeScratch)
    layer_order: dict[str, int] = field(default_factory=dict)
    # the host tier's split layout (offload.layout "split"): this group's KV, by layer index
    split: SplitKV | None = None
    # landmark scores (prefill_representatives "landmark"): per layer (its place in the group)
    # a row per KV slot, plus one that padding slots (-1) write, of H_kv sums and a count;
    # slots are pages of landmark_page
    landmarks: torch.Tensor | None = None
    landmark_page: int = 0

    def landmark_state(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s landmark state as the kernels take it, ``[pages, page, H + 1]``."""
        assert self.landmarks is not None
        state = self.landmarks[layer, :-1]
        return state.view(-1, self.landmark_page, state.shape[-1])


@dataclass(frozen=True)
class SparseCall:
    """Parts of prefill chunks pruned with the same parameters: ``"body"`` (the layer's) or
    ``"tail"`` (with the tail window, where the config sets one)."""

    kind: str
    blocks: QueryBlocks  # in blocks of the first stage's b_q


@dataclass(frozen=True)
class PrefillBatch:
    """Prefill chunks that read the same cache: one varlen dense call, then the sparse calls."""

    dense: DenseRows | None
    calls: tuple[SparseCall, ...]
    # the host tier stages one request's pages at a time on the GPU: its row and length
    staged: tuple[int, int] | None = None


@dataclass(frozen=True)
class PrefillPlan:
    """A step's prefill chunks, planned once for every layer: one batch, or with the host tier
    one per request it stages plus one of the chunks it does not; and the (query, context key)
    pairs of the sparse queries (host int; the kernels count what they attended)."""

    batches: tuple[PrefillBatch, ...]
    context_pairs: int
    # every chunk of the step whole, at its block-table row, in tiles of the keys it adds its
    # queries' landmark scores to (with landmark representatives; before any chunk is pruned)
    landmarks: LandmarkTiles | None = None


@dataclass
class InfiniteHiPMetadata:
    num_actual_tokens: int
    block_table: torch.Tensor  # the prefill rows read theirs
    slot_mapping: torch.Tensor
    # decode rows come first: rows [0, num_decodes) hold one query each, tokens [0, num_decodes)
    num_decodes: int
    decode: dec.DecodeRows | None
    # whether any decode row may run sparse; a graph capture always runs the cascade
    run_cascade: bool
    # the prefill rows' work (None: a pure decode step)
    prefill: PrefillPlan | None
    plan: StepPlan


class InfiniteHiPMetadataBuilder(AttentionMetadataBuilder[InfiniteHiPMetadata]):
    # Decode needs no host work per layer, so vLLM may capture uniform decode batches in full
    # CUDA graphs; mixed batches run attention eagerly between piecewise graphs.
    _cudagraph_support: ClassVar[AttentionCGSupport] = (
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    )

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1)
        self.config = InfiniteHiPConfig.from_vllm_config(vllm_config)
        # what the decode state is sized for: the decode stages
        decode_config = self.config.for_decode()
        self.block_size = kv_cache_spec.block_size
        self.threshold = decode_threshold(decode_config, device,
                                          is_fp8_kv(vllm_config.cache_config.cache_dtype))
        trained, extension = trained_and_extension(self.config, vllm_config.model_config)
        self._trained = trained
        past = list(dict.fromkeys(self.config.spans_past_trained(trained)
                                  + decode_config.spans_past_trained(trained))) if extension else []
        if past:
            # SmolLM2 (trained 8K) at 32K-64K: 8 of 12 passkeys with the defaults, 0 of 12 with
            # either budget raised past 8K (docs/results.md, passkey-settings-gpu-2026-12-03)
            logger.warning_once(
                "InfiniteHiP: RoPE extension is on, and a query's reach exceeds the trained "
                "length %d (%s): those layers see distances the model never saw. Lower "
                "window_tokens or the kept budgets.", trained, "; ".join(past))
        max_rows = vllm_config.scheduler_config.max_num_seqs
        max_len = vllm_config.model_config.max_model_len
        params = {name: layer_prune_params(decode_config, _layer_index(name))
                  for name in layer_names}  # fmt: skip
        final_keep = max(p.stages[-1].keep_tokens for p in params.values())
        masks = {
            name: dec.DecodeMasks.allocate(p, final_keep, max_rows, device)
            for name, p in params.items()
        }
        any_params = next(iter(params.values()))
        model = vllm_config.model_config
        heads = model.get_num_attention_heads(vllm_config.parallel_config)
        # z-score ranking keeps each head's scores until the row's top-k standardises them
        score_heads = heads if self.config.head_reduction == "z-score" else None
        scores = dec.allocate_scores(dec.stage_widths(any_params, max_len), max_rows, device,
                                     score_heads)  # fmt: skip
        workspace = arrivals = queries = None
        if device.type == "cuda":
            from vllm_infinitehip.kernels.triton_bsa import decode_workspace_floats

            max_keys = (decode_config.sink_tokens + decode_config.window_tokens
                        + final_keep)  # a row's keys: sink, window, final blocks
            n = decode_workspace_floats(max_rows, heads, model.get_head_size(), max_keys,
                                        rope=True)  # fmt: skip
            workspace = torch.empty(n, dtype=torch.float32, device=device)
            arrivals = torch.zeros(max_rows, dtype=torch.int32, device=device)
            if extension:
                queries = torch.empty(2, max_rows, heads, model.get_head_size(),
                                      dtype=torch.float32, device=device)  # fmt: skip
        slots = DecodeSlots(max_rows, self.config.refresh_intervals, device)
        _offer_step_gate(self.config, slots, vllm_config, device)
        self.plan = StepPlan(
            slots, masks,
            DecodeScratch(scores, workspace, arrivals, queries=queries,
                          gate=_cascade_gate(self.config, slots, len(layer_names), device)),
            prefill_threshold(self.config, device, extension, trained,
                              kv_fp8=is_fp8_kv(vllm_config.cache_config.cache_dtype)),
            layer_order={name: i for i, name in enumerate(layer_names)},
        )  # fmt: skip
        if self.config.offload.enabled:
            self._setup_tier(vllm_config, kv_cache_spec, layer_names, any_params, device)
        if self.config.prefill_representatives == "landmark":
            num_blocks = vllm_config.cache_config.num_gpu_blocks
            # vLLM allocates its KV after the builders; the split layout's is made already
            # (_setup_split), and its sizing counted the scores (worker._size_split)
            pending = 0 if self.plan.split is not None else (
                num_blocks * kv_cache_spec.page_size_bytes * len(layer_names))  # fmt: skip
            self.plan.landmarks = _landmark_state(
                len(layer_names), num_blocks * self.block_size, kv_cache_spec.num_kv_heads,
                device, kv_bytes=pending,
            )  # fmt: skip
            self.plan.landmark_page = self.block_size
        i32 = dict(dtype=torch.int32, device=device)
        # persistent per-row buffers: what a captured graph reads is rewritten each step
        self._row_slots = torch.full((max_rows,), -1, **i32)
        self._row_levels = torch.full((max_rows,), -1, **i32)
        self._row_seq_lens = torch.zeros(max_rows, **i32)
        self._row_stale = torch.zeros(max_rows, **i32)
        logger.info_once("InfiniteHiP config: %s", self.config.summary())

    def _setup_tier(
        self, vllm_config: VllmConfig, spec: AttentionSpec, layer_names: list[str],
        params: ref.PruneParams, device: torch.device,
    ) -> None:  # fmt: skip
        """The host tier's bank and staging, and every layer's final masks in one tensor so that
        a step plans the promotions of all layers at once (the split layout: its KV instead,
        :meth:`_setup_split`)."""
        plan = self.plan
        tier = host_tier.current()
        if tier is not None and tier.layout == "split":
            self._setup_split(vllm_config, spec, layer_names, params, device, tier)
            return
        plan.bank, plan.key_rows, plan.staging = _make_bank(
            self.config, vllm_config, spec, len(layer_names), device
        )
        plan.bank_layers = {name: i for i, name in enumerate(layer_names)}
        per_row = self._setup_read_plan(layer_names, params, spec.block_size)
        max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        plan.bank.allocate_plan(vllm_config.scheduler_config.max_num_seqs * per_row, max_tokens)
        if plan.key_rows is not None:
            plan.key_rows.allocate_plan(max_tokens)

    def _setup_read_plan(
        self, layer_names: list[str], params: ref.PruneParams, page: int
    ) -> int:
        """Every layer's final masks in one tensor, so that a step lists the pages all layers'
        decode rows read at once (:func:`decode_read_pages`); returns the pages a row lists."""
        plan = self.plan
        self._final_all = torch.stack([plan.masks[n].final for n in layer_names])
        self._counts_all = torch.stack([plan.masks[n].counts for n in layer_names])
        for i, name in enumerate(layer_names):
            plan.masks[name] = dataclasses.replace(
                plan.masks[name], final=self._final_all[i], counts=self._counts_all[i]
            )
        self._tier_window = (params.sink_tokens, params.window_tokens)
        self._n_stages = len(params.stages)
        per_row = -(-params.sink_tokens // page) + (-(-params.window_tokens // page) + 1)
        # blocks read past their end may reach the next page: one more page per block
        per_row += self._final_all.shape[2] * (2 if params.extend_reused_blocks else 1)
        self._tier_pages_per_row = per_row
        self._tier_params = params
        return per_row

    def _setup_split(
        self, vllm_config: VllmConfig, spec: AttentionSpec, layer_names: list[str],
        params: ref.PruneParams, device: torch.device, tier: host_tier.HostTier,
    ) -> None:  # fmt: skip
        """This group's KV in the split layout (every layer's K plane and V pages, and the V
        bank, sized by the worker), registered with the tier for the worker's placement; on a
        GPU, the staging that dense prefill chunks read whole pages from."""
        num_blocks = vllm_config.cache_config.num_gpu_blocks
        if num_blocks != tier.num_blocks:
            raise RuntimeError(f"vLLM made {num_blocks} KV blocks; the split layout sized "
                               f"{tier.num_blocks}")  # fmt: skip
        page_shape = (spec.block_size, spec.num_kv_heads, spec.head_size)
        host_alloc = tier.host_alloc if device.type == "cuda" else None
        self.plan.split = SplitKV(len(layer_names), num_blocks, tier.gpu_pages, page_shape,
                                  spec.dtype, device, host_alloc=host_alloc,
                                  bank_slots=tier.bank_pages)  # fmt: skip
        tier.register_split(self.plan.split)
        self.plan.bank_layers = {name: i for i, name in enumerate(layer_names)}
        if self.plan.split.bank is not None:
            per_row = self._setup_read_plan(layer_names, params, spec.block_size)
            max_rows = vllm_config.scheduler_config.max_num_seqs
            self.plan.split.bank.allocate_plan(max_rows * per_row, 0)
        if device.type == "cuda":
            max_pages = split_staging_pages(self.config, vllm_config, device, spec.block_size)
            self.plan.staging = PrefillStaging(max_pages, (2, *page_shape), spec.dtype, device)

    def _plan_tier(self, m: CommonAttentionMetadata, num_decodes: int, capture: bool) -> None:
        """The step's bank work for every layer (eager, before the step's graph): promotions
        for the decode rows, and where each written token goes in the bank."""
        bank = self.plan.bank
        if self.plan.key_rows is not None:
            self.plan.key_rows.plan_writes(
                None if capture else m.slot_mapping[: m.num_actual_tokens]
            )
        if capture:  # the graph must hold the layers' copies; nothing to copy at capture
            bank.clear_fills()
            bank.clear_writes()
            self.plan.bank_fill_entries = m.num_reqs * self._tier_pages_per_row
            return
        self.plan.bank_fill_entries = num_decodes * self._tier_pages_per_row
        if num_decodes:
            bank.plan_promotion(*self._decode_reads(m, num_decodes))
        else:  # a graph that captured a layer's copy must find nothing stale to copy
            bank.clear_fills()
        bank.plan_writes(m.slot_mapping[: m.num_actual_tokens])

    def _decode_reads(
        self, m: CommonAttentionMetadata, num_decodes: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The pages ``[L, B, P]`` every layer's decode rows read (:func:`decode_read_pages`),
        the rows to promote them for, and the rows that refresh this step."""
        slots = self._row_slots[:num_decodes]
        levels = self._row_levels[:num_decodes]
        extension = dec.block_extension(self._tier_params, self._row_stale[:num_decodes])
        block_ends = None if extension is None else self._tier_params.block_size_k + extension
        pages = decode_read_pages(
            m.block_table_tensor[:num_decodes], self._row_seq_lens[:num_decodes], slots,
            self._final_all, self._counts_all[:, :, -1], *self._tier_window, self.block_size,
            block_ends,
        )  # fmt: skip
        # a row at level 0 is new (its slot's masks are a former owner's) or reruns every
        # stage; the others' masks are the last step's, exactly what they will read
        promote = (slots >= 0) & (levels > 0)
        refreshing = (levels >= 0) & (levels < self._n_stages)
        return pages, promote, refreshing

    def build_for_cudagraph_capture(
        self, common_attn_metadata: CommonAttentionMetadata
    ) -> InfiniteHiPMetadata:
        # The graph must hold the whole cascade: at replay, rows decide on device what runs.
        return self._build(common_attn_metadata, capture=True)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> InfiniteHiPMetadata:
        return self._build(common_attn_metadata, capture=False)

    def _build(self, m: CommonAttentionMetadata, capture: bool) -> InfiniteHiPMetadata:
        n = m.num_reqs
        qsl = m.query_start_loc_cpu[: n + 1].numpy()
        query_lens = np.diff(qsl)
        if m.seq_lens_cpu_upper_bound is not None:
            # exact for prefill rows, and for decode rows without speculative decoding
            seq_lens_host = m.seq_lens_cpu_upper_bound[:n].numpy()
        else:  # the CPU runner's seq_lens are host tensors: no sync
            seq_lens_host = m.seq_lens[:n].cpu().numpy()
        not_decode = np.flatnonzero(query_lens != 1)
        num_decodes = int(not_decode[0]) if not_decode.size else n
        dec_lens = seq_lens_host[:num_decodes]
        sparse_host = dec_lens > self.threshold
        counters = self.plan.counters
        if not capture:
            n_sparse = int(sparse_host.sum())
            counters.sparse_decode_queries += n_sparse
            counters.dense_queries += int((dec_lens > 0).sum()) - n_sparse
        prefill = None
        if num_decodes < n:
            prefill = self._plan_prefill(qsl.tolist(), seq_lens_host.tolist(), num_decodes)
        if self.plan.landmarks is not None and not capture:
            # the slots this step writes start with no landmark score, in every layer at once
            # (a block vLLM hands out again held another request's); the step's prefill chunks
            # add their queries after, decode keys keep none. Enqueued before the step's
            # forward, so no layer's work (nor a decode graph) does it.
            self.plan.landmarks.index_fill_(1, m.slot_mapping[: m.num_actual_tokens], 0.0)

        decode = None
        slots = self.plan.slots
        if num_decodes:
            seq_lens = m.seq_lens[:num_decodes]
            block_table = m.block_table_tensor[:num_decodes]
            slots.assign(
                block_table, seq_lens, self.threshold, self.block_size,
                out=(self._row_slots, self._row_levels, self._row_seq_lens, self._row_stale),
            )  # fmt: skip
            decode = dec.DecodeRows(
                block_table, self._row_seq_lens[:num_decodes], self._row_slots[:num_decodes],
                self._row_levels[:num_decodes], self._row_stale[:num_decodes],
            )  # fmt: skip
        elif not capture:
            slots.release_all()
        if self.plan.bank is not None:
            self._plan_tier(m, num_decodes, capture)
        split = self.plan.split
        if split is not None and split.bank is not None and num_decodes and not capture:
            # the split layout's V bank: copies enqueued before the step's forward (its graph
            # reads V through the tables, whatever they point at)
            split.plan_reads(*self._decode_reads(m, num_decodes),
                             fill_entries=num_decodes * self._tier_pages_per_row)  # fmt: skip
        return InfiniteHiPMetadata(
            num_actual_tokens=m.num_actual_tokens,
            block_table=m.block_table_tensor,
            slot_mapping=m.slot_mapping,
            num_decodes=num_decodes,
            decode=decode,
            run_cascade=capture or bool(sparse_host.any()),
            prefill=prefill,
            plan=self.plan,
        )

    def _plan_prefill(self, qsl: list[int], seq_lens: list[int], first: int) -> PrefillPlan:
        """Rows ``first..`` are prefill chunks (queries ``qsl[i]:qsl[i + 1]``, the last of a
        ``seq_lens[i]``-token context): dense at or below the dense threshold, else cut into
        parts as INFINITEHIP.md §1 prunes them, each part of every chunk in one batch."""
        counters, config = self.plan.counters, self.config
        bq = config.stages[-1].block_size_q
        tail = bq if config.tail_window(self._trained) is not None else 0
        dense: list[RequestPart] = []
        parts: list[tuple[str, RequestPart]] = []
        # with the host tier: (row, length), dense part, sparse parts of each staged chunk
        staged: list[tuple[tuple[int, int], list[RequestPart], list[tuple[str, RequestPart]]]] = []
        context = 0
        chunks: list[RequestPart] = []  # each whole, at its block-table row
        for i in range(first, len(seq_lens)):
            lo, hi, seq_len = qsl[i], qsl[i + 1], seq_lens[i]
            n = hi - lo
            if n == 0:
                continue
            chunks.append(RequestPart(i, lo, hi, seq_len - n, seq_len))
            dense_chunk = seq_len <= self.plan.prefill_threshold
            stage = stages_chunk(self.plan, n, bq, dense_chunk)
            row = 0 if stage else i
            if dense_chunk:
                counters.dense_queries += n
                part = RequestPart(row, lo, hi, seq_len - n, seq_len)
                if stage:
                    staged.append(((i, seq_len), [part], []))
                else:
                    dense.append(part)
                continue
            counters.sparse_prefill_queries += n
            context += n * seq_len - n * (n - 1) // 2  # sum of (p + 1) over the positions
            last = n - 1 if config.prefill_final_query_own_mask else n
            body_end = max(0, min(n - tail, last))
            chunk = [
                (kind, RequestPart(row, lo + a, lo + b, seq_len - n + a, seq_len))
                for kind, a, b in (("body", 0, body_end), ("tail", body_end, last),
                                   ("tail", last, n))
                if b > a
            ]  # fmt: skip
            if stage:
                staged.append(((i, seq_len), [], chunk))
            else:
                parts.extend(chunk)
        batches = [self._prefill_batch(dense, parts, None)] if dense or parts else []
        batches += [self._prefill_batch(d, p, key) for key, d, p in staged]
        landmarks = None
        if self.plan.landmarks is not None:
            landmarks = LandmarkTiles.plan(tuple(chunks), config.landmark_window, self.device)
        return PrefillPlan(tuple(batches), context, landmarks)

    def _prefill_batch(
        self, dense: list[RequestPart], parts: list[tuple[str, RequestPart]],
        staged: tuple[int, int] | None,
    ) -> PrefillBatch:  # fmt: skip
        """One varlen dense call and one sparse call per kind of part (each part of every
        chunk in one layout of query blocks of the first stage's b_q)."""
        bq_first = self.config.stages[0].block_size_q
        by_kind = {kind: [p for k, p in parts if k == kind] for kind in ("body", "tail")}
        calls = tuple(SparseCall(kind, QueryBlocks.plan(ps, bq_first, self.device))
                      for kind, ps in by_kind.items() if ps)  # fmt: skip
        return PrefillBatch(DenseRows.plan(dense, self.device) if dense else None, calls, staged)


def stages_chunk(plan: StepPlan, num_queries: int, block_size_q: int, dense: bool) -> bool:
    """Whether a prefill chunk reads a GPU copy of its request's pages (``plan.staging``, the
    host tier on a GPU) instead of the cache: when its queries re-read the context (dense
    tiles, or more than one query block) and the cache is not where it can read it. The host
    layout keeps the whole cache on the host; the split layout keeps K in HBM and the sparse
    kernels read each V where it lives, so only a dense chunk (FlashAttention reads whole
    pages) is staged there."""
    if plan.staging is None or num_queries <= block_size_q:
        return False
    return plan.split is None or dense


def split_staging_pages(config: InfiniteHiPConfig, vllm_config: VllmConfig,
                        device: torch.device, block_size: int) -> int:
    """Pages of the split layout's prefill staging on a GPU: one request's, up to the longest
    context prefilled densely (only dense chunks are staged, :func:`stages_chunk`), not
    ``max_model_len``'s: at 3M fp8 tokens that is 6 GiB of HBM left to V."""
    trained, extension = trained_and_extension(config, vllm_config.model_config)
    kv_fp8 = is_fp8_kv(vllm_config.cache_config.cache_dtype)
    longest = min(vllm_config.model_config.max_model_len,
                  prefill_threshold(config, device, extension, trained, kv_fp8))  # fmt: skip
    return -(-longest // block_size)


def _landmark_state(num_layers: int, num_slots: int, num_kv_heads: int,
                    device: torch.device, kv_bytes: int) -> torch.Tensor:
    """Landmark scores of every layer of a group, zeroed: ``[layers, slots + 1, H_kv + 1]``
    float32 (the last row takes padding slots' writes). They live beside the KV cache, about
    1% of a 16-bit cache's bytes; on a GPU the memory left past vLLM's budget must hold them.
    vLLM makes the builders before it allocates the KV cache (``kv_bytes`` for this group), so
    the check counts that too: a clear error here, not an out-of-memory in vLLM's allocation."""
    shape = (num_layers, num_slots + 1, num_kv_heads + 1)
    need = 4 * math.prod(shape)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if free < need + kv_bytes + (256 << 20):
            raise RuntimeError(
                f"InfiniteHiP: prefill_representatives \"landmark\" keeps {need / 2**30:.2f} GiB "
                f"of scores beside the {kv_bytes / 2**30:.2f} GiB KV cache, and "
                f"{free / 2**30:.2f} GiB are free: lower gpu_memory_utilization (or "
                "kv_cache_memory_bytes) by that much"
            )
    return torch.zeros(shape, dtype=torch.float32, device=device)


class InfiniteHiPBackend(AttentionBackend):
    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = False

    supported_dtypes: ClassVar[list[torch.dtype]] = [
        torch.float16,
        torch.bfloat16,
        torch.float32,
    ]
    # fp8 is e4m3 with vLLM's per-layer scales; not fp8_e5m2, whose uint8 storage the kernels
    # would read as e4m3
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "float16", "bfloat16", "fp8", "fp8_e4m3"]

    @staticmethod
    def get_name() -> str:
        # Attention.__init__ looks the backend up by this name in AttentionBackendEnum.
        return "INFINITEHIP"

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int | MultipleOf]:
        return [MultipleOf(16)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [32, 64, 96, 128, 256]

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @staticmethod
    def get_impl_cls() -> type[InfiniteHiPImpl]:
        return InfiniteHiPImpl

    @staticmethod
    def get_builder_cls() -> type[InfiniteHiPMetadataBuilder]:
        return InfiniteHiPMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        return (num_blocks, 2, block_size, num_kv_heads, head_size)

    @staticmethod
    def use_cascade_attention(*args, **kwargs) -> bool:
        return False


def _cascade_gate(
    config: InfiniteHiPConfig, slots: DecodeSlots, n_layers: int, device: torch.device
) -> object | None:
    """The gate that lets a captured decode graph skip every layer's pruning cascade on steps
    where no row refreshes (28 of 32 with the default schedule): CUDA only, where conditional
    graph nodes work, and not with ``tp_mask: "global"``, whose collectives stay in the main
    graph."""
    if device.type != "cuda" or _score_reduce(config) is not None:
        return None
    from vllm_infinitehip.kernels.graph_if import GraphIf, conditional_graphs_work

    if not conditional_graphs_work(device):
        return None
    return GraphIf(slots.refreshing, n_layers)


def _offer_step_gate(
    config: InfiniteHiPConfig, slots: DecodeSlots, vllm_config: VllmConfig, device: torch.device
) -> None:
    """Let full decode graphs branch once per step on the refresh flag (step_branches.py):
    CUDA, where conditional nodes work, one GPU (a TP group's collectives stay out of
    conditional bodies), and not with ``tp_mask: "global"``."""
    parallel = vllm_config.parallel_config
    one_gpu = parallel.tensor_parallel_size * parallel.pipeline_parallel_size == 1
    if device.type != "cuda" or _score_reduce(config) is not None or not one_gpu:
        return
    from vllm_infinitehip.kernels.graph_if import GraphIf, conditional_graphs_work

    if conditional_graphs_work(device):
        step_branches.offer(GraphIf(slots.refreshing, 2, frozenset({1})), device, vllm_config)


def _score_reduce(config: InfiniteHiPConfig) -> ref.ScoreReduce | None:
    """``tp_mask: "global"``: the max of each stage's scores over the TP group, through vLLM's
    own group collective (gloo on the CPU; on CUDA the communicator graphs capture)."""
    if config.tp_mask != "global":
        return None
    from vllm.distributed import get_tp_group

    group = get_tp_group()
    if group.world_size == 1:
        return None

    def max_over_ranks(scores: torch.Tensor) -> torch.Tensor:
        return group.all_gather(scores.unsqueeze(0), dim=0).amax(dim=0)

    return max_over_ranks


class InfiniteHiPImpl(AttentionImpl):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
        **unsupported,
    ) -> None:
        unsupported_features = {
            "alibi_slopes": alibi_slopes is not None,
            "sliding_window": sliding_window is not None,
            "logits_soft_cap": bool(logits_soft_cap),
            "attention sinks": sinks is not None,
            "non-decoder attention": attn_type != AttentionType.DECODER,
            "KV sharing": kv_sharing_target_layer_name is not None,
        }
        bad = [name for name, present in unsupported_features.items() if present]
        if bad:
            raise NotImplementedError(
                f"--attention-backend infinitehip does not support {', '.join(bad)} "
                f"(this model's attention layers use it); choose another backend"
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = None
        from vllm.config import get_current_vllm_config

        vllm_config = get_current_vllm_config()
        self.config = InfiniteHiPConfig.from_vllm_config(vllm_config)
        self._decode_config = self.config.for_decode()  # what decode prunes with
        model_config = vllm_config.model_config
        self.max_model_len = model_config.max_model_len
        self.trained_context, self.rope_extension = trained_and_extension(
            self.config, model_config
        )
        self._rope_table = None
        if self.rope_extension:
            from vllm_infinitehip.kernels.rope import RopeTable

            # vLLM's own rotary embedding of this model (rope_theta, llama3 scaling), built here
            # while the model's config is current.
            self._rope_table = RopeTable.from_vllm(
                head_size, model_config.hf_text_config, dtype=model_config.dtype
            )
        # Set by metrics.collect_recall: recall of each prefill chunk's final query and of each
        # sparse decode query goes here (an optional observer; it reads back to the host).
        self.recall_log: list[dict] | None = None
        # Device state is made here, not on the first forward, which may be inside a CUDA-graph
        # capture: (attended, context) pairs of this layer's sparse queries, and the RoPE
        # tables and fixed query turns of both pruning styles a layer may use.
        device = _current_device(vllm_config)
        self.pairs = torch.zeros(2, dtype=torch.int64, device=device)
        self._placements: dict[str, object] = {}
        if self._rope_table is not None and device.type == "cuda":
            from vllm_infinitehip.kernels import triton_decode
            from vllm_infinitehip.kernels.triton_rope import delta_tables

            bound = 4 * self.max_model_len + (1 << 16)
            delta_tables(self._rope_table, bound, device)
            scan_window = layer_prune_params(self._decode_config, 0).scan_window
            for style in ("relative", "chunk-indexed"):
                self._placements[style] = triton_decode.QueryPlacement.build(
                    style, self._rope_table, scan_window, device
                )
        self.plan: StepPlan | None = None
        self._params: ref.PruneParams | None = None  # prefill's
        self._tail_params: ref.PruneParams | None = None
        self._decode_params: ref.PruneParams | None = None
        self._layer_name: str | None = None
        self._scratch: DecodeScratch | None = None
        self._scratch_refresh_body: DecodeScratch | None = None
        self._ops: AttentionOps | None = None
        self._bank_layer = -1
        # an fp8 cache's per-layer scales (vLLM's device tensors; readers dequantize with them)
        self._kv_scales: dict[str, torch.Tensor] = {}
        # the host tier's page copy for this device (fills into the bank, prefill staging),
        # picked once: do_kv_cache_update runs it for every layer of every step
        self._copy_pages = _page_copier(device) if self.config.offload.enabled else None

    # ---------------------------------------------------------------- once per layer
    def _setup(self, layer: AttentionLayer, plan: StepPlan, device: torch.device) -> None:
        """This layer's parameters and ops, on its first forward (host work only)."""
        self._layer_name = layer.layer_name
        self._ops = ops_for(device, self.config.scoring_precision, _score_reduce(self.config))
        layer_index = _layer_index(layer.layer_name)
        rope_plan = self._rope_plan(layer_index)
        self._params = layer_prune_params(self.config, layer_index, rope_plan, prefill=True)
        self._decode_params = layer_prune_params(self._decode_config, layer_index, rope_plan)
        tail_window = self.config.tail_window(self.trained_context)
        if tail_window is not None:
            self._tail_params = dataclasses.replace(self._params, window_tokens=tail_window)
        self.plan = plan
        self._kv_scales = {"k_scale": layer._k_scale, "v_scale": layer._v_scale}
        rope = self._params.rope
        placement = self._placements.get(rope.pruning) if rope is not None else None
        bank = plan.bank
        if bank is not None or plan.split is not None:
            self._bank_layer = plan.bank_layers[layer.layer_name]
        self._scratch = dataclasses.replace(
            plan.scratch, placement=placement,
            bank=bank.layer(self._bank_layer) if bank is not None else None,
            key_rows=(plan.key_rows.layer(self._bank_layer)
                      if plan.key_rows is not None else None),
            gate_region=plan.layer_order[layer.layer_name],
        )  # fmt: skip
        # the refresh body of a branched decode graph: the step's branch is the gate
        self._scratch_refresh_body = dataclasses.replace(self._scratch, gate=None,
                                                         refresh_only=True)  # fmt: skip

    def _rope_plan(self, layer_index: int) -> ref.RopePlan | None:
        """This layer's position remapping when extending past the trained length (§2); queries
        inside the trained length keep their true positions."""
        if self._rope_table is None:
            return None
        return ref.RopePlan(
            table=self._rope_table,
            pruning=self.config.rope_pruning_for_layer(layer_index),
            bsa=self.config.rope_bsa,
            trained_context=self.trained_context,
            pruning_from=0 if self.config.remap_pruning == "always" else None,
        )

    # ---------------------------------------------------------------- per step
    def do_kv_cache_update(
        self,
        layer: AttentionLayer,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        plan = _current_plan(layer.layer_name)
        if plan is None:
            # a run without metadata (profiling, a warm-up or capture's dummy batch) attends to
            # nothing (``forward`` returns zeros), so what it would write is never read; in the
            # split layout vLLM's tensor is an empty stand-in there is no writing into
            return
        if plan.split is not None:
            plane, split = plan.split.layer(plan.bank_layers[layer.layer_name])
            if plane.device.type == "cuda":
                from vllm_infinitehip.kernels.triton_bank import write_split_kv

                write_split_kv(plane, split, key, value, slot_mapping, layer._k_scale,
                               layer._v_scale)  # fmt: skip
            else:
                ref.write_paged_kv(plane, key, value, slot_mapping, split=split,
                                   k_scale=layer._k_scale, v_scale=layer._v_scale)  # fmt: skip
            return
        self._write_kv(layer, key, value, kv_cache, slot_mapping)
        if plan.bank is not None:
            plan.bank.layer_work(
                plan.bank_layers[layer.layer_name], kv_cache, slot_mapping.shape[0],
                self._copy_pages,
                lambda pages, slots: self._write_kv(layer, key, value, pages, slots),
                fill_entries=plan.bank_fill_entries,
            )  # fmt: skip
            if plan.key_rows is not None:
                plan.key_rows.forget_writes(plan.bank_layers[layer.layer_name],
                                            slot_mapping.shape[0])  # fmt: skip

    def _write_kv(
        self, layer: AttentionLayer, key: torch.Tensor, value: torch.Tensor,
        kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    ) -> None:
        if kv_cache.device.type == "cuda":
            from vllm.v1.attention.ops.triton_reshape_and_cache_flash import (
                triton_reshape_and_cache_flash,
            )

            # vLLM's own kernel: strided K/V planes of our layout, padding slots (-1) skipped,
            # no host sync
            triton_reshape_and_cache_flash(
                key, value, kv_cache[:, 0], kv_cache[:, 1], slot_mapping, self.kv_cache_dtype,
                layer._k_scale, layer._v_scale,
            )  # fmt: skip
        else:
            ref.write_paged_kv(kv_cache, key, value, slot_mapping, k_scale=layer._k_scale,
                               v_scale=layer._v_scale)  # fmt: skip

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: InfiniteHiPMetadata,
        output: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        assert output is not None
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("infinitehip does not fuse output quantization")
        if attn_metadata is None:  # profiling run
            return output.fill_(0)
        m = attn_metadata
        if self._params is None:
            self._setup(layer, m.plan, query.device)
        out = output[: m.num_actual_tokens].view(-1, self.num_heads, self.head_size)
        q_all = query[: m.num_actual_tokens].view(-1, self.num_heads, self.head_size)
        ops = self._ops
        kv_args = self._kv_scales
        if m.plan.split is not None:  # the split layout: the group's KV, not vLLM's tensor
            kv_cache, split = m.plan.split.layer(self._bank_layer)
            kv_args = {**kv_args, "split": split}
        nd = m.num_decodes
        if nd:
            self._decode(ops, q_all[:nd], out[:nd], kv_cache, m, kv_args)
        if m.prefill is not None:
            self._prefill(ops, m.prefill, q_all, out, kv_cache, m.block_table, kv_args)
        return output

    def _decode(
        self, ops: AttentionOps, q: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor,
        m: InfiniteHiPMetadata, kv_args: dict,
    ) -> None:
        """All decode rows: one cascade (rows due for a refresh, each from its own level), then
        one block-sparse launch (dense rows attend to everything). No host work on the GPU."""
        masks = m.plan.masks[self._layer_name]
        rows = m.decode
        branch = step_branches.current()  # None unless a full decode graph is being captured
        if m.run_cascade and branch != step_branches.REUSE:
            scratch = self._scratch if branch is None else self._scratch_refresh_body
            ops.refresh_decode(self._decode_params, masks, q, kv_cache, rows, self.scale,
                               scratch, **kv_args)  # fmt: skip
        ops.attend_decode(self._decode_params, masks, q, kv_cache, rows, self.scale, out,
                          self.pairs, self._scratch, **kv_args)  # fmt: skip
        if self.recall_log is not None:
            self._log_decode_recall(masks, q, kv_cache, rows)

    def _prefill(
        self, ops: AttentionOps, plan: PrefillPlan, q: torch.Tensor, out: torch.Tensor,
        kv_cache: torch.Tensor, block_table: torch.Tensor, kv_args: dict,
    ) -> None:  # fmt: skip
        """The step's prefill chunks as planned, batch by batch (with the host tier, each staged
        chunk is a batch of its own, read from its GPU copy): one dense call, then one cascade
        and one attention launch per kind of part. Each chunk's last query block uses the tail
        window, and its final query (the next token's) may be pruned alone
        (``prefill_final_query_own_mask``)."""
        landmarks = None
        if self.plan.landmarks is not None:
            landmarks = self.plan.landmark_state(self.plan.layer_order[self._layer_name])
            ops.add_landmarks(plan.landmarks, q, kv_cache, block_table, landmarks, self.scale,
                              self.config.landmark_window, **kv_args)  # fmt: skip
        for batch in plan.batches:
            cache, table, scales = kv_cache, block_table, kv_args
            if batch.staged is not None:
                row, seq_len = batch.staged
                split = kv_args.get("split")
                if split is not None:  # whole pages from the K plane and V's homes
                    from vllm_infinitehip.kernels.triton_bank import gather_split_pages

                    def copy(plane, pages, blocks, slots, split=split):
                        gather_split_pages(plane, split, pages, blocks, slots)

                    scales = self._kv_scales
                else:
                    copy = self._copy_pages
                cache, table_row = self.plan.staging.stage(kv_cache, block_table[row], seq_len,
                                                           copy)  # fmt: skip
                table = table_row.view(1, -1)
            if batch.dense is not None:
                ops.dense_rows(batch.dense, q, out, cache, table, self.scale, **scales)
            shared: dict = {}  # the kinds of part of one batch read one cache: turned keys once
            for call in batch.calls:
                params = self._params if call.kind == "body" else (
                    self._tail_params or self._params)  # fmt: skip
                prune = ops.prune_blocks(params, call.blocks, q, cache, table, self.scale,
                                         shared=shared, landmarks=landmarks,
                                         **scales)  # fmt: skip
                self.pairs[0] += ops.attend_blocks(params, call.blocks, q, cache, table,
                                                   self.scale, prune, out, **scales)  # fmt: skip
                if self.recall_log is not None:
                    self._log_prefill_recall(params, call.blocks, prune, q, cache, table)
        self.pairs[1] += plan.context_pairs

    # ---------------------------------------------------------------- recall observer
    def _log_prefill_recall(
        self, params: ref.PruneParams, blocks: QueryBlocks, prune: ref.PruneResult,
        q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
    ) -> None:  # fmt: skip
        """Recall of each chunk's final query (the part that holds it), with its block's mask."""
        fine = blocks.refine(params.block_size_q)
        for lo, p in zip(fine.part_blocks, blocks.parts):
            if p.slice_end != p.seq_len:
                continue
            b = lo + (p.q_hi - p.q_lo - 1) // params.block_size_q
            req = RequestKV(kv_cache, block_table[p.row], p.seq_len, **self._kv_scales)
            positions = torch.tensor([p.seq_len - 1], device=q.device)
            final = ref.PruneResult(prune.block_starts[b : b + 1], prune.block_valid[b : b + 1], [])
            self._log_recall("final-prompt", params, req, q[p.q_hi - 1 : p.q_hi], positions, final)

    def _log_decode_recall(
        self, masks: dec.DecodeMasks, q: torch.Tensor, kv_cache: torch.Tensor,
        rows: dec.DecodeRows,
    ) -> None:
        for b, (slot, seq_len) in enumerate(zip(rows.slots.tolist(), rows.seq_lens.tolist())):
            if slot < 0:
                continue
            req = RequestKV(kv_cache, rows.block_table[b], seq_len, **self._kv_scales)
            positions = torch.tensor([seq_len - 1], device=q.device)
            self._log_recall("decode", self._decode_params, req, q[b : b + 1], positions,
                             masks.prune_result(slot))  # fmt: skip

    def _log_recall(
        self, query: str, params: ref.PruneParams, req: RequestKV, q: torch.Tensor,
        positions: torch.Tensor, prune: ref.PruneResult,
    ) -> None:
        """Dense softmax mass on the keys one query attended (exact, reference math)."""
        k, _ = req.contiguous()
        mask = ref.sparse_key_mask(
            params, req.seq_len, positions, prune.block_starts[-1:], prune.block_valid[-1:]
        )
        recall = ref.attention_recall(q, k, positions, mask, self.scale)[0]
        record = {
            "query": query, "layer": _layer_index(self._layer_name), "seq_len": req.seq_len,
            "recall": float(recall.mean()), "recall_min_head": float(recall.min()),
        }  # fmt: skip
        if params.rope is not None:  # what the selection missed, under the layer's remapping
            remapped = ref.remapped_attention_recall(params, q, k, positions, mask, self.scale)[0]
            record["recall_remapped"] = float(remapped.mean())
            record["recall_remapped_min_head"] = float(remapped.min())
        self.recall_log.append(record)
