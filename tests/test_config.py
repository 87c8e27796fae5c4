import pytest

from vllm_infinitehip.config import PRESETS, InfiniteHiPConfig, InfiniteHiPConfigError


def test_default_is_3k_5k_with_code_defaults():
    """Prefill prunes with the 3K stages, decode with the 5K stages (``"auto"``, no model yet)."""
    c = InfiniteHiPConfig.from_user(None)
    assert c.preset == "3k-5k"
    assert (c.sink_tokens, c.window_tokens) == (256, 1024)
    assert [(s.chunk_size, s.keep_tokens, s.query_stride) for s in c.stages] == [
        (256, 32768, 4),
        (32, 8192, 4),
        (8, 2048, 1),
    ]
    assert c.decode_stages == "auto"
    assert [(s.chunk_size, s.keep_tokens, s.query_stride) for s in c.for_decode().stages] == [
        (64, 32768, 4),
        (32, 16384, 4),
        (16, 4096, 1),
    ]
    assert c.refresh_intervals == (32, 16, 8)
    assert c.effective_dense_threshold == 256 + 1024 + 2048
    assert (c.head_reduction, c.exact_last_stage, c.drop_window_candidates,
            c.extend_reused_blocks) == ("z-score", True, True, True)
    assert c.remap_pruning == "always"
    assert c.final_keep_for_layer(0) == 4096 and c.final_keep_for_layer(10) == 2048
    decode = c.for_decode()
    assert decode.decode_stages is None and decode.block_size_k == 16
    assert decode.final_keep_for_layer(0) == 4096 and decode.final_keep_for_layer(10) == 4096
    assert InfiniteHiPConfig.from_user(c.to_dict()) == c


def test_decode_stages_follow_given_stages_unless_given_too():
    stages = [{"chunk_size": 64, "keep_tokens": 2048}, {"chunk_size": 16, "keep_tokens": 1024},
              {"chunk_size": 4, "keep_tokens": 256}]
    own = InfiniteHiPConfig.from_user({"stages": stages})
    assert own.decode_stages is None and own.for_decode() is own  # not the preset's 5K stages
    assert own.for_decode().block_size_k == 4
    both = InfiniteHiPConfig.from_user({"stages": stages, "decode_stages": stages[:2],
                                        "refresh_intervals": [8, 4]})
    assert [s.chunk_size for s in both.stages] == [64, 16, 4]
    assert [s.chunk_size for s in both.for_decode().stages] == [64, 16]
    assert both.for_decode().final_keep_tokens == 1024
    assert both.decode_threshold(None) == 256 + 1024 + 1024  # decode's final budget
    assert InfiniteHiPConfig.from_user(both.to_dict()) == both
    paper = InfiniteHiPConfig.from_user({"preset": "3k-fast"})
    assert paper.decode_stages is None and paper.for_decode().stages == paper.stages
    only_decode = InfiniteHiPConfig.from_user({"decode_stages": stages})
    assert only_decode.stages == paper.stages and only_decode.for_decode().block_size_k == 4


def test_auto_decode_stages_keep_the_span_inside_half_the_trained_length():
    """``"auto"``: the 5K decode stages (sink 256 + 4096 + window 1024 = 5376 tokens laid out
    left of a remapped row's query) where that span is at most half the trained length or RoPE
    extension is off; otherwise decode prunes with ``stages``."""
    c = InfiniteHiPConfig.from_user({})
    five = c.for_decode().stages
    for trained, extension, decode in [(32768, True, five), (10752, True, five),
                                       (10750, True, c.stages), (8192, True, c.stages),
                                       (8192, False, five)]:
        resolved = c.for_model(trained, extension)
        assert resolved.for_decode().stages == decode, (trained, extension)
        assert resolved.stages == c.stages  # prefill untouched
    assert c.for_model(8192, True).decode_threshold(None) == 256 + 1024 + 2048
    narrow = InfiniteHiPConfig.from_user({"window_tokens": 256})  # span 4608 fits 9216
    assert narrow.for_model(9216, True).for_decode().block_size_k == 16
    given = InfiniteHiPConfig.from_user({"decode_stages": PRESETS["5k"]["stages"]})
    assert given.for_model(8192, True) is given  # a list given is kept as given
    assert InfiniteHiPConfig.from_user(c.to_dict()) == c
    with pytest.raises(InfiniteHiPConfigError, match=r"refresh_intervals.*decode_stages.*5K"):
        InfiniteHiPConfig.from_user({"stages": PRESETS["5k"]["stages"][1:], "decode_stages": "auto",
                                     "refresh_intervals": [8, 4]})  # fmt: skip


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_validates(preset):
    c = InfiniteHiPConfig.from_user({"preset": preset})
    assert c.preset == preset
    assert c.refresh_intervals == PRESETS[preset]["refresh_intervals"]


def test_presets_differ_as_documented():
    assert InfiniteHiPConfig.from_user({"preset": "3k"}).refresh_intervals == (16, 8, 4)
    assert InfiniteHiPConfig.from_user({"preset": "3k-fast"}).refresh_intervals == (32, 16, 8)
    assert InfiniteHiPConfig.from_user({"preset": "3k-flash"}).refresh_intervals == (96, 24, 8)
    five = InfiniteHiPConfig.from_user({"preset": "5k"})
    assert [s.chunk_size for s in five.stages] == [64, 32, 16]
    assert [s.keep_tokens for s in five.stages] == [32768, 16384, 4096]


def test_every_field_overridable_and_json_string():
    c = InfiniteHiPConfig.from_user(
        '{"preset": "3k-fast", "sink_tokens": 64, "window_tokens": 512, "dense_threshold": 100,'
        ' "probe": "first", "dense_layers": [0], "dense_layer_keep_tokens": 1024,'
        ' "refresh_intervals": [8, 4, 2],'
        ' "stages": [{"chunk_size": 64, "keep_tokens": 2048}, {"chunk_size": 16, "keep_tokens": 1024},'
        ' {"chunk_size": 4, "keep_tokens": 256}]}'
    )
    assert (c.sink_tokens, c.window_tokens, c.effective_dense_threshold) == (64, 512, 100)
    assert c.probe == "first" and c.dense_layers == (0,) and c.block_size_k == 4
    assert c.refresh_intervals == (8, 4, 2)
    assert InfiniteHiPConfig.from_user(c.to_dict()) == c


def test_dense_decode_threshold_auto_takes_the_device_crossover():
    auto = InfiniteHiPConfig.from_user(None)
    assert auto.dense_threshold == "auto"
    assert auto.decode_threshold(32768) == 32768  # a GPU with FlashAttention
    # elsewhere: where sparsity starts, with the decode stages' final budget
    assert auto.decode_threshold(None) == 256 + 1024 + 4096
    fixed = InfiniteHiPConfig.from_user({"dense_threshold": 3328})
    assert fixed.decode_threshold(32768) == 3328  # an explicit value is kept on every device
    assert InfiniteHiPConfig.from_user({"dense_threshold": None}).decode_threshold(32768) == 5376
    with pytest.raises(InfiniteHiPConfigError, match=r"infinitehip\.dense_threshold"):
        InfiniteHiPConfig.from_user({"dense_threshold": "big"})


def test_negative_dense_layers_count_from_the_last_layer():
    c = InfiniteHiPConfig.from_user({"dense_layers": [0, 1, 2, 3, -1]})
    assert c.for_layers(24).dense_layers == (0, 1, 2, 3, 23)
    assert c.for_layers(24).final_keep_for_layer(23) == 4096
    assert c.for_layers(4).dense_layers == (0, 1, 2, 3)  # the last is one of the first four
    with pytest.raises(InfiniteHiPConfigError, match=r"infinitehip.dense_layers\[0\]"):
        InfiniteHiPConfig.from_user({"dense_layers": [-30]}).for_layers(24)


def test_selection_rules_parse_and_reach_the_layers():
    from vllm_infinitehip.backend import layer_prune_params

    raw = {"head_reduction": "z-score", "exact_last_stage": True, "drop_window_candidates": True,
           "extend_reused_blocks": False}
    c = InfiniteHiPConfig.from_user(raw)
    p = layer_prune_params(c, 5)
    assert (p.head_reduction, p.exact_last_stage, p.drop_window_candidates,
            p.extend_reused_blocks) == ("z-score", True, True, False)
    assert InfiniteHiPConfig.from_user(c.to_dict()) == c


def test_group_bisection_reaches_prefill_params_and_not_decode_params():
    from vllm_infinitehip.backend import layer_prune_params

    c = InfiniteHiPConfig.from_user({"prefill_representatives": "group-bisection"})
    assert c.prefill_group_probes and layer_prune_params(c, 5, prefill=True).group_probes
    assert not layer_prune_params(c.for_decode(), 5).group_probes
    assert not layer_prune_params(InfiniteHiPConfig(), 5, prefill=True).group_probes
    assert InfiniteHiPConfig.from_user(c.to_dict()) == c
    with pytest.raises(InfiniteHiPConfigError, match="prefill_representatives"):
        InfiniteHiPConfig.from_user({"prefill_representatives": "kv-group"})


@pytest.mark.parametrize(
    "raw, field",
    [
        ({"sink_token": 1}, "infinitehip.sink_token"),
        ({"preset": "7k"}, "infinitehip.preset"),
        ({"sink_tokens": "256"}, "infinitehip.sink_tokens"),
        ({"window_tokens": True}, "infinitehip.window_tokens"),
        ({"probe": "centre"}, "infinitehip.probe"),
        ({"refresh_intervals": [8, 4]}, "infinitehip.refresh_intervals"),
        ({"refresh_intervals": [8, 16, 4]}, "infinitehip.refresh_intervals[1]"),
        (
            {"stages": [{"chunk_size": 256, "keep_tokens": 4096}, {"chunk_size": 48, "keep_tokens": 480},
                        {"chunk_size": 8, "keep_tokens": 256}]},
            "infinitehip.stages[1].chunk_size",
        ),
        (
            {"stages": [{"chunk_size": 256, "keep_tokens": 1000}, {"chunk_size": 32, "keep_tokens": 512},
                        {"chunk_size": 8, "keep_tokens": 256}]},
            "infinitehip.stages[0].keep_tokens",
        ),
        (
            {"stages": [{"chunk_size": 256, "keep_tokens": 4096, "block_size_q": 64},
                        {"chunk_size": 32, "keep_tokens": 512, "block_size_q": 128},
                        {"chunk_size": 8, "keep_tokens": 256}]},
            "infinitehip.stages[1].block_size_q",
        ),
        ({"window_tokens": 128}, "infinitehip.window_tokens"),
        ({"stages": [{"chunk_size": 8}]}, "infinitehip.stages[0].keep_tokens"),
        ({"stages": [{"chunk_size": 8, "keep_tokens": 64, "size": 1}]}, "infinitehip.stages[0].size"),
        ({"dense_layers": [1.5]}, "infinitehip.dense_layers[0]"),
        ({"prefill_final_query_own_mask": 1}, "infinitehip.prefill_final_query_own_mask"),
        ({"head_reduction": "mean"}, "infinitehip.head_reduction"),
        ({"exact_last_stage": "yes"}, "infinitehip.exact_last_stage"),
        ({"drop_window_candidates": 0}, "infinitehip.drop_window_candidates"),
        ({"extend_reused_blocks": "on"}, "infinitehip.extend_reused_blocks"),
        ({"remap_pruning": "never"}, "infinitehip.remap_pruning"),
        ({"prefill_representatives": "mean"}, "infinitehip.prefill_representatives"),
        ({"prefill_representatives": "landmark", "window_tokens": 512},
         "infinitehip.stages[0].chunk_size"),
        ({"prefill_representatives": "landmark", "offload": True}, "infinitehip.offload.layout"),
        ({"decode_stages": [{"chunk_size": 64, "keep_tokens": 4096},
                            {"chunk_size": 24, "keep_tokens": 480}]},
         "infinitehip.decode_stages[1].chunk_size"),
        ({"decode_stages": [{"chunk_size": 16, "keep_tokens": 4096}]},
         "infinitehip.refresh_intervals` has 3 entries but there are 1 `infinitehip.decode_stages"),
        ({"decode_stages": {"chunk_size": 16}}, "infinitehip.decode_stages"),
        ({"decode_stages": [{"chunk_size": 64, "keep_tokens": 4096, "size": 1}]},
         "infinitehip.decode_stages[0].size"),
        ({"decode_stages": [{"chunk_size": 64, "keep_tokens": 32768}, {"chunk_size": 32, "keep_tokens": 16384},
                            {"chunk_size": 32, "keep_tokens": 4096}], "dense_layer_keep_tokens": 4112},
         "infinitehip.decode_stages[2]"),
        ("{not json", "not valid JSON"),
    ],
)
def test_bad_config_names_the_field(raw, field):
    with pytest.raises(InfiniteHiPConfigError) as e:
        InfiniteHiPConfig.from_user(raw)
    assert field in str(e.value)


def test_a_first_stage_may_score_coarser_query_blocks():
    c = InfiniteHiPConfig.from_user({"stages": [
        {"chunk_size": 256, "keep_tokens": 32768, "block_size_q": 128, "query_stride": 8},
        {"chunk_size": 32, "keep_tokens": 8192, "block_size_q": 64, "query_stride": 4},
        {"chunk_size": 8, "keep_tokens": 2048, "block_size_q": 64, "query_stride": 1},
    ]})  # fmt: skip
    assert [s.block_size_q for s in c.stages] == [128, 64, 64]
    with pytest.raises(InfiniteHiPConfigError, match=r"stages\[1\].block_size_q.*must divide"):
        InfiniteHiPConfig.from_user({"stages": [
            {"chunk_size": 256, "keep_tokens": 32768, "block_size_q": 96, "query_stride": 8},
            {"chunk_size": 32, "keep_tokens": 8192, "block_size_q": 64},
            {"chunk_size": 8, "keep_tokens": 2048, "block_size_q": 64, "query_stride": 1},
        ]})  # fmt: skip


def test_tail_window_fills_the_trained_length_with_the_final_budget():
    c = InfiniteHiPConfig.from_user({})  # sink 256, final 2048, b_q 64
    assert c.tail_window(8192) == 8192 - 256 - 2048 - 64
    assert c.tail_window(2048) == c.window_tokens  # never below the window
    assert InfiniteHiPConfig.from_user({"prefill_tail_window": None}).tail_window(8192) is None
    assert InfiniteHiPConfig.from_user({"prefill_tail_window": 3000}).tail_window(8192) == 3000


def test_spans_past_the_trained_length_are_named_per_kind_of_layer():
    # defaults: sink 256, window 1024, kept 2048 (4096 in dense_layers), b_q 64
    assert InfiniteHiPConfig.from_user({}).spans_past_trained(8192) == []
    wide = InfiniteHiPConfig.from_user({"window_tokens": 4096}).spans_past_trained(8192)
    assert wide == [("dense_layers: sink_tokens 256 + kept 4096 + window_tokens 4096 + "
                     "block_size_q 64 - 1 = 8511")]
    kept = InfiniteHiPConfig.from_user({"dense_layer_keep_tokens": 8192})
    assert [line.split(":")[0] for line in kept.spans_past_trained(8192)] == ["dense_layers"]
    assert [line.split(":")[0] for line in kept.spans_past_trained(3000)] == [
        "layers", "dense_layers"]
    no_dense = InfiniteHiPConfig.from_user({"dense_layers": []})
    assert no_dense.spans_past_trained(3391) == []
    assert no_dense.spans_past_trained(3390) == [
        "layers: sink_tokens 256 + kept 2048 + window_tokens 1024 + block_size_q 64 - 1 = 3391"]


def test_prefill_dense_threshold_rule():
    from vllm_infinitehip.config import CPU_DENSE_PREFILL_CROSSOVER, DENSE_PREFILL_CROSSOVER

    auto = InfiniteHiPConfig.from_user({})
    base = auto.effective_dense_threshold
    gpu, cpu = DENSE_PREFILL_CROSSOVER, CPU_DENSE_PREFILL_CROSSOVER
    assert auto.prefill_threshold(gpu, rope_extension=False, trained_context=8192) == gpu
    # dense attention sees true positions: only inside the trained length with extension on
    assert auto.prefill_threshold(gpu, True, 8192) == 8192
    assert auto.prefill_threshold(gpu, True, 1 << 20) == gpu
    assert auto.prefill_threshold(cpu, False, 8192) == cpu
    assert auto.prefill_threshold(cpu, True, 8192) == 8192
    assert auto.prefill_threshold(None, False, 8192) == base  # dense never the cheaper one
    # a threshold below the dense one never makes short contexts sparse
    assert auto.prefill_threshold(cpu, True, 1024) == base
    off = InfiniteHiPConfig.from_user({"prefill_dense_threshold": None})
    assert off.prefill_threshold(gpu, False, 8192) == base
    fixed = InfiniteHiPConfig.from_user({"prefill_dense_threshold": 50000})
    assert fixed.prefill_threshold(None, True, 8192) == 50000
    with pytest.raises(ValueError, match=r"infinitehip\.prefill_dense_threshold"):
        InfiniteHiPConfig.from_user({"prefill_dense_threshold": "big"})
    with pytest.raises(ValueError, match=r"infinitehip\.scoring_precision"):
        InfiniteHiPConfig.from_user({"scoring_precision": "fp16"})


def test_tp_mask_is_per_rank_by_default_and_global_on_request():
    assert InfiniteHiPConfig.from_user({}).tp_mask == "per-rank"
    assert InfiniteHiPConfig.from_user({"tp_mask": "global"}).tp_mask == "global"
    with pytest.raises(ValueError, match=r"infinitehip\.tp_mask.*per-rank, global"):
        InfiniteHiPConfig.from_user({"tp_mask": "all"})


def test_offload_is_off_by_default_and_parses_short_and_long_forms():
    from vllm_infinitehip.config import OffloadConfig

    assert InfiniteHiPConfig.from_user({}).offload == OffloadConfig(enabled=False)
    assert InfiniteHiPConfig.from_user({"offload": True}).offload == OffloadConfig(enabled=True)
    assert InfiniteHiPConfig.from_user({"offload": False}).offload.enabled is False
    # an object turns it on unless it says otherwise; sizes are GiB, integers accepted
    c = InfiniteHiPConfig.from_user({"offload": {"host_gib": 64, "bank_gib": 2.5}})
    assert c.offload == OffloadConfig(enabled=True, host_gib=64.0, bank_gib=2.5)
    assert InfiniteHiPConfig.from_user({"offload": {"enabled": False, "host_gib": 8}}).offload == (
        OffloadConfig(enabled=False, host_gib=8.0)
    )
    assert InfiniteHiPConfig.from_user({"offload": {"host_gib": None}}).offload.host_gib is None
    assert InfiniteHiPConfig.from_user(c.to_dict()) == c


@pytest.mark.parametrize(
    "offload, field",
    [
        ("yes", "infinitehip.offload"),
        ({"host_gb": 8}, "infinitehip.offload.host_gb"),
        ({"enabled": "true"}, "infinitehip.offload.enabled"),
        ({"host_gib": 0}, "infinitehip.offload.host_gib"),
        ({"host_gib": True}, "infinitehip.offload.host_gib"),
        ({"bank_gib": -1}, "infinitehip.offload.bank_gib"),
        ({"bank_gib": "4"}, "infinitehip.offload.bank_gib"),
    ],
)
def test_bad_offload_config_names_the_field(offload, field):
    with pytest.raises(InfiniteHiPConfigError, match=rf"`{field}`"):
        InfiniteHiPConfig.from_user({"offload": offload})


def test_the_landmark_window_keeps_every_follower_before_the_block_that_scores():
    """512 queries (the authors') with the defaults; shorter where the window leaves less room
    between a first-stage chunk and the window."""
    assert InfiniteHiPConfig.from_user({}).landmark_window == 512
    small = {"window_tokens": 256, "stages": [
        {"chunk_size": 64, "keep_tokens": 1024}, {"chunk_size": 16, "keep_tokens": 512},
        {"chunk_size": 8, "keep_tokens": 256}], "prefill_representatives": "landmark"}
    assert InfiniteHiPConfig.from_user(small).landmark_window == 256 - 2 * 64
