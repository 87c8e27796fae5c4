"""The Triton SelectRep scorer and paged cascade against the PyTorch reference.

Without a GPU the kernels run in Triton's CPU interpreter; with one, the same small cases run
compiled on it, and one more case runs at realistic shapes.

``TRITON_INTERPRET=1`` is set only while this module imports and while its tests run
(tests/helpers/interpret.py says why).

Ties: SelectRep descends by comparing two probe scores, so scores that tie (or differ by less
than fp32 rounding, since the kernel sums the products in another order than torch) could send
the kernel and the reference down different halves. With standard-normal data that has
probability around 1e-7 per comparison; the seeds below are fixed, so the small cases are
deterministic on the interpreter.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # Before triton and the kernels are imported; the previous value is parked in the
    # environment (not a variable) so that nothing but environment edits precede the imports.
    os.environ["_TRITON_INTERPRET_BEFORE"] = os.environ.get("TRITON_INTERPRET", "<unset>")
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from vllm_infinitehip.kernels import reference as ref
from vllm_infinitehip.kernels import triton_prune as tp
from vllm_infinitehip.kernels import triton_rope as tr
from vllm_infinitehip.kernels import triton_topk
from vllm_infinitehip.kernels.rope import RopeTable, rope_cos_sin, rotate

from tests.helpers import interpret

HAS_CUDA = torch.cuda.is_available()
_SAVED_INTERPRET = interpret.take_saved()

INTERPRETED = isinstance(tp._select_rep_kernel, InterpretedFunction) and isinstance(
    tl.max, InterpretedFunction
)
DEVICE = "cpu" if INTERPRETED else "cuda"

pytestmark = interpret.module_marks(INTERPRETED, HAS_CUDA)


@pytest.fixture(autouse=True, scope="module")
def _interpreter_env():
    """Interpreted launches read TRITON_INTERPRET too; scope it to this module's tests."""
    yield from interpret.scoped_env(INTERPRETED, _SAVED_INTERPRET)


# --------------------------------------------------------------------------- fixtures
def paged_cache(
    k: torch.Tensor, page_size: int, gen: torch.Generator, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache holding ``k`` at randomly permuted pages; everything else (V, spare pages, the
    block table's tail, slots past the end) is NaN or points at NaN, so a stray read shows."""
    t, hkv, d = k.shape
    used = -(-t // page_size)
    num_pages = used + 5
    cache = torch.full((num_pages, 2, page_size, hkv, d), float("nan"), dtype=dtype)
    perm = torch.randperm(num_pages, generator=gen)
    block_table = torch.cat([perm[:used], perm[used:].repeat(3)]).to(torch.int32)
    padded = torch.full((used * page_size, hkv, d), float("nan"))
    padded[:t] = k
    cache[block_table[:used].long(), 0] = padded.view(used, page_size, hkv, d).to(dtype)
    return cache.to(DEVICE), block_table.to(DEVICE)


def to_cpu_gathered(cache: torch.Tensor, block_table: torch.Tensor, t: int) -> torch.Tensor:
    k, _ = ref.gather_paged_kv(cache, block_table, t)
    return k


def assert_scores_match(got: torch.Tensor, want: torch.Tensor) -> None:
    got, want = got.cpu(), want.cpu()
    assert not torch.isnan(got).any(), "unwritten (poisoned) or NaN scores"
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)), "-inf positions differ"
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin], want[fin], rtol=1e-4, atol=1e-6)


# --------------------------------------------------------------------------- SelectRep
# (seq_len, D, page_size, H_q, H_kv, chunk_size, probe, num queries, query stride, precision)
CASES = [
    (200, 32, 16, 4, 4, 8, "midpoint", 40, 4, "fp32"),
    (800, 64, 32, 8, 2, 8, "first", 17, 4, "fp32"),
    (531, 64, 16, 7, 1, 64, "midpoint", 20, 4, "fp32"),
    (397, 32, 32, 7, 1, 16, "first", 1, 4, "fp32"),
    (650, 32, 16, 8, 2, 16, "midpoint", 23, 1, "fp32"),
    (700, 64, 32, 4, 1, 64, "first", 16, 4, "fp32"),
    (333, 48, 16, 4, 2, 8, "midpoint", 9, 1, "fp32"),  # D not a power of two
    (257, 32, 16, 8, 2, 16, "first", 33, 4, "ieee"),
]


@pytest.mark.parametrize("t,d,page,hq,hkv,chunk,probe,nq,stride,precision", CASES)
def test_scores_equal_reference(t, d, page, hq, hkv, chunk, probe, nq, stride, precision):
    gen = torch.Generator().manual_seed(t * 31 + d + hq + chunk)
    k = torch.randn(t, hkv, d, generator=gen)
    cache, block_table = paged_cache(k, page, gen)
    q = torch.randn(nq, hq, d, generator=gen)
    qp = ref.pool_queries(q, 16, stride) * d**-0.5  # a partial block leaves NaN rows
    nb = qp.shape[0]

    sink = 5
    c = -(-(t - sink) // chunk)
    # Starts in random order per block (later stages see arbitrary subsets), some invalid.
    order = torch.stack([torch.randperm(c, generator=gen) for _ in range(nb)])
    starts = sink + order * chunk
    if t % 2:
        starts = starts.to(torch.int32)
    valid = (torch.rand(c, nb, generator=gen) > 0.2).t()  # non-contiguous on purpose
    # Per-block limits: the whole context, one that leaves a chunk a single key wide, one
    # that cuts a chunk partway, and one that leaves later chunks empty.
    limits = [t, sink + (c // 2) * chunk + 1, t - chunk // 2 - 1, sink + 2 * chunk + 3]
    key_limit = torch.tensor([limits[i % len(limits)] for i in range(nb)])

    poison = torch.full((nb, hq, c), float("nan"), device=DEVICE)
    got = tp.select_rep_scores_paged(
        qp.to(DEVICE),
        cache,
        block_table,
        starts.to(DEVICE),
        valid.to(DEVICE),
        key_limit.to(DEVICE),
        chunk_size=chunk,
        probe=probe,
        per_head_out=poison,
        precision=precision,
    )

    kk = to_cpu_gathered(cache.cpu(), block_table.cpu(), t)
    assert torch.equal(kk, k)
    cand = ref.Candidates(starts.long(), valid)
    assert_scores_match(got, ref.select_rep_scores(qp, kk, cand, chunk, key_limit, probe))
    # Each head's own path, not only the max over heads.
    g = hq // hkv
    for h in range(hq):
        kh = kk[:, h // g : h // g + 1]
        want_h = ref.select_rep_scores(qp[:, h : h + 1], kh, cand, chunk, key_limit, probe)
        assert_scores_match(poison[:, h], want_h)


def test_empty_inputs_launch_nothing():
    gen = torch.Generator().manual_seed(0)
    cache, block_table = paged_cache(torch.randn(40, 1, 32, generator=gen), 16, gen)
    qp = torch.randn(2, 1, 4, 32, device=DEVICE)
    none = torch.zeros(2, 0, dtype=torch.long, device=DEVICE)
    out = tp.select_rep_scores_paged(
        qp, cache, block_table, none, none.bool(), torch.full((2,), 40, device=DEVICE),
        chunk_size=8,
    )  # fmt: skip
    assert out.shape == (2, 0)


def test_request_without_queries():
    gen = torch.Generator().manual_seed(1)
    cache, block_table = paged_cache(torch.randn(100, 2, 32, generator=gen), 16, gen)
    res = tp.run_stages_paged(
        small_params("midpoint"), torch.zeros(0, 4, 32, device=DEVICE), cache, block_table,
        torch.zeros(0, dtype=torch.long, device=DEVICE), 0.1, seq_len=100,
    )  # fmt: skip
    assert res.block_starts.shape == (0, 12) and res.block_valid.shape == (0, 12)


def test_bad_arguments_name_the_input():
    cache = torch.zeros(4, 2, 16, 3, 32)
    qp = torch.zeros(1, 4, 4, 32)
    z = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="H_q=4 must be a multiple of H_kv=3"):
        tp.select_rep_scores_paged(qp, cache, z[0], z, z.bool(), z[:, 0], chunk_size=8)
    with pytest.raises(ValueError, match="probe='centre'"):
        tp.select_rep_scores_paged(
            qp, cache, z[0], z, z.bool(), z[:, 0], chunk_size=8, probe="centre"
        )
    with pytest.raises(ValueError, match="precision='fp8'"):
        tp.select_rep_scores_paged(
            qp, cache[:, :, :, :2], z[0], z, z.bool(), z[:, 0], chunk_size=8, precision="fp8"
        )


# --------------------------------------------------------------------------- the cascade
def small_params(probe: str) -> ref.PruneParams:
    # Budgets below the candidate counts at every stage, so each stage's scores decide.
    stages = (
        ref.StageParams(32, 256, 16, 4),
        ref.StageParams(8, 96, 16, 4),
        ref.StageParams(4, 48, 16, 1),
    )
    return ref.PruneParams(16, 64, stages, probe)


def assert_same_selection(got: ref.PruneResult, want: ref.PruneResult) -> None:
    def same(gs, gv, ws, wv):
        gs, gv = gs.cpu(), gv.cpu()
        assert torch.equal(gv, wv)
        assert torch.equal(gs[gv], ws[wv])  # starts under valid=False are unspecified

    same(got.block_starts, got.block_valid, want.block_starts, want.block_valid)
    assert len(got.stage_inputs) == len(want.stage_inputs)
    for g, w in zip(got.stage_inputs, want.stage_inputs):
        same(g.starts, g.valid, w.starts, w.valid)


def assert_same_resume(params, q, k, cache, block_table, pos, scale, want):
    """Resuming at stage 1 from the reference's cached input selects what the reference does."""
    resume_in = want.stage_inputs[1]
    want_r = ref.run_stages(params, q, k, pos, scale, 1, resume_in)
    dev_in = ref.Candidates(resume_in.starts.to(DEVICE), resume_in.valid.to(DEVICE))
    got_r = tp.run_stages_paged(params, q.to(DEVICE), cache, block_table, pos.to(DEVICE),
                                scale, 1, dev_in)  # fmt: skip
    assert_same_selection(got_r, want_r)


@pytest.mark.parametrize(
    "nq,probe,page", [(40, "midpoint", 16), (1, "first", 32)], ids=["prefill", "decode"]
)
def test_run_stages_paged_equals_reference(nq, probe, page):
    t, hq, hkv, d, scale = 700, 8, 2, 32, 0.18
    gen = torch.Generator().manual_seed(nq)
    k = torch.randn(t, hkv, d, generator=gen)
    cache, block_table = paged_cache(k, page, gen)
    q = torch.randn(nq, hq, d, generator=gen)
    pos = torch.arange(t - nq, t)
    params = small_params(probe)

    want = ref.run_stages(params, q, k, pos, scale)
    assert bool(want.block_valid.any()) and want.block_starts.shape[1] == 12
    got = tp.run_stages_paged(
        params, q.to(DEVICE), cache, block_table, pos.to(DEVICE), scale, seq_len=t
    )
    assert_same_selection(got, want)

    # Decode refresh: resume at stage 1 from the reference's cached stage input.
    assert_same_resume(params, q, k, cache, block_table, pos, scale, want)


@pytest.mark.parametrize("per_group", [False, True])
@pytest.mark.parametrize("pruning", [None, "relative", "chunk-indexed"])
def test_run_stages_paged_with_landmarks_equals_reference(per_group, pruning):
    """Landmark representatives from a prompt's state (every query of it added) select what the
    reference selects with the prompt's landmark scores, per query head or per KV head, at
    true positions and with each RoPE style; and not what bisection selects."""
    t, nq, scale = 700, 40, 0.18
    k, q, pos, rope, cache, block_table = rotated_case(23, pruning, t=t, nq=nq)
    gen = torch.Generator().manual_seed(5)
    q_all = torch.cat([torch.randn(t - nq, *q.shape[1:], generator=gen), q])
    h = k.shape[1] if per_group else q.shape[1]
    state = torch.zeros(cache.shape[0], cache.shape[2], h + 1, device=DEVICE)
    ref.landmark_accumulate_paged(q_all.to(DEVICE), cache, block_table, 0, state, scale,
                                  window=32)  # fmt: skip
    landmarks = ref.landmark_scores(q_all, k, scale, window=32, per_group=per_group)
    params = ref.PruneParams(16, 64, small_params("midpoint").stages, "midpoint", rope,
                             exact_last_stage=True)  # fmt: skip

    want = ref.run_stages(params, q, k, pos, scale, landmarks=landmarks)
    assert bool(want.block_valid.any())
    got = tp.run_stages_paged(params, q.to(DEVICE), cache, block_table, pos.to(DEVICE), scale,
                              seq_len=t, landmarks=state)  # fmt: skip
    assert_same_selection(got, want)
    bisection = ref.run_stages(params, q, k, pos, scale)
    assert not torch.equal(bisection.block_starts[bisection.block_valid],
                           want.block_starts[want.block_valid])  # fmt: skip


def rotated_case(seed: int, pruning: str | None, t: int = 700, nq: int = 40):
    """Random keys and the last ``nq`` queries of a ``t``-token request (4 query heads over 2 KV
    heads, D = 32, pages of 16), rotated at their true positions with the RoPE plan of style
    ``pruning`` (None: no rotation, no plan): ``k, q, pos, rope, cache, block_table``."""
    hq, hkv, d = 4, 2, 32
    gen = torch.Generator().manual_seed(seed)
    table = RopeTable.default(d, 10000.0)
    pos = torch.arange(t - nq, t)
    k = torch.randn(t, hkv, d, generator=gen)
    q = torch.randn(nq, hq, d, generator=gen)
    rope = None
    if pruning is not None:
        k, q = rotate(k, torch.arange(t), table), rotate(q, pos, table)
        rope = ref.RopePlan(table, pruning, "streaming")
    cache, block_table = paged_cache(k, 16, gen)
    return k, q, pos, rope, cache, block_table


@pytest.mark.parametrize("pruning", [None, "relative", "chunk-indexed"])
def test_run_stages_paged_with_a_coarse_first_stage_equals_reference(pruning):
    """Stage 0 over 32-query blocks, the later stages over 16 (neighbouring blocks share the
    first stage's work): the kernel cascade hands the survivors down as the reference does,
    with each RoPE style's per-block placement."""
    t, scale = 700, 0.18
    k, q, pos, rope, cache, block_table = rotated_case(17, pruning)
    fine = small_params("midpoint").stages
    stages = (ref.StageParams(32, 256, 32, 8), *fine[1:])
    params = ref.PruneParams(16, 64, stages, "midpoint", rope)

    want = ref.run_stages(params, q, k, pos, scale)
    assert want.stage_inputs[0].starts.shape[0] == 2 and want.block_starts.shape[0] == 3
    assert bool(want.block_valid.any())
    got = tp.run_stages_paged(
        params, q.to(DEVICE), cache, block_table, pos.to(DEVICE), scale, seq_len=t
    )
    assert_same_selection(got, want)


def test_run_stages_paged_static_bound_keeps_selection():
    # Sizing stage 1 by an allocated maximum instead of the live length only adds invalid
    # chunks (as long as the keep count is unchanged), so the valid selection is the same.
    t, hq, hkv, d, scale, nq = 450, 4, 2, 32, 0.2, 3
    gen = torch.Generator().manual_seed(7)
    k = torch.randn(t, hkv, d, generator=gen)
    cache, block_table = paged_cache(k, 16, gen)
    q = torch.randn(nq, hq, d, generator=gen)
    pos = torch.arange(t - nq, t)
    params = small_params("midpoint")
    want = ref.run_stages(params, q, k, pos, scale)
    got = tp.run_stages_paged(
        params, q.to(DEVICE), cache, block_table, pos.to(DEVICE), scale, seq_len=t + 300
    )
    assert got.stage_inputs[0].starts.shape[1] > want.stage_inputs[0].starts.shape[1]
    gv = got.block_valid.cpu()
    assert torch.equal(gv, want.block_valid)
    assert torch.equal(got.block_starts.cpu()[gv], want.block_starts[want.block_valid])


# --------------------------------------------------------------------------- RoPE: delta tables
_delta_cos_sin_kernel = None


def _delta_cos_sin_kernel_src(
    delta_ptr,
    cos_ptr,
    sin_ptr,
    n,
    hi_ptr,
    lo_ptr,
    bias,
    n_hi,
    HALF: tl.constexpr,
    LO_BITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_f = tl.arange(0, BLOCK_F)
    n_ok = offs_n < n
    f_ok = offs_f < HALF
    delta = tl.load(delta_ptr + offs_n, mask=n_ok, other=0)
    cos, sin = tr.delta_cos_sin(delta, n_ok, offs_f, f_ok, hi_ptr, lo_ptr, bias, n_hi, HALF, LO_BITS)
    out = offs_n[:, None] * HALF + offs_f[None, :]
    tl.store(cos_ptr + out, cos, mask=n_ok[:, None] & f_ok[None, :])
    tl.store(sin_ptr + out, sin, mask=n_ok[:, None] & f_ok[None, :])


def delta_cos_sin_triton(
    delta: torch.Tensor, tables: tr.DeltaTables
) -> tuple[torch.Tensor, torch.Tensor]:
    """``triton_rope.delta_cos_sin`` run on its own: cos, sin ``[N, rotary_dim // 2]`` for
    ``delta [N]``. The kernels call the same ``@triton.jit`` helper inline; this launch checks
    its precision alone."""
    delta = delta.reshape(-1).contiguous()
    n, half = delta.shape[0], tables.half
    cos = torch.empty(n, half, dtype=torch.float32, device=delta.device)
    sin = torch.empty_like(cos)
    if n == 0:
        return cos, sin
    block_n = 16
    # Decorated at first use, inside a test: triton.jit reads TRITON_INTERPRET when it decorates,
    # and this module sets it only while its tests run.
    global _delta_cos_sin_kernel
    if _delta_cos_sin_kernel is None:
        _delta_cos_sin_kernel = triton.jit(_delta_cos_sin_kernel_src)
    _delta_cos_sin_kernel[(triton.cdiv(n, block_n),)](
        delta, cos, sin, n, tables.hi, tables.lo, tables.bias, tables.n_hi,
        HALF=half, LO_BITS=tr.LO_BITS, BLOCK_N=block_n, BLOCK_F=triton.next_power_of_2(half),
    )  # fmt: skip
    return cos, sin


LLAMA_TABLE = RopeTable.default(128, rope_theta=500000.0)


def test_delta_tables_match_float64_truth_at_millions():
    # Every split edge (lo = 0 and S - 1, hi changing sign), the tables' own bound, and
    # random deltas up to several million either way.
    s = 1 << tr.LO_BITS
    bound = 6_000_000
    edges = [0, 1, -1, s - 1, s, s + 1, -s + 1, -s, -s - 1, 2_000_000, -2_000_003]
    gen = torch.Generator().manual_seed(3)
    delta = torch.cat([
        torch.tensor(edges), torch.randint(-bound, bound + 1, (200,), generator=gen),
    ])  # fmt: skip
    for table in (LLAMA_TABLE, RopeTable.default(64, 10000.0)):
        tables = tr.delta_tables(table, bound, "cpu")
        assert tables.max_abs_delta >= bound
        delta = torch.cat([delta, torch.tensor([tables.max_abs_delta, -tables.max_abs_delta])])
        cos64, sin64 = rope_cos_sin(delta, table, torch.float64)
        got_ref = tr.delta_cos_sin_reference(delta, tables)
        got_tri = delta_cos_sin_triton(delta.to(DEVICE), tr.delta_tables(table, bound, DEVICE))
        for cos, sin in (got_ref, got_tri):
            assert float((cos.cpu().double() - cos64).abs().max()) < 1e-6
            assert float((sin.cpu().double() - sin64).abs().max()) < 1e-6
        # delta 0 is an exact identity (window keys pass through the rotation unchanged)
        assert bool((got_tri[0][0] == 1).all()) and bool((got_tri[1][0] == 0).all())
    # What the tables avoid: float32 angles are off by far more at these deltas.
    big = torch.tensor([4_000_000])
    naive = torch.cos(big.float().unsqueeze(-1) * LLAMA_TABLE.inv_freq.float()).double()
    assert float((naive - rope_cos_sin(big, LLAMA_TABLE, torch.float64)[0]).abs().max()) > 1e-2


def test_delta_tables_are_cached_and_grow():
    table = RopeTable.default(32, 10000.0)
    small = tr.delta_tables(table, 5000, "cpu")
    assert tr.delta_tables(table, 3000, "cpu") is small  # a smaller bound reuses them
    # equal frequencies share tables (vLLM builds one RopeTable per layer)
    assert tr.delta_tables(RopeTable.default(32, 10000.0), 5000, "cpu") is small
    big = tr.delta_tables(table, 100_000, "cpu")
    assert big is not small and big.max_abs_delta >= 100_000
    assert tr.delta_tables(table, 5000, "cpu") is big
    # out-of-bound deltas are clamped into the table, never read out of bounds
    cos, _ = tr.delta_cos_sin_reference(torch.tensor([10**9, -(10**9)]), small)
    assert bool(torch.isfinite(cos).all())


# --------------------------------------------------------------------------- RoPE: SelectRep
GPTJ_TABLE = RopeTable(RopeTable.default(64, 10000.0).inv_freq, is_neox=False)
PARTIAL_TABLE = RopeTable.default(32, 10000.0)  # rotary_dim 32 of a 64-wide head

# (style, seq_len, D, page, H_q, H_kv, chunk, probe, num queries, stride, cache dtype, table)
ROPE_CASES = {
    "relative-gqa4-d128": ("relative", 900, 128, 16, 8, 2, 16, "midpoint", 20, 4,
                           torch.float32, LLAMA_TABLE),
    "relative-mha-d64-fp16-first": ("relative", 600, 64, 32, 4, 4, 8, "first", 1, 4,
                                    torch.float16, RopeTable.default(64)),
    "chunk-indexed-gqa4-d64": ("chunk-indexed", 1000, 64, 32, 8, 2, 32, "midpoint", 33, 4,
                               torch.float32, RopeTable.default(64)),
    "chunk-indexed-mha-d128-fp16": ("chunk-indexed", 700, 128, 16, 2, 2, 8, "first", 1, 1,
                                    torch.float16, LLAMA_TABLE),
    "relative-gptj-bf16": ("relative", 500, 64, 16, 4, 1, 16, "midpoint", 16, 4,
                           torch.bfloat16, GPTJ_TABLE),
    "chunk-indexed-partial-rotary": ("chunk-indexed", 500, 64, 16, 4, 1, 16, "first", 16, 4,
                                     torch.float32, PARTIAL_TABLE),
    "relative-partial-rotary": ("relative", 400, 64, 16, 4, 2, 16, "midpoint", 16, 4,
                                torch.float32, PARTIAL_TABLE),
}  # fmt: skip


@pytest.mark.parametrize("name", ROPE_CASES)
def test_scores_with_key_rotation_equal_reference(name):
    style, t, d, page, hq, hkv, chunk, probe, nq, stride, dtype, table = ROPE_CASES[name]
    gen = torch.Generator().manual_seed(len(name) * 7 + t)
    # what vLLM caches: keys rotated at their true positions
    k = rotate(torch.randn(t, hkv, d, generator=gen), torch.arange(t), table)
    cache, block_table = paged_cache(k, page, gen, dtype)
    qp = ref.pool_queries(torch.randn(nq, hq, d, generator=gen), 16, stride) * d**-0.5
    nb = qp.shape[0]
    sink = 4
    c = -(-(t - sink) // chunk)
    order = torch.stack([torch.randperm(c, generator=gen) for _ in range(nb)])
    starts = sink + order * chunk
    valid = torch.rand(nb, c, generator=gen) > 0.2
    limits = [t, t - chunk // 2 - 1, sink + (c // 2) * chunk + 1]
    key_limit = torch.tensor([limits[i % len(limits)] for i in range(nb)])
    # the reference scores keys un-rotated to position 0 (from the cache's own rounding)
    k0 = rotate(to_cpu_gathered(cache.cpu(), block_table.cpu(), t).float(), -torch.arange(t), table)
    cand = ref.Candidates(starts, valid)
    sw = 60
    if style == "relative":
        q_left, q_right = rotate(qp, sw + 1, table), rotate(qp, sw, table)
        base = torch.zeros(nb, c, dtype=torch.long)
        want = ref.select_rep_scores(q_left, k0, cand, chunk, key_limit, probe,
                                     q_pooled_right=q_right)  # fmt: skip
    else:
        q_left, q_right = qp, None
        q_pos = torch.clamp(key_limit - 1, max=c + sw)
        base = torch.arange(c).view(1, -1) - q_pos.view(-1, 1)
        want = ref.select_rep_scores(qp, k0, cand, chunk, key_limit, probe,
                                     chunk_rotation=(base, table))  # fmt: skip

    poison = torch.full((nb, hq, c), float("nan"), device=DEVICE)
    got = tp.select_rep_scores_paged(
        q_left.to(DEVICE), cache, block_table, starts.to(DEVICE), valid.to(DEVICE),
        key_limit.to(DEVICE), chunk_size=chunk, probe=probe, per_head_out=poison,
        q_pooled_right=None if q_right is None else q_right.to(DEVICE),
        key_rotation=(base.to(DEVICE), table),
    )  # fmt: skip
    assert not torch.isnan(poison).any()
    got, want = got.cpu(), want.cpu()
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)), "-inf positions differ"
    fin = torch.isfinite(want)
    # Angles from the split tables differ from the reference's by ~1e-7 rad: scores agree to
    # float32 rounding of sums of D products, not bit for bit.
    torch.testing.assert_close(got[fin], want[fin], rtol=1e-4, atol=1e-4)
    # The rotation matters: scoring the cached keys as they are gives other scores.
    plain = tp.select_rep_scores_paged(
        q_left.to(DEVICE), cache, block_table, starts.to(DEVICE), valid.to(DEVICE),
        key_limit.to(DEVICE), chunk_size=chunk, probe=probe,
    ).cpu()  # fmt: skip
    assert (plain[fin] - want[fin]).abs().max() > 1e-2
    if style == "relative":
        # Over the keys at position 0 with the left queries alone, the right probes turned by
        # the probes' gap (1) in the kernel: the same scores as the two query sets
        cache0, block_table0 = paged_cache(k0, page, gen)
        turned = tp.select_rep_scores_paged(
            q_left.to(DEVICE), cache0, block_table0, starts.to(DEVICE), valid.to(DEVICE),
            key_limit.to(DEVICE), chunk_size=chunk, probe=probe, right_turn=(1, table),
        ).cpu()  # fmt: skip
        assert torch.equal(torch.isneginf(turned), torch.isneginf(want))
        torch.testing.assert_close(turned[fin], want[fin], rtol=1e-4, atol=1e-4)
        unturned = tp.select_rep_scores_paged(
            q_left.to(DEVICE), cache0, block_table0, starts.to(DEVICE), valid.to(DEVICE),
            key_limit.to(DEVICE), chunk_size=chunk, probe=probe,
        ).cpu()  # fmt: skip
        assert not torch.equal(unturned, turned)  # the turn decides some probes


def test_key_rotation_rejects_bad_layouts():
    cache = torch.zeros(4, 2, 16, 1, 32)
    qp = torch.zeros(1, 1, 4, 32)
    z = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="rotary_dim 64 exceeds the head size 32"):
        tp.select_rep_scores_paged(qp, cache, z[0], z, z.bool(), z[:, 0] + 1, chunk_size=8,
                                   key_rotation=(z, RopeTable.default(64)))  # fmt: skip
    with pytest.raises(ValueError, match="q_pooled_right"):
        tp.select_rep_scores_paged(qp, cache, z[0], z, z.bool(), z[:, 0] + 1, chunk_size=8,
                                   q_pooled_right=qp[:, :, :2])  # fmt: skip
    with pytest.raises(ValueError, match="right_turn takes the place"):
        tp.select_rep_scores_paged(qp, cache, z[0], z, z.bool(), z[:, 0] + 1, chunk_size=8,
                                   q_pooled_right=qp,
                                   right_turn=(1, RopeTable.default(32)))  # fmt: skip
    with pytest.raises(ValueError, match="right_turn delta -1"):
        tp.select_rep_scores_paged(qp, cache, z[0], z, z.bool(), z[:, 0] + 1, chunk_size=8,
                                   right_turn=(-1, RopeTable.default(32)))  # fmt: skip


# --------------------------------------------------------------------------- RoPE: the cascade
def rope_params(pruning: str, probe: str, table: RopeTable) -> ref.PruneParams:
    p = small_params(probe)
    return ref.PruneParams(p.sink_tokens, p.window_tokens, p.stages, probe,
                           ref.RopePlan(table, pruning, "streaming"))  # fmt: skip


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
def test_unrotated_key_pages_hold_the_keys_at_position_zero(fp8):
    """Each part's row, read through the returned table, is the un-rotated key the cache was
    written from (fp8: its dequantized value turned back, in bf16); rows no part reads are
    not copied. With ``ordinal_chunks`` a key turns to its first-stage chunk's ordinal."""
    from vllm_infinitehip.kernels.query_blocks import QueryBlocks, RequestPart

    t, hkv, d, page = 300, 2, 64, 16
    table = RopeTable.default(d, 10000.0)
    gen = torch.Generator().manual_seed(3)
    k0 = torch.randn(t, hkv, d, generator=gen)
    cache, row = paged_cache(rotate(k0, torch.arange(t), table), page, gen)
    block_table = torch.stack([row, row.flip(0)])  # row 1: another request, not in the parts
    k_scale = 0.05
    if fp8:
        cache, dequantized = fp8_of(cache, k_scale, 1.0)
    parts = [RequestPart(0, 0, 20, 250, 270), RequestPart(0, 20, 50, 270, t)]
    blocks = QueryBlocks.plan(parts, 16, DEVICE)
    # fp8 with the tensor-core precision: a bf16 copy (an fp32 one for the exact precisions)
    precision = "tf32" if fp8 else "fp32"
    pages, turned_table = tp.unrotated_key_pages(cache, block_table, blocks, table, k_scale,
                                                 precision=precision)  # fmt: skip
    assert pages.shape == (-(-t // page), 1, page, hkv, d)
    assert pages.dtype == (torch.bfloat16 if fp8 else torch.float32)
    assert torch.equal(turned_table[1].cpu(), torch.zeros_like(turned_table[1].cpu()))
    got = pages[turned_table[0].long()].view(-1, hkv, d)[:t].float().cpu()
    want = k0
    if fp8:  # what the cache holds, turned back
        want = rotate(to_cpu_gathered(dequantized, row, t).cpu(), -torch.arange(t), table)
    torch.testing.assert_close(got, want, rtol=1e-2 if fp8 else 1e-5, atol=1e-2 if fp8 else 1e-5)
    if not fp8:  # a bf16 cache under an exact precision: turned in fp32 and kept in fp32
        half = cache.to(torch.bfloat16)
        pages, turned_table = tp.unrotated_key_pages(half, block_table, blocks, table)
        assert pages.dtype == torch.float32
        got = pages[turned_table[0].long()].view(-1, hkv, d)[:t].cpu()
        want = rotate(to_cpu_gathered(half.float(), row, t).cpu(), -torch.arange(t), table)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    if not fp8:  # chunk-indexed first stage: sink 16, chunks of 32
        pages, turned_table = tp.unrotated_key_pages(cache, block_table, blocks, table,
                                                     ordinal_chunks=(16, 32))  # fmt: skip
        got = pages[turned_table[0].long()].view(-1, hkv, d)[:t].cpu()
        ordinal = (torch.arange(t) - 16).clamp(min=0) // 32
        torch.testing.assert_close(got, rotate(k0, ordinal, table), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("is_neox", "rotary_dim", "hkv", "dtype", "ordinal"),
    [(True, 64, 2, torch.float32, False), (False, 48, 3, torch.bfloat16, False),
     (True, 32, 3, torch.float32, True), (True, 64, 2, torch.uint8, True)],
    ids=["neox-fp32", "gptj-partial-bf16", "partial-ordinal", "fp8-ordinal"],
)  # fmt: skip
def test_turned_key_pages_equal_the_torch_reference(is_neox, rotary_dim, hkv, dtype, ordinal):
    """The Triton turn (one program per page, angles from the delta tables) against the torch
    loop (rope.rotate, float64 angles per key), page for page: NeoX and GPT-J pairing, partial
    rotary, a head count that is not a power of two, an fp8 cache, and chunk ordinals."""
    from vllm_infinitehip.kernels.query_blocks import QueryBlocks, RequestPart

    t, d, page, k_scale = 300, 64, 16, 0.05
    gen = torch.Generator().manual_seed(4)
    dims = torch.arange(0, rotary_dim, 2, dtype=torch.float64)
    inv_freq = 1.0 / (10000.0 ** (dims / rotary_dim))
    table = RopeTable(inv_freq, is_neox)
    k = torch.randn(t, hkv, d, generator=gen)
    cache, row = paged_cache(rotate(k, torch.arange(t), table), page, gen)
    cache = cache.nan_to_num()  # spare pages: zeros here, whatever fp8 makes of NaN
    if dtype == torch.uint8:
        cache, _ = fp8_of(cache, k_scale, 1.0)
    else:
        cache = cache.to(dtype)
    block_table = torch.stack([row, row.flip(0)])
    blocks = QueryBlocks.plan([RequestPart(1, 0, 30, 250, 280), RequestPart(0, 0, 20, 270, t)],
                              16, DEVICE)  # fmt: skip
    chunks = (16, 32) if ordinal else None
    for precision in ("fp32", "tf32"):
        got, got_table = tp.unrotated_key_pages(cache, block_table.to(DEVICE), blocks, table,
                                                k_scale, chunks, precision)  # fmt: skip
        want, want_table = tp.unrotated_key_pages_reference(
            cache, block_table.to(DEVICE), blocks, table, k_scale, chunks, precision)
        assert got.dtype == want.dtype and torch.equal(got_table, want_table)
        tol = 1e-5 if got.dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.float().cpu(), want.float().cpu(), rtol=tol, atol=tol)


def test_calls_sharing_a_dict_turn_the_keys_back_once(monkeypatch):
    """Two kinds of part of one batch (a chunk's body and its tail) over one cache: with one
    ``shared`` dict the keys are turned back once, and each call selects what the reference
    does for its queries."""
    from vllm_infinitehip.kernels.query_blocks import QueryBlocks, RequestPart

    t, nq = 700, 48
    k, q, pos, rope, cache, block_table = rotated_case(5, "relative", t, nq)
    p = small_params("midpoint")
    params = ref.PruneParams(p.sink_tokens, p.window_tokens, p.stages, "midpoint", rope)
    made = []
    real = tp.unrotated_key_pages
    monkeypatch.setattr(tp, "unrotated_key_pages",
                        lambda *a, **kw: made.append(1) or real(*a, **kw))  # fmt: skip
    shared: dict = {}
    for lo, hi in ((0, 32), (32, nq)):  # body, then tail: queries at t - nq + lo ..
        part = RequestPart(0, lo, hi, t - nq + lo, t)
        blocks = QueryBlocks.plan([part], 16, DEVICE)
        got = tp.run_stages_blocks(params, q.to(DEVICE), blocks, cache, block_table.view(1, -1),
                                   0.125, shared=shared)  # fmt: skip
        want = ref.run_stages(params, q[lo:hi], k[: t - nq + hi], pos[lo:hi], 0.125)
        v = want.block_valid
        assert torch.equal(got.block_valid.cpu()[: v.shape[0], : v.shape[1]], v)
        assert torch.equal(got.block_starts.cpu()[: v.shape[0], : v.shape[1]][v],
                           want.block_starts[v])  # fmt: skip
    assert len(made) == 1


@pytest.mark.slow  # long under the Triton interpreter
@pytest.mark.parametrize(
    "pruning,nq,hkv,page,probe",
    [
        ("relative", 40, 2, 16, "midpoint"),
        ("relative", 1, 8, 32, "first"),
        ("chunk-indexed", 33, 8, 32, "midpoint"),
        ("chunk-indexed", 1, 2, 16, "midpoint"),
    ],
    ids=["relative-prefill-gqa4", "relative-decode-mha", "chunk-indexed-prefill-mha",
         "chunk-indexed-decode-gqa4"],
)  # fmt: skip
def test_run_stages_paged_with_rope_equals_reference(pruning, nq, hkv, page, probe):
    t, hq, d, scale = 1100, 8, 64, 0.125
    table = RopeTable.default(d, 10000.0)
    gen = torch.Generator().manual_seed(nq + hkv)
    k = rotate(torch.randn(t, hkv, d, generator=gen), torch.arange(t), table)
    cache, block_table = paged_cache(k, page, gen)
    pos = torch.arange(t - nq, t)
    q = rotate(torch.randn(nq, hq, d, generator=gen), pos, table)
    params = rope_params(pruning, probe, table)

    want = ref.run_stages(params, q, k, pos, scale)
    assert bool(want.block_valid.any())
    got = tp.run_stages_paged(
        params, q.to(DEVICE), cache, block_table, pos.to(DEVICE), scale, seq_len=t
    )
    assert_same_selection(got, want)
    # The remapping matters: without it the selection is another one.
    plain = ref.run_stages(small_params(probe), q, k, pos, scale)
    assert not torch.equal(
        plain.block_starts[plain.block_valid], want.block_starts[want.block_valid]
    )

    # Decode refresh with RoPE: resume at stage 1 from the reference's cached input.
    assert_same_resume(params, q, k, cache, block_table, pos, scale, want)


@pytest.mark.slow  # long under the Triton interpreter
@pytest.mark.parametrize("pruning", ["relative", "chunk-indexed"])
def test_run_stages_paged_keeps_blocks_inside_the_trained_length_at_true_positions(pruning):
    """48 queries at 1052..1099 in blocks of 16, trained length 1076: the first block ends
    below it and selects as without the remapping, the others (1076 is in the second) as with
    it; the kernel equals the reference on the mixed chunk, and a coarse first stage (blocks
    of 32: the first ends at 1083) decides by its own blocks' last queries."""
    import dataclasses

    t, nq, hq, hkv, d, scale = 1100, 48, 8, 2, 64, 0.125
    table = RopeTable.default(d, 10000.0)
    gen = torch.Generator().manual_seed(17)
    k = rotate(torch.randn(t, hkv, d, generator=gen), torch.arange(t), table)
    cache, block_table = paged_cache(k, 16, gen)
    pos = torch.arange(t - nq, t)
    q = rotate(torch.randn(nq, hq, d, generator=gen), pos, table)
    remapping = rope_params(pruning, "midpoint", table)
    params = dataclasses.replace(
        remapping, rope=dataclasses.replace(remapping.rope, trained_context=1076))

    want = ref.run_stages(params, q, k, pos, scale)
    plain = ref.run_stages(small_params("midpoint"), q, k, pos, scale)
    remapped = ref.run_stages(remapping, q, k, pos, scale)
    for rows, path in ((slice(0, 1), plain), (slice(1, 3), remapped)):
        assert torch.equal(want.block_valid[rows], path.block_valid[rows])
        assert torch.equal(want.block_starts[rows], path.block_starts[rows])
    assert not torch.equal(plain.block_starts[:1], remapped.block_starts[:1])
    got = tp.run_stages_paged(params, q.to(DEVICE), cache, block_table, pos.to(DEVICE), scale,
                              seq_len=t)  # fmt: skip
    assert_same_selection(got, want)

    coarse = dataclasses.replace(params, stages=(
        dataclasses.replace(params.stages[0], block_size_q=32), *params.stages[1:]))
    want = ref.run_stages(coarse, q, k, pos, scale)
    got = tp.run_stages_paged(coarse, q.to(DEVICE), cache, block_table, pos.to(DEVICE), scale,
                              seq_len=t)  # fmt: skip
    assert_same_selection(got, want)


def test_run_stages_paged_pruning_none_keeps_cached_positions():
    # pruning="none" (a RopePlan for BSA only) scores the cached vectors as they are.
    t, nq, scale = 500, 16, 0.2
    table = RopeTable.default(32)
    gen = torch.Generator().manual_seed(11)
    k = torch.randn(t, 2, 32, generator=gen)
    cache, block_table = paged_cache(k, 16, gen)
    q = torch.randn(nq, 4, 32, generator=gen)
    pos = torch.arange(t - nq, t)
    params = rope_params("none", "midpoint", table)
    want = ref.run_stages(params, q, k, pos, scale)
    got = tp.run_stages_paged(params, q.to(DEVICE), cache, block_table, pos.to(DEVICE), scale,
                              seq_len=t)  # fmt: skip
    assert_same_selection(got, want)


# --------------------------------------------------------------------------- fp8 KV cache
def fp8_of(cache: torch.Tensor, k_scale: float, v_scale: float):
    """vLLM's fp8 cache of ``cache`` (uint8 storage of e4m3 ``x / scale`` per plane) and what
    it dequantizes to, ``float32(e4m3) * scale``, written out here as the oracle's input."""
    scales = torch.tensor([k_scale, v_scale], device=cache.device).view(1, 2, 1, 1, 1)
    e4m3 = (cache.float() / scales).to(torch.float8_e4m3fn)
    return e4m3.view(torch.uint8), e4m3.float() * scales


@pytest.mark.parametrize("style", ["none", "relative", "chunk-indexed"])
def test_scores_over_an_fp8_cache_equal_the_dequantized_cache(style):
    """Every probe key (and its rotation partner) is dequantized: the scores are bit-identical
    to the kernel's over the dequantized fp32 cache, and match the reference's."""
    t, d, page, hq, hkv, chunk, nq = 300, 32, 16, 4, 2, 16, 20
    table = RopeTable.default(d, 10000.0)
    gen = torch.Generator().manual_seed(41 + len(style))
    k = rotate(8 * torch.randn(t, hkv, d, generator=gen), torch.arange(t), table)
    cache, block_table = paged_cache(k, page, gen)
    stored, deq = fp8_of(cache, 0.5, 2.0)
    qp = ref.pool_queries(torch.randn(nq, hq, d, generator=gen), 16, 4) * d**-0.5
    nb = qp.shape[0]
    c = -(-(t - 4) // chunk)
    starts = 4 + torch.stack([torch.randperm(c, generator=gen) for _ in range(nb)]) * chunk
    valid = torch.rand(nb, c, generator=gen) > 0.2
    key_limit = torch.tensor([t, t - 9])
    kw = {}
    q_left, q_right = qp, None
    if style == "relative":
        q_left, q_right = rotate(qp, 61, table), rotate(qp, 60, table)
        kw = dict(q_pooled_right=q_right.to(DEVICE),
                  key_rotation=(torch.zeros(nb, c, dtype=torch.long, device=DEVICE), table))
    elif style == "chunk-indexed":
        base = torch.arange(c).view(1, -1) - torch.clamp(key_limit - 1, max=c + 60).view(-1, 1)
        kw = dict(key_rotation=(base.to(DEVICE), table))

    def scores(kv, **more):
        return tp.select_rep_scores_paged(
            q_left.to(DEVICE), kv, block_table, starts.to(DEVICE), valid.to(DEVICE),
            key_limit.to(DEVICE), chunk_size=chunk, **kw, **more,
        ).cpu()  # fmt: skip

    want = scores(deq)
    k_scale, v_scale = (torch.tensor([x], device=DEVICE) for x in (0.5, 2.0))
    assert torch.equal(scores(stored, k_scale=k_scale, v_scale=v_scale), want)
    # the reference over the gathered, dequantized keys
    kk = ref.gather_paged_kv(stored.cpu(), block_table.cpu(), t, k_scale=0.5, v_scale=2.0)[0]
    cand = ref.Candidates(starts, valid)
    if style == "none":
        oracle = ref.select_rep_scores(qp, kk, cand, chunk, key_limit)
    else:
        k0 = rotate(kk, -torch.arange(t), table)
        if style == "relative":
            oracle = ref.select_rep_scores(q_left, k0, cand, chunk, key_limit,
                                           q_pooled_right=q_right)  # fmt: skip
        else:
            oracle = ref.select_rep_scores(qp, k0, cand, chunk, key_limit,
                                           chunk_rotation=(base, table))  # fmt: skip
    assert torch.equal(torch.isneginf(want), torch.isneginf(oracle))
    fin = torch.isfinite(oracle)
    torch.testing.assert_close(want[fin], oracle[fin], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        scores(stored)
    with pytest.raises(ValueError, match="precision='fast'"):
        scores(stored, k_scale=k_scale, v_scale=v_scale, precision="fast")


def test_run_stages_paged_over_an_fp8_cache_equals_reference():
    t, hq, hkv, d, scale, nq = 700, 4, 2, 32, 0.18, 17
    table = RopeTable.default(d, 10000.0)
    gen = torch.Generator().manual_seed(43)
    k = rotate(8 * torch.randn(t, hkv, d, generator=gen), torch.arange(t), table)
    cache, block_table = paged_cache(k, 16, gen)
    stored, deq = fp8_of(cache, 0.5, 2.0)
    q = torch.randn(nq, hq, d, generator=gen)
    pos = torch.arange(t - nq, t)
    params = rope_params("chunk-indexed", "midpoint", table)
    kk = to_cpu_gathered(deq.cpu(), block_table.cpu(), t)
    want = ref.run_stages(params, q, kk, pos, scale)
    assert bool(want.block_valid.any())
    got = tp.run_stages_paged(params, q.to(DEVICE), stored, block_table, pos.to(DEVICE), scale,
                              seq_len=t, k_scale=0.5, v_scale=2.0)  # fmt: skip
    assert_same_selection(got, want)


# --------------------------------------------------------------------------- realistic, GPU
def overlap(got_starts, got_valid, want_starts, want_valid) -> float:
    """Share of the reference's selected (block, start) pairs that ``got`` also selects."""

    def pairs(s, v):
        s, v = s.cpu(), v.cpu()
        rows = torch.arange(s.shape[0]).view(-1, 1).expand_as(s)
        return set(zip(rows[v].tolist(), s[v].tolist()))

    want = pairs(want_starts, want_valid)
    return len(pairs(got_starts, got_valid) & want) / max(1, len(want))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRETED, reason="needs a CUDA GPU (compiled Triton)")
@pytest.mark.parametrize("precision,min_overlap", [("fp32", 0.95), ("fast", 0.9)])
def test_realistic_decode_on_gpu(precision, min_overlap):
    t, hq, hkv, d, page = 65536, 32, 8, 128, 16
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    k = torch.randn(t, hkv, d, generator=gen, device=dev, dtype=torch.bfloat16)
    used = t // page
    num_pages = used + 64
    cache = torch.randn(num_pages, 2, page, hkv, d, generator=gen, device=dev).bfloat16()
    block_table = torch.randperm(num_pages, generator=gen, device=dev)[:used].to(torch.int32)
    cache[block_table.long(), 0] = k.view(used, page, hkv, d)
    q = torch.randn(1, hq, d, generator=gen, device=dev, dtype=torch.bfloat16)
    pos = torch.tensor([t - 1], device=dev)
    scale = d**-0.5
    stages = (
        ref.StageParams(256, 32768, 64, 4),
        ref.StageParams(32, 8192, 64, 4),
        ref.StageParams(8, 2048, 64, 1),
    )
    params = ref.PruneParams(256, 1024, stages, "midpoint")

    # Stage 1 alone: the top-128 of ~250 chunks.
    qp = ref.pool_queries(q, 64, 4) * scale
    key_limit = pos + 1
    cand = ref.first_stage_candidates(params, t, pos)
    want = ref.select_rep_scores(qp, k, cand, 256, key_limit)
    got = tp.select_rep_scores_paged(
        qp, cache, block_table, cand.starts, cand.valid, key_limit, chunk_size=256,
        precision=precision,
    )  # fmt: skip
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    top_w = torch.topk(want, 128, dim=1).indices
    top_g = torch.topk(got, 128, dim=1).indices
    assert overlap(top_g, torch.ones_like(top_g, dtype=torch.bool), top_w,
                   torch.ones_like(top_w, dtype=torch.bool)) >= min_overlap  # fmt: skip

    # The whole cascade, with no host sync once seq_len is given.
    want_r = ref.run_stages(params, q, k, pos, scale)
    tp.run_stages_paged(params, q, cache, block_table, pos, scale, seq_len=t, precision=precision)
    torch.cuda.synchronize()  # compiled and warm before the sync check
    torch.cuda.set_sync_debug_mode("error")
    try:
        got_r = tp.run_stages_paged(
            params, q, cache, block_table, pos, scale, seq_len=t, precision=precision
        )
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert int(want_r.block_valid.sum()) == 256
    assert overlap(got_r.block_starts, got_r.block_valid, want_r.block_starts,
                   want_r.block_valid) >= min_overlap  # fmt: skip


# --------------------------------------------------------------------------- selection rules
PRUNE_RULES = {
    "dominant-head": ("dominant_head", {"head_reduction": "z-score"}),
    "sharp-key": ("sharp_keys", {"exact_last_stage": True}),
    "window-overlap": ("recent_keys", {"drop_window_candidates": True}),
}


@pytest.mark.parametrize("rule", list(PRUNE_RULES))
def test_selection_rule_prefill_cascade_equals_reference_where_the_rule_decides(rule):
    """The prefill cascade on a case built so that the rule changes the kept blocks
    (tests/helpers/planted.py; 40 queries, the case's query at each): the kernel keeps the
    reference's, and the last query block keeps the needles (or nothing inside its window)."""
    import dataclasses

    from tests.helpers import planted

    builder, rules = PRUNE_RULES[rule]
    case = getattr(planted, builder)(seed=1)
    t, nq = case.k.shape[0], 40
    gen = torch.Generator().manual_seed(5)
    cache, block_table = paged_cache(case.k, 16, gen)
    q = case.q.expand(nq, -1, -1).contiguous()
    pos = torch.arange(t - nq, t)
    kept = {}
    for name, p in (("paper", case.params), ("rule", dataclasses.replace(case.params, **rules))):
        want = ref.run_stages(p, q, case.k, pos, 1.0)
        got = tp.run_stages_paged(p, q.to(DEVICE), cache, block_table, pos.to(DEVICE), 1.0,
                                  seq_len=t)  # fmt: skip
        assert_same_selection(got, want)
        kept[name] = planted.kept_blocks(want, row=-1)
    if case.needles:
        assert not set(case.needles) <= kept["paper"]
        assert set(case.needles) <= kept["rule"]
    else:  # the last block's first query is at t - 8 (blocks of 32 from t - 40)
        edge = t - 8 - planted.WINDOW
        assert any(s > edge for s in kept["paper"])
        assert not any(s > edge for s in kept["rule"])


@pytest.mark.parametrize("pruning", [None, "relative", "chunk-indexed"])
def test_all_selection_rules_prefill_cascade_equals_reference(pruning):
    import dataclasses

    t, scale = 700, 0.18
    k, q, pos, rope, cache, block_table = rotated_case(23, pruning)
    params = dataclasses.replace(small_params("midpoint"), rope=rope, head_reduction="z-score",
                                 exact_last_stage=True, drop_window_candidates=True)
    want = ref.run_stages(params, q, k, pos, scale)
    got = tp.run_stages_paged(params, q.to(DEVICE), cache, block_table, pos.to(DEVICE), scale,
                              seq_len=t)  # fmt: skip
    assert_same_selection(got, want)
    assert_same_resume(params, q, k, cache, block_table, pos, scale, want)


@pytest.mark.parametrize("pruning", [None, "relative", "chunk-indexed"])
def test_group_probes_prefill_cascade_equals_reference(pruning):
    """``group_probes`` (prefill_representatives "group-bisection") with the selection rules:
    the kernel cascade, one program per KV head holding its group's queries, keeps what the
    reference keeps, at true positions and with each RoPE style, and the first stage's scores
    equal the reference's; the grouped first stage ranks chunks apart from the per-head one."""
    import dataclasses

    t, scale = 700, 0.18
    k, q, pos, rope, cache, block_table = rotated_case(29, pruning)
    params = dataclasses.replace(small_params("midpoint"), rope=rope, head_reduction="z-score",
                                 exact_last_stage=True, drop_window_candidates=True,
                                 group_probes=True)  # fmt: skip
    want = ref.run_stages(params, q, k, pos, scale)
    assert bool(want.block_valid.any())
    got = tp.run_stages_paged(params, q.to(DEVICE), cache, block_table, pos.to(DEVICE), scale,
                              seq_len=t)  # fmt: skip
    assert_same_selection(got, want)
    if pruning is None:
        st = params.stages[0]
        cand = want.stage_inputs[0]
        block_min_pos, key_limit = ref.block_bounds(pos, st.block_size_q)
        qp = ref.pool_queries(q, st.block_size_q, st.query_stride) * scale
        kw = dict(chunk_size=st.chunk_size, head_reduction="z-score")
        grouped = tp.select_rep_scores_paged(
            qp.to(DEVICE), cache, block_table, cand.starts.to(DEVICE), cand.valid.to(DEVICE),
            key_limit.to(DEVICE), group_probes=True, **kw,
        ).cpu()  # fmt: skip
        oracle = ref.select_rep_scores(qp, k, cand, st.chunk_size, key_limit,
                                       head_reduction="z-score", group_probes=True)  # fmt: skip
        fin = torch.isfinite(oracle)
        assert torch.equal(fin, torch.isfinite(grouped))
        torch.testing.assert_close(grouped[fin], oracle[fin], rtol=1e-4, atol=1e-4)
        per_head = ref.select_rep_scores(qp, k, cand, st.chunk_size, key_limit,
                                         head_reduction="z-score")  # fmt: skip
        assert not torch.allclose(per_head[fin], oracle[fin])


def test_a_chunk_tile_past_the_shared_memory_is_halved_until_it_compiles(monkeypatch):
    """A launch whose tile needs more shared memory than the GPU has raises Triton's
    OutOfResources when it compiles (on Hopper: two-sided group probes at 64 chunks); it is
    retried unpipelined, then with halved tiles, and the scores equal the reference's; what
    compiled is kept for the same settings. The failure is injected above 16 chunks here,
    since the interpreter has no shared memory."""
    from triton.runtime.errors import OutOfResources

    tried = []
    launch = tp._launch_select_rep

    def small_tiles_only(*args):
        block_chunk, num_stages = args[-3], args[-2]
        tried.append((block_chunk, num_stages))
        assert not args[-1]["FAST_DOT"]
        if block_chunk > 16:
            raise OutOfResources(block_chunk * 4096, 232448, "shared memory")
        launch(*args)

    monkeypatch.setattr(tp, "_launch_select_rep", small_tiles_only)
    monkeypatch.setattr(tp, "_TILE_FITS", {})
    t, d, hq, hkv, chunk, scale = 300, 32, 4, 2, 8, 0.18
    gen = torch.Generator().manual_seed(2)
    k = torch.randn(t, hkv, d, generator=gen)
    cache, block_table = paged_cache(k, 16, gen)
    qp = torch.randn(3, hq, 2, d, generator=gen) * scale
    starts = torch.arange(0, 280, chunk).view(1, -1).expand(3, -1).contiguous()
    cand = ref.Candidates(starts, torch.ones_like(starts, dtype=torch.bool))
    limit = torch.tensor([t, t, 200])
    want = ref.select_rep_scores(qp, k, cand, chunk, limit, group_probes=True)
    for _ in range(2):
        got = tp.select_rep_scores_paged(
            qp.to(DEVICE), cache, block_table, starts.to(DEVICE), cand.valid.to(DEVICE),
            limit.to(DEVICE), chunk_size=chunk, group_probes=True,
        ).cpu()  # fmt: skip
        fin = torch.isfinite(want)
        assert torch.equal(fin, torch.isfinite(got))
        torch.testing.assert_close(got[fin], want[fin], rtol=1e-4, atol=1e-4)
    first, _, stages = tp._launch_config(d)
    assert stages > 1  # so the first retry is the unpipelined tile
    halvings = [(first >> i, 1) for i in range(first.bit_length()) if first >> i >= 16]
    # the second call starts from the tile that compiled
    assert tried == [(first, stages)] + halvings + [(16, 1)]


@pytest.mark.parametrize("pruning", ["relative", "chunk-indexed"])
def test_remapped_pruning_below_the_trained_length_equals_reference(pruning):
    """``pruning_from=0``: query blocks below the trained length (here all of them) score at
    remapped positions in the kernel cascade as in the reference, unlike the plain plan."""
    import dataclasses

    t, nq, hq, hkv, d, page, scale = 700, 40, 4, 2, 32, 16, 0.18
    gen = torch.Generator().manual_seed(29)
    table = RopeTable.default(d, 10000.0)
    pos = torch.arange(t - nq, t)
    k = rotate(torch.randn(t, hkv, d, generator=gen), torch.arange(t), table)
    q = rotate(torch.randn(nq, hq, d, generator=gen), pos, table)
    cache, block_table = paged_cache(k, page, gen)
    below = ref.RopePlan(table, pruning, "streaming", trained_context=10_000)
    params = dataclasses.replace(small_params("midpoint"),
                                 rope=dataclasses.replace(below, pruning_from=0))
    want = ref.run_stages(params, q, k, pos, scale)
    plain = ref.run_stages(dataclasses.replace(params, rope=below), q, k, pos, scale)
    assert not torch.equal(want.block_starts[want.block_valid],
                           plain.block_starts[plain.block_valid])  # fmt: skip
    got = tp.run_stages_paged(params, q.to(DEVICE), cache, block_table, pos.to(DEVICE), scale,
                              seq_len=t)  # fmt: skip
    assert_same_selection(got, want)


# --------------------------------------------------------------------------- fused top-k
def _top_k_brute_force(scores: torch.Tensor, starts: torch.Tensor, keep: int, how: str):
    """Each block's kept starts in position order, by Python loops in float64: per head the
    z-score over its finite scores (or the raw score), the max over heads, then the ``keep``
    best by (score, earlier chunk first)."""
    out = []
    for b in range(scores.shape[0]):
        per_head = scores[b].double().view(-1, scores.shape[-1]).tolist()
        best = [float("-inf")] * scores.shape[-1]
        for row in per_head:
            finite = [x for x in row if x != float("-inf")]
            if how == "z-score" and finite:
                mean = sum(finite) / len(finite)
                std = max((sum((x - mean) ** 2 for x in finite) / len(finite)) ** 0.5, 1e-6)
                row = [(x - mean) / std if x != float("-inf") else x for x in row]
            best = [max(a, x) for a, x in zip(best, row)]
        ranked = sorted((j for j in range(len(best)) if best[j] != float("-inf")),
                        key=lambda j: (-best[j], j))  # fmt: skip
        out.append(sorted(int(starts[b, j]) for j in ranked[:keep]))
    return out


@pytest.mark.parametrize(("how", "per_head"), [("z-score", True), ("max", True), ("max", False)])
def test_fused_top_k_keeps_what_brute_force_and_the_reference_keep(how, per_head):
    """keep_top_blocks (the ranking over heads and the top-k in one launch) against a float64
    brute-force loop and against reference.reduce_heads + keep_top_chunks: the kept starts in
    position order, invalid entries last. Blocks with every chunk valid, with a valid prefix
    shorter or longer than ``keep``, and with none; heads with a single finite score (spread
    0); more chunks than one tile of heads holds (several head tiles). Without per-head scores
    the ranking given is taken as it is."""
    gen = torch.Generator().manual_seed(11)
    nb, h, c, keep = 6, 5, 300, 24
    scores = torch.randn(nb, h, c, generator=gen) * 3
    n_valid = [300, 10, 24, 0, 150, 25]
    for b, n in enumerate(n_valid):
        scores[b, :, n:] = float("-inf")
    scores[4, 2, 1:] = float("-inf")  # a head with one finite score
    scores[4, 3, ::7] = float("-inf")  # holes inside the valid prefix, in one head
    starts = (64 + torch.arange(c) * 32).expand(nb, c).contiguous()
    if not per_head:
        scores = ref.reduce_heads(scores, "z-score")
    got = triton_topk.keep_top_blocks(scores.to(DEVICE), starts.to(DEVICE), keep, how)
    got_starts, got_valid = (t.cpu() for t in got)
    assert got_valid.shape == (nb, keep) and got_valid.dtype == torch.bool
    want = _top_k_brute_force(scores, starts, keep, how)
    assert [int(n) for n in got_valid.sum(1)] == [min(keep, n) for n in n_valid]
    for b in range(nb):
        n = int(got_valid[b].sum())
        assert bool(got_valid[b, :n].all())  # valid entries first
        assert got_starts[b, :n].tolist() == want[b]
    ranking = ref.reduce_heads(scores, how) if per_head else scores
    ref_starts, ref_valid = ref.keep_top_chunks(ranking, ref.Candidates(starts, starts >= 0), keep)
    assert torch.equal(ref_valid, got_valid)
    assert torch.equal(ref_starts[ref_valid], got_starts[got_valid])


def test_fused_top_k_breaks_ties_to_the_earlier_chunk_and_keeps_nothing_when_asked():
    """Equal scores go to the earlier chunk (the kernel's rule: torch.topk's is unspecified);
    keep 0 returns empty tensors; a bad keep or ranking is refused."""
    scores = torch.zeros(1, 2, 8)
    scores[0, :, 5] = 1.0  # one winner, then seven ties
    starts = torch.arange(8).view(1, 8) * 16
    got_starts, got_valid = triton_topk.keep_top_blocks(scores.to(DEVICE), starts.to(DEVICE), 3)
    assert got_valid.cpu().tolist() == [[True, True, True]]
    assert got_starts.cpu().tolist() == [[0, 16, 80]]
    empty = triton_topk.keep_top_blocks(scores.to(DEVICE), starts.to(DEVICE), 0)
    assert [tuple(t.shape) for t in empty] == [(1, 0), (1, 0)]
    with pytest.raises(ValueError, match="keep=9"):
        triton_topk.keep_top_blocks(scores, starts, 9)
    with pytest.raises(ValueError, match="log-softmax"):
        triton_topk.keep_top_blocks(scores, starts, 2, "log-softmax")


def test_a_launch_no_tile_fits_is_scored_with_16_bit_products(monkeypatch, caplog):
    """When no tile fits at the asked precision (injected here: every launch with fp32 or
    tf32 products fails), a launch over 16-bit keys is scored with one 16-bit product per
    probe, as precision="fast" scores it, with one warning; over fp32 keys the error names the
    settings that avoid it."""
    from triton.runtime.errors import OutOfResources

    launch = tp._launch_select_rep

    def fast_only(*args):
        if not args[-1]["FAST_DOT"]:
            raise OutOfResources(266240, 232448, "shared memory")
        launch(*args)

    t, d, hq, hkv, chunk, scale = 300, 32, 4, 2, 8, 0.18
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(t, hkv, d, generator=gen)
    qp = torch.randn(3, hq, 2, d, generator=gen) * scale
    starts = torch.arange(0, 280, chunk).view(1, -1).expand(3, -1).contiguous()
    valid = torch.ones_like(starts, dtype=torch.bool)
    limit = torch.tensor([t, t, 200])
    cache16, block_table = paged_cache(k, 16, gen, torch.bfloat16)
    args = (qp.to(DEVICE), cache16, block_table, starts.to(DEVICE), valid.to(DEVICE),
            limit.to(DEVICE))  # fmt: skip
    monkeypatch.setattr(tp, "_TILE_FITS", {})
    want = tp.select_rep_scores_paged(*args, chunk_size=chunk, group_probes=True,
                                      precision="fast").cpu()  # fmt: skip
    monkeypatch.setattr(tp, "_TILE_FITS", {})
    monkeypatch.setattr(tp, "_launch_select_rep", fast_only)
    with caplog.at_level("WARNING", logger="vllm.vllm_infinitehip"):
        got = tp.select_rep_scores_paged(*args, chunk_size=chunk, group_probes=True,
                                         precision="tf32").cpu()  # fmt: skip
    assert torch.equal(got, want)
    assert "16-bit products" in caplog.text
    cache32, block_table = paged_cache(k, 16, gen)
    with pytest.raises(RuntimeError, match="scoring_precision") as raised:
        tp.select_rep_scores_paged(qp.to(DEVICE), cache32, block_table, *args[3:],
                                   chunk_size=chunk, group_probes=True)  # fmt: skip
    assert isinstance(raised.value.__cause__, OutOfResources)
