"""The end-to-end benchmark's bookkeeping (``benchmarks/e2e.py``, ``benchmarks/tp.py``), on
hand-made traces and rows: the GPU-idle attribution the GPU runs need to say which host call keeps
a host-bound decode step long, and the tensor-parallel engines, ratios and rows of the 2-GPU run,
which no CPU can run (vLLM's CPU platform refuses the Ray executor)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import e2e  # noqa: E402  (benchmarks/e2e.py)
import pytest  # noqa: E402
import tp  # noqa: E402  (benchmarks/tp.py)


def test_idle_gaps_are_charged_to_the_host_call_that_ended_them():
    # two steps: kernels overlap inside a step (one busy stretch), then the GPU waits for the
    # next step's graph launch; a 2 us hole inside step 2 is under the threshold
    kernels = [
        ("gemm", 0.0, 40.0), ("attn", 30.0, 50.0),  # step 1: busy 0-50
        ("gemm", 80.0, 120.0), ("norm", 122.0, 130.0),  # step 2: 30 us gap, then a 2 us hole
        ("gemm", 200.0, 240.0),  # 70 us gap before it
    ]
    launches = [
        ("cudaGraphLaunch", 1.0, 5.0, "model_runner.py(10): execute"),
        ("cudaEventSynchronize", 20.0, 55.0, "async_utils.py(50): get_output"),  # idle at 50
        ("cudaLaunchKernel", 60.0, 62.0, "backend.py(5): build"),  # ends the first gap
        ("cudaGraphLaunch", 75.0, 79.0, "model_runner.py(10): execute"),  # ends it, later
        ("cudaMemcpyAsync", 150.0, 151.0, "sampler.py(3): sample"),
        ("cudaGraphLaunch", 190.0, 199.0, "model_runner.py(10): execute"),  # ends the second
        ("cudaLaunchKernel", 205.0, 206.0, "backend.py(5): build"),  # after the gap: not it
    ]
    got = e2e.idle_gaps(kernels, launches, steps=2)
    assert got["idle_us_per_step"] == (30.0 + 70.0) / 2
    assert got["gaps_per_step"] == 1.0
    assert got["by_host_call"] == [
        ["model_runner.py(10): execute > cudaGraphLaunch", 50.0, 1.0],
    ]
    # the first gap began inside the synchronize; the second while the host ran Python
    assert got["by_call_in_flight"] == [
        ["(host busy)", 35.0, 0.5],
        ["async_utils.py(50): get_output > cudaEventSynchronize", 15.0, 0.5],
    ]


def test_idle_gaps_of_a_busy_gpu_and_of_a_gap_before_any_host_call():
    assert e2e.idle_gaps([("k", 0.0, 10.0), ("k", 10.0, 20.0)], [], steps=1) == {
        "idle_us_per_step": 0.0, "gaps_per_step": 0.0, "by_host_call": [],
        "by_call_in_flight": [],
    }  # fmt: skip
    got = e2e.idle_gaps([("k", 0.0, 10.0), ("k", 50.0, 60.0)], [("cuX", 70.0, 71.0, "c")], 1)
    assert got["by_host_call"] == [["(no host call)", 40.0, 1.0]]
    assert got["by_call_in_flight"] == [["(host busy)", 40.0, 1.0]]


def test_tensor_parallel_engines_reach_vllm_as_its_own_arguments():
    spec = e2e.engine_spec("3k-fast+ext+tp2+ray", 140000, trained=8192)
    assert (spec["tensor_parallel_size"], spec["distributed_executor_backend"]) == (2, "ray")
    assert spec["attention_backend"] == "infinitehip"
    assert spec["additional_config"]["infinitehip"]["rope_extension"] is True
    assert spec["additional_config"]["infinitehip"]["trained_context"] == 8192
    assert spec["load_format"] == "dummy"
    fa = e2e.engine_spec("flash_attn+tp2", 140000)
    assert (fa["tensor_parallel_size"], fa["distributed_executor_backend"]) == (2, "mp")
    assert fa["attention_backend"] == "FLASH_ATTN"
    assert "tensor_parallel_size" not in e2e.engine_spec("3k-fast", 140000)
    with pytest.raises(SystemExit, match="executor for"):
        e2e.engine_spec("3k-fast+ray", 140000)


def test_selection_rule_engines_set_every_rule_and_the_block_extension():
    """A plain preset runs the defaults; +paper / +rules name their rules and read blocks as
    chosen unless +extend is named too."""
    hip = lambda name: e2e.engine_spec(name, 140000)["additional_config"]["infinitehip"]
    assert set(hip("3k-fast")) == {"preset", "rope_extension"}
    paper = hip("3k-fast+paper")
    assert (paper["head_reduction"], paper["remap_pruning"], paper["extend_reused_blocks"]) == (
        "max", "past-trained", False)
    assert hip("3k+rules")["extend_reused_blocks"] is False
    rules = hip("3k+rules+extend")
    assert (rules["head_reduction"], rules["extend_reused_blocks"]) == ("z-score", True)
    assert hip("3k-fast+landmark")["prefill_representatives"] == "landmark"
    from vllm_infinitehip.config import InfiniteHiPConfig

    InfiniteHiPConfig.from_user(hip("3k-fast+landmark"))  # a valid config
    # +bk16: the last stage's blocks of 16, its budget and the other stages the preset's
    config = InfiniteHiPConfig.from_user(hip("3k-fast+bk16+qb128"))
    preset = InfiniteHiPConfig.from_user({"preset": "3k-fast"})
    assert (config.block_size_k, config.final_keep_tokens) == (16, preset.final_keep_tokens)
    assert config.stages[0].block_size_q == 128
    assert config.stages[1:-1] == preset.stages[1:-1]
    # on a preset with its own decode stages the modifiers change prefill's stages only
    mixed = InfiniteHiPConfig.from_user(hip("3k-5k+qb128"))
    default = InfiniteHiPConfig.from_user({"preset": "3k-5k"})
    assert mixed.stages[0].block_size_q == 128 and mixed.decode_stages == default.decode_stages


def _speed(engine, backend, tp_size, tok_s, batch=1, context=131072):
    return {"engine": engine, "backend": backend, "tp": tp_size, "context": context,
            "batch": batch, "decode_tok_s": tok_s, "prefill_s": 10.0,
            "executor": "ray" if tp_size > 1 else None}  # fmt: skip


def test_tp2_rows_are_compared_with_tp1_and_with_flash_attn_at_the_same_tp():
    rows = [_speed("3k-fast+ext", "infinitehip", 1, 100.0),
            _speed("3k-fast+ray+ext+tp2", "infinitehip", 2, 150.0),  # any modifier order
            _speed("flash_attn+tp2+ray", "flash_attn", 2, 60.0),
            _speed("flash_attn", "flash_attn", 1, 50.0),
            _speed("3k-fast+tp2+ray", "infinitehip", 2, 300.0, batch=8)]  # no TP = 1 row
    e2e.add_ratios(rows)
    by = {(r["engine"], r["batch"]): r for r in rows}
    assert by["3k-fast+ray+ext+tp2", 1]["decode_vs_tp1"] == 1.5
    assert by["3k-fast+ray+ext+tp2", 1]["decode_speedup_vs_flash_attn"] == 2.5  # FA at TP = 2
    assert by["3k-fast+ext", 1]["decode_speedup_vs_flash_attn"] == 2.0  # FA at TP = 1
    assert by["flash_attn+tp2+ray", 1]["decode_vs_tp1"] == 1.2
    assert by["3k-fast+ext", 1]["decode_vs_tp1"] is None
    assert by["3k-fast+tp2+ray", 8]["decode_vs_tp1"] is None
    assert "decode_vs_tp1" in e2e.table(rows)


def test_tp_results_join_speed_and_greedy_rows_in_the_issues_shape():
    speed = [_speed("3k-fast+tp2+ray", "infinitehip", 2, 150.0)]
    greedy = [{"backend": "infinitehip", "tp_mask": "global", "tp": 2, "executor": "ray",
               "prompt_tokens": n, "decode_tokens": 32, "token_agreement": a,
               "first_divergence": None if a == 1.0 else 3, "equal": a == 1.0}
              for n, a in ((2900, 1.0), (3500, 0.75))]  # fmt: skip
    rows = tp.join(speed, greedy)
    for r in rows:
        assert {"tp", "executor", "context", "batch", "decode_tok_s", "greedy_match_tp1"} <= set(r)
    assert [r["kind"] for r in rows] == ["speed", "greedy", "greedy"]
    assert rows[0]["decode_tok_s"] == 150.0 and rows[0]["greedy_match_tp1"] is None
    assert [(r["context"], r["batch"], r["greedy_match_tp1"]) for r in rows[1:]] == [
        (2900, 2, True), (3500, 2, False)]
    assert rows[2]["first_divergence"] == 3


@pytest.mark.parametrize("name,layout,gib,bank", [
    ("off", "off", None, None), ("fp8:32", "host", 32.0, 32.0), ("fp8-split", "split", None, None),
    ("fp8-split:40", "split", 40.0, None), ("bf16-split", "split", None, None),
    ("fp8-split:40:0", "split", 40.0, 0.0), ("fp8-split:40:4", "split", 40.0, 4.0),
])  # fmt: skip
def test_offload_engines_name_a_layout_the_config_accepts(name, layout, gib, bank):
    """benchmarks/offload.py's engine names become an offload config that parses, with the
    size where its layout takes it (the bank of "host", the GPU side of "split" and its V
    bank)."""
    import offload  # noqa: E402  (benchmarks/offload.py)

    from vllm_infinitehip.config import InfiniteHiPConfig

    assert offload.parse_engine(name)[1:3] == (layout, gib)
    hip = offload.spec_for(name, 1 << 20, 80.0)["additional_config"]["infinitehip"]
    cfg = InfiniteHiPConfig.from_user(hip).offload
    assert cfg.enabled == (layout != "off")
    if layout != "off":
        assert cfg.layout == layout and cfg.host_gib == 80.0
        assert (cfg.bank_gib if layout == "host" else cfg.gpu_gib) == gib
        assert cfg.bank_gib == bank


def test_offload_counts_split_reads_of_host_homed_pages_only():
    """``tier_pages_per_step`` from a real split layout's V bank (CPU): a step whose rows read
    only GPU-homed pages counts 0 pages, not 0 hits of many reads; one that reads host-homed
    pages counts each of them, every layer."""
    import offload  # noqa: E402  (benchmarks/offload.py)
    import torch

    from vllm_infinitehip.block_manager.split_kv import SplitKV
    from vllm_infinitehip.metrics import tier_ratios

    layers, blocks, gpu_pages = 2, 16, 4
    split = SplitKV(layers, blocks, gpu_pages, (1, 1, 1), torch.float32, torch.device("cpu"),
                    bank_slots=3)  # fmt: skip
    split.place(range(gpu_pages), {"r": list(range(gpu_pages))})
    split.place(range(gpu_pages, 8), {"r": list(range(8))})  # four victims' V to the host
    host_homed = [b for b in range(8) if split.home[b] < 0]
    assert len(host_homed) == 4 and split.spilled_blocks == 4
    split.bank.allocate_plan(4, 0)
    rows = torch.ones(1, dtype=torch.bool)

    def step(pages: list[int]) -> float | None:
        read = torch.tensor(pages).view(1, 1, -1).expand(layers, 1, -1)
        split.plan_reads(read, rows, rows, fill_entries=len(pages))
        tier = split.bank.stats(reset=True)
        return offload.tier_pages_per_step({**tier, **tier_ratios(tier)})

    gpu_homed = [b for b in range(8) if split.home[b] >= 0]
    assert step(gpu_homed[:3]) == 0.0
    assert step(host_homed[:2] + gpu_homed[:1]) == 2 * layers
    assert offload.tier_pages_per_step({}) is None


def test_offload_compares_a_context_the_tier_off_cannot_hold_with_more_gpu_kv():
    """Where the tier off has a row, greedy tokens and decode ratios are against it; where it
    has none, each engine's tokens are against the one that kept the most KV on the GPU."""
    import offload  # noqa: E402  (benchmarks/offload.py)

    def row(engine, ctx, on, gpu, tokens, tok_s=100.0):
        return {"engine": engine, "context": ctx, "kv_dtype": "fp8", "offload": on,
                "gpu_kv_gib": gpu, "tokens": tokens, "decode_tok_s": tok_s,
                "decode_tok_s_steady": tok_s}  # fmt: skip

    rows = [row("fp8-off", 1, False, 32.0, [1, 2], 200.0),
            row("fp8-split:24", 1, True, 19.0, [1, 2]), row("fp8-split", 3, True, 100.0, [5, 6]),
            row("fp8-split:40", 3, True, 35.0, [5, 6]), row("fp8-split:20", 3, True, 20.0, [5, 7])]
    offload.compare(rows)
    assert [r["greedy_equal_to_tier_off"] for r in rows] == [None, True, None, None, None]
    assert rows[1]["decode_ratio_vs_tier_off"] == 0.5
    # 1: the tier off answers for it; 3: the largest GPU side is the reference of the others
    assert [r["greedy_equal_to_more_gpu"] for r in rows] == [None, None, None, True, False]
