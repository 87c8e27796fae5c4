"""The backend inside vLLM on a CUDA GPU (Triton path). CPU twins: tests/test_vllm_cpu.py.

Runs the tests' tiny Llama (its shapes; ``load_format="dummy"`` weights); each engine runs in its
own process through tests/helpers/generate.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HELPER = Path(__file__).parent.parent / "helpers" / "generate.py"

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ENGINE = dict(load_format="dummy", dtype="float32", enforce_eager=True, max_model_len=4096,
              max_num_seqs=4, gpu_memory_utilization=0.3, seed=0)
STAGES = [{"chunk_size": 64, "keep_tokens": 1024, "block_size_q": 32, "query_stride": 4},
          {"chunk_size": 16, "keep_tokens": 512, "block_size_q": 32, "query_stride": 4},
          {"chunk_size": 8, "keep_tokens": 256, "block_size_q": 32, "query_stride": 1}]
PROMPTS = ["def main():\n    " + "x = compute(x)\n    " * 300 + "return", "import os\n" * 600]


@pytest.fixture
def generate(tiny_model, tmp_path):
    """``generate(backend, engine, max_tokens, **extra)``: the tiny Llama's greedy tokens (and the
    worker's report) from an engine in its own process."""
    return lambda *args, **kw: _generate(tiny_model, tmp_path, *args, **kw)


def _generate(model: str, tmp_path: Path, backend: str, engine: dict, max_tokens: int = 12,
              **extra):
    spec = {"engine": engine, "prompts": extra.pop("prompts", PROMPTS), "max_tokens": max_tokens,
            "report": backend == "infinitehip", **extra}
    (tmp_path / "in.json").write_text(json.dumps(spec))
    out = tmp_path / f"{backend}-{len(list(tmp_path.iterdir()))}.json"
    subprocess.run([sys.executable, str(HELPER), model, backend, str(tmp_path / "in.json"),
                    str(out)], check=True, timeout=600)
    return json.loads(out.read_text())


def test_full_budget_triton_path_equals_dense_backend(generate):
    full = [dict(s, keep_tokens=8192) for s in STAGES]
    hip = {"sink_tokens": 32, "window_tokens": 256, "dense_threshold": 64, "dense_layers": [],
           "stages": full, "prefill_tail_window": None, "prefill_dense_threshold": None}
    ours = generate("infinitehip", {**ENGINE, "additional_config": {"infinitehip": hip}})
    dense = generate("TRITON_ATTN", ENGINE)
    assert ours["report"]["stats"]["sparse_prefill_queries"] > 0
    assert ours["tokens"] == dense


def test_small_budget_runs_sparse_on_gpu(generate):
    hip = {"sink_tokens": 32, "window_tokens": 256, "dense_threshold": 512, "dense_layers": [],
           "stages": STAGES, "prefill_dense_threshold": None}
    ours = generate("infinitehip", {**ENGINE, "additional_config": {"infinitehip": hip}})
    stats = ours["report"]["stats"]
    assert all(len(t) == 12 for t in ours["tokens"])
    assert stats["sparse_prefill_queries"] > 0 and stats["sparse_decode_queries"] > 0
    assert stats["dense_queries"] == 0


SMALL = {"sink_tokens": 32, "window_tokens": 256, "dense_threshold": 512, "dense_layers": [],
         "stages": STAGES, "refresh_intervals": [8, 4, 2], "prefill_dense_threshold": None}
GRAPHS = {k: v for k, v in ENGINE.items() if k != "enforce_eager"}


@pytest.mark.parametrize("trained_context", [None, 1024], ids=["no-extension", "extension"])
def test_cuda_graphs_on_and_off_give_the_same_greedy_tokens(generate, trained_context):
    """vLLM's default FULL_AND_PIECEWISE mode captures infinitehip decode in full graphs; the
    replayed cascade (every refresh level inside one graph, each layer's behind a conditional
    node that skips it on steps refreshing nothing; with RoPE extension, the query placement
    inside it too) must give the eager tokens."""
    cfg = SMALL if trained_context is None else {**SMALL, "trained_context": trained_context}
    hip = {"additional_config": {"infinitehip": cfg}}
    eager = generate("infinitehip", {**ENGINE, **hip}, max_tokens=24)
    graphs = generate("infinitehip", {**GRAPHS, **hip}, max_tokens=24)
    stats = graphs["report"]["stats"]
    assert stats["sparse_decode_queries"] > 0
    assert stats["decode_graph_gated_layers"] == stats["layers"] > 0
    assert graphs["report"]["stats"]["refreshes"] == eager["report"]["stats"]["refreshes"]
    assert graphs["tokens"] == eager["tokens"]


def test_decode_forward_does_no_host_sync(generate):
    """Every pure-decode forward runs under torch.cuda.set_sync_debug_mode("error")."""
    ours = generate("infinitehip", {**ENGINE, "additional_config": {"infinitehip": SMALL}},
                    max_tokens=16, sync_debug=True)  # fmt: skip
    assert ours["report"]["sync_checked_forwards"] >= 2 * 15  # layers x decode steps
    assert ours["report"]["stats"]["sparse_decode_queries"] > 0


def test_mixed_refresh_levels_in_one_batch_equal_each_request_alone(generate):
    """Requests added a few steps apart decode side by side at different refresh levels, in
    one batched cascade; each must produce the tokens it produces alone."""
    hip = {"additional_config": {"infinitehip": SMALL}}
    prompts = PROMPTS + ["class A:\n    pass\n" * 200]
    together = generate("infinitehip", {**GRAPHS, **hip}, max_tokens=20,
                        prompts=prompts, stagger=[0, 3, 5])  # fmt: skip
    alone = generate("infinitehip", {**GRAPHS, **hip}, max_tokens=20, prompts=prompts,
                     one_at_a_time=True)["tokens"]  # fmt: skip
    levels = together["report"]["stats"]["refreshes"]
    assert len([k for k, v in levels.items() if v]) == 4  # every level ran
    assert together["tokens"] == alone


def test_prefill_chunks_of_several_requests_in_one_step_equal_each_alone(generate):
    """Three prompts prefilled in one step (one of them short enough to run dense, between the
    sparse ones): one dense call and one cascade and attention launch per kind of part for all
    of them, with CUDA graphs on. Each must produce the tokens it produces alone (one engine:
    the batch, then each prompt). CPU twin: tests/test_vllm_cpu.py (a batch of four)."""
    assert_a_batch_equals_each_prompt_alone(
        generate, {**SMALL, "prefill_dense_threshold": 1200}, max_num_batched_tokens=8192)


def assert_a_batch_equals_each_prompt_alone(generate, hip: dict, **engine) -> None:
    """Two sparse prompts and a dense one between them, with CUDA graphs on, in one engine:
    the batch, then each prompt alone; both kinds of prefill ran and the tokens agree."""
    prompts = [PROMPTS[0], "class A:\n    pass\n" * 60, PROMPTS[1]]
    out = generate("infinitehip", {**GRAPHS, **engine, "additional_config": {"infinitehip": hip}},
                   max_tokens=12, prompts=prompts, batch_then_alone=True)  # fmt: skip
    stats = out["report"]["stats"]
    assert stats["sparse_prefill_queries"] > 0 and stats["dense_queries"] > 0
    tokens = out["tokens"]
    assert tokens[:3] == tokens[3:]


def test_landmark_representatives_in_a_batch_equal_each_prompt_alone(generate):
    """``prefill_representatives: "landmark"`` on the GPU path: the step's chunks add their
    queries to the landmark state in one launch, the SelectRep kernel probes each chunk's
    representative; with CUDA graphs on and prompts cut into chunks differently in a batch
    than alone, each gives the tokens it gives alone (tail window off: it widens the last block
    of every chunk, whatever the representatives). CPU twin: tests/test_vllm_cpu.py."""
    hip = {**SMALL, "prefill_representatives": "landmark", "prefill_tail_window": None,
           "prefill_dense_threshold": 1200}
    assert_a_batch_equals_each_prompt_alone(generate, hip, max_num_batched_tokens=2048,
                                            enable_prefix_caching=False)  # fmt: skip


def test_dense_prefill_through_flash_attention_equals_the_dense_backend(generate):
    """Below ``prefill_dense_threshold`` prefill runs vLLM's FlashAttention over this plugin's
    cache layout (checked at startup); with decode dense too, greedy text equals FLASH_ATTN's."""
    bf16 = {**ENGINE, "dtype": "bfloat16"}
    hip = {"dense_threshold": 8192, "prefill_dense_threshold": 8192}
    ours = generate("infinitehip", {**bf16, "additional_config": {"infinitehip": hip}})
    assert ours["report"]["stats"]["sparse_prefill_queries"] == 0
    assert ours["tokens"] == generate("FLASH_ATTN", bf16)


@pytest.mark.parametrize("bank", ["pages", "pages+key-rows"])
def test_host_tier_on_and_off_give_the_same_greedy_tokens(generate, bank):
    """The KV in pinned host memory, CUDA graphs on: greedy tokens equal the tier off.
    ``pages``: a bank of 15 pages per layer (each sparse row reads about 50), too small for any
    key rows, so pruning reads through the page bank. ``pages+key-rows``: most of a 16 MiB bank
    holds the pruning stages' key rows, which later refreshes hit. CPU twin (pages only, the
    CPU's reference cascade reads every key): tests/test_offload_vllm.py; the key rows' logic
    on the CPU: tests/test_triton_decode.py."""
    off = generate("infinitehip", {**GRAPHS, "additional_config": {"infinitehip": SMALL}},
                   max_tokens=24)  # fmt: skip
    offload = {"enabled": True, "host_gib": 1, "bank_gib": 2**-12}
    if bank == "pages+key-rows":
        offload = {**offload, "host_gib": 0.25, "bank_gib": 2**-6, "key_row_share": 0.9}
    tier = {**SMALL, "offload": offload}
    on = generate("infinitehip", {**GRAPHS, "additional_config": {"infinitehip": tier}},
                  max_tokens=24)  # fmt: skip
    stats = on["report"]["stats"]
    assert stats["sparse_decode_queries"] > 0
    if bank == "pages":
        assert "key_row_hits" not in stats["tier"]
        assert stats["tier"]["filled_pages"] > 0 and stats["tier"]["attn_host_pages_reuse"] > 0
    else:
        assert stats["tier"]["key_rows_filled"] > 0 and stats["tier"]["key_row_hits"] > 0
        assert stats["tier"]["hit_ratio_mask"] > 0
    assert on["tokens"] == off["tokens"]


def test_split_layout_on_and_off_give_the_same_greedy_tokens(generate):
    """The host tier's split layout (``offload.layout`` "split"), CUDA graphs on: K of every
    block on the GPU, V of 36 blocks there and the rest in pinned host memory, read over the bus
    by decode and sparse prefill and staged for dense chunks, and the V bank's copies of host
    pages (the default sixteenth of the 5 MiB: 39 slots per layer and a spare) read by decode
    between refreshes. Greedy tokens equal the tier off with the same chunking. CPU twin:
    tests/test_split_kv_vllm.py."""
    engine = {**GRAPHS, "max_num_batched_tokens": 512}
    off = generate("infinitehip", {**engine, "additional_config": {"infinitehip": SMALL}},
                   max_tokens=24)  # fmt: skip
    # the tiny Llama's 16-token blocks hold 8 KiB of K and of V over its 2 layers: 5 MiB keep K
    # of 604 blocks and V of the 36 one step may allocate (512 tokens, 4 requests)
    split = {"enabled": True, "layout": "split", "host_gib": 0.25, "gpu_gib": 5 / 1024}
    on = generate("infinitehip", {**engine, "additional_config": {
        "infinitehip": {**SMALL, "offload": split}}}, max_tokens=24)  # fmt: skip
    stats = on["report"]["stats"]
    assert stats["sparse_decode_queries"] > 0 and stats["sparse_prefill_queries"] > 0
    assert stats["split"]["gpu_pages"] == 36 and stats["split"]["spilled_blocks"] > 0
    assert stats["tier"]["filled_pages"] > 0 and stats["tier"]["attn_bank_pages_reuse"] > 0
    assert on["tokens"] == off["tokens"]
