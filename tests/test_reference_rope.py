"""RoPE remapping in the reference (INFINITEHIP.md §2) on keys cached already rotated."""

import pytest
import torch

from vllm_infinitehip.kernels import reference as ref
from vllm_infinitehip.kernels.rope import RopeTable, rotate, streaming_positions

TABLE = RopeTable.default(32, rope_theta=10000.0)


def params(pruning="relative", bsa="streaming"):
    stages = (ref.StageParams(32, 512, 16, 4), ref.StageParams(8, 256, 16, 4), ref.StageParams(4, 64, 16, 1))
    return ref.PruneParams(16, 64, stages, "midpoint", ref.RopePlan(TABLE, pruning, bsa))


def raw_qkv(t, nq, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(nq, 4, 32, generator=g), torch.randn(t, 2, 32, generator=g),
            torch.randn(t, 2, 32, generator=g))


def _cached_and_raw(t, nq, seed):
    q_raw, k_raw, v = raw_qkv(t, nq, seed)
    pos = torch.arange(t - nq, t)
    return q_raw, k_raw, rotate(q_raw, pos, TABLE), rotate(k_raw, torch.arange(t), TABLE), pos


def test_relative_pruning_scores_raw_content_at_fixed_distances():
    t, nq = 1200, 16
    q_raw, k_raw, q, k, pos = _cached_and_raw(t, nq, seed=1)
    p = params(pruning="relative")
    block_min = pos[:1]
    cand = ref.first_stage_candidates(p, t, block_min)
    limit = block_min + 1
    qp_cached = ref.pool_queries(rotate(q.float(), -pos, TABLE), 16, 4) * 0.2
    got = ref._stage_scores(p, qp_cached, rotate(k, -torch.arange(t), TABLE), cand, 32, limit, block_min)
    # expected straight from raw vectors: query at sw'+1 against probes at 0 (left), 1 (right)
    qp = ref.pool_queries(q_raw, 16, 4) * 0.2
    sw = p.scan_window
    want = ref.select_rep_scores(rotate(qp, sw + 1, TABLE), k_raw, cand, 32, limit,
                                 q_pooled_right=rotate(qp, sw, TABLE))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # ...which is not what scoring the cached (truly rotated) vectors gives
    plain = ref.select_rep_scores(ref.pool_queries(q, 16, 4) * 0.2, k, cand, 32, limit)
    assert not torch.allclose(plain, want, rtol=1e-2, atol=1e-2)


def test_chunk_indexed_pruning_places_keys_at_chunk_ordinals():
    t, nq = 1200, 1
    q_raw, k_raw, q, k, pos = _cached_and_raw(t, nq, seed=4)
    p = params(pruning="chunk-indexed")
    prune = ref.run_stages(p, q, k, pos, 0.2)
    cand = prune.stage_inputs[0]
    c = cand.starts.shape[1]
    q_pos = min(int(pos[0]), c + p.scan_window)
    # expected: every chunk's keys at its ordinal j, the query at min(p, C + sw'), from raw vectors
    qp = ref.pool_queries(q_raw, 16, 4) * 0.2
    want = torch.full((1, c), float("-inf"))
    for j in range(c):
        one = ref.Candidates(cand.starts[:, j : j + 1], cand.valid[:, j : j + 1])
        kj = rotate(k_raw, torch.full((t,), j), TABLE)
        want[0, j] = ref.select_rep_scores(rotate(qp, q_pos, TABLE), kj, one, 32, pos[:1] + 1)[0, 0]
    got = ref._stage_scores(p, qp, k_raw, cand, 32, pos[:1] + 1, pos[:1])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_streaming_attention_equals_attention_at_the_remapped_positions():
    t, nq = 900, 20
    q_raw, k_raw, v = raw_qkv(t, nq, seed=2)
    pos = torch.arange(t - nq, t)
    q = rotate(q_raw, pos, TABLE)
    k = rotate(k_raw, torch.arange(t), TABLE)  # what vLLM caches
    p = params(pruning="none")
    prune = ref.run_stages(p, q, k, pos, 0.2)
    out, _, attended = ref.sparse_attention(p, q, k, v, pos, 0.2, prune=prune)

    # independent construction: raw keys rotated straight to their remapped positions
    expected = torch.empty_like(q)
    n_attended = 0
    for b in range(prune.block_starts.shape[0]):
        lo, hi = b * 16, min(nq, (b + 1) * 16)
        p_min = int(pos[lo])
        starts = prune.block_starts[b][prune.block_valid[b]]
        sel = (starts.view(-1, 1) + torch.arange(4)).reshape(-1)
        far = torch.cat([torch.arange(16), sel])
        new = streaming_positions(16, 64, sel.numel(), torch.tensor(p_min), num_slots=far.numel())
        w0 = p_min - 64 + 1
        keep = far < w0
        far, new = far[keep], new[keep]
        window = torch.arange(w0, int(pos[hi - 1]) + 1)
        keys = torch.cat([rotate(k_raw[far], new, TABLE), rotate(k_raw[window], window, TABLE)])
        vals = torch.cat([v[far], v[window]])
        mask = torch.cat([torch.ones(hi - lo, far.numel(), dtype=torch.bool),
                          window.view(1, -1) <= pos[lo:hi].view(-1, 1)], 1)
        n_attended += int(mask.sum())
        expected[lo:hi] = ref.masked_attention(q[lo:hi], keys, vals, mask, 0.2)
        # every distance the query sees stays within the budget, not the context
        assert int(pos[hi - 1]) - int(new.min()) <= 16 + 64 + 64 + 16
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    assert attended == n_attended


def test_streaming_matches_plain_attention_when_nothing_moves():
    # Selected blocks already adjacent to the window and a budget covering everything: the
    # remapped positions equal the true ones, so the output equals dense attention.
    t = 200
    q_raw, k_raw, v = raw_qkv(t, 1, seed=3)
    pos = torch.tensor([t - 1])
    q = rotate(q_raw, pos, TABLE)
    k = rotate(k_raw, torch.arange(t), TABLE)
    p = params(pruning="none")
    starts = torch.arange(16, t - 64, 4).view(1, -1)  # every block between sink and window
    prune = ref.PruneResult(starts, torch.ones_like(starts, dtype=torch.bool), [])
    out, _, _ = ref.sparse_attention(p, q, k, v, pos, 0.2, prune=prune)
    torch.testing.assert_close(out, ref.dense_attention(q, k, v, pos, 0.2), rtol=1e-4, atol=1e-4)


def _with_trained(p, trained):
    import dataclasses

    return dataclasses.replace(p, rope=dataclasses.replace(p.rope, trained_context=trained))


def _without_rope(p):
    import dataclasses

    return dataclasses.replace(p, rope=None)


@pytest.mark.parametrize("pruning", ["relative", "chunk-indexed"])
def test_blocks_inside_the_trained_length_keep_true_positions(pruning):
    # A prefill chunk of 80 queries (5 blocks of 16) at 1120..1199 with the trained length at
    # 1160: blocks 0-1 end below it and must be scored and attended exactly as without the
    # remapping; block 2 holds position 1160 and blocks 2-4 exactly as the remapping does.
    t, nq, trained = 1200, 80, 1160
    _, _, q, k, pos = _cached_and_raw(t, nq, seed=6)
    v = raw_qkv(t, nq, seed=7)[2]
    remapped_p = params(pruning=pruning)
    p = _with_trained(remapped_p, trained)
    got = ref.run_stages(p, q, k, pos, 0.2)
    plain = ref.run_stages(_without_rope(p), q, k, pos, 0.2)
    remapped = ref.run_stages(remapped_p, q, k, pos, 0.2)
    below, above = slice(0, 2), slice(2, 5)
    assert torch.equal(got.block_starts[below], plain.block_starts[below])
    assert torch.equal(got.block_valid[below], plain.block_valid[below])
    assert torch.equal(got.block_starts[above], remapped.block_starts[above])
    assert torch.equal(got.block_valid[above], remapped.block_valid[above])
    # the remapping does change the selection here, so the checks above can tell them apart
    assert not torch.equal(plain.block_starts, remapped.block_starts)

    out, _, attended = ref.sparse_attention(p, q, k, v, pos, 0.2, prune=got)
    want_plain, _, n_plain = ref.sparse_attention(_without_rope(p), q, k, v, pos, 0.2, prune=got)
    want_remap, _, n_remap = ref.sparse_attention(remapped_p, q, k, v, pos, 0.2, prune=got)
    assert torch.equal(out[:32], want_plain[:32])
    assert torch.equal(out[32:], want_remap[32:])
    assert not torch.allclose(want_plain[32:], want_remap[32:], atol=1e-3)
    assert n_plain <= attended <= n_remap

    # every block below the trained length: the whole request runs as without the remapping
    all_below = _with_trained(remapped_p, t)
    got = ref.run_stages(all_below, q, k, pos, 0.2)
    assert torch.equal(got.block_starts, plain.block_starts)
    out, _, attended = ref.sparse_attention(all_below, q, k, v, pos, 0.2, prune=got)
    want, _, n = ref.sparse_attention(_without_rope(p), q, k, v, pos, 0.2, prune=got)
    assert torch.equal(out, want) and attended == n


def test_recall_inside_the_trained_length_is_against_true_positions():
    t, nq = 1200, 2
    _, _, q, k, pos = _cached_and_raw(t, nq, seed=8)  # queries at 1198 and 1199
    p = _with_trained(params(pruning="relative"), 1199)
    prune = ref.run_stages(p, q, k, pos, 0.2)
    mask = ref.sparse_key_mask(p, t, pos, prune.block_starts, prune.block_valid)
    got = ref.remapped_attention_recall(p, q, k, pos, mask, 0.2)
    true = ref.attention_recall(q, k, pos, mask, 0.2)
    remapped = ref.remapped_attention_recall(_with_trained(p, 0), q, k, pos, mask, 0.2)
    assert torch.equal(got[0], true[0])
    assert torch.equal(got[1], remapped[1])
    assert not torch.allclose(true[1], remapped[1], atol=1e-4)
