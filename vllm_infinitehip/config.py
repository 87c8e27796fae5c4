"""The one configuration object of the plugin, its presets and its validation.

Users set it through vLLM's own ``--additional-config '{"infinitehip": {...}}'`` (or
``LLM(..., additional_config={"infinitehip": {...}})``). It is parsed and validated once, in the
process where the user gave it; a bad value raises :class:`InfiniteHiPConfigError` naming the field.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
from dataclasses import dataclass, field
from typing import Any

ADDITIONAL_CONFIG_KEY = "infinitehip"


class InfiniteHiPConfigError(ValueError):
    """A user-supplied InfiniteHiP setting is invalid; the message names the field."""


@dataclass(frozen=True)
class StageConfig:
    """One pruning stage S(i) = (b_q, l_c, k): INFINITEHIP.md §1.1.

    ``keep_tokens`` is the number of tokens that survive this stage (``k(i)``); it must be a
    multiple of ``chunk_size``. ``query_stride`` average-pools that many consecutive queries of a
    block before scoring.
    """

    chunk_size: int
    keep_tokens: int
    block_size_q: int = 64
    query_stride: int = 1


# INFINITEHIP.md §1.2: the code's defaults produced the paper's numbers, so presets follow the code.
_3K_STAGES = (
    StageConfig(chunk_size=256, keep_tokens=32768, block_size_q=64, query_stride=4),
    StageConfig(chunk_size=32, keep_tokens=8192, block_size_q=64, query_stride=4),
    StageConfig(chunk_size=8, keep_tokens=2048, block_size_q=64, query_stride=1),
)
_5K_STAGES = (
    StageConfig(chunk_size=64, keep_tokens=32768, block_size_q=64, query_stride=4),
    StageConfig(chunk_size=32, keep_tokens=16384, block_size_q=64, query_stride=4),
    StageConfig(chunk_size=16, keep_tokens=4096, block_size_q=64, query_stride=1),
)

PRESETS: dict[str, dict[str, Any]] = {
    # The default: prefill prunes with the 3K stages, decode with the 5K stages. A decode query
    # is pruned alone and its mask reused between refreshes, so its larger budget costs little
    # (H100, 128K: 2.7% of a decode step); in prefill the 5K stages' finer first stage probes
    # four times the chunks of every query block (256K: 42.6 against 30.2 s). On RULER at 32K
    # the 5K decode stages kept 0.94 of dense attention's score, the 3K ones 0.87.
    "3k-5k": {"stages": _3K_STAGES, "decode_stages": "auto", "refresh_intervals": (32, 16, 8)},
    # The paper's 3K and 3K-fast: the same stages, masks refreshed twice as often in "3k". A
    # multi-token copy (a UUID) walks out of its selected block between last-stage refreshes,
    # which "3k" halves, at a decode cost (docs/configuration.md).
    "3k": {"stages": _3K_STAGES, "refresh_intervals": (16, 8, 4)},
    "3k-fast": {"stages": _3K_STAGES, "refresh_intervals": (32, 16, 8)},
    "3k-flash": {"stages": _3K_STAGES, "refresh_intervals": (96, 24, 8)},
    "5k": {"stages": _5K_STAGES, "refresh_intervals": (32, 16, 8)},
}

# ``decode_stages`` "auto" decodes with the 5K stages unless RoPE extension is on and their
# remapped span (sink + 4096 kept + window, every key of a remapped decode row laid out left of
# its window) exceeds this share of the trained length; then decode takes ``stages``. SmolLM2
# (trained 8K) at 4x, RULER niah_single_1: 85 with the 3K decode stages (span 3328, 0.41 of 8K),
# 15 with the 5K ones (5376, 0.66), the same prefill (H100, 2026-12-06; the CPU gives the same
# answers); passkeys at 64K with the 5K stages: 0 of 20 against 13 (2026-12-03). Qwen2.5-Coder
# (trained 32K, span 0.16) keeps its answers with the 5K stages to 8x.
DECODE_SPAN_SHARE = 0.5
PROBE_RULES = ("midpoint", "first")
HEAD_REDUCTIONS = ("max", "z-score")
REMAP_PRUNING = ("past-trained", "always")
PREFILL_REPRESENTATIVES = ("bisection", "group-bisection", "landmark")
LANDMARK_WINDOW = 512  # the authors' (kernels.reference.LANDMARK_WINDOW)
ROPE_PRUNING_STYLES = ("paper", "relative", "chunk-indexed", "none")
ROPE_BSA_STYLES = ("streaming", "none")
SCORING_PRECISIONS = ("tf32", "fp32")
TP_MASK_MODES = ("per-rank", "global")
# H200, 2026-11-30 (docs/results.md, attention kernels): one 32K-query prefill chunk of a
# Llama-3-8B layer took 105 ms sparse and 105 ms with vLLM's FA3 at 128K context, 64 vs 14 ms
# at 32K.
DENSE_PREFILL_CROSSOVER = 131072
# H200, Llama-3-8B shapes, batch 1, through vLLM: sparse decode was 1.09x FLASH_ATTN at 32K
# (2026-12-01), 1.35x at 64K and 1.73x at 128K (2026-12-05). At 32K it saves under a tenth of a
# step and loses answers (RULER at 1x), so "auto" decodes densely up to here on a GPU.
DENSE_DECODE_CROSSOVER = 32768
# 2 CPU cores, SmolLM2-135M shapes, one 8K-query chunk of all 30 layers through the PyTorch
# reference (benchmarks/prefill_crossover.py, 2026-12-02): dense was 5.5x (RoPE extension on) and
# 4.1x (off) cheaper than sparse at 8K, 1.3x at 16K; at 32K sparse was 1.3x cheaper with
# extension on and even with it off, 2.3x and 1.4x at 64K.
CPU_DENSE_PREFILL_CROSSOVER = 16384


@dataclass(frozen=True)
class OffloadConfig:
    """The host KV tier (``infinitehip.offload``): vLLM's KV blocks live in host memory and a GPU
    bank caches the pages the kernels read (``block_manager``).

    - ``enabled``: on or off (``"offload": true`` is short for ``{"enabled": true}``).
    - ``host_gib``: host memory for KV, the capacity vLLM's scheduler sees. ``None``: 80% of the
      memory the machine has available at startup.
    - ``bank_gib``: GPU memory for the bank of hot pages. ``None``: what vLLM's profiling leaves
      for KV on the GPU (``gpu_memory_utilization``).
    - ``key_row_share``: the share of the bank (0 to 1, exclusive) that holds single K rows for
      the pruning stages' probes (``block_manager.key_rows``); the rest holds the pages
      attention reads. Pruning probes about a quarter of every K row of the context, attention
      reads a few thousand tokens per row and step, so K takes most (the paper's "favour K").
    - ``layout``: ``"host"`` (the above) or ``"split"``: capacity is GPU plus host memory,
      every block's K stays on the GPU and its V lives on the GPU first and moves to the host
      only past what the GPU holds (``block_manager.split_kv``). ``host_gib`` is then the host
      memory for V pages, and ``bank_gib`` the GPU memory of a bank of copies of the host-homed
      V pages decode reads, taken from the GPU's V homes when V spills (``None``: a sixteenth
      of the GPU's KV memory; 0: no bank, decode reads host-homed V over the bus at every
      step). ``key_row_share`` does not apply.
    - ``gpu_gib`` (``"split"``): GPU memory for KV, K of every block and the V pages homed
      there. ``None``: what vLLM's profiling leaves for KV.
    """

    enabled: bool = False
    host_gib: float | None = None
    bank_gib: float | None = None
    key_row_share: float = 0.75
    layout: str = "host"
    gpu_gib: float | None = None


@dataclass(frozen=True)
class InfiniteHiPConfig:
    """Everything the backend needs to know; immutable once validated.

    Fields (all settable through ``additional_config["infinitehip"]``):

    - ``preset``: ``3k-5k`` (default), ``3k-fast``, ``3k``, ``3k-flash`` or ``5k``; supplies
      ``stages``, ``decode_stages`` and ``refresh_intervals`` unless those are given too.
    - ``sink_tokens``: the first tokens every query attends to (n_sink).
    - ``window_tokens``: the sliding window of the most recent tokens (n_stream).
    - ``stages``: list of ``{"chunk_size", "keep_tokens", "block_size_q", "query_stride"}``. A
      stage may score coarser query blocks than the next (its ``block_size_q`` a multiple of the
      next one's): neighbouring blocks then share its work, and the last stage's blocks are
      block-sparse attention's.
    - ``decode_stages``: the stages decode prunes with, in the same form; ``null``: ``stages``
      (also when ``stages`` is given and ``decode_stages`` is not); ``"auto"`` (the default
      preset's): the 5K stages, unless RoPE extension is on and their span (sink + 4096 +
      window) exceeds half the trained length, where decode takes ``stages``
      (:data:`DECODE_SPAN_SHARE`). Prefill and decode prune
      apart (a decode row's mask is its own, refreshed on ``refresh_intervals``), so each may
      have its own budget and block size.
    - ``dense_layer_keep_tokens`` / ``dense_layers``: layers that keep a larger final budget.
      Negative indices count from the last layer (``-1``: the last), as in Python.
    - ``refresh_intervals``: one decode-step interval per decode stage for recomputing the mask.
    - ``dense_threshold``: sequences up to this many tokens decode with exact dense attention.
      ``"auto"`` (default): on a GPU where vLLM's FlashAttention reads the cache,
      ``DENSE_DECODE_CROSSOVER`` (32K: below it sparse decode saves little and loses answers),
      elsewhere ``None``'s value; ``None``: sink + window + final budget, the point below which
      sparsity reads no fewer keys.
    - ``probe``: SelectRep probe rule, ``midpoint`` (code, default) or ``first`` (paper).
    - ``head_reduction``: how a stage's per-head chunk scores become the layer's one ranking:
      ``"max"`` of the raw scores over heads (the paper's), or ``"z-score"``: each head's scores
      standardised over the row's candidates first, then the max (default). On models whose
      q/k biases or delimiter tokens give a few heads large logits everywhere (Qwen2), the raw
      max lets those heads decide every ranking and outvote the head that reads a needle.
    - ``exact_last_stage``: the last stage scores each chunk by its best key (every key of a
      ``block_size_k`` chunk loaded: 8 loads against bisection's 6) instead of bisecting. A
      needle is often one sharp key, which bisection can step past.
    - ``drop_window_candidates``: every stage after the first drops candidates that start
      inside the query's sliding window (they would spend the budget on keys the window
      attends anyway); the first stage always does.
    - ``extend_reused_blocks``: on the decode steps between two refreshes of the last stage,
      each selected block is read as many tokens past its end as steps have passed since it
      was chosen (at most ``block_size_k`` more). A multi-token copy (a UUID, a line of code)
      walks one token per step out of the block that held its source; this keeps the next
      tokens in view until the mask is refreshed, at the cost of reading up to twice the
      selected keys (default on: RULER at 1x on Qwen2.5-Coder-0.5B went from 42.7 to 45.1,
      niah_single_3's UUID copies from 60 to 95).
    - ``rope_extension``: remap RoPE positions (INFINITEHIP.md §2) so every distance a layer sees
      stays inside the trained range: ``"auto"`` (on when ``max_model_len`` exceeds
      ``trained_context``), ``true`` or ``false``. Only queries at or past ``trained_context``
      attend remapped (per decode row, per query block in prefill); the others attend at their
      true positions, as without extension, and are pruned as ``remap_pruning`` says.
    - ``rope_pruning``: RoPE style in the pruning stages when extending: ``"paper"`` (chunk-indexed
      in ``dense_layers``, relative elsewhere), ``"relative"``, ``"chunk-indexed"`` or ``"none"``.
    - ``rope_bsa``: RoPE style in block-sparse attention when extending: ``"streaming"``, ``"none"``.
    - ``remap_pruning``: which queries the pruning stages score at remapped positions when
      extending: ``"past-trained"`` (those at or past ``trained_context``, as attention) or
      ``"always"`` (every query, as the authors' code does; attention below the trained length
      still keeps true positions).
    - ``trained_context``: the model's trained length; filled in from the model's config.
    - ``prefill_tail_window``: the last ``block_size_q`` queries of every prefill chunk (the ones
      that produce the first output token) attend with this larger window. ``"auto"`` (the
      authors' code): trained length - sink - final budget - block_size_q, the same in every
      layer (``dense_layers``' larger budget then reaches past the trained length; shrinking
      their window to fit lost a passkey that the common window found); ``null``: off.
    - ``prefill_final_query_own_mask``: prune the last query of every prefill chunk on its own,
      as a decode query is (b_q = 1), instead of with its block (the max over 64 queries). Off by
      default, as in the authors' code: on SmolLM2 passkeys past the trained length neither was
      better consistently (the block's question tokens help find the needle, filler hurts).
    - ``prefill_dense_threshold``: prefill chunks whose context is at most this many tokens run
      exact dense attention. ``"auto"``: where dense stops being the cheaper one, capped at the
      trained length when RoPE extension is on: on a GPU ``DENSE_PREFILL_CROSSOVER`` (128K,
      vLLM's FlashAttention over the paged cache against the sparse kernels), on the CPU
      ``CPU_DENSE_PREFILL_CROSSOVER`` (16K, SDPA against the PyTorch reference); on a GPU
      without FlashAttention, and at least, ``dense_threshold``. ``null``: ``dense_threshold``.
    - ``prefill_representatives``: which key of a candidate chunk the prefill's pruning stages
      score it by (an exact last stage scores every key either way). ``"bisection"``
      (default): SelectRep's bisection per query block and head, two probes per step.
      ``"landmark"``: the chunk's key that the text right after it reads most, its landmark
      score (the mean scaled logit of the ``landmark_window`` queries that follow a key, over
      the query heads of its KV head), kept per KV slot as each prefill chunk is written: one
      probe per chunk and KV head. It keeps sharp keys that bisection steps past. The scores
      take ``(H_kv + 1)`` float32 per token and layer beside the KV cache (about 1% of a
      16-bit cache). With ``offload``, the ``"split"`` layout only. ``"group-bisection"``: the
      query heads of a KV group bisect one path, each step descending by the best probe over
      all their queries, so a probe key is read once per group instead of once per query head
      (the stages read G times fewer keys, G = H_q / H_kv); the ranking then reduces over KV
      heads. Decode keeps bisection per head.
    - ``scoring_precision``: how the GPU prefill's pruning stages multiply q.k: ``"tf32"`` (one
      tensor-core pass, default) or ``"fp32"`` (three passes, fp32-accurate). Decode scoring is
      always exact fp32 (one query per row).
    - ``block_size_k``: granularity of selected blocks in block-sparse attention (= last chunk).
    - ``offload``: the host KV tier, :class:`OffloadConfig` (off by default).
    - ``tp_mask``: under tensor parallelism each rank holds ``H_kv / TP`` heads, and the stages'
      head-max runs over those. ``"per-rank"`` (default, as the authors do): each rank selects
      for its own heads, so masks differ from TP = 1 and no collective runs. ``"global"``: each
      stage's scores are max-reduced over the TP group before its top-k (one all-gather of a
      ``[rows, chunks]`` float32 tensor per stage and layer), so masks equal TP = 1.
    """

    preset: str = "3k-5k"
    sink_tokens: int = 256
    window_tokens: int = 1024
    stages: tuple[StageConfig, ...] = _3K_STAGES
    decode_stages: tuple[StageConfig, ...] | str | None = "auto"
    refresh_intervals: tuple[int, ...] = (32, 16, 8)
    dense_layers: tuple[int, ...] = (0, 1, 2, 3)
    dense_layer_keep_tokens: int = 4096
    dense_threshold: int | str | None = "auto"
    probe: str = "midpoint"
    head_reduction: str = "z-score"
    exact_last_stage: bool = True
    drop_window_candidates: bool = True
    extend_reused_blocks: bool = True
    prefill_tail_window: int | str | None = "auto"
    prefill_final_query_own_mask: bool = False
    rope_extension: bool | str = "auto"
    rope_pruning: str = "paper"
    rope_bsa: str = "streaming"
    remap_pruning: str = "always"
    prefill_representatives: str = "bisection"
    trained_context: int | None = None
    scoring_precision: str = "tf32"
    prefill_dense_threshold: int | str | None = "auto"
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    tp_mask: str = "per-rank"

    @property
    def final_keep_tokens(self) -> int:
        return self.stages[-1].keep_tokens

    def for_decode(self) -> InfiniteHiPConfig:
        """This config as decode reads it: ``stages`` are the decode stages (its final budget,
        block size, threshold and state sizes follow from them). ``"auto"`` not yet resolved for
        a model (:meth:`for_model`) reads as the 5K stages, as without RoPE extension."""
        decode = _5K_STAGES if self.decode_stages == "auto" else self.decode_stages
        if decode is None or decode == self.stages:
            return self if self.decode_stages is None else dataclasses.replace(
                self, decode_stages=None)  # fmt: skip
        return dataclasses.replace(self, stages=decode, decode_stages=None)

    def for_model(self, trained_context: int, rope_extension: bool) -> InfiniteHiPConfig:
        """This config for a model trained on ``trained_context`` tokens, served with RoPE
        extension on or off: ``decode_stages`` ``"auto"`` resolved (:data:`DECODE_SPAN_SHARE`)."""
        if self.decode_stages != "auto":
            return self
        span = self.sink_tokens + _5K_STAGES[-1].keep_tokens + self.window_tokens
        fits = not rope_extension or span <= trained_context * DECODE_SPAN_SHARE
        return dataclasses.replace(self, decode_stages=_5K_STAGES if fits else None)

    @property
    def block_size_k(self) -> int:
        return self.stages[-1].chunk_size

    @property
    def prefill_group_probes(self) -> bool:
        """Prefill's pruning stages bisect one path per KV group (``prefill_representatives``
        ``"group-bisection"``; ``PruneParams.group_probes``)."""
        return self.prefill_representatives == "group-bisection"

    @property
    def landmark_window(self) -> int:
        """How many following queries a key's landmark score averages: at most 512 (the
        authors'), and at most ``window_tokens - 2 * stages[0].chunk_size``. A candidate chunk
        ends that far before its query block's window, so every follower of its keys precedes
        the block and has been added when the block is scored: a prompt selects the same
        blocks however vLLM chunks it, batched or alone."""
        return min(LANDMARK_WINDOW, self.window_tokens - 2 * self.stages[0].chunk_size)

    @property
    def effective_dense_threshold(self) -> int:
        """The decode threshold where no device crossover applies (``"auto"`` as ``None``)."""
        if isinstance(self.dense_threshold, int):
            return self.dense_threshold
        return self.sink_tokens + self.window_tokens + self.final_keep_tokens

    def decode_threshold(self, dense_crossover: int | None) -> int:
        """Longest context decoded densely. ``dense_crossover``: the context up to which dense
        decode is the better choice on this device (:data:`DENSE_DECODE_CROSSOVER` on a GPU with
        vLLM's FlashAttention), None where it never is; only ``"auto"`` reads it. Without a
        number, where sparsity starts is the decode stages' (their final budget)."""
        base = self.for_decode().effective_dense_threshold
        if self.dense_threshold == "auto" and dense_crossover is not None:
            return max(base, dense_crossover)
        return base

    def prefill_threshold(
        self, dense_crossover: int | None, rope_extension: bool, trained_context: int
    ) -> int:
        """Longest context whose prefill chunks run dense (see ``prefill_dense_threshold``).
        ``dense_crossover``: the context up to which dense prefill is the cheaper one on this
        device (:data:`DENSE_PREFILL_CROSSOVER` on a GPU with vLLM's FlashAttention,
        :data:`CPU_DENSE_PREFILL_CROSSOVER` on the CPU); None where it never is."""
        base = self.effective_dense_threshold
        v = self.prefill_dense_threshold
        if v is None:
            return base
        if v == "auto":
            if dense_crossover is None:
                return base
            auto = dense_crossover
            if rope_extension:  # dense attention sees true positions: only inside the trained length
                auto = min(auto, trained_context)
            return max(base, auto)
        return max(base, int(v))

    def extends_rope(self, max_model_len: int, trained_context: int) -> bool:
        if self.rope_extension == "auto":
            return max_model_len > trained_context
        return bool(self.rope_extension)

    def rope_pruning_for_layer(self, layer_index: int) -> str:
        if self.rope_pruning == "paper":
            return "chunk-indexed" if layer_index in self.dense_layers else "relative"
        return self.rope_pruning

    def tail_window(self, trained_context: int) -> int | None:
        """Window of a prefill chunk's last query block, or None when the tail is not special."""
        if self.prefill_tail_window is None:
            return None
        if self.prefill_tail_window == "auto":
            auto = trained_context - self.sink_tokens - self.final_keep_tokens
            return max(self.window_tokens, auto - self.stages[-1].block_size_q)
        return max(self.window_tokens, int(self.prefill_tail_window))

    def spans_past_trained(self, trained_context: int) -> list[str]:
        """Where a query's reach exceeds the trained length under RoPE extension, one line per
        kind of layer. Block-sparse attention (§2) lays the sink and the kept blocks out just
        left of the window, so a prefill block's first query sees sink + kept + window + the
        block's other queries; past the trained length those are distances the model never saw.
        The prefill tail's window is left out: ``"auto"`` sizes it for the common budget, and
        ``dense_layers`` reach past it by the authors' design (``prefill_tail_window``)."""
        bq = self.stages[-1].block_size_q
        kinds = [("layers", self.final_keep_tokens)]
        if self.dense_layers:
            kinds.append(("dense_layers", self.final_keep_for_layer(self.dense_layers[0])))
        out = []
        for name, keep in kinds:
            span = self.sink_tokens + keep + self.window_tokens + bq - 1
            if span > trained_context:
                out.append(f"{name}: sink_tokens {self.sink_tokens} + kept {keep} + "
                           f"window_tokens {self.window_tokens} + block_size_q {bq} - 1 = {span}")
        return out

    def final_keep_for_layer(self, layer_index: int) -> int:
        if layer_index in self.dense_layers:
            return max(self.dense_layer_keep_tokens, self.final_keep_tokens)
        return self.final_keep_tokens

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["stages"] = [dataclasses.asdict(s) for s in self.stages]
        out["decode_stages"] = (self.decode_stages if self.decode_stages in (None, "auto")
                                else [dataclasses.asdict(s) for s in self.decode_stages])
        out["refresh_intervals"] = list(self.refresh_intervals)
        out["dense_layers"] = list(self.dense_layers)
        out["offload"] = dataclasses.asdict(self.offload)
        return out

    def summary(self) -> str:
        def listed(stages: tuple[StageConfig, ...]) -> str:
            return "[" + ", ".join(
                f"(b_q={s.block_size_q}/{s.query_stride}, l_c={s.chunk_size}, k={s.keep_tokens})"
                for s in stages) + "]"  # fmt: skip

        decode = ("stages" if self.decode_stages is None else "auto"
                  if self.decode_stages == "auto" else listed(self.decode_stages))
        return (
            f"preset={self.preset} sink={self.sink_tokens} window={self.window_tokens} "
            f"stages={listed(self.stages)} decode_stages={decode} "
            f"refresh={list(self.refresh_intervals)} "
            f"dense_threshold={self.dense_threshold} probe={self.probe} "
            f"head_reduction={self.head_reduction} exact_last_stage={self.exact_last_stage} "
            f"drop_window_candidates={self.drop_window_candidates} "
            f"extend_reused_blocks={self.extend_reused_blocks} "
            f"dense_layers={list(self.dense_layers)}->k={self.dense_layer_keep_tokens} "
            f"prefill_tail_window={self.prefill_tail_window} "
            f"prefill_final_query_own_mask={self.prefill_final_query_own_mask} "
            f"rope_extension={self.rope_extension} remap_pruning={self.remap_pruning} "
            f"trained_context={self.trained_context} "
            f"scoring_precision={self.scoring_precision} "
            f"prefill_dense_threshold={self.prefill_dense_threshold} "
            f"offload={self.offload} tp_mask={self.tp_mask}"
        )

    # ---------------------------------------------------------------- parsing
    @classmethod
    def from_user(cls, raw: Any) -> InfiniteHiPConfig:
        """Parse the user's ``infinitehip`` dict (or JSON string); raise on any bad field."""
        if raw is None:
            raw = {}
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as e:
                raise InfiniteHiPConfigError(f"`infinitehip` is not valid JSON: {e}") from None
        if isinstance(raw, InfiniteHiPConfig):
            return raw
        if not isinstance(raw, dict):
            raise InfiniteHiPConfigError(
                f"`infinitehip` must be an object, got {type(raw).__name__}"
            )
        _check_fields(raw, cls, "infinitehip")
        preset = raw.get("preset", "3k-5k")
        if not isinstance(preset, str) or preset not in PRESETS:
            raise InfiniteHiPConfigError(
                f"`infinitehip.preset`={preset!r} is not one of {', '.join(PRESETS)}"
            )
        values: dict[str, Any] = copy.deepcopy(PRESETS[preset])
        values["preset"] = preset
        for key, value in raw.items():
            if key == "preset":
                continue
            values[key] = value

        kwargs: dict[str, Any] = {"preset": preset}
        for name in ("sink_tokens", "window_tokens", "dense_layer_keep_tokens"):
            if name in values:
                kwargs[name] = _int(values[name], f"infinitehip.{name}", minimum=0)
        if "dense_threshold" in values:
            v = values["dense_threshold"]
            if v is not None and v != "auto":
                v = _int(v, "infinitehip.dense_threshold", minimum=0)
            kwargs["dense_threshold"] = v
        if "probe" in values:
            probe = values["probe"]
            if probe not in PROBE_RULES:
                raise InfiniteHiPConfigError(
                    f"`infinitehip.probe`={probe!r} is not one of {', '.join(PROBE_RULES)}"
                )
            kwargs["probe"] = probe
        if "rope_extension" in values:
            v = values["rope_extension"]
            if v not in (True, False, "auto"):
                raise InfiniteHiPConfigError(
                    f"`infinitehip.rope_extension`={v!r} must be true, false or \"auto\""
                )
            kwargs["rope_extension"] = v
        for name, allowed in (
            ("rope_pruning", ROPE_PRUNING_STYLES),
            ("rope_bsa", ROPE_BSA_STYLES),
            ("scoring_precision", SCORING_PRECISIONS),
            ("tp_mask", TP_MASK_MODES),
            ("head_reduction", HEAD_REDUCTIONS),
            ("remap_pruning", REMAP_PRUNING),
            ("prefill_representatives", PREFILL_REPRESENTATIVES),
        ):
            if name in values:
                if values[name] not in allowed:
                    raise InfiniteHiPConfigError(
                        f"`infinitehip.{name}`={values[name]!r} is not one of {', '.join(allowed)}"
                    )
                kwargs[name] = values[name]
        if "prefill_dense_threshold" in values:
            v = values["prefill_dense_threshold"]
            if v is not None and v != "auto":
                v = _int(v, "infinitehip.prefill_dense_threshold", minimum=0)
            kwargs["prefill_dense_threshold"] = v
        if values.get("trained_context") is not None:
            kwargs["trained_context"] = _int(
                values["trained_context"], "infinitehip.trained_context", minimum=1
            )
        if "prefill_tail_window" in values:
            v = values["prefill_tail_window"]
            if v is not None and v != "auto":
                v = _int(v, "infinitehip.prefill_tail_window", minimum=0)
            kwargs["prefill_tail_window"] = v
        for name in ("prefill_final_query_own_mask", "exact_last_stage",
                     "drop_window_candidates", "extend_reused_blocks"):
            if name in values:
                v = values[name]
                if not isinstance(v, bool):
                    raise InfiniteHiPConfigError(
                        f"`infinitehip.{name}`={v!r} must be true or false"
                    )
                kwargs[name] = v
        if "dense_layers" in values:
            kwargs["dense_layers"] = tuple(
                _int(v, f"infinitehip.dense_layers[{i}]", minimum=-(1 << 16))
                for i, v in enumerate(_list(values["dense_layers"], "infinitehip.dense_layers"))
            )
        kwargs["stages"] = tuple(
            _stage(s, i) for i, s in enumerate(_list(values["stages"], "infinitehip.stages"))
        )
        # stages given without decode_stages: decode prunes with them too, not the preset's
        if "stages" in raw and "decode_stages" not in raw:
            values["decode_stages"] = None
        decode = values.get("decode_stages")
        kwargs["decode_stages"] = decode if decode in (None, "auto") else tuple(
            _stage(s, i, "decode_stages")
            for i, s in enumerate(_list(decode, "infinitehip.decode_stages")))  # fmt: skip
        kwargs["refresh_intervals"] = tuple(
            _int(v, f"infinitehip.refresh_intervals[{i}]", minimum=1)
            for i, v in enumerate(
                _list(values["refresh_intervals"], "infinitehip.refresh_intervals")
            )
        )
        if "offload" in values:
            kwargs["offload"] = _offload(values["offload"])
        config = cls(**kwargs)
        config.validate()
        return config

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> InfiniteHiPConfig:
        """The validated config of a vLLM config, parsed once per distinct setting (every layer's
        impl and the builder ask for it)."""
        additional = getattr(vllm_config, "additional_config", None) or {}
        raw = additional.get(ADDITIONAL_CONFIG_KEY)
        try:
            key = json.dumps(raw, sort_keys=True)
        except TypeError:  # not plain JSON (e.g. an InfiniteHiPConfig): parse it directly
            config = cls.from_user(raw)
        else:
            config = _parsed(key)
        model = getattr(vllm_config, "model_config", None)
        if model is None:
            return config
        layers = getattr(getattr(model, "hf_text_config", None), "num_hidden_layers", None)
        if layers is not None:
            config = config.for_layers(int(layers))
        return config.for_model(*trained_and_extension(config, model))

    def for_layers(self, num_layers: int) -> InfiniteHiPConfig:
        """This config for a model of ``num_layers`` layers: negative ``dense_layers`` counted
        from the last (one reaching before the first raises, naming the field; a positive one
        past the last names no layer, as on any shorter model)."""
        resolved = []
        for i, layer in enumerate(self.dense_layers):
            at = layer + num_layers if layer < 0 else layer
            if at < 0:
                raise InfiniteHiPConfigError(
                    f"`infinitehip.dense_layers[{i}]`={layer} is outside the model's "
                    f"{num_layers} layers"
                )
            resolved.append(at)
        resolved_layers = tuple(dict.fromkeys(resolved))
        if resolved_layers == self.dense_layers:
            return self
        return dataclasses.replace(self, dense_layers=resolved_layers)

    def validate(self) -> None:
        """Cross-field consistency; raises :class:`InfiniteHiPConfigError` naming the field."""
        named = [("stages", self.stages)]
        if self.decode_stages == "auto":  # the 5K stages, or ``stages`` (:meth:`for_model`)
            named.append(("decode_stages", _5K_STAGES))
        elif self.decode_stages is not None:
            named.append(("decode_stages", self.decode_stages))
        for name, stages in named:
            _check_stages(stages, name, self.window_tokens, self.dense_layer_keep_tokens)
        # "auto" may decode with either list (for_model), so the intervals must fit both
        auto = self.decode_stages == "auto"
        for decode_name, decode in named if auto else named[-1:]:
            if len(self.refresh_intervals) != len(decode):
                what = " (the 5K stages of \"auto\")" if auto and decode_name != "stages" else ""
                raise InfiniteHiPConfigError(
                    f"`infinitehip.refresh_intervals` has {len(self.refresh_intervals)} entries "
                    f"but there are {len(decode)} `infinitehip.{decode_name}`{what}: give one "
                    "interval per decode stage"
                )
        for i in range(1, len(self.refresh_intervals)):
            if self.refresh_intervals[i] > self.refresh_intervals[i - 1]:
                raise InfiniteHiPConfigError(
                    f"`infinitehip.refresh_intervals[{i}]`={self.refresh_intervals[i]} must not "
                    f"exceed refresh_intervals[{i - 1}]={self.refresh_intervals[i - 1]}: a later "
                    f"stage refreshes at least as often as an earlier one"
                )
        first = self.stages[0].chunk_size
        if self.prefill_representatives == "landmark" and self.landmark_window < 1:
            raise InfiniteHiPConfigError(
                f"`infinitehip.prefill_representatives`=\"landmark\" needs "
                f"`infinitehip.stages[0].chunk_size`={first} to be less than half of "
                f"`infinitehip.window_tokens`={self.window_tokens}: a key's landmark score "
                "averages the queries between its chunk and the window"
            )
        if (self.prefill_representatives == "landmark" and self.offload.enabled
                and self.offload.layout == "host"):  # fmt: skip
            raise InfiniteHiPConfigError(
                "`infinitehip.prefill_representatives`=\"landmark\" does not combine with "
                "`infinitehip.offload.layout`=\"host\" yet (its prefill reads staged copies "
                "of the pages, not the pages its scores follow): use the \"split\" layout"
            )


def _check_stages(
    stages: tuple[StageConfig, ...], name: str, window_tokens: int, dense_layer_keep_tokens: int
) -> None:
    """One stage list's own rules (``stages`` or ``decode_stages``), naming the field."""
    if not stages:
        raise InfiniteHiPConfigError(f"`infinitehip.{name}` must hold at least one stage")
    for i, s in enumerate(stages):
        where = f"infinitehip.{name}[{i}]"
        if s.keep_tokens % s.chunk_size:
            raise InfiniteHiPConfigError(
                f"`{where}.keep_tokens`={s.keep_tokens} must be a multiple of "
                f"`{where}.chunk_size`={s.chunk_size}"
            )
        if s.block_size_q % s.query_stride:
            raise InfiniteHiPConfigError(
                f"`{where}.query_stride`={s.query_stride} must divide "
                f"`{where}.block_size_q`={s.block_size_q}"
            )
        if i > 0:
            prev = stages[i - 1]
            if prev.chunk_size % s.chunk_size:
                raise InfiniteHiPConfigError(
                    f"`{where}.chunk_size`={s.chunk_size} must divide "
                    f"`infinitehip.{name}[{i - 1}].chunk_size`={prev.chunk_size}"
                )
            if s.keep_tokens > prev.keep_tokens:
                raise InfiniteHiPConfigError(
                    f"`{where}.keep_tokens`={s.keep_tokens} must not exceed "
                    f"`infinitehip.{name}[{i - 1}].keep_tokens`={prev.keep_tokens}"
                )
            if prev.block_size_q % s.block_size_q:
                raise InfiniteHiPConfigError(
                    f"`{where}.block_size_q`={s.block_size_q} must divide "
                    f"`infinitehip.{name}[{i - 1}].block_size_q`={prev.block_size_q}: a "
                    f"stage's query blocks split into the next stage's"
                )
    if window_tokens < stages[0].chunk_size:
        raise InfiniteHiPConfigError(
            f"`infinitehip.window_tokens`={window_tokens} must be at least "
            f"`infinitehip.{name}[0].chunk_size`={stages[0].chunk_size}"
        )
    if dense_layer_keep_tokens % stages[-1].chunk_size:
        raise InfiniteHiPConfigError(
            f"`infinitehip.dense_layer_keep_tokens`={dense_layer_keep_tokens} must be a "
            f"multiple of the last stage's chunk_size={stages[-1].chunk_size} "
            f"(`infinitehip.{name}[{len(stages) - 1}]`)"
        )


def trained_and_extension(config: InfiniteHiPConfig, model_config: Any) -> tuple[int, bool]:
    """The model's trained length and whether RoPE extension is on for this served length."""
    trained = (
        config.trained_context
        or getattr(model_config.hf_text_config, "max_position_embeddings", None)
        or model_config.max_model_len
    )
    return trained, config.extends_rope(model_config.max_model_len, trained)


@functools.lru_cache(maxsize=64)
def _parsed(raw_json: str) -> InfiniteHiPConfig:
    return InfiniteHiPConfig.from_user(json.loads(raw_json))


def _int(value: Any, where: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InfiniteHiPConfigError(
            f"`{where}`={value!r} must be an integer, got {type(value).__name__}"
        )
    if value < minimum:
        raise InfiniteHiPConfigError(f"`{where}`={value} must be >= {minimum}")
    return value


def _check_fields(raw: dict, cls: type, where: str) -> None:
    names = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in names:
            raise InfiniteHiPConfigError(
                f"unknown field `{where}.{key}`; valid fields: {', '.join(sorted(names))}"
            )


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, (list, tuple)):
        raise InfiniteHiPConfigError(f"`{where}` must be a list, got {type(value).__name__}")
    return list(value)


def _stage(raw: Any, i: int, name: str = "stages") -> StageConfig:
    where = f"infinitehip.{name}[{i}]"
    if isinstance(raw, StageConfig):
        return raw
    if not isinstance(raw, dict):
        raise InfiniteHiPConfigError(f"`{where}` must be an object, got {type(raw).__name__}")
    _check_fields(raw, StageConfig, where)
    for required in ("chunk_size", "keep_tokens"):
        if required not in raw:
            raise InfiniteHiPConfigError(f"`{where}.{required}` is required")
    return StageConfig(**{k: _int(v, f"{where}.{k}", minimum=1) for k, v in raw.items()})


def _offload(raw: Any) -> OffloadConfig:
    where = "infinitehip.offload"
    if isinstance(raw, OffloadConfig):
        return raw
    if isinstance(raw, bool):
        return OffloadConfig(enabled=raw)
    if not isinstance(raw, dict):
        raise InfiniteHiPConfigError(
            f"`{where}` must be true, false or an object, got {type(raw).__name__}"
        )
    _check_fields(raw, OffloadConfig, where)
    enabled = raw.get("enabled", True)
    if not isinstance(enabled, bool):
        raise InfiniteHiPConfigError(f"`{where}.enabled`={enabled!r} must be true or false")
    layout = raw.get("layout", OffloadConfig.layout)
    if layout not in OFFLOAD_LAYOUTS:
        raise InfiniteHiPConfigError(
            f"`{where}.layout`={layout!r} must be one of {', '.join(map(repr, OFFLOAD_LAYOUTS))}"
        )
    sizes: dict[str, float | None] = {}
    for name in ("host_gib", "bank_gib", "gpu_gib"):
        v = raw.get(name)
        # the split layout's V bank is optional: 0 turns it off
        zero_ok = name == "bank_gib" and layout == "split"
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                              or v < 0 or (v == 0 and not zero_ok)):  # fmt: skip
            least = "a number of GiB, 0 or more" if zero_ok else "a positive number of GiB"
            raise InfiniteHiPConfigError(
                f"`{where}.{name}`={v!r} must be {least} (or null: automatic)"
            )
        sizes[name] = None if v is None else float(v)
    share = raw.get("key_row_share", OffloadConfig.key_row_share)
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share < 1:
        raise InfiniteHiPConfigError(
            f"`{where}.key_row_share`={share!r} must be a number between 0 and 1 (exclusive)"
        )
    if sizes["gpu_gib"] is not None and layout != "split":
        raise InfiniteHiPConfigError(
            f"`{where}.gpu_gib` sizes the \"split\" layout; with layout {layout!r} the GPU "
            f"holds a bank (`{where}.bank_gib`)"
        )
    return OffloadConfig(enabled=enabled, key_row_share=float(share), layout=layout, **sizes)


OFFLOAD_LAYOUTS = ("host", "split")
