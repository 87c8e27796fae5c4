"""Shared fixtures: one tiny model, one in-process InfiniteHiP engine for the whole session."""

from __future__ import annotations

import gc
import os

# Engines run in-process (starts in seconds, and tests can read the workers' counters).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import pytest

# Small enough that a few-thousand-token prompt runs the sparse path with real pruning. The
# "auto" prefill threshold would prefill such prompts densely on the CPU (dense is cheaper there
# up to 16K); these tests are about the sparse path, so only the dense threshold applies.
SMALL_HIP = {
    "sink_tokens": 32,
    "window_tokens": 256,
    "dense_threshold": 1024,
    "prefill_dense_threshold": None,
    "dense_layers": [],
    "stages": [
        {"chunk_size": 64, "keep_tokens": 1024, "block_size_q": 32, "query_stride": 4},
        {"chunk_size": 16, "keep_tokens": 512, "block_size_q": 32, "query_stride": 4},
        {"chunk_size": 8, "keep_tokens": 256, "block_size_q": 32, "query_stride": 1},
    ],
    "refresh_intervals": [8, 4, 2],
}

ENGINE_KW = dict(
    max_model_len=8192,
    dtype="float32",
    enforce_eager=True,
    compilation_config={"mode": 0},
    kv_cache_memory_bytes=1 << 30,
    max_num_seqs=8,
    max_num_batched_tokens=2048,
    seed=0,
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that starts a vLLM engine (marked ``vllm``: an engine, a server or Ray) is ``slow``
    too, so ``pytest -m "not slow"`` leaves every startup out."""
    for item in items:
        if item.get_closest_marker("vllm") is not None:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def tiny_model() -> str:
    from tests.helpers.offline_models import tiny_llama

    return str(tiny_llama())


@pytest.fixture(scope="session")
def hip_llm(tiny_model):
    from vllm import LLM

    llm = LLM(
        tiny_model,
        attention_backend="infinitehip",
        additional_config={"infinitehip": SMALL_HIP},
        **ENGINE_KW,
    )
    yield llm
    del llm
    gc.collect()
