"""The landmark state kernel (kernels/triton_landmark.py) against its PyTorch reference and the
one-call sums of kernels/reference.py.

Without a GPU the kernel runs in Triton's CPU interpreter (``TRITON_INTERPRET=1`` set while this
module imports and its tests run, then restored: tests/helpers/interpret.py); with one, compiled.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["_TRITON_INTERPRET_BEFORE"] = os.environ.get("TRITON_INTERPRET", "<unset>")
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
from triton.runtime.interpreter import InterpretedFunction
from vllm_infinitehip.kernels import reference as ref
from vllm_infinitehip.kernels import triton_landmark as tlm

from tests.helpers import interpret

_SAVED_INTERPRET = interpret.take_saved()
INTERPRETED = isinstance(tlm._landmark_kernel, InterpretedFunction)
DEVICE = "cpu" if INTERPRETED else "cuda"
pytestmark = interpret.module_marks(INTERPRETED, torch.cuda.is_available())


@pytest.fixture(autouse=True, scope="module")
def _interpreter_env():
    yield from interpret.scoped_env(INTERPRETED, _SAVED_INTERPRET)


PAGE = 16


def accumulate(q, cache, table_row, q_start, state, scale, **kw):
    """One request's chunk through the kernel: its tiles planned, one launch."""
    from vllm_infinitehip.kernels.query_blocks import LandmarkTiles

    window = kw.setdefault("window", ref.LANDMARK_WINDOW)
    tiles = LandmarkTiles.single(q.shape[0], q_start, window, q.device)
    tlm.landmark_accumulate_tiles(q, cache, table_row.view(1, -1), tiles, state, scale, **kw)


def paged_prompt(seed: int, t: int, hq: int, hkv: int, d: int, fp8: bool = False,
                 dtype: torch.dtype = torch.float32):
    """Queries and keys of one prompt, the keys in a paged cache on shuffled pages; ``dtype``
    the queries' and the cache's (an fp8 cache's: the queries')."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, hq, d, generator=g).to(dtype)
    k = torch.randn(t, hkv, d, generator=g).to(dtype)
    n_pages = -(-t // PAGE)
    pages = torch.randperm(n_pages + 3, generator=g)[:n_pages]
    cache = torch.zeros(n_pages + 3, 2, PAGE, hkv, d, dtype=dtype)
    for i, p in enumerate(pages.tolist()):
        rows = k[i * PAGE : (i + 1) * PAGE]
        cache[p, 0, : rows.shape[0]] = rows
    if fp8:
        # values exactly representable in e4m3 (the interpreter rounds others wrongly)
        k = (k * 4).round().clamp(-8, 8) / 4
        cache = torch.zeros_like(cache)
        for i, p in enumerate(pages.tolist()):
            rows = k[i * PAGE : (i + 1) * PAGE]
            cache[p, 0, : rows.shape[0]] = rows
        cache = cache.to(ref.FP8_DTYPE).view(torch.uint8)
    return q.to(DEVICE), k.to(DEVICE), cache.to(DEVICE), pages.to(torch.int32).to(DEVICE)


@pytest.mark.parametrize("per_group", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_chunks_added_by_the_kernel_equal_the_reference_and_one_call(per_group, fp8, dtype):
    """fp32 queries take the kernel's tf32x3 products, 16-bit ones (a model's, over a cache of
    their dtype or of fp8) one 16-bit pass (fp16 under the interpreter, whose bf16 products
    are wrong: bf16 takes the fp32 path there): each equals the fp32 reference."""
    t, hq, hkv, d, window = 150, 4, 2, 16, 24
    q, k, cache, table = paged_prompt(3, t, hq, hkv, d, fp8, dtype)
    h = hkv if per_group else hq
    state = torch.zeros(cache.shape[0], PAGE, h + 1, device=DEVICE)
    want = torch.zeros_like(state)
    scales = dict(k_scale=1.0, v_scale=1.0) if fp8 else {}
    for lo, hi in ((0, 40), (40, 41), (41, 150)):
        accumulate(q[lo:hi], cache, table, lo, state, 0.3, window=window, **scales)
        ref.landmark_accumulate_paged(q[lo:hi], cache, table, lo, want, 0.3, window=window,
                                       **scales)  # fmt: skip
    torch.testing.assert_close(state, want, rtol=1e-5, atol=1e-4)
    # the request's scores read back are the one-call scores of the whole prompt
    group = hq // h
    means = ref.landmark_means_paged(state, table, t, group)
    kf = ref.gather_paged_kv(cache, table.long(), t, **scales)[0]
    torch.testing.assert_close(
        means, ref.landmark_scores(q, kf, 0.3, window=window, per_group=per_group),
        rtol=1e-5, atol=1e-4)  # fmt: skip
    # slots no request owns stay zero
    used = set(table.tolist())
    for p in range(cache.shape[0]):
        if p not in used:
            assert not bool(state[p].any())


def test_one_launch_over_a_steps_chunks_equals_the_reference_chunk_by_chunk():
    """Two requests' chunks in one step, at rows 1 and 0 of the block table, their queries
    interleaved in the step's query tensor as vLLM lays a batch out: one launch over the
    planned tiles adds what the reference adds chunk by chunk."""
    from vllm_infinitehip.kernels.query_blocks import LandmarkTiles, RequestPart

    hq, hkv, d, window = 4, 2, 16, 24
    qa, _, cache_a, table_a = paged_prompt(5, 90, hq, hkv, d)
    qb, _, cache_b, table_b = paged_prompt(6, 70, hq, hkv, d)
    # one cache: b's pages after a's
    cache = torch.cat([cache_a, cache_b])
    table_b = table_b + cache_a.shape[0]
    width = max(table_a.numel(), table_b.numel())
    table = torch.zeros(2, width, dtype=torch.int32, device=DEVICE)
    table[0, : table_b.numel()], table[1, : table_a.numel()] = table_b, table_a
    # this step: a's queries 40..90 (its first 40 came earlier), then all of b's
    q = torch.cat([qa[40:], qb])
    chunks = (RequestPart(1, 0, 50, 40, 90), RequestPart(0, 50, 120, 0, 70))
    tiles = LandmarkTiles.plan(chunks, window, torch.device(DEVICE))
    state = torch.zeros(cache.shape[0], PAGE, hkv + 1, device=DEVICE)
    want = torch.zeros_like(state)
    tlm.landmark_accumulate_tiles(q, cache, table, tiles, state, 0.3, window=window)
    for p in chunks:
        ref.landmark_accumulate_paged(q[p.q_lo : p.q_hi], cache, table[p.row], p.first_pos,
                                      want, 0.3, window=window)  # fmt: skip
    assert bool(want.any())
    torch.testing.assert_close(state, want, rtol=1e-5, atol=1e-4)


def test_a_bad_state_is_refused():
    q, _, cache, table = paged_prompt(1, 20, 4, 2, 16)
    with pytest.raises(ValueError, match="landmark state"):
        accumulate(q, cache, table, 0, torch.zeros(cache.shape[0], PAGE, 4), 0.3)
