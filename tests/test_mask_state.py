from vllm_infinitehip.mask_state import DecodeStateStore, refresh_level


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
    # rerun counts over 192 steps: stage 1 twice(+step 0), stage 2 on 24-multiples, ...
    assert sum(1 for x in levels[:192] if x == 0) == 2
    assert sum(1 for x in levels[:192] if x <= 1) == 8
    assert sum(1 for x in levels[:192] if x <= 2) == 24


def test_store_follows_requests_and_forgets_finished_ones():
    store = DecodeStateStore()
    bs = 16
    a = [5, 6, 7]  # request A: 40 tokens -> 3 blocks
    b = [9, 10]  # request B: 20 tokens
    s1 = store.assign([a, b], [40, 20], bs)
    assert [s.decode_step for s in s1] == [0, 0]
    s2 = store.assign([a, b], [41, 21], bs)
    assert s2[0] is s1[0] and s2[1] is s1[1]
    assert [s.decode_step for s in s2] == [1, 1]
    # B finished: its state is dropped; A continues
    s3 = store.assign([a], [42], bs)
    assert s3[0] is s1[0] and len(store) == 1
    # a new request reusing B's blocks gets a fresh state
    s4 = store.assign([a, [9, 10]], [43, 30], bs)
    assert s4[0] is s1[0] and s4[1] is not s1[1] and s4[1].decode_step == 0
    # a length jump (not exactly one new token) is not the same request
    s5 = store.assign([a + [8], None], [50, 0], bs)
    assert s5[0] is not s1[0] and s5[1] is None


def test_store_rows_sharing_all_blocks_get_separate_states():
    store = DecodeStateStore()
    s1 = store.assign([[1, 2], [1, 3]], [20, 20], 16)
    assert s1[0] is not s1[1]
    s2 = store.assign([[1, 2], [1, 3]], [21, 21], 16)
    assert s2[0] is s1[0] and s2[1] is s1[1]
