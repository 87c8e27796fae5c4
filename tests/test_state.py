"""The refresh schedule and the device-side matching of decode rows to state slots."""

import torch

from vllm_infinitehip.state import DecodeSlots, refresh_level, refresh_levels, stale_steps

INTERVALS = (8, 4, 2)


def test_refresh_schedule_matches_intervals():
    intervals = (96, 24, 8)
    levels = [refresh_level(s, intervals) for s in range(200)]
    assert levels[0] == 0
    for s in range(1, 200):
        if s % 96 == 0:
            assert levels[s] == 0
        elif s % 24 == 0:
            assert levels[s] == 1
        elif s % 8 == 0:
            assert levels[s] == 2
        else:
            assert levels[s] == 3  # reuse
    assert sum(1 for x in levels[:192] if x == 0) == 2
    assert sum(1 for x in levels[:192] if x <= 1) == 8
    assert sum(1 for x in levels[:192] if x <= 2) == 24
    steps = torch.arange(200, dtype=torch.int32)
    assert refresh_levels(steps, intervals).tolist() == levels


def test_stale_steps_count_back_to_the_last_refresh_of_any_level():
    """Against a walk of the schedule: the steps since a level other than reuse last came, for
    nested intervals and for intervals that do not divide each other."""
    for intervals in ((32, 16, 8), (10, 7, 3), (5, 5, 5)):
        n = len(intervals)
        last, want = 0, []
        for s in range(300):
            if refresh_level(s, intervals) < n:
                last = s
            want.append(s - last)
        got = stale_steps(torch.arange(300, dtype=torch.int32), intervals).tolist()
        assert got == want, intervals
        assert max(want) == min(intervals) - 1


def table(rows: list[list[int]]) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)


def step(slots: DecodeSlots, rows, seq_lens, threshold=0):
    s, lv = slots.assign(table(rows), torch.tensor(seq_lens, dtype=torch.int32), threshold, 16)
    return s.tolist(), lv.tolist()


def test_slots_follow_requests_and_free_the_ones_that_left():
    slots = DecodeSlots(4, INTERVALS, torch.device("cpu"))
    a = [5, 6, 7]  # request A: 40 tokens -> 3 blocks
    b = [9, 10]  # request B: 20 tokens
    s0, lv0 = step(slots, [a, b], [40, 20])
    assert sorted(s0) == [0, 1] and lv0 == [0, 0] and slots.live() == 2
    s1, lv1 = step(slots, [a, b], [41, 21])
    assert s1 == s0 and lv1 == [3, 3]  # step 1 of (8, 4, 2): reuse
    s2, lv2 = step(slots, [a, b], [42, 22])
    assert s2 == s0 and lv2 == [2, 2]
    # B left (finished, aborted or preempted): its slot is free after this step
    s3, _ = step(slots, [a], [43])
    assert s3 == [s0[0]] and slots.live() == 1
    # a new request on B's old blocks, and a length jump on A's: both start afresh
    s4, lv4 = step(slots, [a + [8], [9, 10]], [50, 30])
    assert lv4 == [0, 0] and slots.live() == 2
    # a step without sparse rows keeps nothing
    step(slots, [a + [8]], [51], threshold=100)
    assert slots.live() == 0
    # levels are counted once per row and step: 4 + 2 + 2 + 1 + 2 rows had slots
    counts = slots.level_counts.tolist()
    assert counts[:4] == [2 + 2, 0, 2, 2 + 1] and counts[4] == 1


def test_a_block_crossing_keeps_the_slot():
    slots = DecodeSlots(2, INTERVALS, torch.device("cpu"))
    s0, _ = step(slots, [[3]], [16])  # position 15 is the last of block 3
    s1, lv = step(slots, [[3, 4]], [17])  # previous token in block 3, this one in block 4
    assert s1 == s0 and lv == [3]
    s2, _ = step(slots, [[3, 4]], [18])
    assert s2 == s0


def test_rows_claiming_one_slot_get_separate_ones():
    """Two rows whose previous token sits in one shared block at one length: the earlier row
    keeps the slot, the other starts afresh (prefix caching can share a full block)."""
    slots = DecodeSlots(4, INTERVALS, torch.device("cpu"))
    s0, _ = step(slots, [[1, 2]], [20])
    s1, lv = step(slots, [[1, 2], [1, 2]], [21, 21])
    assert s1[0] == s0[0] and s1[1] != s0[0] and lv == [3, 0]


def test_more_rows_than_slots_leaves_the_rest_dense():
    slots = DecodeSlots(1, INTERVALS, torch.device("cpu"))
    s0, lv = step(slots, [[1], [2]], [10, 10])
    assert s0 == [0, -1] and lv == [0, -1]
    # with the only slot kept, a newcomer must not get it too (its mask would overwrite)
    s1, lv1 = step(slots, [[1], [2], [3]], [11, 10, 10])
    assert s1 == [0, -1, -1] and lv1 == [3, -1, -1]
