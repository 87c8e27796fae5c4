"""The ``INFINITEHIP`` attention backend for vLLM 0.26, modelled on ``triton_attn.py``.

Four classes in data-flow order: the per-step metadata, its builder (once per step, all layers:
which rows decode sparsely and at which refresh level), the backend (what vLLM asks before it
runs), and the impl (per layer: write KV, then dense, sparse-prefill or sparse-decode attention).
The compute lives in ``vllm_infinitehip.kernels``; this file decides what to run.

KV cache layout: ``[num_blocks, 2, block_size, num_kv_heads, head_size]`` on every device, so the
PyTorch reference (CPU) and the GPU kernels read the same cache.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

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

from vllm_infinitehip.config import InfiniteHiPConfig
from vllm_infinitehip.kernels import reference as ref
from vllm_infinitehip.kernels.ops import ReferenceOps, RequestKV, ops_for
from vllm_infinitehip.mask_state import LEVEL_NONE, DecodeState, DecodeStateStore, refresh_level
from vllm_infinitehip.metrics import AttentionStats

# Under the "vllm" namespace so that vLLM's logging configuration (handlers, level) applies.
logger = init_logger(f"vllm.{__name__}")


@dataclass
class InfiniteHiPMetadata:
    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor
    max_seq_len: int
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    # host copies, one entry per request
    query_start_loc_host: list[int]
    seq_lens_host: list[int]
    # per request: its decode state (None unless it decodes sparsely) and refresh level
    decode_states: list[DecodeState | None]
    refresh_levels: list[int]


class InfiniteHiPMetadataBuilder(AttentionMetadataBuilder[InfiniteHiPMetadata]):
    # build() matches requests to their decode state on the host (block-table rows, lengths), so
    # the attention op runs outside CUDA graphs; FULL graphs need that matching on device.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.config = InfiniteHiPConfig.from_vllm_config(vllm_config)
        self.block_size = kv_cache_spec.block_size
        self.decode_states = DecodeStateStore()
        logger.info_once("InfiniteHiP config: %s", self.config.summary())

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> InfiniteHiPMetadata:
        m = common_attn_metadata
        qsl = m.query_start_loc_cpu[: m.num_reqs + 1].tolist()
        seq_lens = m.seq_lens.cpu()[: m.num_reqs].tolist()
        threshold = self.config.effective_dense_threshold
        decode_rows = [
            i
            for i in range(m.num_reqs)
            if qsl[i + 1] - qsl[i] == 1 and seq_lens[i] > threshold
        ]
        rows: list[list[int] | None] = [None] * m.num_reqs
        if decode_rows:
            table = m.block_table_tensor[decode_rows].cpu()
            for j, i in enumerate(decode_rows):
                n_blocks = (seq_lens[i] + self.block_size - 1) // self.block_size
                rows[i] = table[j, :n_blocks].tolist()
        states = self.decode_states.assign(rows, seq_lens, self.block_size)
        levels = [
            LEVEL_NONE if st is None else refresh_level(st.decode_step, self.config.refresh_intervals)
            for st in states
        ]
        return InfiniteHiPMetadata(
            num_actual_tokens=m.num_actual_tokens,
            max_query_len=m.max_query_len,
            query_start_loc=m.query_start_loc,
            max_seq_len=m.max_seq_len,
            seq_lens=m.seq_lens,
            block_table=m.block_table_tensor,
            slot_mapping=m.slot_mapping,
            query_start_loc_host=qsl,
            seq_lens_host=seq_lens,
            decode_states=states,
            refresh_levels=levels,
        )


class InfiniteHiPBackend(AttentionBackend):
    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = False

    supported_dtypes: ClassVar[list[torch.dtype]] = [
        torch.float16,
        torch.bfloat16,
        torch.float32,
    ]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "float16", "bfloat16"]

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
        self.stats = AttentionStats()
        model_config = vllm_config.model_config
        trained = (
            self.config.trained_context
            or getattr(model_config.hf_text_config, "max_position_embeddings", None)
            or model_config.max_model_len
        )
        self.trained_context = trained
        self.rope_extension = self.config.extends_rope(model_config.max_model_len, trained)
        self._rope_table = None
        if self.rope_extension:
            from vllm_infinitehip.kernels.rope import RopeTable

            # vLLM's own rotary embedding of this model (rope_theta, llama3 scaling), built here
            # while the model's config is current.
            self._rope_table = RopeTable.from_vllm(
                head_size, model_config.hf_text_config, dtype=model_config.dtype
            )
        # metrics.collect_recall sets a list here: recall of each prefill chunk's final query and
        # of each decode query goes to it
        self.recall_log: list[dict] | None = None
        self._params: ref.PruneParams | None = None
        self._tail_params: ref.PruneParams | None = None
        self._layer_name: str | None = None

    def _prune_params(self, layer: AttentionLayer) -> ref.PruneParams:
        if self._params is None:
            from vllm.model_executor.models.utils import extract_layer_index

            self._layer_name = layer.layer_name
            layer_index = extract_layer_index(layer.layer_name)
            final_keep = self.config.final_keep_for_layer(layer_index)
            stages = [
                ref.StageParams(s.chunk_size, s.keep_tokens, s.block_size_q, s.query_stride)
                for s in self.config.stages
            ]
            last = stages[-1]
            stages[-1] = ref.StageParams(
                last.chunk_size, final_keep, last.block_size_q, last.query_stride
            )
            self._params = ref.PruneParams(
                sink_tokens=self.config.sink_tokens,
                window_tokens=self.config.window_tokens,
                stages=tuple(stages),
                probe=self.config.probe,
                rope=self._rope_plan(layer_index),
            )
            tail_window = self.config.tail_window(self.trained_context)
            if tail_window is not None:
                self._tail_params = dataclasses.replace(self._params, window_tokens=tail_window)
        return self._params

    def _rope_plan(self, layer_index: int) -> ref.RopePlan | None:
        """This layer's position remapping when extending past the trained length (§2)."""
        if self._rope_table is None:
            return None
        return ref.RopePlan(
            table=self._rope_table,
            pruning=self.config.rope_pruning_for_layer(layer_index),
            bsa=self.config.rope_bsa,
        )

    def _sparse_prefill(
        self, ops: ReferenceOps, params: ref.PruneParams, req: RequestKV, q: torch.Tensor,
        positions: torch.Tensor,
    ) -> tuple[torch.Tensor, int]:
        """Sparse attention for a prefill chunk: its last query block uses the tail window, and
        its final query (the next token's) may be pruned alone (``prefill_final_query_own_mask``)."""
        n = q.shape[0]
        tail_params = self._tail_params or params
        tail = params.block_size_q if self._tail_params is not None else 0
        last = n - 1 if self.config.prefill_final_query_own_mask else n
        body_end = max(0, min(n - tail, last))
        bounds = [(params, 0, body_end), (tail_params, body_end, last), (tail_params, last, n)]
        parts = [(p, slice(lo, hi)) for p, lo, hi in bounds if hi > lo]
        outs, attended = [], 0
        for p, sl in parts:
            prune = ops.prune(p, req, q[sl], positions[sl], self.scale)
            o, pairs = ops.attend(p, req, q[sl], positions[sl], self.scale, prune)
            outs.append(o)
            attended += pairs
        if self.recall_log is not None:
            self._log_recall("final-prompt", p, req, q[-1:], positions[-1:], prune)
        return torch.cat(outs) if len(outs) > 1 else outs[0], attended

    def _log_recall(
        self, query: str, params: ref.PruneParams, req: RequestKV, q: torch.Tensor,
        positions: torch.Tensor, prune: ref.PruneResult,
    ) -> None:
        """Dense softmax mass on the keys one query attended (exact, reference math)."""
        from vllm.model_executor.models.utils import extract_layer_index

        k, _ = req.contiguous()
        mask = ref.sparse_key_mask(
            params, req.seq_len, positions, prune.block_starts[-1:], prune.block_valid[-1:]
        )
        recall = ref.attention_recall(q, k, positions, mask, self.scale)[0]
        self.recall_log.append({
            "query": query, "layer": extract_layer_index(self._layer_name), "seq_len": req.seq_len,
            "recall": float(recall.mean()), "recall_min_head": float(recall.min()),
        })  # fmt: skip

    def do_kv_cache_update(
        self,
        layer: AttentionLayer,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        ref.write_paged_kv(kv_cache, key, value, slot_mapping)

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
        params = self._prune_params(layer)
        n_stages = len(params.stages)
        m = attn_metadata
        out = output[: m.num_actual_tokens].view(-1, self.num_heads, self.head_size)
        q_all = query[: m.num_actual_tokens].view(-1, self.num_heads, self.head_size)
        threshold = self.config.effective_dense_threshold
        ops = ops_for(q_all.device)
        for i, seq_len in enumerate(m.seq_lens_host):
            lo, hi = m.query_start_loc_host[i], m.query_start_loc_host[i + 1]
            if hi == lo:
                continue
            q = q_all[lo:hi]
            req = RequestKV(kv_cache, m.block_table[i], seq_len)
            positions = torch.arange(seq_len - (hi - lo), seq_len, device=q.device)
            if seq_len <= threshold:
                out[lo:hi] = ops.dense(req, q, positions, self.scale)
                self.stats.dense_queries += hi - lo
                continue
            state = m.decode_states[i]
            if state is None:  # a prefill chunk (or a lone query outside decode tracking)
                o, attended = self._sparse_prefill(ops, params, req, q, positions)
                self.stats.sparse_prefill_queries += hi - lo
            else:
                level = m.refresh_levels[i]
                prune = self._decode_mask(ops, params, state, level, req, q, positions)
                o, attended = ops.attend(params, req, q, positions, self.scale, prune)
                if self.recall_log is not None:
                    self._log_recall("decode", params, req, q, positions, prune)
                self.stats.sparse_decode_queries += 1
                self.stats.count_refresh(level, n_stages)
            out[lo:hi] = o
            self.stats.sparse_attended_pairs += attended
            self.stats.sparse_context_pairs += int((positions + 1).sum())
        return output

    def _decode_mask(
        self,
        ops: ReferenceOps,
        params: ref.PruneParams,
        state: DecodeState,
        level: int,
        req: RequestKV,
        q: torch.Tensor,
        positions: torch.Tensor,
    ) -> ref.PruneResult:
        """The decode mask at this step's refresh level, from this layer's cached stage inputs."""
        cached: ref.PruneResult | None = state.layers.get(self._layer_name)
        n_stages = len(params.stages)
        if cached is None:
            level = 0
        if level >= n_stages:
            return cached
        start_input = None if level == 0 else cached.stage_inputs[level]
        prune = ops.prune(params, req, q, positions, self.scale, level, start_input)
        if level > 0:
            prune.stage_inputs = cached.stage_inputs[:level] + prune.stage_inputs
        state.layers[self._layer_name] = prune
        return prune
