"""Landmark representatives (kernels/reference.py ``landmark_scores``,
``landmark_representatives``, ``select_rep_scores(landmarks=)``) against brute-force oracles, and
the case they exist for: a sharp key that bisection misses."""

from __future__ import annotations

import pytest
import torch

from vllm_infinitehip.kernels import reference as ref


def brute_landmarks(q, k, scale, q_start, window):
    t_keys, hkv = k.shape[:2]
    hq = q.shape[1]
    out = torch.full((t_keys, hq), float("-inf"))
    for t in range(t_keys):
        for h in range(hq):
            followers = range(max(t + 1, q_start), min(t + window, q_start + q.shape[0] - 1) + 1)
            vals = [scale * float(q[p - q_start, h] @ k[t, h // (hq // hkv)]) for p in followers]
            if vals:
                out[t, h] = sum(vals) / len(vals)
    return out


@pytest.mark.parametrize("q_start,window", [(0, 16), (40, 16), (90, 64)])
def test_landmark_scores_are_the_mean_logit_of_the_following_queries(q_start, window):
    g = torch.Generator().manual_seed(q_start + window)
    q = torch.randn(70, 4, 8, generator=g)
    k = torch.randn(q_start + 70, 2, 8, generator=g)
    got = ref.landmark_scores(q, k, 0.3, q_start=q_start, window=window)
    want = brute_landmarks(q, k, 0.3, q_start, window)
    assert torch.equal(got.isinf(), want.isinf())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the last key has no follower; a key before every query's window neither
    assert bool(got[-1].isinf().all())
    if q_start > window:
        assert bool(got[: q_start - window].isinf().all())


def test_a_prompt_prefilled_in_chunks_gets_the_sums_of_one_call():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(300, 4, 8, generator=g)
    k = torch.randn(300, 2, 8, generator=g)
    for per_group in (False, True):
        whole = ref.landmark_sums(q, k, 0.5, window=32, per_group=per_group)
        sums, counts = torch.zeros_like(whole[0]), torch.zeros_like(whole[1])
        for lo, hi in ((0, 100), (100, 117), (117, 300)):  # keys as far as the chunk's end
            s, c = ref.landmark_sums(q[lo:hi], k[:hi], 0.5, q_start=lo, window=32,
                                     per_group=per_group)  # fmt: skip
            sums[:hi] += s
            counts[:hi] += c
        torch.testing.assert_close(sums, whole[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(counts, whole[1])
    # one score per KV head: the sum over its query heads, and the mean over them all
    per_head, counts = ref.landmark_sums(q, k, 0.5, window=32)
    per_kv, _ = ref.landmark_sums(q, k, 0.5, window=32, per_group=True)
    torch.testing.assert_close(per_kv, per_head.view(300, 2, 2).sum(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        ref.landmark_scores(q, k, 0.5, window=32, per_group=True)[:-1],
        ref.landmark_scores(q, k, 0.5, window=32)[:-1].view(299, 2, 2).mean(-1))


def test_the_aligned_table_picks_each_chunks_representative():
    g = torch.Generator().manual_seed(6)
    landmarks = torch.randn(100, 2, generator=g)
    landmarks[40:45] = float("-inf")
    table = ref.landmark_table(landmarks, sink=4, chunk_size=16, n_chunks=7)
    for j in range(7):
        lo, hi = 4 + 16 * j, min(100, 4 + 16 * (j + 1))
        for h in range(2):
            want = lo + int(landmarks[lo:hi, h].argmax()) if lo < 100 else lo
            assert int(table[j, h]) == want, (j, h)
    # a batch of requests (the kernels' tables): each row as it alone
    other = torch.randn(100, 2, generator=g)
    both = ref.landmark_table(torch.stack([landmarks, other]), sink=4, chunk_size=16, n_chunks=7)
    assert torch.equal(both[0], table)
    assert torch.equal(both[1], ref.landmark_table(other, sink=4, chunk_size=16, n_chunks=7))


def test_a_representative_is_its_chunks_best_scored_key_in_each_head():
    g = torch.Generator().manual_seed(1)
    landmarks = torch.randn(50, 3, generator=g)
    landmarks[7:9] = float("-inf")  # keys no query followed
    left = torch.tensor([[0, 8, 40], [3, 16, 48]]).view(1, 2, 3).expand(2, 2, 3)
    left = torch.cat([left, left[:, :1]], dim=1)  # 3 heads
    right = torch.minimum(left + 8, torch.tensor(50))
    reps = ref.landmark_representatives(landmarks, left, right, 8)
    for b in range(2):
        for h in range(3):
            for c in range(3):
                lo, hi = int(left[b, h, c]), int(right[b, h, c])
                want = lo + int(landmarks[lo:hi, h].argmax())
                assert int(reps[b, h, c]) == want


def test_landmark_scores_of_a_stage_are_each_chunks_representative_score():
    """select_rep_scores(landmarks=) against its definition: per head, the best pooled query's
    logit with the chunk's representative, reduced over heads."""
    g = torch.Generator().manual_seed(2)
    t, hq, hkv, d = 300, 4, 2, 16
    k = torch.randn(t, hkv, d, generator=g)
    landmarks = torch.randn(t, hq, generator=g)
    qp = torch.randn(2, hq, 3, d, generator=g)
    starts = torch.tensor([[16, 48, 80, 112], [16, 80, 144, 208]])
    cand = ref.Candidates(starts, torch.tensor([[True, True, False, True]] * 2))
    limit = torch.tensor([200, 300])
    for how in ("max", "z-score"):
        got = ref.select_rep_scores(qp, k, cand, 32, limit, head_reduction=how,
                                    landmarks=landmarks)  # fmt: skip
        per_head = torch.full((2, hq, 4), float("-inf"))
        for b in range(2):
            for h in range(hq):
                for c in range(4):
                    lo = int(starts[b, c])
                    hi = min(lo + 32, int(limit[b]))
                    if not bool(cand.valid[b, c]) or lo >= hi:
                        continue
                    rep = lo + int(landmarks[lo:hi, h].argmax())
                    per_head[b, h, c] = (qp[b, h] @ k[rep, h // (hq // hkv)]).max()
        torch.testing.assert_close(got, ref.reduce_heads(per_head, how))


def sharp_key_kept(seed: int, landmarks: bool) -> bool:
    """An i.i.d. haystack with one key 3 sigma along the final query, read by the 64 queries
    after it (as a copy reads its source). Is it in the final query's mask?"""
    g = torch.Generator().manual_seed(seed)
    t, d = 2048, 32
    k = torch.randn(t, 1, d, generator=g)
    q = 0.3 * torch.randn(t, 1, d, generator=g)
    needle = int(torch.randint(300, 1500, (1,), generator=g))
    direction = torch.randn(d, generator=g)
    direction /= direction.norm()
    k[needle, 0] += (3.0 - k[needle, 0] @ direction) * direction
    q[needle + 1 : needle + 65, 0] += 2 * direction
    q[t - 1, 0] = direction
    stages = (ref.StageParams(32, 256, 1, 1), ref.StageParams(8, 64, 1, 1))
    p = ref.PruneParams(16, 128, stages, exact_last_stage=True, drop_window_candidates=True)
    pos = torch.tensor([t - 1])
    lm = ref.landmark_scores(q, k, 1.0) if landmarks else None
    prune = ref.run_stages(p, q[t - 1 :], k, pos, 1.0, landmarks=lm)
    mask = ref.sparse_key_mask(p, t, pos, prune.block_starts, prune.block_valid)
    return bool(mask[0, needle])


def test_landmarks_keep_a_sharp_key_that_bisection_misses():
    bisection = sum(sharp_key_kept(seed, False) for seed in range(40))
    landmark = sum(sharp_key_kept(seed, True) for seed in range(40))
    # measured: 16 and 40 of 40
    assert landmark == 40
    assert bisection <= 28
