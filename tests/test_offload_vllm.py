"""The host KV tier through real vLLM on the CPU: nothing lost, and nothing left behind.

On the CPU the host store is vLLM's own KV tensor and the bank a second tensor; the logic is
the GPU's. vLLM's CPU pages hold 128 tokens (64 KiB here); the bank holds 6 per layer while
four sparse decode rows read about 12 each, so reads go to the host too, pages move at every
refresh, and the bank is always full: greedy tokens must still equal the tier off, exactly.
"""

from __future__ import annotations

import gc

import pytest

from tests.conftest import ENGINE_KW, SMALL_HIP

pytestmark = pytest.mark.vllm

# (6 slots + 1 spare) * 2 layers * 64 KiB pages
BANK_SLOTS = 6
OFFLOAD = {"enabled": True, "host_gib": 1, "bank_gib": (BANK_SLOTS + 1) * 2 * 2**16 / 2**30}


def long_prompt(n_words: int, tag: str) -> str:
    return f"{tag}. " + " ".join(f"item{i % 97}" for i in range(n_words)) + " The end is"


PROMPTS = [long_prompt(1500, "alpha"), long_prompt(2200, "beta"), long_prompt(1800, "gamma"),
           long_prompt(2600, "delta")]  # fmt: skip


def greedy(llm, prompts, max_tokens):
    from vllm import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))
    return [list(o.outputs[0].token_ids) for o in outs]


def tier_stats(llm, reset=True):
    return llm.collective_rpc("infinitehip_stats", kwargs={"reset": reset})[0]


def bank_pages_checked(worker) -> tuple[int, int]:
    """(resident pages, of them not equal to their host page) over every layer's bank: the
    write-through invariant, checked in the worker between steps."""
    import torch

    from vllm_infinitehip.backend import InfiniteHiPImpl

    checked = stale = 0
    context = worker.model_runner.compilation_config.static_forward_context
    for name, layer in context.items():
        impl = getattr(layer, "impl", None)
        if not isinstance(impl, InfiniteHiPImpl) or impl.plan is None or impl.plan.bank is None:
            continue
        bank, i = impl.plan.bank, impl.plan.bank_layers[name]
        table = bank.cache.table[i, :-1]
        for page in (table >= 0).nonzero().flatten().tolist():
            checked += 1
            stale += not torch.equal(bank.pages[i, int(table[page])], layer.kv_cache[page])
    return checked, stale


@pytest.fixture(scope="module")
def tier_off_tokens(hip_llm):
    return greedy(hip_llm, PROMPTS, 16)


@pytest.fixture(scope="module")
def offload_llm(tiny_model, hip_llm):
    from vllm import LLM

    llm = LLM(tiny_model, attention_backend="infinitehip",
              additional_config={"infinitehip": {**SMALL_HIP, "offload": OFFLOAD}},
              **ENGINE_KW)  # fmt: skip
    yield llm
    del llm
    gc.collect()


def test_a_batch_through_a_small_bank_equals_the_tier_off(offload_llm, tier_off_tokens):
    tier_stats(offload_llm)
    assert greedy(offload_llm, PROMPTS, 16) == tier_off_tokens
    checked, stale = offload_llm.collective_rpc(bank_pages_checked)[0]
    assert checked == 2 * BANK_SLOTS and stale == 0
    s = tier_stats(offload_llm)
    t = s["tier"]
    assert s["sparse_decode_queries"] == 2 * 4 * 15
    assert t["bank_slots"] == 2 * BANK_SLOTS
    # the bank was used, and was too small for what the rows read
    assert t["filled_pages"] >= t["bank_slots"]
    assert t["attn_bank_pages_refresh"] > 0 and t["attn_bank_pages_reuse"] > 0
    assert t["attn_host_pages_refresh"] > 0 and t["attn_host_pages_reuse"] > 0
    assert 0 < t["hit_ratio_attn"] < 1 and t["host_bytes_per_step"] > 0
    # both layers, at every step with a sparse decode row (the prompts' prefills end apart)
    assert t["decode_layer_steps"] % 2 == 0 and t["decode_layer_steps"] >= 2 * 15


def test_each_prompt_alone_through_the_tier_equals_the_tier_off(offload_llm, hip_llm):
    # alone against alone: vLLM's CPU GEMMs are not batch-invariant, so a row's tokens may
    # differ between a batch of four and a batch of one, with or without the tier
    alone = [greedy(hip_llm, [p], 16)[0] for p in PROMPTS[:2]]
    assert [greedy(offload_llm, [p], 16)[0] for p in PROMPTS[:2]] == alone


def test_finished_and_aborted_requests_leave_both_tiers_empty(offload_llm):
    from vllm import SamplingParams

    greedy(offload_llm, PROMPTS[:2], 6)
    greedy(offload_llm, ["Hello, my name is"], 2)  # the next step releases what finished
    s = tier_stats(offload_llm, reset=False)
    assert s["live_slots"] == 0 and s["tier"]["resident_pages"] == 0

    engine = offload_llm.llm_engine
    engine.add_request("abort-me", PROMPTS[2], SamplingParams(temperature=0, max_tokens=200))
    for _ in range(8):  # prefill in chunks, then decode steps
        engine.step()
    s = tier_stats(offload_llm, reset=False)
    assert s["live_slots"] == 1 and s["tier"]["resident_pages"] > 0
    checked, stale = offload_llm.collective_rpc(bank_pages_checked)[0]
    assert checked == s["tier"]["resident_pages"] and stale == 0  # mid-generation too
    engine.abort_request(["abort-me"])
    greedy(offload_llm, ["The capital of France is"], 2)
    s = tier_stats(offload_llm, reset=False)
    assert s["live_slots"] == 0 and s["tier"]["resident_pages"] == 0
    assert not engine.has_unfinished_requests()


def test_fp8_kv_through_the_tier_equals_fp8_with_the_tier_off(tiny_model):
    """``kv_cache_dtype="fp8"`` (e4m3, vLLM's scales): pages are stored quantized on the host and
    in the bank alike, and every reader dequantizes on load. Runs last: a second tier in this
    process replaces the module engine's."""
    from vllm import LLM

    def run(hip):
        llm = LLM(tiny_model, attention_backend="infinitehip", kv_cache_dtype="fp8",
                  additional_config={"infinitehip": hip}, **ENGINE_KW)  # fmt: skip
        try:
            tokens = greedy(llm, PROMPTS[:2], 16)
            return tokens, tier_stats(llm), llm.collective_rpc(bank_pages_checked)[0]
        finally:
            del llm
            gc.collect()

    off, off_stats, _ = run(SMALL_HIP)
    # fp8 pages are a quarter of this float32 model's (16 KiB): the same 6 slots per layer
    fp8_bank = {**OFFLOAD, "bank_gib": (BANK_SLOTS + 1) * 2 * 2**14 / 2**30}
    on, on_stats, (checked, stale) = run({**SMALL_HIP, "offload": fp8_bank})
    assert off_stats["sparse_decode_queries"] > 0
    assert on_stats["tier"]["bank_slots"] == 2 * BANK_SLOTS
    assert on_stats["tier"]["attn_host_pages_refresh"] > 0
    assert checked > 0 and stale == 0
    assert on == off
