"""The Triton block-sparse attention kernels against the PyTorch reference.

Without a GPU the kernels run under Triton's interpreter on CPU tensors. Triton decides between
compiling and interpreting when a kernel is *defined* (``@triton.jit`` reads TRITON_INTERPRET), so
the variable is set here, before ``triton_bsa`` (and with it triton) is imported. With a GPU the
same small cases run compiled on it, and the realistic-shape tests run too.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

_GPU = torch.cuda.is_available()
if not _GPU:
    os.environ["TRITON_INTERPRET"] = "1"

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from vllm_infinitehip.kernels import ops  # noqa: E402
from vllm_infinitehip.kernels import reference as ref  # noqa: E402
from vllm_infinitehip.kernels import triton_bsa as tb  # noqa: E402
from vllm_infinitehip.kernels import triton_prune as tp  # noqa: E402
from vllm_infinitehip.kernels.rope import RopeTable, rotate  # noqa: E402

_RUNNABLE = _GPU or isinstance(tb._prefill_kernel, InterpretedFunction)
pytestmark = [
    pytest.mark.skipif(
        not _RUNNABLE,
        reason="no GPU, and triton_bsa was imported before TRITON_INTERPRET=1 was set, so its "
        "kernels were compiled for a GPU; run this file on its own: "
        "pytest tests/test_triton_bsa.py",
    ),
    # The interpreter turns loop bounds into ints through a NumPy call that NumPy deprecates.
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
]
gpu = pytest.mark.skipif(not _GPU, reason="needs a CUDA GPU (realistic shapes, bf16, CUDA graphs)")

DEVICE = torch.device("cuda" if _GPU else "cpu")


# --------------------------------------------------------------------------- inputs
def paged_cache(
    seq_lens: list[int], page: int, hkv: int, d: int, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache with every request's pages scattered at random, and its ``[B, max_pages]`` table.

    Table entries past a request's last page are -1, so reading one would not go unnoticed.
    """
    n_pages = [math.ceil(s / page) for s in seq_lens]
    total = sum(n_pages) + 3  # a few pages that belong to nobody
    kv = torch.randn(total, 2, page, hkv, d, generator=gen).to(dtype)
    perm = torch.randperm(total, generator=gen)
    table = torch.full((len(seq_lens), max(n_pages) + 2), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(n_pages):
        table[b, :n] = perm[used : used + n].int()
        used += n
    return kv.to(DEVICE), table.to(DEVICE)


def random_starts(
    limit: int, k: int, n: int, bk: int, aligned: bool, gen: torch.Generator
) -> tuple[torch.Tensor, int]:
    """Up to ``n`` ascending block starts in ``[0, limit + bk)``, then garbage up to ``k`` entries.

    The range runs from inside the sink to past the causal limit, so the kernels must mask
    blocks overlapping the sink, the window and the future. ``aligned`` puts them on one grid
    (what the cascade produces); otherwise they may overlap each other or repeat.
    """
    if aligned:
        offset = int(torch.randint(0, bk, (1,), generator=gen))
        grid = torch.arange(offset, limit + bk, bk)
        pick = grid[torch.randperm(grid.numel(), generator=gen)[:n]]
    else:
        pick = torch.randint(0, limit + bk, (n,), generator=gen)
    pick = pick.sort().values
    garbage = torch.randint(-5, 1 << 20, (k - pick.numel(),), generator=gen)
    return torch.cat([pick, garbage]).int(), pick.numel()


def expected(
    q: torch.Tensor,
    kv: torch.Tensor,
    table_row: torch.Tensor,
    seq_len: int,
    starts: torch.Tensor,
    valid: torch.Tensor,
    *,
    bq: int,
    bk: int,
    sink: int,
    window: int,
    scale: float,
    cap: float = 0.0,
) -> torch.Tensor:
    """The reference output in fp32 for queries ``q`` at the last ``len(q)`` positions."""
    k, v = ref.gather_paged_kv(kv, table_row, seq_len)
    q, k, v = q.float(), k.float(), v.float()
    pos = torch.arange(seq_len - q.shape[0], seq_len, device=q.device)
    params = ref.PruneParams(sink, window, (ref.StageParams(bk, 0, bq, 1),))
    mask = ref.sparse_key_mask(params, seq_len, pos, starts.long(), valid)
    if cap == 0.0:
        return ref.masked_attention(q, k, v, mask, scale)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("qhd,thd->hqt", q, k) * scale
    s = (cap * torch.tanh(s / cap)).masked_fill(~mask, float("-inf"))
    return torch.einsum("hqt,thd->qhd", s.softmax(-1), v)


@pytest.fixture
def poisoned_workspace(monkeypatch):
    """Split scratch full of NaN: a partial the merge reads but no split wrote shows up."""
    real = tb._decode_workspace

    def nan_workspace(*args, **kwargs):
        return tuple(t.fill_(float("nan")) for t in real(*args, **kwargs))

    monkeypatch.setattr(tb, "_decode_workspace", nan_workspace)


# --------------------------------------------------------------------------- decode
def run_decode_case(
    hq, hkv, d, page, bk, sink, window, splits, aligned, seed, dtype=torch.float32, cap=0.0
):
    gen = torch.Generator().manual_seed(seed)
    # a long request, a short one inside sink + window, one with no selected block, a full one
    seq_lens = [int(torch.randint(100, 600, (1,), generator=gen)), 20, 333, 600]
    k_max = 16
    n_want = [10, 4, 0, k_max]
    kv, table = paged_cache(seq_lens, page, hkv, d, dtype, gen)
    rows = [random_starts(s, k_max, n, bk, aligned, gen) for s, n in zip(seq_lens, n_want)]
    starts = torch.stack([r[0] for r in rows]).to(DEVICE)
    n_valid = torch.tensor([r[1] for r in rows], dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(seq_lens), hq, d, generator=gen).to(dtype).to(DEVICE)
    scale = d**-0.5
    out = torch.full_like(q, float("nan"))
    got = tb.sparse_decode_attention(
        q, kv, table, torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), starts, n_valid,
        block_size_k=bk, sink_tokens=sink, window_tokens=window, scale=scale,
        num_splits=splits, logit_soft_cap=cap, out=out,
    )  # fmt: skip
    assert got is out and bool(torch.isfinite(out).all()), "every output element is written"
    for b, s in enumerate(seq_lens):
        valid = (torch.arange(k_max, device=DEVICE) < n_valid[b]).view(1, -1)
        want = expected(
            q[b : b + 1], kv, table[b], s, starts[b : b + 1], valid,
            bq=1, bk=bk, sink=sink, window=window, scale=scale, cap=cap,
        )  # fmt: skip
        yield out[b : b + 1].float(), want


DECODE_CASES = {
    # name: (hq, hkv, d, page, bk, sink, window, num_splits, aligned)
    "mha-default-splits": (4, 4, 32, 16, 8, 16, 64, None, True),
    "gqa4-overlapping-blocks": (8, 2, 64, 32, 4, 16, 64, 3, False),
    "gqa7-no-sink-one-split": (7, 1, 32, 32, 8, 0, 37, 1, True),
    "gqa7-no-window-many-empty-splits": (7, 1, 64, 16, 4, 20, 0, 16, False),
}


@pytest.mark.parametrize("name", DECODE_CASES)
def test_decode_matches_reference(name, poisoned_workspace):
    for got, want in run_decode_case(*DECODE_CASES[name], seed=len(name)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_decode_soft_cap_and_fp16(poisoned_workspace):
    for got, want in run_decode_case(8, 2, 32, 16, 8, 16, 64, 2, True, seed=5, cap=2.0):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for got, want in run_decode_case(
        4, 1, 32, 32, 4, 16, 48, None, False, seed=6, dtype=torch.float16
    ):
        torch.testing.assert_close(got, want, rtol=1e-2, atol=2e-3)


def test_decode_request_without_keys_is_zero():
    gen = torch.Generator().manual_seed(7)
    kv, table = paged_cache([40, 1], 16, 2, 32, torch.float32, gen)
    q = torch.randn(2, 4, 32, generator=gen).to(DEVICE)
    seq_lens = torch.tensor([40, 0], dtype=torch.int32, device=DEVICE)  # row 1: CUDA-graph padding
    starts = torch.zeros(2, 4, dtype=torch.int32, device=DEVICE)
    n_valid = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    out = tb.sparse_decode_attention(
        q, kv, table, seq_lens, starts, n_valid,
        block_size_k=8, sink_tokens=4, window_tokens=16, scale=0.2, num_splits=2,
    )  # fmt: skip
    assert bool((out[1] == 0).all()) and bool(torch.isfinite(out[0]).all())


# --------------------------------------------------------------------------- prefill
def prefill_selection(nq, bq, seq_len, k_max, bk, aligned, gen):
    """Random selected blocks per query block (the first block gets all ``k_max``), on DEVICE."""
    starts, valid = [], []
    for j in range(math.ceil(nq / bq)):
        block_end = min(seq_len, seq_len - nq + (j + 1) * bq)  # one past the block's last query
        n = int(torch.randint(0, k_max + 1, (1,), generator=gen)) if j else k_max
        row, n = random_starts(block_end, k_max, n, bk, aligned, gen)
        starts.append(row)
        valid.append(torch.arange(k_max) < n)
    return torch.stack(starts).to(DEVICE), torch.stack(valid).to(DEVICE)


def run_prefill_case(
    hq, hkv, d, page, bk, bq, nq, seq_len, sink, window, aligned, seed,
    dtype=torch.float32, cap=0.0,
):  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    k_max = 12
    kv, table = paged_cache([seq_len], page, hkv, d, dtype, gen)
    starts, valid = prefill_selection(nq, bq, seq_len, k_max, bk, aligned, gen)
    q = torch.randn(nq, hq, d, generator=gen).to(dtype).to(DEVICE)
    scale = d**-0.5
    out = torch.full_like(q, float("nan"))
    got = tb.sparse_prefill_attention(
        q, kv, table[0], seq_len, starts, valid, block_size_q=bq, block_size_k=bk,
        sink_tokens=sink, window_tokens=window, scale=scale, logit_soft_cap=cap, out=out,
    )  # fmt: skip
    assert got is out and bool(torch.isfinite(out).all()), "every output element is written"
    want = expected(
        q, kv, table[0], seq_len, starts, valid,
        bq=bq, bk=bk, sink=sink, window=window, scale=scale, cap=cap,
    )  # fmt: skip
    return out.float(), want


PREFILL_CASES = {
    # name: (hq, hkv, d, page, bk, bq, nq, seq_len, sink, window, aligned)
    "mha-chunked": (4, 4, 32, 16, 8, 16, 64, 300, 16, 64, True),
    "gqa7-whole-prompt-partial-block": (7, 1, 32, 32, 4, 32, 70, 70, 16, 48, False),
    "gqa4-no-sink-d64": (8, 2, 64, 16, 8, 16, 40, 600, 0, 64, False),
    "gqa4-no-window": (8, 2, 32, 32, 4, 32, 33, 200, 24, 0, True),
}


@pytest.mark.parametrize("name", PREFILL_CASES)
def test_prefill_matches_reference(name):
    got, want = run_prefill_case(*PREFILL_CASES[name], seed=len(name))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_prefill_soft_cap_and_fp16():
    got, want = run_prefill_case(8, 2, 32, 16, 8, 16, 48, 250, 16, 40, True, seed=8, cap=2.0)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    got, want = run_prefill_case(
        4, 1, 32, 32, 4, 16, 48, 250, 16, 40, False, seed=9, dtype=torch.float16
    )
    torch.testing.assert_close(got, want, rtol=1e-2, atol=2e-3)


def test_prefill_rejects_mismatched_blocks():
    q = torch.zeros(40, 4, 32, device=DEVICE)
    kv = torch.zeros(4, 2, 16, 4, 32, device=DEVICE)
    starts = torch.zeros(2, 4, dtype=torch.int32, device=DEVICE)  # 40 queries need 3 blocks
    with pytest.raises(ValueError, match="block_starts"):
        tb.sparse_prefill_attention(
            q, kv, torch.arange(4, device=DEVICE), 64, starts, starts > 0, block_size_q=16,
            block_size_k=8, sink_tokens=4, window_tokens=16, scale=0.1,
        )  # fmt: skip


# --------------------------------------------------------------------------- RoPE: streaming
def expected_streaming(
    q, kv, table_row, seq_len, starts, valid, *, bq, bk, sink, window, scale, rope
) -> torch.Tensor:
    """The reference's StreamingLLM-positioned attention (fp32) for the last ``len(q)`` positions."""
    k, v = ref.gather_paged_kv(kv, table_row, seq_len)
    pos = torch.arange(seq_len - q.shape[0], seq_len, device=q.device)
    params = ref.PruneParams(
        sink, window, (ref.StageParams(bk, 0, bq, 1),), rope=ref.RopePlan(rope, "none", "streaming")
    )
    prune = ref.PruneResult(starts.long(), valid, [])
    out, _, _ = ref.sparse_attention(
        params, q.float(), k.float(), v.float(), pos, scale, prune=prune
    )
    return out


NEOX64 = RopeTable.default(64, 10000.0)
NEOX128 = RopeTable.default(128, 500000.0)
GPTJ64 = RopeTable(NEOX64.inv_freq, is_neox=False)
PARTIAL64 = RopeTable.default(32, 10000.0)  # rotary_dim 32 of a 64-wide head

STREAMING_DECODE_CASES = {
    # name: (hq, hkv, d, page, bk, sink, window, num_splits, aligned, dtype, rope)
    "mha-d64-aligned": (4, 4, 64, 16, 8, 16, 64, None, True, torch.float32, NEOX64),
    "gqa4-d128-overlapping-blocks": (8, 2, 128, 32, 4, 16, 64, 3, False, torch.float32, NEOX128),
    "gqa4-d64-fp16": (8, 2, 64, 16, 8, 16, 48, 2, True, torch.float16, NEOX64),
    "gqa7-no-sink-gptj": (7, 1, 64, 32, 8, 0, 37, 1, False, torch.float32, GPTJ64),
    "gqa4-no-window-partial-rotary": (4, 1, 64, 16, 4, 20, 0, 5, False, torch.float32, PARTIAL64),
}


@pytest.mark.parametrize("name", STREAMING_DECODE_CASES)
def test_decode_streaming_matches_reference(name, poisoned_workspace):
    hq, hkv, d, page, bk, sink, window, splits, aligned, dtype, rope = STREAMING_DECODE_CASES[name]
    gen = torch.Generator().manual_seed(len(name) + 100)
    # a long request, one inside sink + window (its window covers the sink), one without
    # selected blocks, a full one
    seq_lens = [int(torch.randint(300, 900, (1,), generator=gen)), 20, 333, 900]
    k_max = 16
    kv, table = paged_cache(seq_lens, page, hkv, d, dtype, gen)
    rows = [random_starts(s, k_max, n, bk, aligned, gen) for s, n in zip(seq_lens, [10, 4, 0, 16])]
    starts = torch.stack([r[0] for r in rows]).to(DEVICE)
    n_valid = torch.tensor([r[1] for r in rows], dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(seq_lens), hq, d, generator=gen).to(dtype).to(DEVICE)
    scale = d**-0.5
    out = torch.full_like(q, float("nan"))
    tb.sparse_decode_attention(
        q, kv, table, torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), starts, n_valid,
        block_size_k=bk, sink_tokens=sink, window_tokens=window, scale=scale,
        num_splits=splits, out=out, rope=rope,
    )  # fmt: skip
    assert bool(torch.isfinite(out).all()), "every output element is written"
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-3)
    moved = 0.0
    for b, s in enumerate(seq_lens):
        valid = (torch.arange(k_max, device=DEVICE) < n_valid[b]).view(1, -1)
        kw = dict(bq=1, bk=bk, sink=sink, window=window, scale=scale)
        want = expected_streaming(q[b : b + 1], kv, table[b], s, starts[b : b + 1], valid,
                                  rope=rope, **kw)  # fmt: skip
        torch.testing.assert_close(out[b : b + 1].float(), want, **tol)
        plain = expected(q[b : b + 1], kv, table[b], s, starts[b : b + 1], valid, **kw)
        moved = max(moved, float((plain - want).abs().max()))
    assert moved > 1e-2, "the positions must matter in this case"


@pytest.mark.parametrize("rope", [None, NEOX64], ids=["true-positions", "streaming"])
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "overlapping"])
def test_decode_reads_reused_blocks_past_their_end(rope, aligned, poisoned_workspace):
    """``stale_steps``: each row reads its blocks ``min(stale, bk)`` tokens longer, as the
    reference's ``extend_blocks``; at true positions also against an independent mask that
    lists every read token as a one-token block."""
    hq, hkv, d, page, bk, sink, window = 8, 2, 64, 16, 8, 16, 48
    gen = torch.Generator().manual_seed(7 + aligned)
    seq_lens = [700, 20, 333, 900]
    stale = [3, 5, 0, 20]  # the last is capped at bk
    k_max = 16
    kv, table = paged_cache(seq_lens, page, hkv, d, torch.float32, gen)
    rows = [random_starts(s, k_max, n, bk, aligned, gen) for s, n in zip(seq_lens, [10, 4, 6, 16])]
    starts = torch.stack([r[0] for r in rows]).to(DEVICE)
    n_valid = torch.tensor([r[1] for r in rows], dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(seq_lens), hq, d, generator=gen).to(DEVICE)
    scale = d**-0.5
    out = torch.full_like(q, float("nan"))
    tb.sparse_decode_attention(
        q, kv, table, torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), starts, n_valid,
        block_size_k=bk, sink_tokens=sink, window_tokens=window, scale=scale, out=out,
        rope=rope, stale_steps=torch.tensor(stale, dtype=torch.int32, device=DEVICE),
    )  # fmt: skip
    assert bool(torch.isfinite(out).all()), "every output element is written"
    plan = None if rope is None else ref.RopePlan(rope, "none", "streaming")
    params = ref.PruneParams(sink, window, (ref.StageParams(bk, 0, 1, 1),), rope=plan)
    changed = 0.0
    for b, s in enumerate(seq_lens):
        k, v = ref.gather_paged_kv(kv, table[b], s)
        pos = torch.tensor([s - 1], device=DEVICE)
        n = int(n_valid[b])
        prune = ref.PruneResult(starts[b : b + 1, :n].long(), torch.ones(1, n, dtype=torch.bool,
                                device=DEVICE), [])  # fmt: skip
        extend = min(stale[b], bk)
        want, _, _ = ref.sparse_attention(params, q[b : b + 1], k, v, pos, scale, prune=prune,
                                          extend_blocks=extend)  # fmt: skip
        torch.testing.assert_close(out[b : b + 1], want, rtol=1e-4, atol=1e-4)
        as_read, _, _ = ref.sparse_attention(params, q[b : b + 1], k, v, pos, scale, prune=prune)
        changed = max(changed, float((as_read - want).abs().max()))
        if rope is None:  # every read token as its own block, deduplicated
            tokens = sorted({t for st in prune.block_starts[0].tolist()
                             for t in range(st, st + bk + extend)})  # fmt: skip
            one = ref.PruneParams(sink, window, (ref.StageParams(1, 0, 1, 1),))
            tok = torch.tensor(tokens, dtype=torch.long, device=DEVICE).view(1, -1)
            mask = ref.sparse_key_mask(one, s, pos, tok, torch.ones_like(tok, dtype=torch.bool))
            torch.testing.assert_close(want, ref.masked_attention(q[b : b + 1], k, v, mask, scale),
                                       rtol=1e-5, atol=1e-5)  # fmt: skip
    assert changed > 1e-3, "the extension must change what some row reads"


STREAMING_PREFILL_CASES = {
    # name: (hq, hkv, d, page, bk, bq, nq, seq_len, sink, window, aligned, dtype, rope)
    "mha-d64-chunked": (4, 4, 64, 16, 8, 16, 64, 700, 16, 64, True, torch.float32, NEOX64),
    "gqa4-d128-overlapping": (8, 2, 128, 32, 4, 16, 40, 1200, 16, 48, False, torch.float32,
                              NEOX128),
    "gqa4-whole-prompt-fp16": (8, 2, 64, 32, 8, 32, 70, 70, 16, 40, False, torch.float16, NEOX64),
    "gqa7-no-sink-gptj": (7, 1, 64, 16, 8, 16, 33, 500, 0, 64, True, torch.float32, GPTJ64),
    "gqa4-no-window-partial": (4, 1, 64, 16, 4, 16, 20, 400, 24, 0, False, torch.float32,
                               PARTIAL64),
}  # fmt: skip


@pytest.mark.parametrize("name", STREAMING_PREFILL_CASES)
def test_prefill_streaming_matches_reference(name):
    hq, hkv, d, page, bk, bq, nq, seq_len, sink, window, aligned, dtype, rope = (
        STREAMING_PREFILL_CASES[name]
    )
    gen = torch.Generator().manual_seed(len(name) + 200)
    k_max = 12
    kv, table = paged_cache([seq_len], page, hkv, d, dtype, gen)
    starts, valid = prefill_selection(nq, bq, seq_len, k_max, bk, aligned, gen)
    q = torch.randn(nq, hq, d, generator=gen).to(dtype).to(DEVICE)
    scale = d**-0.5
    out = torch.full_like(q, float("nan"))
    tb.sparse_prefill_attention(
        q, kv, table[0], seq_len, starts, valid, block_size_q=bq, block_size_k=bk,
        sink_tokens=sink, window_tokens=window, scale=scale, out=out, rope=rope,
    )  # fmt: skip
    assert bool(torch.isfinite(out).all()), "every output element is written"
    kw = dict(bq=bq, bk=bk, sink=sink, window=window, scale=scale)
    want = expected_streaming(q, kv, table[0], seq_len, starts, valid, rope=rope, **kw)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-3)
    torch.testing.assert_close(out.float(), want, **tol)
    plain = expected(q, kv, table[0], seq_len, starts, valid, **kw)
    assert float((plain - want).abs().max()) > 1e-2, "the positions must matter in this case"


def _rotated_request(seq_len, pos, hq, hkv, d, rope, gen):
    """One request's paged cache and queries ``[len(pos), hq, d]`` as vLLM caches and hands them
    over: rotated at their true positions."""
    kv, table = paged_cache([seq_len], 16, hkv, d, torch.float32, gen)
    k, v = ref.gather_paged_kv(kv, table[0], seq_len)
    t = torch.arange(seq_len, device=DEVICE)
    slots = table[0][t // 16].long() * 16 + t % 16
    ref.write_paged_kv(kv, rotate(k, t, rope), v, slots)
    q = rotate(torch.randn(pos.shape[0], hq, d, generator=gen), pos.cpu(), rope).to(DEVICE)
    return kv, table, q


@pytest.mark.slow  # long under the Triton interpreter
@pytest.mark.parametrize(
    "pruning,nq,after",
    [("relative", 40, 0), ("chunk-indexed", 1, 0), ("relative", 40, 24), (None, 40, 24)],
    ids=["relative-prefill", "chunk-indexed-one-query", "relative-body-slice",
         "no-rope-body-slice"],
)
def test_triton_ops_match_the_reference_through_backend_calls(pruning, nq, after, monkeypatch):
    """TritonOps gives the reference's masks and outputs, through the backend's own calls.

    ``after`` > 0 is a prefill chunk's body: the backend attends a chunk in slices, so ``after``
    queries of the same chunk (its tail) follow the slice, and their keys are in the cache
    already. They are the slice's future (a kernel that took the slice to end the sequence
    let every query see ``after`` future tokens).
    """
    seq_len, hq, hkv, d, scale = 800, 8, 2, 64, 0.125
    gen = torch.Generator().manual_seed(nq)
    rope = NEOX64
    pos = torch.arange(seq_len - after - nq, seq_len - after, device=DEVICE)
    kv, table, q = _rotated_request(seq_len, pos, hq, hkv, d, rope, gen)
    stages = (ref.StageParams(32, 256, 16, 4), ref.StageParams(8, 96, 16, 4),
              ref.StageParams(4, 48, 16, 1))  # fmt: skip
    plan = ref.RopePlan(rope, pruning, "streaming") if pruning else None
    params = ref.PruneParams(16, 64, stages, "midpoint", plan)
    req = ops.RequestKV(kv, table[0], seq_len)

    end = seq_len - after
    want_prune = ops.ReferenceOps().prune(params, req, q, pos, scale)
    want, _ = ops.ReferenceOps().attend(params, req, q, pos, scale, want_prune, end)

    def no_reference(*args, **kwargs):
        raise AssertionError("TritonOps fell back to the reference")

    for name in ("run_stages", "sparse_attention", "_streaming_attention"):
        monkeypatch.setattr(ref, name, no_reference)
    calls = []
    for mod, name in ((tp, "select_rep_scores_paged"), (tb, "sparse_decode_attention"),
                      (tb, "sparse_prefill_attention")):  # fmt: skip
        real = getattr(mod, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(mod, name, spy)

    got_prune = ops.TritonOps().prune(params, req, q, pos, scale)
    got, attended = ops.TritonOps().attend(params, req, q, pos, scale, got_prune, end)
    assert "select_rep_scores_paged" in calls
    assert "sparse_prefill_attention" in calls  # decode rows go through attend_decode
    gv = got_prune.block_valid.cpu()
    assert torch.equal(gv, want_prune.block_valid.cpu())
    assert torch.equal(got_prune.block_starts.cpu()[gv], want_prune.block_starts.cpu()[gv])
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-4, atol=1e-4)
    assert int(attended) > 0


@pytest.mark.slow  # long under the Triton interpreter
@pytest.mark.parametrize("pruning", ["relative", "chunk-indexed"])
def test_triton_ops_keep_blocks_inside_the_trained_length_at_true_positions(pruning):
    """48 queries at 752..799 in blocks of 16, trained length 776: the first block (last query
    767) is pruned and attended as without the remapping, the others as with it, in the
    reference and in the kernels alike."""
    import dataclasses

    seq_len, nq, hq, hkv, d, scale = 800, 48, 8, 2, 64, 0.125
    gen = torch.Generator().manual_seed(23)
    rope = NEOX64
    pos = torch.arange(seq_len - nq, seq_len, device=DEVICE)
    kv, table, q = _rotated_request(seq_len, pos, hq, hkv, d, rope, gen)
    stages = (ref.StageParams(32, 256, 16, 4), ref.StageParams(8, 96, 16, 4),
              ref.StageParams(4, 48, 16, 1))  # fmt: skip
    remapping = ref.RopePlan(rope, pruning, "streaming")
    plain_p = ref.PruneParams(16, 64, stages, "midpoint", None)
    remap_p = dataclasses.replace(plain_p, rope=remapping)
    params = dataclasses.replace(plain_p, rope=dataclasses.replace(remapping, trained_context=776))
    req = ops.RequestKV(kv, table[0], seq_len)
    reference, triton_ops = ops.ReferenceOps(), ops.TritonOps()

    def run(o, p, prune=None):
        prune = o.prune(p, req, q, pos, scale) if prune is None else prune
        return prune, o.attend(p, req, q, pos, scale, prune, seq_len)[0]

    want_prune, want = run(reference, params)
    plain_prune, _ = run(reference, plain_p)
    remap_prune, _ = run(reference, remap_p)
    for rows, path in ((slice(0, 1), plain_prune), (slice(1, 3), remap_prune)):
        assert torch.equal(want_prune.block_starts[rows], path.block_starts[rows])
    assert not torch.equal(plain_prune.block_starts[:1], remap_prune.block_starts[:1])
    _, plain = run(reference, plain_p, want_prune)
    _, remapped = run(reference, remap_p, want_prune)
    assert torch.equal(want[:16], plain[:16]) and torch.equal(want[16:], remapped[16:])

    got_prune, got = run(triton_ops, params)
    gv = got_prune.block_valid.cpu()
    assert torch.equal(gv, want_prune.block_valid.cpu())
    assert torch.equal(got_prune.block_starts.cpu()[gv], want_prune.block_starts.cpu()[gv])
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-4, atol=1e-4)
    # ...and the first block's rows are the kernels' own true-position result
    _, got_plain = run(triton_ops, plain_p, got_prune)
    torch.testing.assert_close(got[:16], got_plain[:16], rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- GPU, real shapes
# --------------------------------------------------------------------------- batched prefill
@pytest.mark.slow  # long under the Triton interpreter
@pytest.mark.parametrize(
    ("pruning", "first_block", "trained"),
    [(None, 32, 0), ("chunk-indexed", 32, 0), ("relative", 32, 0), ("relative", 32, 1000)],
    ids=["coarse-first-stage", "chunk-indexed-coarse-first-stage", "relative-all-remapped",
         "relative-some-below-the-trained-length"],
)  # fmt: skip
def test_prefill_chunks_batched_equal_each_chunk_alone(pruning, first_block, trained):
    """A step's sparse prefill chunks as the builder plans them, several requests and parts of
    different lengths in one cascade and one attention launch per kind of part
    (``TritonOps.prune_blocks`` / ``attend_blocks``), equal the reference run chunk by chunk
    (``ReferenceOps``, itself checked against the request-at-a-time calls): the same selected
    blocks for every query block, the same outputs, and rows of other requests left alone. The
    requests' lengths differ, so the batch's candidate lists are wider than a short request's
    (its own candidate count places chunk-indexed queries). Relative pruning reads keys turned
    back once per call; with a trained length of 1000, requests 0 and 1 prune at true
    positions and request 2 remapped, in two launches over the same blocks."""
    from vllm_infinitehip.kernels.query_blocks import QueryBlocks, RequestPart

    hq, hkv, d, scale = 8, 2, 64, 0.125
    seq_lens = [900, 610, 1300]
    gen = torch.Generator().manual_seed(7)
    kv, table = paged_cache(seq_lens, 16, hkv, d, torch.float32, gen)
    if pruning:  # vLLM caches keys rotated at their true positions
        for b, n in enumerate(seq_lens):
            k, v = ref.gather_paged_kv(kv, table[b], n)
            t = torch.arange(n, device=DEVICE)
            ref.write_paged_kv(kv, rotate(k, t, NEOX64), v, table[b][t // 16].long() * 16 + t % 16)
    stages = (ref.StageParams(32, 256, first_block, 4), ref.StageParams(8, 96, 16, 4),
              ref.StageParams(4, 48, 16, 1))  # fmt: skip
    plan = ref.RopePlan(NEOX64, pruning, "streaming", trained) if pruning else None
    params = ref.PruneParams(16, 64, stages, "midpoint", plan)
    # the step's queries: request 1's chunk is cut into a body and a one-query part, request 0
    # sits between two of request 2's parts, and 5 tokens at the front belong to nobody
    chunks = [(2, 5, 80), (0, 80, 180), (2, 180, 181), (1, 181, 301)]
    n_tokens = 301
    q = torch.randn(n_tokens, hq, d, generator=gen).to(DEVICE)
    parts = []
    for row, lo, hi in chunks:
        end = {2: 1300 if hi == 181 else 1299, 0: 900, 1: 610}[row]
        parts.append(RequestPart(row, lo, hi, end - (hi - lo), seq_lens[row]))
    blocks = QueryBlocks.plan(parts, first_block, DEVICE)
    assert blocks.part_blocks == (0, 3, 7, 8, 12)  # each part padded to blocks of 32
    fine = blocks.refine(16)
    assert fine.count.sum().item() == n_tokens - 5

    reference, triton_ops = ops.ReferenceOps(), ops.TritonOps()
    want_prune = reference.prune_blocks(params, blocks, q, kv, table, scale)
    got_prune = triton_ops.prune_blocks(params, blocks, q, kv, table, scale)
    assert got_prune.block_starts.shape[0] == fine.num_blocks
    # the reference's stacking is each request alone
    for lo, p in zip(fine.part_blocks, parts):
        req = ops.RequestKV(kv, table[p.row], p.seq_len)
        pos = torch.arange(p.first_pos, p.slice_end, device=DEVICE)
        alone = reference.prune(params, req, q[p.q_lo : p.q_hi], pos, scale)
        n = alone.block_starts.shape[0]
        w = alone.block_valid.shape[1]
        assert torch.equal(want_prune.block_valid[lo : lo + n, :w], alone.block_valid)
        assert not want_prune.block_valid[lo : lo + n, w:].any()
    width = max(got_prune.block_valid.shape[1], want_prune.block_valid.shape[1])

    def widen(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(t.cpu(), (0, width - t.shape[1]))

    gv, wv = widen(got_prune.block_valid), widen(want_prune.block_valid)
    assert torch.equal(gv, wv)
    assert torch.equal(widen(got_prune.block_starts)[gv], widen(want_prune.block_starts)[wv])
    assert gv.sum() > 0 and not gv[fine.count.cpu() == 0].any()  # padding blocks select nothing

    want = torch.full_like(q, 7.0)
    got = torch.full_like(q, 7.0)
    want_pairs = reference.attend_blocks(params, blocks, q, kv, table, scale, want_prune, want)
    got_pairs = triton_ops.attend_blocks(params, blocks, q, kv, table, scale, got_prune, got)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got[:5], torch.full_like(q[:5], 7.0))  # nobody's rows untouched
    assert 0 < int(want_pairs) <= int(got_pairs)  # the kernels count the budget, a bound


def test_dense_chunks_batched_equal_each_chunk_alone():
    """The dense chunks of a step (not one range of the step's queries) through
    ``dense_rows``: each equals the chunk alone. On a GPU with bf16 this is one varlen
    FlashAttention call; elsewhere the same plan runs chunk by chunk."""
    from vllm_infinitehip.kernels.query_blocks import DenseRows, RequestPart

    hq, hkv, d = 8, 2, 64
    seq_lens = [300, 90, 257]
    gen = torch.Generator().manual_seed(3)
    dtype = torch.bfloat16 if _GPU else torch.float32
    kv, table = paged_cache(seq_lens, 16, hkv, d, dtype, gen)
    q = torch.randn(200, hq, d, generator=gen).to(DEVICE, dtype)
    parts = [RequestPart(0, 10, 110, 200, 300), RequestPart(2, 120, 200, 177, 257),
             RequestPart(1, 110, 120, 80, 90)]  # fmt: skip
    rows = DenseRows.plan(parts, DEVICE)
    assert rows.token_index is not None and rows.max_q == 100 and rows.max_k == 300
    got = torch.full_like(q, 3.0)
    ops.TritonOps().dense_rows(rows, q, got, kv, table, d**-0.5)
    for p in parts:
        req = ops.RequestKV(kv, table[p.row], p.seq_len)
        pos = torch.arange(p.first_pos, p.slice_end, device=DEVICE)
        alone = ops.ReferenceOps().dense(req, q[p.q_lo : p.q_hi], pos, d**-0.5)
        tol = 2e-2 if _GPU else 1e-5
        torch.testing.assert_close(got[p.q_lo : p.q_hi].float(), alone.float(), rtol=tol, atol=tol)
    assert torch.equal(got[:10], torch.full_like(q[:10], 3.0))


def three_row_decode(gen: torch.Generator):
    """A paged cache of three requests (700, 300 and 90 tokens), their decode queries and
    selections, and row slots (the last row without one: dense)."""
    seq_lens = [700, 300, 90]
    kv, table = paged_cache(seq_lens, 16, 2, 64, torch.float32, gen)
    rows = [random_starts(s, 12, n, 8, True, gen) for s, n in zip(seq_lens, [9, 12, 3])]
    starts = torch.stack([r[0] for r in rows]).to(DEVICE)
    n_valid = torch.tensor([r[1] for r in rows], dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(seq_lens), 8, 64, generator=gen).to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([0, 1, -1], dtype=torch.int32, device=DEVICE)
    return kv, table, q, lens, starts, n_valid, slots


def bank_of(kv: torch.Tensor, n_resident: int, gen: torch.Generator):
    """A host-tier bank holding ``n_resident`` random pages of ``kv`` in shuffled slots (plus a
    spare), its residency table, and a copy of ``kv`` whose resident pages are NaN: a read
    that goes to the host for a resident page poisons the result."""
    n_pages = kv.shape[0]
    resident = torch.randperm(n_pages, generator=gen)[:n_resident]
    slots = torch.randperm(n_resident + 1, generator=gen)[:n_resident]
    pages = torch.zeros(n_resident + 1, *kv.shape[1:], dtype=kv.dtype, device=kv.device)
    table = torch.full((n_pages,), -1, dtype=torch.int32, device=kv.device)
    pages[slots.to(kv.device)] = kv[resident.to(kv.device)]
    table[resident.to(kv.device)] = slots.int().to(kv.device)
    host = kv.clone()
    host[resident.to(kv.device)] = float("nan")
    return (pages, table), host


@pytest.mark.parametrize("rope", [None, NEOX64], ids=["true-positions", "streaming"])
def test_decode_reads_resident_pages_from_the_bank(rope):
    """Through the bank, with the host's copies of resident pages poisoned, decode attention is
    bit-identical to reading the cache alone (a row without a slot attends densely too)."""
    gen = torch.Generator().manual_seed(11)
    kv, table, q, lens, starts, n_valid, slots = three_row_decode(gen)
    bank, host = bank_of(kv, kv.shape[0] // 2, gen)

    def decode(cache, bank=None):
        return tb.sparse_decode_attention(
            q, cache, table, lens, starts, n_valid, block_size_k=8, sink_tokens=16,
            window_tokens=64, scale=0.125, num_splits=3, rope=rope, row_slots=slots, bank=bank,
        )  # fmt: skip

    want = decode(kv)
    assert torch.isnan(decode(host)).any(), "the poisoned pages are read"
    assert torch.equal(decode(host, bank), want)


def test_decode_bank_must_match_the_cache_layout():
    gen = torch.Generator().manual_seed(12)
    kv, table = paged_cache([40], 16, 2, 32, torch.float32, gen)
    (pages, res), _ = bank_of(kv, 2, gen)
    args = (torch.randn(1, 4, 32, device=DEVICE), kv, table, torch.tensor([40], device=DEVICE),
            torch.zeros(1, 4, dtype=torch.int32, device=DEVICE),
            torch.zeros(1, dtype=torch.int32, device=DEVICE))  # fmt: skip
    kw = dict(block_size_k=8, sink_tokens=4, window_tokens=16, scale=0.2)
    with pytest.raises(ValueError, match="page layout"):
        tb.sparse_decode_attention(*args, **kw, bank=(pages.half(), res))
    with pytest.raises(ValueError, match="residency table"):
        tb.sparse_decode_attention(*args, **kw, bank=(pages, res.long()))


# --------------------------------------------------------------------------- split K / V
def split_of(kv: torch.Tensor, gen: torch.Generator, poison=float("nan")):
    """``kv`` as the host tier splits it: a K plane, and each block's V at a random home, a
    third on the GPU and the rest on the host, half of those with a bank copy on the GPU.
    Every GPU page that holds no V, and the host copy of every banked page, is ``poison``: a
    read that goes anywhere but where ``table`` points poisons the result. Returns the K plane,
    the split, and the split whose banked host pages are intact (what writes must keep)."""
    n = kv.shape[0]
    order = torch.randperm(n, generator=gen)
    on_dev, on_host = order[: n // 3], order[n // 3 :]
    banked = on_host[: on_host.numel() // 2]
    n_dev = on_dev.numel() + banked.numel() + 2  # two spare pages
    dev_slots = torch.randperm(n_dev, generator=gen)
    host_pages = torch.randperm(on_host.numel() + 1, generator=gen)
    home = torch.empty(n, dtype=torch.int32)
    home[on_dev] = dev_slots[: on_dev.numel()].int()
    home[on_host] = (-1 - host_pages[: on_host.numel()]).int()
    table = home.clone()
    table[banked] = dev_slots[on_dev.numel() : on_dev.numel() + banked.numel()].int()
    v = kv[:, 1].cpu()
    v_dev = torch.full((n_dev, *v.shape[1:]), poison, dtype=torch.float32).to(v.dtype)
    v_host = torch.full((on_host.numel() + 1, *v.shape[1:]), poison, dtype=torch.float32)
    v_host = v_host.to(v.dtype)
    v_dev[home[on_dev].long()] = v[on_dev]
    v_dev[table[banked].long()] = v[banked]
    v_host[(-1 - home[on_host]).long()] = v[on_host]
    intact = v_host.clone()
    v_host[(-1 - home[banked]).long()] = poison
    plane = kv[:, :1].clone()
    to = dict(device=kv.device)
    split = ref.SplitV(v_dev.to(**to), v_host.to(**to), table.to(**to), home.to(**to))
    return plane, split, ref.SplitV(split.v_dev.clone(), intact.to(**to), split.table, split.home)


@pytest.mark.parametrize("rope", [None, NEOX64], ids=["true-positions", "streaming"])
def test_decode_reads_split_v_where_its_table_places_it(rope, poisoned_workspace):
    """K from the plane, V from its GPU home, its bank copy or the host: bit-identical to the
    cache those bytes came from, with every other V page poisoned; the reference reads the same."""
    gen = torch.Generator().manual_seed(13)
    kv, table, q, lens, starts, n_valid, slots = three_row_decode(gen)
    plane, split, _ = split_of(kv, gen)

    def decode(cache, **kw):
        return tb.sparse_decode_attention(
            q, cache, table, lens, starts, n_valid, block_size_k=8, sink_tokens=16,
            window_tokens=64, scale=0.125, num_splits=3, rope=rope, row_slots=slots, **kw,
        )  # fmt: skip

    want = decode(kv)
    assert not torch.isnan(want).any()
    assert torch.equal(decode(plane, split=split), want)
    for b, n in enumerate(lens.tolist()):
        k, v = ref.gather_paged_kv(plane, table[b], n, split=split)
        assert torch.equal(torch.stack([k, v]), torch.stack(ref.gather_paged_kv(kv, table[b], n)))
    with pytest.raises(ValueError, match="page layout"):
        decode(plane, split=ref.SplitV(split.v_dev.half(), split.v_host, split.table, split.home))
    with pytest.raises(ValueError, match="kv_cache must be"):
        decode(kv, split=split)


def test_decode_reads_a_split_fp8_cache_as_the_dequantized_one(poisoned_workspace):
    gen = torch.Generator().manual_seed(14)
    seq_lens = [400, 120]
    kv, table = paged_cache(seq_lens, 16, 2, 64, torch.float32, gen)
    stored, deq = fp8_of(3 * kv, *FP8_SCALES)
    rows = [random_starts(s, 12, n, 8, True, gen) for s, n in zip(seq_lens, [9, 3])]
    starts = torch.stack([r[0] for r in rows]).to(DEVICE)
    n_valid = torch.tensor([r[1] for r in rows], dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(seq_lens), 8, 64, generator=gen).to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    k_scale, v_scale = layer_scales()
    # 0x7E (448) poisons: the interpreter decodes the e4m3fn NaN byte as 480
    plane, split, _ = split_of(stored, gen, poison=0x7E)
    args = (q, None, table, lens, starts, n_valid)
    kw = dict(block_size_k=8, sink_tokens=16, window_tokens=64, scale=0.125, num_splits=2)
    want = tb.sparse_decode_attention(*args[:1], deq, *args[2:], **kw)
    got = tb.sparse_decode_attention(*args[:1], plane, *args[2:], **kw, split=split,
                                     k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    assert torch.equal(got, want)


@pytest.mark.parametrize("rope", [None, NEOX64], ids=["true-positions", "streaming"])
@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
def test_prefill_reads_split_v_where_its_table_places_it(rope, fp8):
    """Sparse prefill over a split cache (every V page it must not read poisoned) is
    bit-identical to the whole cache, plain and streaming, fp32 and fp8."""
    gen = torch.Generator().manual_seed(17)
    seq_len, nq, bq, bk = 300, 70, 16, 8
    kv, table = paged_cache([seq_len], 16, 2, 64, torch.float32, gen)
    scales = {}
    if fp8:
        kv, _ = fp8_of(3 * kv, *FP8_SCALES)
        scales = dict(zip(("k_scale", "v_scale"), layer_scales()))
    plane, split, _ = split_of(kv, gen, poison=0x7E if fp8 else float("nan"))
    starts, valid = prefill_selection(nq, bq, seq_len, 12, bk, True, gen)
    q = torch.randn(nq, 8, 64, generator=gen).to(DEVICE)

    def prefill(cache, **kw):
        return tb.sparse_prefill_attention(
            q, cache, table[0], seq_len, starts, valid, block_size_q=bq, block_size_k=bk,
            sink_tokens=16, window_tokens=32, scale=0.125, rope=rope, **scales, **kw,
        )  # fmt: skip

    want = prefill(kv)
    assert torch.isfinite(want).all()
    assert torch.equal(prefill(plane, split=split), want)


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
def test_split_writes_equal_the_cache_written_whole(fp8):
    """New tokens written to a split cache (the Triton writer and the reference) read back
    as the same tokens written to the whole cache: K in the plane, V at its home, and the bank
    copy of a banked host page updated too. Padding slots write nothing."""
    gen = torch.Generator().manual_seed(15)
    kv, _ = paged_cache([300], 16, 2, 32, torch.float32, gen)
    scales = layer_scales() if fp8 else (None, None)
    if fp8:
        kv, _ = fp8_of(kv, *FP8_SCALES)
    plane, _, split = split_of(kv, gen, poison=0 if fp8 else 0.0)
    n_tok = 40
    slots = torch.randperm(kv.shape[0] * 16, generator=gen)[:n_tok].int()
    slots[::7] = -1
    slots = slots.to(DEVICE)
    # rows of a wider tensor, as vLLM's fused qkv hands them over
    qkv = torch.randn(n_tok, 3, 2, 32, generator=gen)
    if fp8 and not _GPU:
        # Triton's interpreter converts fp32 to e4m3 wrongly where rounding carries into the
        # exponent (1.98 -> 1.0); on values x / scale that e4m3 holds exactly the conversion
        # is exact, so the writer's routing and scaling are still checked bit for bit. Compiled,
        # random values check the GPU's rounding against torch's too.
        qkv = qkv.to(torch.float8_e4m3fn).float()
        qkv[:, 1] *= FP8_SCALES[0]
        qkv[:, 2] *= FP8_SCALES[1]
    qkv = qkv.to(DEVICE)
    key, value = qkv[:, 1], qkv[:, 2]
    whole = kv.clone()
    ref.write_paged_kv(whole, key, value, slots, k_scale=scales[0], v_scale=scales[1])
    blocks = torch.arange(kv.shape[0], device=DEVICE)
    for writer in ("reference", "triton"):
        p = plane.clone()
        s = ref.SplitV(split.v_dev.clone(), split.v_host.clone(), split.table, split.home)
        if writer == "triton":
            from vllm_infinitehip.kernels import triton_bank

            triton_bank.write_split_kv(p, s, key, value, slots, *scales)
        else:
            ref.write_paged_kv(p, key, value, slots, split=s, k_scale=scales[0],
                               v_scale=scales[1])  # fmt: skip
        assert torch.equal(p[:, 0], whole[:, 0]), writer
        assert torch.equal(ref.split_v_pages(s, blocks), whole[:, 1]), writer
        # the home of a banked page holds the write too (the bank copy is only a copy)
        home_only = ref.SplitV(s.v_dev, s.v_host, s.home, s.home)
        assert torch.equal(ref.split_v_pages(home_only, blocks), whole[:, 1]), writer


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
def test_split_pages_gather_into_whole_pages(fp8):
    """The prefill staging of a split cache: whole pages equal to the cache they came from,
    padding entries skipped (Triton and the reference)."""
    from vllm_infinitehip.kernels import triton_bank

    gen = torch.Generator().manual_seed(16)
    kv, _ = paged_cache([200], 16, 2, 32, torch.float32, gen)
    if fp8:
        kv, _ = fp8_of(kv, *FP8_SCALES)
    plane, split, _ = split_of(kv, gen, poison=0x7E if fp8 else float("nan"))
    pages = torch.randperm(kv.shape[0], generator=gen)[:9].int().to(DEVICE)
    slots = torch.tensor([4, -1, 0, 7, 2, -1, 1, 3, 5], dtype=torch.int32, device=DEVICE)
    for gather in (triton_bank.gather_split_pages, triton_bank.gather_split_pages_reference):
        dst = torch.zeros(8, *kv.shape[1:], dtype=kv.dtype, device=DEVICE)
        gather(plane, split, dst, pages, slots)
        take = slots >= 0
        assert torch.equal(dst[slots[take].long()], kv[pages[take].long()]), gather.__name__
        assert torch.equal(dst[6], torch.zeros_like(dst[6])), "no entry targets slot 6"


# --------------------------------------------------------------------------- fp8 KV cache
FP8_SCALES = (0.5, 2.0)  # (k_scale, v_scale): dequantization must apply each to its own plane


def fp8_of(kv: torch.Tensor, k_scale: float, v_scale: float):
    """vLLM's fp8 cache of ``kv`` (uint8 storage of e4m3 ``x / scale``, per plane) and what it
    dequantizes to, ``float32(e4m3) * scale``, computed here by hand as the oracle's input."""
    scales = torch.tensor([k_scale, v_scale], device=kv.device).view(1, 2, 1, 1, 1)
    e4m3 = (kv.float() / scales).to(torch.float8_e4m3fn)
    return e4m3.view(torch.uint8), e4m3.float() * scales


def layer_scales(device=DEVICE) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales as vLLM's layers hold them (``_k_scale``, ``_v_scale``: float32 device tensors)."""
    return tuple(torch.tensor([s], dtype=torch.float32, device=device) for s in FP8_SCALES)


@pytest.mark.parametrize("rope", [None, NEOX64], ids=["true-positions", "streaming"])
def test_decode_fp8_cache_equals_the_dequantized_cache(rope, poisoned_workspace):
    """Every K/V read is dequantized (sink, window, selected, rotated partners, dense rows):
    the output is bit-identical to the same kernel on the dequantized fp32 cache, and through
    a bank of fp8 pages (the host's copies poisoned) too."""
    gen = torch.Generator().manual_seed(31)
    seq_lens = [500, 90, 260]
    kv, table = paged_cache(seq_lens, 16, 2, 64, torch.float32, gen)
    stored, deq = fp8_of(3 * kv, *FP8_SCALES)
    rows = [random_starts(s, 12, n, 8, True, gen) for s, n in zip(seq_lens, [9, 3, 12])]
    starts = torch.stack([r[0] for r in rows]).to(DEVICE)
    n_valid = torch.tensor([r[1] for r in rows], dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(seq_lens), 8, 64, generator=gen).to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([0, -1, 1], dtype=torch.int32, device=DEVICE)  # row 1: dense

    def decode(cache, **kw):
        return tb.sparse_decode_attention(
            q, cache, table, lens, starts, n_valid, block_size_k=8, sink_tokens=16,
            window_tokens=64, scale=0.125, num_splits=3, rope=rope, row_slots=slots, **kw,
        )  # fmt: skip

    want = decode(deq)
    k_scale, v_scale = layer_scales()
    assert torch.equal(decode(stored, k_scale=k_scale, v_scale=v_scale), want)
    # python floats and the float8 view (not only vLLM's uint8 storage) read the same
    fp8 = stored.view(torch.float8_e4m3fn)
    assert torch.equal(decode(fp8, k_scale=FP8_SCALES[0], v_scale=FP8_SCALES[1]), want)
    # the scales ride along for a cache that is not fp8 and change nothing
    assert torch.equal(decode(deq, k_scale=k_scale, v_scale=v_scale), want)

    # The bank holds pages in the cache's dtype (uint8). The host's resident pages are poisoned
    # with 448 (0x7E), not NaN: the interpreter decodes the e4m3fn NaN byte 0x7F as 480.
    (pages, residency), _ = bank_of(fp8, stored.shape[0] // 2, gen)
    host, bank = stored.clone(), (pages.view(torch.uint8), residency)
    host[residency >= 0] = 0x7E
    assert not torch.allclose(decode(host, k_scale=k_scale, v_scale=v_scale), want)
    assert torch.equal(decode(host, k_scale=k_scale, v_scale=v_scale, bank=bank), want)


@pytest.mark.parametrize(
    "rope,dtype",
    [(None, torch.float32), (NEOX64, torch.float32), (None, torch.float16)],
    ids=["true-positions", "streaming", "fp16-queries"],
)
def test_prefill_fp8_cache_equals_the_dequantized_cache(rope, dtype):
    gen = torch.Generator().manual_seed(32)
    seq_len, nq, bq, bk = 400, 40, 16, 8
    kv, table = paged_cache([seq_len], 16, 2, 64, torch.float32, gen)
    stored, deq = fp8_of(3 * kv, *FP8_SCALES)
    starts, valid = prefill_selection(nq, bq, seq_len, 10, bk, True, gen)
    q = torch.randn(nq, 4, 64, generator=gen).to(dtype).to(DEVICE)

    def prefill(cache, **kw):
        return tb.sparse_prefill_attention(
            q, cache, table[0], seq_len, starts, valid, block_size_q=bq, block_size_k=bk,
            sink_tokens=16, window_tokens=48, scale=0.125, rope=rope, **kw,
        )  # fmt: skip

    want = prefill(deq)
    k_scale, v_scale = layer_scales()
    got = prefill(stored, k_scale=k_scale, v_scale=v_scale)
    if dtype == torch.float32:
        assert torch.equal(got, want)
    else:  # compiled, the two specialisations' fp16 products may round one ulp apart
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
    if rope is None:  # and the dequantized cache gives the reference's output
        ref_out = expected(q, deq, table[0], seq_len, starts, valid, bq=bq, bk=bk, sink=16,
                           window=48, scale=0.125)  # fmt: skip
        tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-3)
        torch.testing.assert_close(want.float(), ref_out, **tol)


@pytest.mark.slow  # long under the Triton interpreter
def test_ops_over_an_fp8_cache_match_the_reference_through_backend_calls():
    """The backend's calls with an fp8 cache written by the CPU writer and the layer's scales:
    TritonOps' prune, attend (a body slice) and decode equal ReferenceOps' (every read
    dequantized), and ReferenceOps equals itself on the dequantized fp32 cache."""
    from vllm_infinitehip.kernels import decode as dec

    seq_len, hq, hkv, d, scale, nq, after = 800, 8, 2, 64, 0.125, 40, 24
    gen = torch.Generator().manual_seed(34)
    plain, table = paged_cache([seq_len], 16, hkv, d, torch.float32, gen)
    k, v = ref.gather_paged_kv(plain, table[0], seq_len)
    t = torch.arange(seq_len, device=DEVICE)
    slots = table[0][t // 16].long() * 16 + t % 16
    k_scale, v_scale = layer_scales()
    stored = torch.zeros(plain.shape, dtype=torch.uint8, device=DEVICE)
    ref.write_paged_kv(stored, 3 * rotate(k, t, NEOX64), 3 * v, slots, k_scale=k_scale,
                       v_scale=v_scale)  # fmt: skip
    deq = stored.view(torch.float8_e4m3fn).float()
    deq[:, 0] *= FP8_SCALES[0]
    deq[:, 1] *= FP8_SCALES[1]
    pos = torch.arange(seq_len - after - nq, seq_len - after, device=DEVICE)
    q = rotate(torch.randn(nq, hq, d, generator=gen), pos.cpu(), NEOX64).to(DEVICE)
    stages = (ref.StageParams(32, 256, 16, 4), ref.StageParams(8, 96, 16, 4),
              ref.StageParams(4, 48, 16, 1))  # fmt: skip
    params = ref.PruneParams(16, 64, stages, "midpoint", ref.RopePlan(NEOX64, "relative"))
    req = ops.RequestKV(stored, table[0], seq_len, k_scale=k_scale, v_scale=v_scale)
    end = seq_len - after

    want_prune = ops.ReferenceOps().prune(params, req, q, pos, scale)
    want, _ = ops.ReferenceOps().attend(params, req, q, pos, scale, want_prune, end)
    plain_req = ops.RequestKV(deq, table[0], seq_len)
    assert torch.equal(ops.ReferenceOps().attend(params, plain_req, q, pos, scale, want_prune,
                                                 end)[0], want)  # fmt: skip
    dense = ops.TritonOps().dense(req, q, pos, scale)  # fp32 queries: the gather path
    assert torch.equal(dense, ops.ReferenceOps().dense(plain_req, q, pos, scale))
    got_prune = ops.TritonOps().prune(params, req, q, pos, scale)
    got, _ = ops.TritonOps().attend(params, req, q, pos, scale, got_prune, end)
    gv = got_prune.block_valid.cpu()
    assert torch.equal(gv, want_prune.block_valid.cpu())
    assert torch.equal(got_prune.block_starts.cpu()[gv], want_prune.block_starts.cpu()[gv])
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-4, atol=1e-4)

    # decode: one sparse row and one dense row, through the ops' keyword scales
    dparams = ref.PruneParams(16, 64, stages, "midpoint")
    i32 = dict(dtype=torch.int32, device=DEVICE)
    rows = dec.DecodeRows(table.expand(2, -1).contiguous(), torch.tensor([seq_len, 70], **i32),
                          torch.tensor([0, -1], **i32), torch.tensor([0, -1], **i32))  # fmt: skip
    qd = torch.randn(2, hq, d, generator=gen).to(DEVICE)
    outs = []
    for impl in (ops.ReferenceOps(), ops.TritonOps()):
        masks = dec.DecodeMasks.allocate(dparams, 48, 1, torch.device(DEVICE))
        widths = dec.stage_widths(dparams, seq_len)
        scratch = ops.DecodeScratch(dec.allocate_scores(widths, 2, torch.device(DEVICE)), None)
        sc = dict(k_scale=k_scale, v_scale=v_scale)
        impl.refresh_decode(dparams, masks, qd, stored, rows, scale, scratch, **sc)
        # the reference counts on the host (it is the CPU path)
        pairs_on = DEVICE if isinstance(impl, ops.TritonOps) else "cpu"
        out, pairs = torch.empty_like(qd), torch.zeros(2, dtype=torch.int64, device=pairs_on)
        impl.attend_decode(dparams, masks, qd, stored, rows, scale, out, pairs, scratch, **sc)
        outs.append((masks.final[0, : int(masks.counts[0, -1])].clone(), out))
    assert outs[0][0].numel() == 12 and torch.equal(outs[0][0], outs[1][0])
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-4, atol=1e-4)


def test_fp8_cache_without_scales_is_refused():
    gen = torch.Generator().manual_seed(33)
    kv, table = paged_cache([40], 16, 2, 32, torch.float32, gen)
    stored, _ = fp8_of(kv, *FP8_SCALES)
    q = torch.randn(1, 4, 32, device=DEVICE)
    zeros = torch.zeros(1, 4, dtype=torch.int32, device=DEVICE)
    kw = dict(block_size_k=8, sink_tokens=4, window_tokens=16, scale=0.2)
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        tb.sparse_decode_attention(q, stored, table, torch.tensor([40], device=DEVICE), zeros,
                                   zeros[:, 0], **kw, k_scale=0.5)  # fmt: skip
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        tb.sparse_prefill_attention(q, stored, table[0], 40, zeros, zeros > 0, block_size_q=16,
                                    **kw)  # fmt: skip


def realistic_inputs(seq_lens: list[int], seed: int):
    gen = torch.Generator().manual_seed(seed)
    hq, hkv, d = 32, 8, 128
    kv, table = paged_cache(seq_lens, 16, hkv, d, torch.bfloat16, gen)
    return gen, hq, kv, table


def grid_starts(pos_limit: int, k_max: int, n: int, sink: int, gen: torch.Generator):
    """Cascade-like starts: ``sink + j * 8`` below ``pos_limit``, ascending, invalid last."""
    grid = torch.arange(sink, max(pos_limit, sink + 1), 8)
    pick = grid[torch.randperm(grid.numel(), generator=gen)[:n]].sort().values
    pad = torch.zeros(k_max - pick.numel(), dtype=pick.dtype)
    return torch.cat([pick, pad]).int(), pick.numel()


@gpu
def test_gpu_realistic_decode_bf16_and_cuda_graph():
    sink, window, bk, k_max = 128, 1024, 8, 256
    seq_lens = [32768, 32000, 20000, 1500]
    gen, hq, kv, table = realistic_inputs(seq_lens, seed=11)
    d = kv.shape[-1]

    def make(lens, counts):
        rows = [grid_starts(s - window, k_max, n, sink, gen) for s, n in zip(lens, counts)]
        starts = torch.stack([r[0] for r in rows]).to(DEVICE)
        n_valid = torch.tensor([r[1] for r in rows], dtype=torch.int32, device=DEVICE)
        # sharper than N(0, 1) scores, so the output is not an average that hides errors
        q = (2 * torch.randn(len(lens), hq, d, generator=gen)).bfloat16().to(DEVICE)
        return q, torch.tensor(lens, dtype=torch.int32, device=DEVICE), starts, n_valid

    def check(out, q, lens, starts, n_valid):
        for b, s in enumerate(lens.tolist()):
            valid = (torch.arange(k_max, device=DEVICE) < n_valid[b]).view(1, -1)
            want = expected(
                q[b : b + 1], kv, table[b], s, starts[b : b + 1], valid,
                bq=1, bk=bk, sink=sink, window=window, scale=d**-0.5,
            )  # fmt: skip
            torch.testing.assert_close(out[b : b + 1].float(), want, rtol=2e-2, atol=1e-2)

    kw = dict(block_size_k=bk, sink_tokens=sink, window_tokens=window, scale=d**-0.5)
    q, lens, starts, n_valid = make(seq_lens, [256, 256, 100, 0])
    out = tb.sparse_decode_attention(q, kv, table, lens, starts, n_valid, **kw)  # compiles
    check(out, q, lens, starts, n_valid)

    # No host sync inside the call, and it replays from a CUDA graph with new inputs.
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out_g = tb.sparse_decode_attention(q, kv, table, lens, starts, n_valid, **kw)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # new lengths stay within each row's pages (its block table was built for seq_lens)
    q2, lens2, starts2, n_valid2 = make([30000, 5000, 20000, 1100], [200, 256, 256, 3])
    for dst, src in ((q, q2), (lens, lens2), (starts, starts2), (n_valid, n_valid2)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    check(out_g, q2, lens2, starts2, n_valid2)


@gpu
def test_gpu_realistic_prefill_bf16():
    sink, window, bk, bq, k_max = 128, 1024, 8, 64, 256
    seq_len, nq = 32768, 256
    gen, hq, kv, table = realistic_inputs([seq_len], seed=12)
    d = kv.shape[-1]
    rows = [
        grid_starts(seq_len - nq + j * bq - window, k_max, k_max - 7 * j, sink, gen)
        for j in range(nq // bq)
    ]
    starts = torch.stack([r[0] for r in rows]).to(DEVICE)
    valid = torch.stack([torch.arange(k_max) < r[1] for r in rows]).to(DEVICE)
    q = (2 * torch.randn(nq, hq, d, generator=gen)).bfloat16().to(DEVICE)
    out = tb.sparse_prefill_attention(
        q, kv, table[0], seq_len, starts, valid, block_size_q=bq, block_size_k=bk,
        sink_tokens=sink, window_tokens=window, scale=d**-0.5,
    )  # fmt: skip
    want = expected(
        q, kv, table[0], seq_len, starts, valid,
        bq=bq, bk=bk, sink=sink, window=window, scale=d**-0.5,
    )  # fmt: skip
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=1e-2)


@gpu
def test_gpu_realistic_decode_fp8_cache_in_a_cuda_graph():
    """Compiled e4m3 loads (``tl.float8e4nv``) at real shapes: an fp8 cache with the layer's
    scale tensors equals the dequantized bf16-query path, also replayed from a CUDA graph
    after the scales change (they are read on the device, not baked into the graph)."""
    sink, window, bk, k_max = 128, 1024, 8, 256
    seq_lens = [32768, 20000, 1500]
    gen, hq, kv, table = realistic_inputs(seq_lens, seed=13)
    d = kv.shape[-1]
    rows = [grid_starts(s - window, k_max, n, sink, gen) for s, n in zip(seq_lens, [256, 90, 0])]
    starts = torch.stack([r[0] for r in rows]).to(DEVICE)
    n_valid = torch.tensor([r[1] for r in rows], dtype=torch.int32, device=DEVICE)
    q = (2 * torch.randn(len(seq_lens), hq, d, generator=gen)).bfloat16().to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    kw = dict(block_size_k=bk, sink_tokens=sink, window_tokens=window, scale=d**-0.5)
    k_scale, v_scale = layer_scales()
    stored, deq = fp8_of(3 * kv.float(), *FP8_SCALES)
    want = tb.sparse_decode_attention(q, deq, table, lens, starts, n_valid, **kw)
    got = tb.sparse_decode_attention(q, stored, table, lens, starts, n_valid, **kw,
                                     k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    # The same dequantized values, but another specialisation: an H200 run had one element of
    # 12288 one bf16 ulp apart, so: within two ulps.
    one_ulp = dict(rtol=8e-3, atol=1e-5)
    torch.testing.assert_close(got.float(), want.float(), **one_ulp)

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out_g = tb.sparse_decode_attention(q, stored, table, lens, starts, n_valid, **kw,
                                               k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    finally:
        torch.cuda.set_sync_debug_mode("default")
    k_scale.fill_(1.0)
    v_scale.fill_(4.0)
    graph.replay()
    scales2 = torch.tensor([1.0, 4.0], device=DEVICE).view(1, 2, 1, 1, 1)
    deq2 = stored.view(torch.float8_e4m3fn).float() * scales2
    want2 = tb.sparse_decode_attention(q, deq2, table, lens, starts, n_valid, **kw)
    torch.cuda.synchronize()
    torch.testing.assert_close(out_g.float(), want2.float(), **one_ulp)


@gpu
def test_gpu_dense_prefill_over_an_fp8_cache():
    """TritonOps.dense over an fp8 cache: vLLM's FA3 fp8 path where vLLM's own backend has one
    (FA3 on Hopper; q quantized per call, so e4m3-close, not bit-close), else the gather path.
    The plain bf16 check keeps its own cache entry."""
    pytest.importorskip("vllm")
    from vllm.v1.attention.backends.fa_utils import get_flash_attn_version

    works = ops.flash_attention_works(DEVICE, kv_fp8=True)
    fa3_hopper = torch.cuda.get_device_capability() == (9, 0) and get_flash_attn_version() == 3
    print(f"\nfp8 FA: works={works} fa3_hopper={fa3_hopper} problem={ops._FLASH_PROBLEM}")
    if fa3_hopper:
        assert works, ops._FLASH_PROBLEM
    assert ops.flash_attention_works(DEVICE)  # the bf16 path is unaffected
    seq_len, nq = 6000, 512
    gen, hq, kv, table = realistic_inputs([seq_len], seed=14)
    d = kv.shape[-1]
    stored, deq = fp8_of(kv.float(), *FP8_SCALES)
    k_scale, v_scale = layer_scales()
    req = ops.RequestKV(stored, table[0], seq_len, k_scale=k_scale, v_scale=v_scale)
    pos = torch.arange(seq_len - nq, seq_len, device=DEVICE)
    q = (2 * torch.randn(nq, hq, d, generator=gen)).bfloat16().to(DEVICE)
    got = ops.TritonOps().dense(req, q, pos, d**-0.5)
    k, v = ref.gather_paged_kv(deq, table[0], seq_len)
    want = ref.dense_attention(q.float(), k, v, pos, d**-0.5)
    err = (got.float() - want).abs()
    # FA3 quantizes q (per call) and the softmax weights to e4m3: against the same q quantized
    # the error must shrink, or something other than q's rounding is off
    q_scale = q.abs().amax().float() / 448
    q8 = (q.float() / q_scale).to(torch.float8_e4m3fn).float() * q_scale
    err_q8 = (got.float() - ref.dense_attention(q8, k, v, pos, d**-0.5)).abs()
    print(f"fp8 dense: max err {float(err.max()):.4f} mean {float(err.mean()):.5f}; "
          f"against quantized q: max {float(err_q8.max()):.4f} mean {float(err_q8.mean()):.5f}")
    # and the error of flash_attention_works' own case, against its tolerance
    gen = torch.Generator().manual_seed(0)
    kv_c = torch.randn(9, 2, 16, 2, 64, generator=gen)
    st = torch.stack([ref.quantize_fp8(kv_c[:, 0], 0.5), ref.quantize_fp8(kv_c[:, 1], 2.0)], 1)
    rq = ops.RequestKV(st.view(torch.uint8).to(DEVICE), torch.tensor(
        [3, 7, 1, 5, 0, 8], dtype=torch.int32, device=DEVICE), 90, k_scale=0.5, v_scale=2.0)
    qc = torch.randn(20, 8, 64, generator=gen).to(DEVICE, torch.bfloat16)
    kc, vc = rq.contiguous()
    ec = (ops._flash_dense(rq, qc, 0.125).float()
          - ref.dense_attention(qc, kc, vc, torch.arange(70, 90, device=DEVICE), 0.125).float())
    print(f"flash_attention_works' case: max err {float(ec.abs().max()):.4f} mean "
          f"{float(ec.abs().mean()):.5f} (tolerance {ops._FP8_FLASH_TOL})")
    assert got.dtype == torch.bfloat16
    assert float(err.mean()) < 0.01 and float(err.max()) < 0.3
