"""Keys and queries built so that one selection rule changes which chunks survive pruning.

Each case is a request's keys ``[T, H_kv, D]`` and one decode query ``[1, H_q, D]`` (scale 1)
with planted "needle" blocks of the last stage's size, and the parameters under which the rule
in question decides whether the needles survive:

- :func:`dominant_head`: query head 0 gives every chunk large noisy scores; head 1 reads the
  needles, whose scores are modest in absolute terms but stand far above head 1's own. The
  raw max over heads (the paper's rule) ranks by head 0's noise; a per-head z-score keeps the
  needles.
- :func:`sharp_keys`: each needle is one key of an 8-key block; bisection probes at most 6 of
  the 8 and can step past it, the exact block max cannot. Only the last stage prunes.
- :func:`recent_keys`: scores grow with position, so the chunk that straddles the window edge
  wins stage 1 and its sub-chunks inside the window win the later stages, unless candidates
  inside the window are dropped at every stage.

No code is shared with the kernels or the reference: the builders only make tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm_infinitehip.kernels import reference as ref

SINK, WINDOW = 16, 128


@dataclass
class Case:
    k: torch.Tensor  # [T, H_kv, D]
    q: torch.Tensor  # [1, H_q, D]
    needles: list[int]  # starts of the planted last-stage blocks
    params: ref.PruneParams  # with the paper's rules (max, bisection, stage-1 window rule only)


def cascade_params(stages: tuple[ref.StageParams, ...]) -> ref.PruneParams:
    return ref.PruneParams(sink_tokens=SINK, window_tokens=WINDOW, stages=stages)


def dominant_head(seed: int, t: int = 3000, n_needles: int = 2) -> Case:
    """Stages (64 -> 512 tokens, 16 -> 256, 8 -> 64). Each needle fills a whole stage-1 chunk
    (16 keys at offset 16 of a stage-0 chunk), where every stage's first midpoint probe lands,
    so bisection finds it in head 1 at every stage: only the head reduction decides."""
    gen = torch.Generator().manual_seed(seed)
    hq, hkv, d = 4, 2, 32
    k = 0.3 * torch.randn(t, hkv, d, generator=gen)
    k[:, 0, 0] = 4.0 * torch.randn(t, generator=gen)  # head 0: large, uninformative
    q = torch.zeros(1, hq, d)
    for h in range(hq):
        q[0, h, h] = 1.0  # head h reads dimension h of its KV head
    n_chunks = (t - WINDOW - SINK) // 64
    picks = torch.randperm(n_chunks - 2, generator=gen)[:n_needles] + 1
    needles = []
    for j in sorted(picks.tolist()):
        lo = SINK + j * 64 + 16
        k[lo : lo + 16, 0, 1] = 3.0  # ~10 sigma in head 1, below head 0's typical maxima
        needles += [lo, lo + 8]
    stages = (ref.StageParams(64, 512, 32, 4), ref.StageParams(16, 256, 32, 4),
              ref.StageParams(8, 64, 32, 1))  # fmt: skip
    return Case(k, q, needles, cascade_params(stages))


def sharp_keys(seed: int, t: int = 3000, n_needles: int = 6) -> Case:
    """Stages 0 and 1 keep every chunk; the last (8-key blocks, 64 tokens kept) decides. Each
    needle is one key at a random offset of its block, 8 sigma above the others."""
    gen = torch.Generator().manual_seed(seed)
    hq, hkv, d = 2, 1, 32
    k = torch.randn(t, hkv, d, generator=gen)
    q = torch.zeros(1, hq, d)
    q[0, 0, 0] = 1.0
    q[0, 1, 1] = 1.0
    n_blocks = (t - WINDOW - SINK) // 8
    picks = torch.randperm(n_blocks - 2, generator=gen)[:n_needles] + 1
    offsets = torch.randint(0, 8, (n_needles,), generator=gen)
    needles = []
    for j, off in zip(sorted(picks.tolist()), offsets.tolist()):
        lo = SINK + j * 8
        k[lo + off, 0, 0] = 8.0
        needles.append(lo)
    everything = 4096
    stages = (ref.StageParams(64, everything, 32, 4), ref.StageParams(16, everything, 32, 4),
              ref.StageParams(8, 8 * n_needles, 32, 1))  # fmt: skip
    return Case(k, q, needles, cascade_params(stages))


def recent_keys(seed: int, t: int = 3000) -> Case:
    """Scores rise with position (a recency-heavy head): without the window check at every
    stage, final blocks land inside the window. ``needles`` is empty: the measure is how many
    final blocks start inside it."""
    gen = torch.Generator().manual_seed(seed)
    hq, hkv, d = 2, 1, 32
    k = 0.1 * torch.randn(t, hkv, d, generator=gen)
    k[:, 0, 0] += torch.linspace(0.0, 6.0, t)
    q = torch.zeros(1, hq, d)
    q[0, :, 0] = 1.0
    stages = (ref.StageParams(64, 512, 32, 4), ref.StageParams(16, 256, 32, 4),
              ref.StageParams(8, 64, 32, 1))  # fmt: skip
    return Case(k, q, [], cascade_params(stages))


def with_rules(params: ref.PruneParams, **rules) -> ref.PruneParams:
    """``params`` with selection rules set (``head_reduction``, ``exact_last_stage``,
    ``drop_window_candidates``)."""
    import dataclasses

    return dataclasses.replace(params, **rules)


def kept_blocks(result: ref.PruneResult, row: int = 0) -> set[int]:
    return set(result.block_starts[row][result.block_valid[row]].tolist())
