"""The split layout of the host tier (``offload.layout: "split"``) through real vLLM on the CPU:
capacity is GPU plus host memory, every block's K stays on the "GPU" (on the CPU, the device
side of the layout), V lives there first and moves to the host past what it holds.

The GPU side is sized to hold K for every block but V for only the pages one step may allocate
(24 of them) and a V bank of 15 pages per layer, so nearly every block's V is spilled to the
host while the prompts are read, and decode reads V from both sides and from the bank's copies
of host pages: greedy tokens must equal the tier off, exactly. A smaller GPU
side makes vLLM preempt and recompute; finished, aborted and preempted requests leave no block
held.
"""

from __future__ import annotations

import gc

import pytest

from tests.conftest import ENGINE_KW, SMALL_HIP
from tests.test_offload_vllm import PROMPTS, greedy, long_prompt

pytestmark = pytest.mark.vllm

MIB = 1 << 20
# the tiny model's blocks: 128 tokens, 2 layers of fp32 K and V, 64 KiB of each per block.
# 16 MiB hold a V bank of 16 pages (1 MiB: 15 slots per layer and a spare), K of 216 blocks
# and V of 24 (the pages one step may allocate: 2048 tokens in blocks of 128, plus one per
# request); the rest of V goes to the host
SPLIT = {"enabled": True, "layout": "split", "host_gib": 1, "gpu_gib": 16 * MIB / 2**30,
         "bank_gib": MIB / 2**30}


def split_state(worker) -> dict:
    """The worker's view: blocks held, the layout's sizes and how many V pages moved."""
    from vllm_infinitehip.block_manager import tier as host_tier

    tier = host_tier.current()
    group = tier.groups[0]
    return {"held": sum(1 for n in worker._block_owners.holders.values() if n > 0),
            "num_blocks": tier.num_blocks, "gpu_pages": tier.gpu_pages,
            "spilled": group.spilled_blocks, "preempted": worker._block_owners.preempted,
            "host_homed": int((group.home < 0).sum())}  # fmt: skip


def make(tiny_model, offload, **kw):
    from vllm import LLM

    return LLM(tiny_model, attention_backend="infinitehip",
               additional_config={"infinitehip": {**SMALL_HIP, "offload": offload}},
               **{**ENGINE_KW, **kw})  # fmt: skip


@pytest.fixture(scope="module")
def split_llm(tiny_model, hip_llm):
    llm = make(tiny_model, SPLIT)
    yield llm
    del llm
    gc.collect()


def test_a_batch_with_v_spilled_to_the_host_equals_the_tier_off(split_llm, hip_llm):
    want = greedy(hip_llm, PROMPTS, 16)
    assert greedy(split_llm, PROMPTS, 16) == want
    state = split_llm.collective_rpc(split_state)[0]
    assert (state["num_blocks"], state["gpu_pages"]) == (216, 24)
    # the prompts' ~140 blocks went through 24 GPU pages: most V was read from the host, and
    # between refreshes from the bank's copies
    assert state["spilled"] > 100 and state["host_homed"] == 216 - 24
    # (15 slots against four rows' reads per layer: the copies are reread, and evicted)
    tier = split_llm.collective_rpc("infinitehip_stats")[0]["tier"]
    assert tier["bank_slots"] == 2 * 15 and tier["filled_pages"] > 0
    assert tier["attn_bank_pages_reuse"] > 0 and tier["promote_hits"] > 0


def test_finished_and_aborted_requests_leave_no_block_held(split_llm):
    from vllm import SamplingParams

    greedy(split_llm, PROMPTS[:2], 6)
    # the next step releases what finished; the short prompt's own block is released by the
    # step after it, so one block stays held
    greedy(split_llm, ["Hello, my name is"], 2)
    assert split_llm.collective_rpc(split_state)[0]["held"] == 1
    engine = split_llm.llm_engine
    engine.add_request("abort-me", PROMPTS[2], SamplingParams(temperature=0, max_tokens=200))
    for _ in range(8):
        engine.step()
    held = split_llm.collective_rpc(split_state)[0]["held"]
    # the stats say where the live request's V is: 41 blocks, more than the GPU's 24 V pages
    stats = split_llm.collective_rpc("infinitehip_stats")[0]["split"]
    assert stats["held_gpu_v"] + stats["held_host_v"] == held > 24
    assert stats["held_host_v"] > 0 and stats["host_kv_bytes"] == stats["held_host_v"] * 2**16
    assert stats["gpu_kv_bytes"] == held * 2**16 + stats["held_gpu_v"] * 2**16
    engine.abort_request(["abort-me"])
    greedy(split_llm, ["The capital of France is"], 2)
    assert split_llm.collective_rpc(split_state)[0]["held"] == 1


def test_fp8_kv_split_equals_fp8_with_the_tier_off(tiny_model, hip_llm):
    """``kv_cache_dtype="fp8"``: the K plane and both sides' V pages hold e4m3 bytes (a quarter
    of fp32's), written quantized and dequantized on every read; V of 24 blocks on the GPU
    side, the rest spilled. Runs after the module engine's tests: its tier replaces theirs."""
    def run(offload):
        hip = {**SMALL_HIP, **({"offload": offload} if offload else {})}
        from vllm import LLM

        llm = LLM(tiny_model, attention_backend="infinitehip", kv_cache_dtype="fp8",
                  additional_config={"infinitehip": hip}, **ENGINE_KW)  # fmt: skip
        try:
            tokens = greedy(llm, PROMPTS[:2], 16)
            state = llm.collective_rpc(split_state)[0] if offload else None
            return tokens, state
        finally:
            del llm
            gc.collect()

    want, _ = run(None)
    # fp8 blocks are 16 KiB of K and of V: 4 MiB hold the bank's 16 pages, K of 216 blocks
    # and V of 24
    got, state = run({**SPLIT, "gpu_gib": 4 * MIB / 2**30, "bank_gib": MIB / 4 / 2**30})
    assert (state["num_blocks"], state["gpu_pages"]) == (216, 24) and state["spilled"] > 0
    assert got == want


def test_landmark_representatives_with_v_spilled_equal_the_tier_off(tiny_model):
    """``prefill_representatives: "landmark"`` over the split layout: the landmark state follows
    the block ids the K plane is indexed by, so with most V spilled the tokens equal the tier
    off with landmarks too. Runs after the module engine's tests: its tier replaces theirs."""
    from vllm import LLM

    hip = {**SMALL_HIP, "prefill_representatives": "landmark", "prefill_tail_window": None}

    def run(offload):
        config = {**hip, **({"offload": offload} if offload else {})}
        llm = LLM(tiny_model, attention_backend="infinitehip",
                  additional_config={"infinitehip": config}, **ENGINE_KW)  # fmt: skip
        try:
            tokens = greedy(llm, PROMPTS[:2], 12)
            return tokens, llm.collective_rpc(split_state)[0] if offload else None
        finally:
            del llm
            gc.collect()

    want, _ = run(None)
    got, state = run(SPLIT)
    assert state["spilled"] > 0
    assert got == want


def test_preemption_under_a_small_gpu_side_keeps_greedy_output(tiny_model):
    """6.5 MiB: the bank's 1 MiB, K of 64 blocks and V of 24. Two prompts of 25 blocks each fit at once, then outgrow it
    while they decode 1000 tokens, so vLLM preempts one (recompute) and resumes it; what is recomputed is homed again. The oracle is
    the tier off with the same 64 blocks, which schedules and preempts alike. Runs last: its
    tier replaces the module engine's in this process."""
    from vllm import LLM

    off = LLM(tiny_model, attention_backend="infinitehip",
              additional_config={"infinitehip": SMALL_HIP},
              **{**ENGINE_KW, "kv_cache_memory_bytes": 64 * 128 * 1024})  # fmt: skip
    prompts = [long_prompt(1100, "epsilon"), long_prompt(1100, "zeta")]
    want = greedy(off, prompts, 1000)
    del off
    gc.collect()
    llm = make(tiny_model, {**SPLIT, "gpu_gib": 6.5 * MIB / 2**30})
    try:
        got = greedy(llm, prompts, 1000)
        greedy(llm, ["Hi"], 1)  # releases the last step's requests
        state = llm.collective_rpc(split_state)[0]
    finally:
        del llm
        gc.collect()
    assert state["num_blocks"] == 64 and state["preempted"] > 0 and state["held"] <= 1
    assert got == want
