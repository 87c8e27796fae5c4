"""Rotary position embedding at arbitrary positions, for InfiniteHiP's RoPE handling (§2).

InfiniteHiP scores and attends with RoPE applied at positions it chooses, not the tokens' true
ones (shared/docs/INFINITEHIP.md §2). vLLM's models rotate K before it is cached and hand over q
already rotated, so this module does not re-implement the model's RoPE. It moves vectors that
are already rotated. RoPE is one plane rotation per frequency, so ``R(a) R(b) = R(a + b)``. A key
cached at true position ``t`` therefore reaches position ``t'`` with ``rotate(k, t' - t)``. The
same holds for llama3-scaled RoPE, which only changes the frequencies.

Attention scores depend only on the difference between query and key positions: if q sits at
``a`` and k at ``b``, the score depends on ``a - b``. So a score wanted at
(query ``q_new``, key ``k_new``) can also be reached by rotating only the key, by
``(p - t) - (q_new - k_new)``.

Precision is the reason this module exists. The deltas are as large as the context (millions of
tokens). In float32, ``delta * inv_freq`` has an ulp of about 0.06 rad at 1e6, so the angles
would be wrong before cos/sin is even taken. Here the angle is formed in float64: an int64 delta
is exact in float64 below 2**53. Only cos/sin are rounded to float32.

Pure PyTorch; vLLM is imported only inside :meth:`RopeTable.from_vllm`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

TWO_PI = 2.0 * math.pi

IntLike = int | torch.Tensor


@dataclass(frozen=True)
class RopeTable:
    """The frequencies of one model's RoPE and its pairing layout.

    ``inv_freq`` is ``[rotary_dim // 2]`` float64, holding the values the model uses. vLLM (and
    HF) compute them in float32, and upcasting keeps exactly those values, so "exact" in this
    module means exact with respect to the model's own frequencies. ``is_neox`` selects the
    pairing: NeoX pairs ``(i, i + rotary_dim/2)`` (half-split), GPT-J pairs ``(2i, 2i+1)``
    (interleaved). Dimensions past ``rotary_dim`` (partial rotary) are not rotated.
    """

    inv_freq: torch.Tensor
    is_neox: bool = True

    def __post_init__(self) -> None:
        if self.inv_freq.ndim != 1 or self.inv_freq.dtype != torch.float64:
            raise ValueError("inv_freq must be a 1-D float64 tensor")

    @property
    def rotary_dim(self) -> int:
        return 2 * self.inv_freq.shape[0]

    def to(self, device: torch.device | str) -> RopeTable:
        """The same table with ``inv_freq`` on ``device`` (so ``rotate`` does no copy per call)."""
        return RopeTable(self.inv_freq.to(device), self.is_neox)

    @classmethod
    def default(
        cls, head_size: int, rope_theta: float = 10000.0, is_neox: bool = True
    ) -> RopeTable:
        """Unscaled RoPE with base ``rope_theta`` over the whole head, without vLLM.

        The exponent is evaluated in float32, as vLLM's ``RotaryEmbedding._compute_inv_freq`` and
        HF do, so the frequencies are bit-identical to the model's, not merely close.
        """
        if head_size % 2:
            raise ValueError(f"head_size must be even, got {head_size}")
        exponent = torch.arange(0, head_size, 2, dtype=torch.float32) / head_size
        inv_freq = 1.0 / (rope_theta**exponent)
        return cls(inv_freq.to(torch.float64), is_neox)

    @classmethod
    def from_vllm(
        cls,
        head_size: int,
        rope_parameters_or_hf_config: Mapping[str, Any] | Any | None,
        max_position: int | None = None,
        *,
        is_neox_style: bool = True,
        dtype: torch.dtype | None = None,
    ) -> RopeTable:
        """The frequencies of the rotary embedding vLLM builds for a model.

        Calls ``get_rope(head_size, max_position=..., is_neox_style=...,
        rope_parameters=..., dtype=...)`` as vLLM's Llama and Qwen2 attention layers do, then
        ``_compute_inv_freq(base)``. That honours ``rope_theta``, ``partial_rotary_factor`` and
        llama3 scaling exactly as the model does. ``rope_parameters_or_hf_config`` is either the
        ``rope_parameters`` dict or an HF config carrying it. For a config, ``max_position``
        defaults to ``config.max_position_embeddings``, as in ``LlamaDecoderLayer``.

        With the model's own arguments (including ``dtype``, the model dtype, which is torch's
        default dtype while vLLM builds a model), get_rope returns the model's cached object and
        builds no second cos/sin cache.

        Raises ``NotImplementedError`` for rotary types whose effect is not a pure rotation by
        ``position * inv_freq``: YaRN and its mscale, linear, dynamic NTK, M-RoPE, dual-chunk
        and others. It also raises when the object's cos/sin cache disagrees with the recomputed
        frequencies, so a change in vLLM cannot go unnoticed.
        """
        # Deferred so that the kernels and their tests import without vLLM.
        from vllm.config import (
            VllmConfig,
            get_current_vllm_config_or_none,
            set_current_vllm_config,
        )
        from vllm.model_executor.layers import rotary_embedding as vllm_rope

        source = rope_parameters_or_hf_config
        if source is None or isinstance(source, Mapping):
            rope_parameters = dict(source) if source is not None else None
        else:  # an HF config, read the way vLLM's Llama does
            rope_parameters = getattr(source, "rope_parameters", None)
            if max_position is None:
                max_position = getattr(source, "max_position_embeddings", 8192)
        if max_position is None:
            raise ValueError("max_position is required when rope_parameters is given as a dict")

        def build() -> Any:
            return vllm_rope.get_rope(
                head_size,
                max_position=max_position,
                is_neox_style=is_neox_style,
                rope_parameters=rope_parameters,
                dtype=dtype,
            )

        if get_current_vllm_config_or_none() is not None:
            rope = build()
        else:
            # CustomOp needs a current config. Under a stand-in config the op would dispatch for
            # that config, so the entries it adds to get_rope's process-wide cache are dropped:
            # a model built later must not inherit them.
            cache: dict = getattr(vllm_rope, "_ROPE_DICT", {})
            before = set(cache)
            with set_current_vllm_config(VllmConfig()):
                rope = build()
            for key in set(cache) - before:
                del cache[key]

        plain = (vllm_rope.RotaryEmbedding, vllm_rope.Llama3RotaryEmbedding)
        if type(rope) not in plain:
            raise NotImplementedError(
                f"{type(rope).__name__} is not a pure rotation by position * inv_freq; "
                "InfiniteHiP's re-rotation supports default and llama3 RoPE only"
            )
        inv_freq = rope._compute_inv_freq(rope.base).to("cpu", torch.float64)
        table = cls(inv_freq, bool(rope.is_neox_style))
        _check_against_cache(table, rope.cos_sin_cache, max_position)
        return table


def _check_against_cache(table: RopeTable, cos_sin_cache: torch.Tensor, max_position: int) -> None:
    """Raise unless vLLM's cos/sin rows agree with ``table`` (to the cache's own rounding)."""
    n = min(max_position, 64)  # small positions: float32 angle error there is < 1e-5 rad
    theirs = cos_sin_cache[:n].to("cpu", torch.float64)
    cos, sin = rope_cos_sin(torch.arange(n), table, torch.float64)
    ours = torch.cat([cos, sin], dim=-1)
    if theirs.shape != ours.shape:
        raise NotImplementedError(
            f"vLLM's cos/sin cache has shape {tuple(theirs.shape)}, expected {tuple(ours.shape)}"
        )
    eps = torch.finfo(cos_sin_cache.dtype).eps if cos_sin_cache.is_floating_point() else 1.0
    tol = max(1e-4, 2.0 * eps)
    err = float((theirs - ours).abs().max())
    if err > tol:
        raise NotImplementedError(
            f"vLLM's cos/sin cache differs from cos/sin(pos * inv_freq) by {err:.3g} (> {tol:.3g})"
        )


# --------------------------------------------------------------------------- angles and rotation
def rope_angles(delta: IntLike, table: RopeTable) -> torch.Tensor:
    """``(delta * inv_freq) mod 2*pi`` in float64, shape ``delta.shape + [rotary_dim // 2]``.

    Guarantee: for integer ``|delta| < 2**53`` the result is within about
    ``|delta| * inv_freq * 2**-51`` rad of the exact value for the table's (float64)
    frequencies. That is below 1e-8 rad for ``|delta|`` up to 1e7. The result lies in
    ``[0, 2*pi)``.
    """
    if isinstance(delta, torch.Tensor) and delta.is_floating_point():
        raise TypeError("positions and deltas must be integer tensors")
    inv_freq = table.inv_freq
    d = torch.as_tensor(delta, dtype=torch.int64, device=inv_freq.device)
    angle = d.to(torch.float64).unsqueeze(-1) * inv_freq
    return torch.remainder(angle, TWO_PI)


def rope_cos_sin(
    delta: IntLike, table: RopeTable, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of :func:`rope_angles`, rounded once to ``dtype``."""
    angle = rope_angles(delta, table)
    return torch.cos(angle).to(dtype), torch.sin(angle).to(dtype)


def rotate(x: torch.Tensor, delta: IntLike, table: RopeTable) -> torch.Tensor:
    """``R(delta) x``: rotate each frequency pair of ``x`` by ``delta * inv_freq``.

    ``x`` is ``[..., N, H, D]`` (for example ``[N, H, D]``) in any floating dtype. Broadcasting
    of ``delta`` (integers; negative values rotate backwards):

    - ``delta.ndim <= x.ndim - 2``: one delta per token, shared by the heads; broadcast against
      ``x.shape[:-2]`` (a scalar, ``[N]``, ``[B, N]``...).
    - ``delta.ndim == x.ndim - 1``: one delta per token and head; broadcast against
      ``x.shape[:-1]`` (``[N, H]`` or ``[N, 1]`` for ``[N, H, D]``).

    Guarantees: the angles come from :func:`rope_angles`, so they are accurate to about 1e-7 rad
    (the float32 rounding of cos/sin) for any ``|delta|`` up to millions. The arithmetic is
    float32 (float64 for float64 ``x``), and the result is cast back to ``x.dtype``.
    ``rotate(x, 0)`` returns ``x`` exactly. Each pair's norm is kept to float32 rounding.
    ``rotate(rotate(x, a), b) == rotate(x, a + b)`` to float32 rounding. Dimensions past
    ``table.rotary_dim`` pass through unchanged.
    """
    rd = table.rotary_dim
    if x.shape[-1] < rd:
        raise ValueError(f"head size {x.shape[-1]} is smaller than rotary_dim {rd}")
    if x.ndim < 2:
        raise ValueError("x must be at least [H, D]")
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    d = torch.as_tensor(delta, device=x.device)
    if d.is_floating_point():
        raise TypeError("positions and deltas must be integer tensors")
    if d.ndim <= x.ndim - 2:
        d = d.unsqueeze(-1)  # the head axis
    elif d.ndim != x.ndim - 1:
        raise ValueError(
            f"delta of shape {tuple(d.shape)} does not fit x of shape {tuple(x.shape)}"
        )
    table = table if table.inv_freq.device == x.device else table.to(x.device)
    cos, sin = rope_cos_sin(d, table, compute)
    return apply_rotation(x, cos, sin, table)


def apply_rotation(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, table: RopeTable
) -> torch.Tensor:
    """Rotate ``x [..., D]`` by precomputed ``cos``/``sin`` (``[..., rotary_dim // 2]``,
    broadcastable), e.g. from :func:`rope_cos_sin` once for many rotations by the same deltas."""
    rd = table.rotary_dim
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(compute)
    xr = xf[..., :rd]
    if table.is_neox:
        x1, x2 = xr[..., : rd // 2], xr[..., rd // 2 :]
    else:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if table.is_neox:
        out = torch.cat([o1, o2], dim=-1)
    else:
        out = torch.stack([o1, o2], dim=-1).flatten(-2)
    if rd < x.shape[-1]:
        out = torch.cat([out, xf[..., rd:].expand(*out.shape[:-1], -1)], dim=-1)
    return out.to(x.dtype)


# --------------------------------------------------------------------------- position rules (§2)
class ChunkIndexedPositions(NamedTuple):
    key_pos: torch.Tensor  # [C]: position of every key of candidate chunk c
    query_pos: torch.Tensor  # like true_query_pos


def chunk_indexed_positions(
    num_candidates: int, true_query_pos: torch.Tensor, scan_window: int
) -> ChunkIndexedPositions:
    """Chunk-indexed RoPE for a pruning stage (§2, "Chunk-indexed RoPE").

    Rule: "Key: pos = c, the ordinal of the key's chunk in the current stage's sorted candidate
    list. All keys in a chunk share this position. Query: pos = min(p, C + sw'), where C is the
    stage's candidate-chunk count."

    ``num_candidates`` is ``C``, the width of the stage's candidate list (invalid entries
    included: ordinals index the list, not the survivors). ``scan_window`` is ``sw'``. The last
    candidate then sits ``sw' + 1`` before the query. Returns int64 ``key_pos = arange(C)``, and
    ``query_pos`` with the shape of ``true_query_pos``, on its device.
    """
    p = torch.as_tensor(true_query_pos, dtype=torch.int64)
    key_pos = torch.arange(num_candidates, dtype=torch.int64, device=p.device)
    return ChunkIndexedPositions(key_pos, torch.clamp(p, max=num_candidates + scan_window))


class RelativePositions(NamedTuple):
    query_pos: torch.Tensor
    left_probe_pos: torch.Tensor
    right_probe_pos: torch.Tensor


def relative_positions(
    scan_window: IntLike, device: torch.device | str | None = None
) -> RelativePositions:
    """Relative-style RoPE for a pruning stage (§2, "Relative-style RoPE").

    Rule: "Query: pos = sw' + 1. Left-branch probe key: pos = 0. Right-branch probe key:
    pos = 1." The query therefore sees every left probe at distance ``sw' + 1`` and every right
    probe at ``sw'``, whatever the chunk. Pass ``scan_window = n_stream`` instead of ``sw'`` to
    get the paper's distances (n_stream + 1, n_stream). Returns int64 tensors shaped like
    ``scan_window`` (0-dim for an int).
    """
    sw = torch.as_tensor(scan_window, dtype=torch.int64, device=device)
    return RelativePositions(sw + 1, torch.zeros_like(sw), torch.ones_like(sw))


def streaming_positions(
    sink_tokens: int,
    window_tokens: int,
    selected_token_count: IntLike,
    p_min: torch.Tensor,
    num_slots: int | None = None,
) -> torch.Tensor:
    """StreamingLLM-style RoPE for block-sparse attention (§2, "StreamingLLM-style RoPE in BSA").

    Rule: "Sink and selected keys are laid out contiguously, immediately left of the window.
    The j-th token in the sequence [sink tokens, then selected blocks in index order] gets
    pos = max(0, j + p_min - n_stream - n_sink - K_sel + 1), where K_sel = (#valid blocks)*b_k."
    The query keeps its true position ``p``, and window keys keep their true positions. They
    need no re-rotation.

    The last sink/selected token (``j = n_sink + K_sel - 1``) lands at ``p_min - n_stream``.
    That is just left of the earliest query's window ``(p_min - n_stream, p_min]``, as in
    :func:`reference.sparse_key_mask`. ``selected_token_count`` (``K_sel``) may be a tensor
    broadcastable with ``p_min`` (one per query block). The result is int64
    ``[*broadcast_shape, num_slots]``, and ``num_slots`` defaults to ``n_sink + max(K_sel)``.
    Slots at or past ``n_sink + K_sel`` of a row (invalid blocks, sorted last) still follow the
    formula. They hold no token, and the caller masks them.
    """
    p = torch.as_tensor(p_min, dtype=torch.int64)
    k_sel = torch.as_tensor(selected_token_count, dtype=torch.int64, device=p.device)
    if num_slots is None:
        num_slots = sink_tokens + (int(k_sel.max()) if k_sel.numel() else 0)
    j = torch.arange(num_slots, dtype=torch.int64, device=p.device)
    first = (p - window_tokens - sink_tokens - k_sel + 1).unsqueeze(-1)  # position of j = 0
    return torch.clamp(j + first, min=0)
