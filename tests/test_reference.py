"""The PyTorch reference against dense attention and against hand-checked cases."""

import dataclasses
import itertools

import pytest
import torch

from vllm_infinitehip.kernels import reference as ref


def params(sink=16, window=64, chunks=(32, 8, 4), keeps=(4096, 2048, 1024), bq=16, strides=(4, 4, 1),
           probe="midpoint"):
    stages = tuple(ref.StageParams(c, k, bq, s) for c, k, s in zip(chunks, keeps, strides))
    return ref.PruneParams(sink, window, stages, probe)


def rand_qkv(t, nq, hq, hkv, d, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(nq, hq, d, generator=g)
    k = torch.randn(t, hkv, d, generator=g)
    v = torch.randn(t, hkv, d, generator=g)
    return q, k, v


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (7, 1)])
@pytest.mark.parametrize("bq,chunks", [(16, (32, 8, 4)), (32, (64, 16, 8)), (8, (16, 4, 2))])
@pytest.mark.parametrize("mode", ["prefill", "chunked-prefill", "decode"])
def test_full_budget_equals_dense(hq, hkv, bq, chunks, mode):
    t = 333
    nq = {"prefill": t, "chunked-prefill": 100, "decode": 1}[mode]
    q, k, v = rand_qkv(t, nq, hq, hkv, 32, seed=hq * 100 + bq)
    pos = torch.arange(t - nq, t)
    p = params(chunks=chunks, keeps=(1 << 14, 1 << 13, 1 << 12), bq=bq, window=chunks[0] + 3)
    out, prune, attended = ref.sparse_attention(p, q, k, v, pos, 0.17)
    dense = ref.dense_attention(q, k, v, pos, 0.17)
    torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-5)
    assert attended == int((pos + 1).sum())  # every causal pair exactly once


def test_small_budget_is_sparse_and_respects_structure():
    t, nq = 2000, 64
    q, k, v = rand_qkv(t, nq, 4, 2, 32, seed=1)
    pos = torch.arange(t - nq, t)
    p = params(sink=16, window=64, chunks=(32, 8, 4), keeps=(512, 128, 64), bq=16)
    prune = ref.run_stages(p, q, k, pos, 0.2)
    assert prune.block_starts.shape == (4, 16)  # 64 final tokens / 4-token blocks
    assert bool(prune.block_valid.all())
    starts = prune.block_starts
    assert bool((starts[:, 1:] > starts[:, :-1]).all()), "sorted, no duplicates"
    assert bool(((starts - 16) % 4 == 0).all()) and bool((starts >= 16).all())
    mask = ref.sparse_key_mask(p, t, pos, prune.block_starts, prune.block_valid)
    for row, qp in zip(mask, pos.tolist()):
        n = int(row.sum())
        assert n <= 16 + 64 + 64 and bool(row[:16].all()) and bool(row[qp - 63 : qp + 1].all())
        assert not bool(row[qp + 1 :].any())


def test_planted_needles_are_selected_and_output_matches_dense():
    # Real keys are locally smooth; a needle is a bump of keys aligned with the query whose
    # score peaks at a random position far outside the window. SelectRep must climb to it.
    t, hq, hkv, d = 4096, 4, 2, 64
    q, k, v = rand_qkv(t, 1, hq, hkv, d, seed=3)
    k *= 0.05  # background keys score near zero
    g = torch.Generator().manual_seed(7)
    needles = (torch.randperm(t - 800, generator=g)[:5] + 300).tolist()
    direction = q[0].view(hkv, hq // hkv, d).mean(1)
    for n in needles:
        for j in range(-48, 49):
            k[n + j] += direction * 3.0 * (1 - abs(j) / 48)
    pos = torch.tensor([t - 1])
    p = params(sink=16, window=64, chunks=(64, 16, 4), keeps=(1024, 512, 128), bq=16,
               strides=(1, 1, 1))
    out, prune, attended = ref.sparse_attention(p, q, k, v, pos, d**-0.5)
    selected = set()
    for s, ok in zip(prune.block_starts[0].tolist(), prune.block_valid[0].tolist()):
        if ok:
            selected.update(range(s, s + 4))
    assert set(needles) <= selected
    assert attended <= 16 + 64 + 128
    dense = ref.dense_attention(q, k, v, pos, d**-0.5)
    torch.testing.assert_close(out, dense, rtol=0.02, atol=0.02)
    # a budget that misses the needles would not match: the window and sink alone are far off
    mask = ref.sparse_key_mask(p, t, pos, prune.block_starts[:, :0], prune.block_valid[:, :0])
    assert (ref.masked_attention(q, k, v, mask, d**-0.5) - dense).abs().max() > 0.1


def test_select_rep_probe_rules_by_hand():
    # one block, one head, one chunk [0, 8): bisection picks the half whose probe scores higher
    d = 4
    k = torch.zeros(8, 1, d)
    q = torch.zeros(1, 1, 1, d)
    q[..., 0] = 1.0
    k[:, 0, 0] = torch.tensor([0.0, 1, 2, 9, 3, 0, 0, 0])
    cand = ref.Candidates(torch.tensor([[0]]), torch.tensor([[True]]))
    limit = torch.tensor([8])
    # midpoint: probes 2 vs 6 -> left (2>0); [0,4): probes 1 vs 3 -> right, score 9; [2,4): 2 vs 3
    mid = ref.select_rep_scores(q, k, cand, 8, limit, "midpoint")
    assert mid.item() == 9.0
    # first: probes 0 vs 4 -> right (3); [4,8): 4 vs 6 -> left (3); [4,6): 4 vs 5 -> 3
    first = ref.select_rep_scores(q, k, cand, 8, limit, "first")
    assert first.item() == 3.0


def _group_bisection_oracle(q, k, starts, valid, chunk, limit):
    """SelectRep with the query heads of each KV group on one path, one chunk at a time in
    Python: the probe of each half scored by the max over every query of the group."""
    nb, hq, _, _ = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    out = torch.full((nb, hkv, starts.shape[1]), float("-inf"))

    def score(b, kv, t):
        return max(float(q[b, h, i] @ k[t, kv]) for h in range(kv * g, (kv + 1) * g)
                   for i in range(q.shape[2]))  # fmt: skip

    for b in range(nb):
        for kv in range(hkv):
            for j, start in enumerate(starts[b].tolist()):
                lo, hi = start, min(start + chunk, int(limit[b]))
                if not valid[b, j] or lo >= hi:
                    continue
                best = float("-inf")
                for _ in range(ref.bisect_steps(chunk)):
                    if hi - lo <= 1:
                        break
                    mid = (lo + hi) // 2
                    s_left, s_right = score(b, kv, (lo + mid) // 2), score(b, kv, (mid + hi) // 2)
                    best = max(best, s_left if s_left > s_right else s_right)
                    lo, hi = (lo, mid) if s_left > s_right else (mid, hi)
                out[b, kv, j] = best if best > float("-inf") else score(b, kv, lo)
    return out


def test_group_probes_bisect_one_path_per_kv_group_as_a_brute_force_loop_does():
    """``group_probes``: each KV group's query heads share a bisection path, scored by the max
    over all their queries (a Python loop as the oracle); the ranking is the max over KV
    heads. On these keys the shared paths score chunks differently from per-head paths."""
    gen = torch.Generator().manual_seed(3)
    nb, hq, hkv, nq, d, t, chunk = 3, 6, 2, 2, 8, 70, 16
    q = torch.randn(nb, hq, nq, d, generator=gen)
    k = torch.randn(t, hkv, d, generator=gen)
    starts = torch.tensor([[0, 16, 32, 48, 64]] * nb)
    valid = torch.ones(nb, 5, dtype=torch.bool)
    valid[1, 2] = False
    limit = torch.tensor([70, 70, 40])
    cand = ref.Candidates(starts, valid)
    got = ref.select_rep_scores(q, k, cand, chunk, limit, group_probes=True)
    want = _group_bisection_oracle(q, k, starts, valid, chunk, limit).amax(dim=1)
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin], want[fin], rtol=1e-5, atol=1e-5)
    per_head = ref.select_rep_scores(q, k, cand, chunk, limit)
    assert not torch.allclose(per_head[fin], got[fin])
    # an exact stage scores every key per head either way
    exact = ref.select_rep_scores(q, k, cand, chunk, limit, exact=True)
    assert torch.equal(ref.select_rep_scores(q, k, cand, chunk, limit, exact=True,
                                             group_probes=True), exact)  # fmt: skip


def test_head_reductions_rank_a_sharp_heads_chunk_over_a_flat_heads_larger_score():
    inf = float("inf")
    # head 0: large, flat scores (its best, chunk 1, barely stands out); head 1: small scores
    # with one chunk (2) far above its others. Chunk 3 is invalid; block 1 has no valid chunk.
    scores = torch.tensor([[[10.0, 10.5, 10.2, -inf], [1.0, 0.0, 5.0, -inf]],
                           [[-inf] * 4, [-inf] * 4]])  # fmt: skip
    assert torch.equal(ref.reduce_heads(scores, "max"), scores.amax(dim=1))
    assert int(ref.reduce_heads(scores, "max")[0].argmax()) == 1
    for how in ("log-softmax", "z-score"):
        out = ref.reduce_heads(scores, how)
        assert int(out[0].argmax()) == 2, how
        assert torch.isneginf(out[0, 3]) and torch.isneginf(out[1]).all(), how
    with pytest.raises(ValueError, match="head_reduction"):
        ref.reduce_heads(scores, "mean")
    # select_rep_scores applies it: one key per chunk, so each head's chunk score is its q.k
    k = torch.zeros(3, 1, 2)
    k[:, 0, 0] = torch.tensor([10.0, 10.5, 10.2])
    k[:, 0, 1] = torch.tensor([1.0, 0.0, 5.0])
    q = torch.zeros(1, 2, 1, 2)
    q[0, 0, 0, 0] = q[0, 1, 0, 1] = 1.0
    cand = ref.Candidates(torch.tensor([[0, 1, 2]]), torch.ones(1, 3, dtype=torch.bool))
    raw = ref.select_rep_scores(q, k, cand, 1, torch.tensor([3]))
    soft = ref.select_rep_scores(q, k, cand, 1, torch.tensor([3]), head_reduction="log-softmax")
    assert int(raw.argmax()) == 1 and int(soft.argmax()) == 2


def test_chunk_activity_leaves_window_to_the_window():
    p = params(sink=16, window=64, chunks=(32, 8, 4), bq=16)
    cand = ref.first_stage_candidates(p, 300, torch.tensor([100, 299]))
    # sw' = 64 - 32 = 32: a chunk is active when its start <= min_pos - 32
    assert cand.starts[0].tolist() == [16 + 32 * j for j in range(9)]
    assert cand.valid[0].tolist() == [s <= 68 for s in cand.starts[0].tolist()]
    assert cand.valid[1].tolist() == [s <= 267 for s in cand.starts[1].tolist()]


def test_resuming_from_cached_stage_input_reproduces_the_mask():
    t = 3000
    q, k, _ = rand_qkv(t, 1, 4, 2, 32, seed=5)
    pos = torch.tensor([t - 1])
    p = params(sink=16, window=64, chunks=(64, 16, 4), keeps=(1024, 256, 64), bq=16)
    full = ref.run_stages(p, q, k, pos, 0.2)
    for level in (1, 2):
        again = ref.run_stages(
            p, q, k, pos, 0.2, start_stage=level, start_input=full.stage_inputs[level]
        )
        assert torch.equal(again.block_starts, full.block_starts)
        assert torch.equal(again.block_valid, full.block_valid)


def test_a_coarse_first_stage_hands_its_survivors_to_each_finer_block():
    """Stage 0 over 32-query blocks, then 16-query blocks (neighbouring blocks share stage 0):
    each fine block's stage-1 input is its coarse block's stage-0 survivors, split; from there
    the cascade is the fine blocks' own (a resume at stage 1 from that input)."""
    t, nq = 3000, 72  # coarse blocks 32, 32, 8; fine blocks 16 x 4 and 8
    q, k, _ = rand_qkv(t, nq, 4, 2, 32, seed=9)
    pos = torch.arange(t - nq, t)
    fine = params(sink=16, window=256, chunks=(64, 16, 4), keeps=(1024, 256, 64), bq=16)
    coarse_first = ref.StageParams(64, 1024, 32, 8)
    mixed = ref.PruneParams(16, 256, (coarse_first, *fine.stages[1:]), "midpoint")
    assert mixed.block_size_q == 16  # block-sparse attention keeps the last stage's blocks

    got = ref.run_stages(mixed, q, k, pos, 0.2)
    stage0 = ref.run_stages(ref.PruneParams(16, 256, (coarse_first,), "midpoint"), q, k, pos, 0.2)
    assert stage0.block_starts.shape[0] == 3
    key_limit = pos[::16] + 1
    split = ref.split_chunks(stage0.block_starts, stage0.block_valid, 64, 16, pos[::32] + 1)
    want_in = ref.Candidates(split.starts.repeat_interleave(2, 0)[:5],
                             split.valid.repeat_interleave(2, 0)[:5])  # fmt: skip
    in_reach = want_in.starts < key_limit.view(-1, 1)
    want_in = ref.Candidates(want_in.starts, want_in.valid & in_reach)
    got_in = got.stage_inputs[1]
    assert torch.equal(got_in.valid, want_in.valid)
    assert torch.equal(got_in.starts[got_in.valid], want_in.starts[want_in.valid])
    # neighbouring fine blocks really share the coarse block's candidates
    assert torch.equal(got_in.valid[0], got_in.valid[1]) and bool(got_in.valid[0].any())
    want = ref.run_stages(fine, q, k, pos, 0.2, start_stage=1, start_input=want_in)
    assert torch.equal(got.block_valid, want.block_valid)
    assert torch.equal(got.block_starts[got.block_valid], want.block_starts[want.block_valid])
    assert got.block_starts.shape[0] == 5  # the final blocks are the fine ones
    # and the coarse first stage is a different selection from the all-fine cascade's
    fine_in = ref.run_stages(fine, q, k, pos, 0.2).stage_inputs[1]
    assert not torch.equal(fine_in.starts[fine_in.valid], got_in.starts[got_in.valid])


def _two_rank_masks(p, q, k, pos, reduce: bool):
    """run_stages as two tensor-parallel ranks run it (each its half of the q and kv heads),
    in two threads; with ``reduce``, each stage's scores are max-combined as tp_mask "global"
    combines them, through a barrier-synchronised exchange (one per stage, as a collective)."""
    import threading

    halves = [(q[:, : q.shape[1] // 2], k[:, : k.shape[1] // 2]),
              (q[:, q.shape[1] // 2 :], k[:, k.shape[1] // 2 :])]  # fmt: skip
    barrier, shared, calls, out = threading.Barrier(2), [None, None], [0, 0], [None, None]

    def rank(r):
        def max_over_ranks(scores):
            calls[r] += 1
            shared[r] = scores
            barrier.wait()
            combined = torch.maximum(shared[0], shared[1])
            barrier.wait()
            return combined

        out[r] = ref.run_stages(p, *halves[r][:1], halves[r][1], pos, 0.2,
                                reduce_scores=max_over_ranks if reduce else None)  # fmt: skip

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return out, calls


def test_global_tp_mask_equals_one_rank_and_per_rank_masks_differ():
    t = 3000
    q, k, _ = rand_qkv(t, 64, 8, 4, 32, seed=11)
    pos = torch.arange(t - 64, t)
    p = params(sink=16, window=64, chunks=(64, 16, 4), keeps=(512, 128, 64), bq=16)
    one = ref.run_stages(p, q, k, pos, 0.2)
    (a, b), calls = _two_rank_masks(p, q, k, pos, reduce=True)
    assert calls == [3, 3]  # once per stage on every rank
    for rank in (a, b):
        assert torch.equal(rank.block_starts, one.block_starts)
        assert torch.equal(rank.block_valid, one.block_valid)
    (a, b), calls = _two_rank_masks(p, q, k, pos, reduce=False)
    assert calls == [0, 0]
    assert not torch.equal(a.block_starts, b.block_starts)  # each rank picks for its heads


@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_write_and_gather_roundtrip(block_size):
    g = torch.Generator().manual_seed(0)
    n_blocks, hkv, d, t = 40, 2, 8, 70
    cache = torch.full((n_blocks, 2, block_size, hkv, d), float("nan"))
    table = torch.randperm(n_blocks, generator=g)[: (t + block_size - 1) // block_size]
    k = torch.randn(t, hkv, d, generator=g)
    v = torch.randn(t, hkv, d, generator=g)
    slots = table[torch.arange(t) // block_size] * block_size + torch.arange(t) % block_size
    slots_padded = torch.cat([slots, torch.tensor([-1, -1])])
    ref.write_paged_kv(cache, torch.cat([k, k[:2]]), torch.cat([v, v[:2]]), slots_padded)
    k2, v2 = ref.gather_paged_kv(cache, table, t)
    assert torch.equal(k2, k) and torch.equal(v2, v)


def test_pool_queries_partial_block():
    q = torch.arange(10, dtype=torch.float32).view(10, 1, 1)
    pooled = ref.pool_queries(q, block_size_q=8, stride=4)  # blocks [0..7], [8, 9]
    assert pooled.shape == (2, 1, 2, 1)
    assert pooled[0, 0, :, 0].tolist() == [1.5, 5.5]
    assert pooled[1, 0, 0, 0].item() == 8.5 and torch.isnan(pooled[1, 0, 1, 0])


def test_attention_recall_is_the_dense_mass_on_the_mask():
    torch.manual_seed(0)
    t, hq, hkv, d = 50, 4, 2, 16
    q, k = torch.randn(3, hq, d), torch.randn(t, hkv, d)
    pos = torch.tensor([20, 35, 49])
    causal = torch.arange(t).view(1, -1) <= pos.view(-1, 1)
    assert torch.allclose(ref.attention_recall(q, k, pos, causal, 0.25), torch.ones(3, hq))
    mask = torch.zeros(3, t, dtype=torch.bool)
    mask[:, [0, 7]] = True
    got = ref.attention_recall(q, k, pos, mask, 0.25)
    for i, p in enumerate(pos.tolist()):
        for h in range(hq):
            probs = (q[i, h] @ k[: p + 1, h // 2].T * 0.25).softmax(-1)
            assert abs(got[i, h] - probs[[0, 7]].sum()) < 1e-5
    # keys past a query's position get no mass even when masked in
    late = torch.zeros(3, t, dtype=torch.bool)
    late[:, 45:] = True
    assert got.new_zeros(hq).allclose(ref.attention_recall(q, k, pos, late, 0.25)[0])


@pytest.mark.parametrize("style", ["relative", "chunk-indexed"])
def test_remapped_recall_places_far_keys_as_the_pruning_style_does(style):
    """Under the remapping a far key's score depends on its content and, chunk-indexed, on its
    chunk alone: moving far keys (relative: anywhere outside the window; chunk-indexed: within
    their stage-0 chunk), each cached rotated at its new position, leaves the remapped recall of
    the same keys unchanged, while the true-position recall moves."""
    from vllm_infinitehip.kernels.rope import RopeTable, rotate

    gen = torch.Generator().manual_seed(5)
    table = RopeTable.default(32, 10000.0)
    stages = (ref.StageParams(32, 256, 16, 1), ref.StageParams(8, 64, 16, 1))
    params = ref.PruneParams(16, 64, stages, rope=ref.RopePlan(table, pruning=style))
    t_len, p = 600, 599
    content = torch.randn(t_len, 2, 32, generator=gen)
    q = rotate(torch.randn(1, 4, 32, generator=gen), p, table)
    pos = torch.tensor([p])
    far = p - params.window_tokens + 1  # positions [0, far) are outside the window
    perm = torch.arange(t_len)
    if style == "relative":
        perm[:far] = torch.randperm(far, generator=gen)
    else:  # within each stage-0 chunk that lies wholly outside the window (and the sink)
        bounds = [0, 16, *range(16 + 32, far + 1, 32)]
        for lo, hi in itertools.pairwise(bounds):
            perm[lo:hi] = lo + torch.randperm(hi - lo, generator=gen)
    mask = torch.zeros(1, t_len, dtype=torch.bool)
    mask[0, 40:200] = True  # some far keys (by content) and the window
    mask[0, far:] = True

    def cache(order):  # position j holds content order[j]
        return rotate(content[order], torch.arange(t_len), table)

    ident = torch.arange(t_len)
    a = ref.remapped_attention_recall(params, q, cache(ident), pos, mask, 0.2)
    b = ref.remapped_attention_recall(params, q, cache(perm), pos, mask[:, perm], 0.2)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    true_a = ref.attention_recall(q, cache(ident), pos, mask, 0.2)
    true_b = ref.attention_recall(q, cache(perm), pos, mask[:, perm], 0.2)
    assert (true_a - true_b).abs().max() > 1e-3
    # a full mask keeps everything; without a remapping it is the true-position recall
    full = torch.arange(t_len).view(1, -1) <= p
    assert torch.allclose(ref.remapped_attention_recall(params, q, cache(ident), pos, full, 0.2),
                          torch.ones(1, 4))  # fmt: skip
    plain = ref.PruneParams(16, 64, stages)
    plain_recall = ref.remapped_attention_recall(plain, q, cache(ident), pos, mask, 0.2)
    assert torch.equal(plain_recall, true_a)


def _bank_over(cache: torch.Tensor, gen: torch.Generator, poison) -> tuple:
    """A block table over ``cache``'s pages, half of them copied into a bank at random slots, and
    the cache with those pages overwritten by ``poison`` (what a read through the bank must never
    see)."""
    n_pages = cache.shape[0]
    perm = torch.randperm(n_pages, generator=gen)
    table = torch.stack([perm[:57], torch.cat([perm[57:76], perm[:38]])]).int()
    resident = torch.randperm(n_pages, generator=gen)[: n_pages // 2]
    slots = torch.randperm(n_pages // 2 + 1, generator=gen)[: n_pages // 2]
    pages = torch.zeros(n_pages // 2 + 1, *cache.shape[1:], dtype=cache.dtype)
    pages[slots] = cache[resident]
    residency = torch.full((n_pages,), -1, dtype=torch.int32)
    residency[resident] = slots.int()
    poisoned = cache.clone()
    poisoned[resident] = poison
    return table, (pages, residency), poisoned


def _decode_through_bank(exact, poisoned, bank, table, seq_lens, gen, hq, d, **scales):
    """The decode references on ``poisoned`` through ``bank`` store the masks and attend exactly
    as on ``exact`` without one; returns what the fp8 test reuses."""
    from vllm_infinitehip.kernels import decode as dec

    stages = (ref.StageParams(64, 512, 32, 4), ref.StageParams(8, 64, 32, 1))
    params = ref.PruneParams(sink_tokens=16, window_tokens=64, stages=stages)
    q = torch.randn(2, hq, d, generator=gen)
    i32 = dict(dtype=torch.int32)
    rows = dec.DecodeRows(table, torch.tensor(seq_lens, **i32), torch.tensor([0, -1], **i32),
                          torch.tensor([0, -1], **i32))  # fmt: skip
    masks = [dec.DecodeMasks.allocate(params, 64, 2, torch.device("cpu")) for _ in range(2)]
    dec.refresh_masks_reference(params, masks[0], q, exact, rows, 0.2)
    dec.refresh_masks_reference(params, masks[1], q, poisoned, rows, 0.2, bank, **scales)
    assert torch.equal(masks[0].final, masks[1].final) and int(masks[0].counts[0, -1]) == 8
    want, pairs = dec.attend_reference(params, masks[0], q, exact, rows, 0.2)
    got, got_pairs = dec.attend_reference(params, masks[1], q, poisoned, rows, 0.2, bank,
                                          **scales)  # fmt: skip
    assert torch.equal(got, want) and got_pairs == pairs
    return params, masks[1], q, rows


def test_reads_through_the_host_tier_bank_equal_the_cache():
    """The CPU path reads through the host tier's bank as the kernels do: with the cache's copies
    of resident pages poisoned, K/V gathers, decode masks and decode attention are unchanged."""
    from vllm_infinitehip.kernels import decode as dec

    gen = torch.Generator().manual_seed(5)
    page, hkv, d, hq = 16, 2, 32, 4
    seq_lens = [900, 300]
    n_pages = sum(-(-s // page) for s in seq_lens) + 2
    cache = torch.randn(n_pages, 2, page, hkv, d, generator=gen)
    table, bank, poisoned = _bank_over(cache, gen, float("nan"))
    for b, s in enumerate(seq_lens):
        for got, want in zip(ref.gather_paged_kv(poisoned, table[b], s, bank),
                             ref.gather_paged_kv(cache, table[b], s)):  # fmt: skip
            assert torch.equal(got, want)
    params, masks, q, rows = _decode_through_bank(cache, poisoned, bank, table, seq_lens, gen,
                                                  hq, d)  # fmt: skip
    assert torch.isnan(dec.attend_reference(params, masks, q, poisoned, rows, 0.2)[0]).any()


# --------------------------------------------------------------------------- fp8 KV cache
def _e4m3(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What an fp8 cache holds for ``x`` at ``scale``, written out by hand: x / scale, saturated
    at the e4m3 maximum (vLLM's GPU write is satfinite), rounded to e4m3."""
    return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("storage", [torch.uint8, torch.float8_e4m3fn])
def test_fp8_paged_write_and_gather_roundtrip(storage):
    g = torch.Generator().manual_seed(1)
    n_blocks, block_size, hkv, d, t = 12, 16, 2, 8, 70
    k_scale, v_scale = 0.5, torch.tensor([2.0])  # a float and a layer-like [1] tensor
    cache = torch.full((n_blocks, 2, block_size, hkv, d), 0x11, dtype=torch.uint8).view(storage)
    table = torch.randperm(n_blocks, generator=g)[: (t + block_size - 1) // block_size]
    k = 40 * torch.randn(t, hkv, d, generator=g)
    v = 40 * torch.randn(t, hkv, d, generator=g)
    k[0, 0, 0], v[1, 1, 1] = 1e6, -1e6  # past 448 * scale: saturates, never NaN
    slots = table[torch.arange(t) // block_size] * block_size + torch.arange(t) % block_size
    before = cache.view(torch.uint8).clone()
    ref.write_paged_kv(cache, torch.cat([k, k[:2]]), torch.cat([v, v[:2]]),
                       torch.cat([slots, torch.tensor([-1, -1])]),
                       k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    assert cache.dtype == storage
    written = torch.zeros(n_blocks * block_size, dtype=torch.bool)
    written[slots] = True
    untouched = ~written.view(n_blocks, 1, block_size, 1, 1).expand_as(before)
    assert torch.equal(cache.view(torch.uint8)[untouched], before[untouched])  # padding skipped

    k2, v2 = ref.gather_paged_kv(cache, table, t, k_scale=k_scale, v_scale=v_scale)
    assert k2.dtype == v2.dtype == torch.float32
    assert torch.equal(k2, _e4m3(k, 0.5).float() * 0.5)
    assert torch.equal(v2, _e4m3(v, 2.0).float() * 2.0)
    assert k2[0, 0, 0] == 448 * 0.5 and v2[1, 1, 1] == -448 * 2.0
    # e4m3 keeps 3 mantissa bits: within 2^-4 relative of what was written (below saturation)
    fine = (k.abs() < 200) & (k.abs() > 1)
    assert bool(((k2 - k).abs()[fine] <= k.abs()[fine] / 16).all())
    k16, _ = ref.gather_paged_kv(cache, table, t, k_scale=k_scale, v_scale=v_scale,
                                 out_dtype=torch.float16)  # fmt: skip
    assert k16.dtype == torch.float16 and torch.equal(k16, k2.half())
    with pytest.raises(ValueError, match="v_scale"):
        ref.gather_paged_kv(cache, table, t, k_scale=k_scale)
    with pytest.raises(ValueError, match="k_scale"):
        ref.write_paged_kv(cache, k, v, slots)
    # a cache that is not fp8 ignores the scales (vLLM's layers hold 1.0 for them)
    plain = torch.zeros(n_blocks, 2, block_size, hkv, d)
    ref.write_paged_kv(plain, k, v, slots, k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(ref.gather_paged_kv(plain, table, t, k_scale=3.0, v_scale=3.0)[0], k)


def test_fp8_reads_through_the_bank_and_decode_references_dequantize():
    """An fp8 cache with fp8 bank pages: gathers through the bank equal the cache's (its
    resident pages poisoned with NaN bytes); the decode reference's masks and attention on the
    fp8 cache equal those on the dequantized fp32 cache."""
    from vllm_infinitehip.kernels import decode as dec

    gen = torch.Generator().manual_seed(6)
    page, hkv, d, hq = 16, 2, 32, 4
    seq_lens = [900, 300]
    n_pages = sum(-(-s // page) for s in seq_lens) + 2
    scales = torch.tensor([0.5, 2.0]).view(1, 2, 1, 1, 1)
    stored = (3 * torch.randn(n_pages, 2, page, hkv, d, generator=gen) / scales).to(
        torch.float8_e4m3fn
    )
    deq = stored.float() * scales
    stored = stored.view(torch.uint8)  # vLLM's storage
    table, bank, poisoned = _bank_over(stored, gen, 0x7F)  # 0x7F: NaN in e4m3fn
    sc = dict(k_scale=torch.tensor([0.5]), v_scale=torch.tensor([2.0]))
    for b, s in enumerate(seq_lens):
        want = ref.gather_paged_kv(deq, table[b], s)
        for got, w in zip(ref.gather_paged_kv(poisoned, table[b], s, bank, **sc), want):
            assert torch.equal(got, w)
        assert torch.isnan(ref.gather_paged_kv(poisoned, table[b], s, **sc)[0]).any()

    params, masks, q, rows = _decode_through_bank(deq, poisoned, bank, table, seq_lens, gen, hq,
                                                  d, **sc)  # fmt: skip
    with pytest.raises(ValueError, match="k_scale"):
        dec.attend_reference(params, masks, q, stored, rows, 0.2)


# --------------------------------------------------------------------------- brute-force oracle
def _oracle_top_blocks(k: torch.Tensor, q: torch.Tensor, n: int, sink: int, window: int) -> set:
    """The ``n`` 8-key blocks a brute-force reader ranks first: every key's exact score in every
    query head (no SelectRep, no cascade), a block's score per head its best key, each head's
    block scores standardised, the max over heads. Blocks overlapping the sink or the window
    are not candidates."""
    t, hkv, d = k.shape
    hq = q.shape[1]
    heads_kv = torch.arange(hq) // (hq // hkv)
    scores = torch.einsum("hd,thd->ht", q[0], k[:, heads_kv])  # [H_q, T]
    first, last = sink, (t - 1 - window) // 8 * 8
    blocks = scores[:, first:last].reshape(hq, -1, 8).amax(-1)  # [H_q, blocks]
    z = (blocks - blocks.mean(-1, keepdim=True)) / blocks.std(-1, unbiased=False, keepdim=True)
    top = z.amax(0).topk(n).indices
    return {first + 8 * int(i) for i in top}


@pytest.mark.parametrize("builder", ["dominant_head", "sharp_keys"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reference_keeps_what_a_brute_force_reader_ranks_first(builder, seed):
    """Planted needles (tests/helpers/planted.py) are what the oracle ranks first, and the
    reference cascade with z-score ranking, exact last stage and the window check keeps every
    one of them in its final blocks."""
    from tests.helpers import planted

    case = getattr(planted, builder)(seed)
    top = _oracle_top_blocks(case.k, case.q, len(case.needles), planted.SINK, planted.WINDOW)
    assert top == set(case.needles)  # the oracle sees the planting
    params = dataclasses.replace(case.params, head_reduction="z-score", exact_last_stage=True,
                                 drop_window_candidates=True)
    t = case.k.shape[0]
    result = ref.run_stages(params, case.q, case.k, torch.tensor([t - 1]), 1.0)
    assert top <= planted.kept_blocks(result)


@pytest.mark.parametrize("seed", [0, 1])
def test_every_stage_exact_keeps_the_brute_force_top_chunks(seed):
    """The research setting ``exact_every_stage`` (no representatives at any stage): a
    one-stage cascade keeps the chunks a brute-force reader ranks first, each chunk's score
    per head its best key before the query, standardised over the candidates, the max over
    heads."""
    gen = torch.Generator().manual_seed(seed)
    t, hq, hkv, d, chunk, keep = 1200, 4, 2, 16, 32, 8
    k = torch.randn(t, hkv, d, generator=gen)
    q = torch.randn(1, hq, d, generator=gen)
    params = ref.PruneParams(sink_tokens=16, window_tokens=64,
                             stages=(ref.StageParams(chunk, keep * chunk, 1, 1),),
                             head_reduction="z-score", exact_every_stage=True)  # fmt: skip
    p = t - 1
    result = ref.run_stages(params, q, k, torch.tensor([p]), 1.0)
    kept = set(result.block_starts[0][result.block_valid[0]].tolist())

    scores = torch.einsum("hd,thd->ht", q[0], k[:, torch.arange(hq) // (hq // hkv)])
    starts = [s for s in range(16, t, chunk) if s <= p - params.scan_window]
    best = torch.stack([scores[:, s : min(s + chunk, p + 1)].amax(-1) for s in starts], -1)
    z = (best - best.mean(-1, keepdim=True)) / best.std(-1, unbiased=False, keepdim=True)
    want = {starts[int(i)] for i in z.amax(0).topk(keep).indices}
    assert kept == want
    # bisection representatives choose otherwise here: the rule is what decides
    paper = dataclasses.replace(params, exact_every_stage=False)
    bisected = ref.run_stages(paper, q, k, torch.tensor([p]), 1.0)
    assert set(bisected.block_starts[0][bisected.block_valid[0]].tolist()) != want
