"""The backend inside real vLLM 0.26 on the CPU, with a tiny random Llama and a real tokenizer."""

from __future__ import annotations

import gc
import itertools
import math

import pytest

from tests.conftest import ENGINE_KW, SMALL_HIP
from tests.helpers.generate import generate_in_subprocess, staggered_generate

pytestmark = pytest.mark.vllm

SHORT_PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "In a hole in the ground there lived a hobbit. " * 20,
    "def fibonacci(n):",
]


def stats(llm, reset=True):
    return llm.collective_rpc("infinitehip_stats", kwargs={"reset": reset})[0]


def greedy(llm, prompts, max_tokens):
    from vllm import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def default_backend_tokens(tiny_model, tmp_path_factory):
    """vLLM's default CPU attention (CPU_ATTN) on the short prompts, in its own process."""
    spec = {"engine": ENGINE_KW, "prompts": SHORT_PROMPTS, "max_tokens": 24}
    return generate_in_subprocess(tiny_model, "default", spec,
                                  tmp_path_factory.mktemp("default"), "short")  # fmt: skip


def test_short_prompts_match_default_backend_exactly(hip_llm, default_backend_tokens):
    stats(hip_llm)
    ours = greedy(hip_llm, SHORT_PROMPTS, 24)
    assert ours == default_backend_tokens
    s = stats(hip_llm)
    assert s["layers"] == 2
    assert s["dense_queries"] > 0
    assert s["sparse_prefill_queries"] == 0 and s["sparse_decode_queries"] == 0


def long_prompt(n_words: int, tag: str) -> str:
    return f"{tag}. " + " ".join(f"item{i % 97}" for i in range(n_words)) + " The end is"


def test_long_prompts_run_the_sparse_path(hip_llm):
    stats(hip_llm)
    prompts = [long_prompt(1500, "alpha"), long_prompt(2200, "beta")]
    toks = greedy(hip_llm, prompts, 20)
    assert all(len(t) == 20 for t in toks)
    s = stats(hip_llm)
    n_layers = 2
    prompt_lens = [len(hip_llm.get_tokenizer().encode(p)) for p in prompts]
    assert min(prompt_lens) > 3000
    # every prompt token and every decode step of both requests ran sparsely in both layers
    assert s["sparse_prefill_queries"] == n_layers * sum(prompt_lens)
    assert s["sparse_decode_queries"] == n_layers * 2 * 19
    assert s["dense_queries"] == 0
    # budget: sink 32 + window 256 + 256 selected tokens per query, far below the context
    assert s["sparsity"] > 0.7
    # refresh schedule (8, 4, 2) over decode steps 0..18 of each request
    per_req = {"0": 3, "1": 2, "2": 5, "reuse": 9}
    assert s["refreshes"] == {k: v * 2 * n_layers for k, v in per_req.items()}


def test_recall_is_logged_per_layer_for_the_final_prompt_query_and_each_decode_step(hip_llm):

    prompt = long_prompt(1500, "gamma")
    n = len(hip_llm.get_tokenizer().encode(prompt))
    hip_llm.collective_rpc("infinitehip_recall")  # on
    greedy(hip_llm, [prompt], 6)
    records = hip_llm.collective_rpc("infinitehip_recall", kwargs={"enable": False})[0]
    final = [r for r in records if r["query"] == "final-prompt" and r["seq_len"] == n]
    decode = [r for r in records if r["query"] == "decode"]
    assert sorted(r["layer"] for r in final) == [0, 1]
    assert sorted((r["seq_len"], r["layer"]) for r in decode) == [
        (n + i, layer) for i in range(1, 6) for layer in (0, 1)
    ]
    # a share of probability mass; the small budget leaves most keys out, so it is not all of it
    assert all(0.0 < r["recall_min_head"] <= r["recall"] <= 1.0 + 1e-6 for r in records)
    assert min(r["recall"] for r in records) < 0.999
    # off again: nothing more is logged
    greedy(hip_llm, [prompt], 2)
    assert hip_llm.collective_rpc("infinitehip_recall", kwargs={"enable": False})[0] == []


def test_a_batch_of_four_long_prompts_equals_each_prompt_alone(hip_llm):
    """Four sparse decode rows share one batched cascade and one attention call per layer;
    each must produce what it produces alone."""
    prompts = [long_prompt(1500, "alpha"), long_prompt(2200, "beta"),
               long_prompt(1800, "gamma"), long_prompt(2600, "delta")]  # fmt: skip
    stats(hip_llm)
    together = greedy(hip_llm, prompts, 12)
    assert stats(hip_llm)["sparse_decode_queries"] == 2 * 4 * 11
    alone = [greedy(hip_llm, [p], 12)[0] for p in prompts]
    assert together == alone


def batch_equals_alone(tiny_model, tmp_path, hip: dict, prompts: list[str], tag: str,
                       **engine) -> dict:  # fmt: skip
    """An engine with ``hip`` (in a subprocess) greedy-decodes 8 tokens of ``prompts`` as one
    batch, then each alone; asserts the two agree and returns the run's stats."""
    engine = {**ENGINE_KW, **engine, "additional_config": {"infinitehip": hip}}
    spec = {"engine": engine, "prompts": prompts, "max_tokens": 8, "report": True,
            "batch_then_alone": True}  # fmt: skip
    out = generate_in_subprocess(tiny_model, "infinitehip", spec, tmp_path, tag)
    n = len(prompts)
    together, alone = out["tokens"][:n], out["tokens"][n:]
    assert together == alone and len(alone) == n
    return out["report"]["stats"]


def test_a_coarse_first_stage_runs_sparse_and_a_batch_equals_each_prompt_alone(
    tiny_model, tmp_path
):
    """The first pruning stage over 64-query blocks, the later ones over 32 (neighbouring blocks
    share the first stage's prefill work): through vLLM, prefill and decode run sparse, and a
    batch gives what each prompt gives alone (chunks and prefix hits on the coarse grid)."""
    hip = {**SMALL_HIP, "stages": [dict(st) for st in SMALL_HIP["stages"]]}
    hip["stages"][0].update(block_size_q=64, query_stride=8)
    prompts = [long_prompt(1500, "mu"), long_prompt(2300, "nu"), long_prompt(1900, "xi")]
    counts = batch_equals_alone(tiny_model, tmp_path, hip, prompts, "coarse")
    assert counts["sparse_prefill_queries"] > 0
    # layers x prompts x decode steps, batched and alone
    assert counts["sparse_decode_queries"] == 2 * 3 * 7 * 2


def test_group_bisection_runs_sparse_and_a_batch_equals_each_prompt_alone(tiny_model, tmp_path):
    """``prefill_representatives: "group-bisection"`` (the query heads of a KV group bisect one
    path): through vLLM, prefill runs sparse, and a batch gives what each prompt gives alone."""
    hip = {**SMALL_HIP, "prefill_representatives": "group-bisection"}
    prompts = [long_prompt(1500, "rho"), long_prompt(2300, "sigma"), long_prompt(1900, "tau")]
    counts = batch_equals_alone(tiny_model, tmp_path, hip, prompts, "group")
    assert counts["sparse_prefill_queries"] > 0


def test_landmark_representatives_run_sparse_and_a_batch_equals_each_prompt_alone(
    tiny_model, tmp_path
):
    """``prefill_representatives: "landmark"``: every prefill chunk adds its queries to the
    layers' landmark scores (3K-token prompts in 2K-token chunks, so a chunk adds to the last
    keys of the one before), and the stages score each chunk by its representatives. A batch
    gives what each prompt gives alone; the alone runs take the batch's freed blocks, whose
    scores must start anew (prefix caching off, so no prompt reuses another's blocks). The
    tail window is off: it widens the last block of every chunk, so where a batch cuts a
    prompt elsewhere than alone, that block's selection differs whatever the representatives."""
    hip = {**SMALL_HIP, "prefill_representatives": "landmark", "prefill_tail_window": None}
    prompts = [long_prompt(1500, "rho"), long_prompt(2300, "sigma"), long_prompt(1900, "tau")]
    counts = batch_equals_alone(tiny_model, tmp_path, hip, prompts, "landmark",
                                enable_prefix_caching=False)  # fmt: skip
    assert counts["sparse_prefill_queries"] > 0 and counts["sparse_decode_queries"] > 0


def test_requests_at_mixed_refresh_levels_equal_each_alone(hip_llm):
    """Requests added steps apart decode side by side at different refresh levels; rows join
    the stages of their own level only."""
    prompts = [long_prompt(1500, "eta"), long_prompt(1700, "theta"), long_prompt(1300, "iota")]
    stats(hip_llm)
    together = staggered_generate(hip_llm, prompts, [0, 3, 5], 16)
    levels = stats(hip_llm)["refreshes"]
    assert all(levels.get(k) for k in ("0", "1", "2", "reuse"))
    assert together == [greedy(hip_llm, [p], 16)[0] for p in prompts]


def test_reused_blocks_read_past_their_end_through_vllm(tiny_model, tmp_path):
    """``extend_reused_blocks`` through vLLM: a batch equals each prompt alone, and the run
    differs from the same engine without it (tokens or attended pairs: the builder hands each
    row's stale steps to attention)."""
    prompts = [long_prompt(1500, "rho"), long_prompt(2100, "sigma")]
    runs = {}
    for extend in (False, True):
        hip = {**SMALL_HIP, "extend_reused_blocks": extend}
        spec = {"engine": {**ENGINE_KW, "additional_config": {"infinitehip": hip}},
                "prompts": prompts, "max_tokens": 12, "report": True,
                "batch_then_alone": True}  # fmt: skip
        runs[extend] = generate_in_subprocess(tiny_model, "infinitehip", spec, tmp_path,
                                              f"extend-{extend}")  # fmt: skip
    on, off = runs[True], runs[False]
    assert on["tokens"][:2] == on["tokens"][2:]
    assert on["report"]["stats"]["sparse_decode_queries"] == 2 * 2 * 2 * 11  # batch and alone
    pairs = lambda run: run["report"]["stats"]["sparse_attended_pairs"]
    assert (on["tokens"], pairs(on)) != (off["tokens"], pairs(off))


def live_slots(llm) -> int:
    return stats(llm, reset=False)["live_slots"]


def test_state_slots_are_freed_after_finish_and_abort(hip_llm):
    from vllm import SamplingParams

    greedy(hip_llm, [long_prompt(1500, "kappa"), long_prompt(1600, "lambda")], 6)
    greedy(hip_llm, [SHORT_PROMPTS[0]], 2)  # any later step frees the finished ones' slots
    assert live_slots(hip_llm) == 0

    engine = hip_llm.llm_engine
    engine.add_request("abort-me", long_prompt(1500, "mu"),
                       SamplingParams(temperature=0, max_tokens=200))  # fmt: skip
    for _ in range(8):  # prefill (three chunks of at most 2048 tokens), then decode steps
        engine.step()
    assert live_slots(hip_llm) == 1
    engine.abort_request(["abort-me"])
    greedy(hip_llm, [SHORT_PROMPTS[1]], 2)
    assert live_slots(hip_llm) == 0
    assert not engine.has_unfinished_requests()


def test_state_slots_are_freed_after_preemption(tiny_model):
    """A KV cache too small for three decoding requests makes vLLM preempt one (and recompute
    it later); all finish, and no slot is left behind."""
    from vllm import LLM

    kw = {**ENGINE_KW, "max_model_len": 4096, "kv_cache_memory_bytes": 6 << 20,
          "disable_log_stats": False}  # fmt: skip
    llm = LLM(tiny_model, attention_backend="infinitehip",
              additional_config={"infinitehip": SMALL_HIP}, **kw)  # fmt: skip
    try:
        # ~1800 tokens each: 3 prompts fit 6144 cached tokens, their 300 new tokens each do not
        prompts = [long_prompt(620, tag) for tag in ("nu", "xi", "omicron")]
        toks = greedy(llm, prompts, 300)
        assert [len(t) for t in toks] == [300, 300, 300]
        preemptions = sum(m.value for m in llm.get_metrics()
                          if m.name == "vllm:num_preemptions")  # fmt: skip
        assert preemptions > 0
        greedy(llm, [SHORT_PROMPTS[0]], 2)
        assert live_slots(llm) == 0
    finally:
        del llm
        gc.collect()


def test_one_batch_mixes_short_and_long_prompts(hip_llm, default_backend_tokens):
    stats(hip_llm)
    prompts = [SHORT_PROMPTS[0], long_prompt(2000, "gamma"), SHORT_PROMPTS[1], long_prompt(1200, "delta")]
    toks = greedy(hip_llm, prompts, 24)
    # short requests stay exact even when batched with sparse ones
    assert toks[0] == default_backend_tokens[0]
    assert toks[2] == default_backend_tokens[1]
    assert len(toks[1]) == 24 and len(toks[3]) == 24
    s = stats(hip_llm)
    assert s["dense_queries"] > 0 and s["sparse_prefill_queries"] > 0
    assert s["sparse_decode_queries"] > 0


def test_full_budget_sparse_equals_dense_in_vllm(tiny_model, tmp_path):
    """With a budget covering the whole context, the sparse path must reproduce dense greedy text."""
    full = {
        "sink_tokens": 32, "window_tokens": 256, "dense_threshold": 64, "dense_layers": [],
        "prefill_dense_threshold": None,
        "stages": [{"chunk_size": 64, "keep_tokens": 8192, "block_size_q": 32, "query_stride": 4},
                   {"chunk_size": 16, "keep_tokens": 8192, "block_size_q": 32, "query_stride": 4},
                   {"chunk_size": 8, "keep_tokens": 8192, "block_size_q": 32, "query_stride": 1}],
        "refresh_intervals": [8, 4, 2],
    }
    prompts = [long_prompt(900, "eps")]
    results = {}
    for backend, extra in (("default", {}), ("infinitehip", {"additional_config": {"infinitehip": full}})):
        spec = {"engine": {**ENGINE_KW, **extra}, "prompts": prompts, "max_tokens": 16}
        results[backend] = generate_in_subprocess(tiny_model, backend, spec, tmp_path, backend)
    assert results["infinitehip"] == results["default"]


def test_decode_prunes_with_decode_stages_and_not_stages(tiny_model, tmp_path):
    """``decode_stages`` are what decode prunes with, ``stages`` do not reach it. Prefill is
    dense in both engines, so only decode differs: with a whole-context decode budget (the
    small ``stages`` beside it) decode attends every key and reproduces the default backend's
    greedy text; with a whole-context ``stages`` budget and the small ``decode_stages``, decode
    prunes."""
    small = SMALL_HIP["stages"]
    full = [{**st, "keep_tokens": 8192} for st in small]
    dense_prefill = {**SMALL_HIP, "dense_threshold": 64, "prefill_dense_threshold": 1 << 20}
    prompts = [long_prompt(900, "phi"), long_prompt(1300, "chi")]
    engines = {"default": {},
               "decode-full": {"stages": small, "decode_stages": full},
               "decode-small": {"stages": full, "decode_stages": small}}  # fmt: skip
    runs = {}
    for name, hip in engines.items():
        extra = {"additional_config": {"infinitehip": {**dense_prefill, **hip}}} if hip else {}
        spec = {"engine": {**ENGINE_KW, **extra}, "prompts": prompts, "max_tokens": 12,
                "report": bool(hip)}  # fmt: skip
        runs[name] = generate_in_subprocess(tiny_model, "infinitehip" if hip else "default",
                                            spec, tmp_path, name)  # fmt: skip
    full_run, small_run = runs["decode-full"], runs["decode-small"]
    assert full_run["tokens"] == runs["default"]
    for run in (full_run, small_run):
        counts = run["report"]["stats"]
        assert counts["sparse_prefill_queries"] == 0  # prefill dense: the pairs are decode's
        assert counts["sparse_decode_queries"] == 2 * 2 * 11  # layers x prompts x steps
    assert full_run["report"]["stats"]["sparsity"] == 0.0
    assert small_run["report"]["stats"]["sparsity"] > 0.5


def test_prefill_stages_leave_decode_unchanged_with_rope_extension(tiny_model, tmp_path):
    """With prefill dense, what ``stages`` say must not reach decode, also with RoPE extension
    on, where decode prunes at remapped positions and a row past ``trained_context`` attends
    remapped (the prompts, 2605 and 3765 tokens, lie on both sides of it): two engines that
    differ only in ``stages`` give the same greedy tokens, with decode pruning in both."""
    small = SMALL_HIP["stages"]
    wide = [{**small[0], "keep_tokens": 2048}, {**small[1], "keep_tokens": 1024},
            {**small[2], "chunk_size": 16, "keep_tokens": 512}]
    hip = {**SMALL_HIP, "dense_threshold": 64, "prefill_dense_threshold": 1 << 20,
           "rope_extension": True, "trained_context": 3072, "decode_stages": small}
    prompts = [long_prompt(900, "rho"), long_prompt(1300, "tau")]
    runs = {}
    for name, stages in (("prefill-small", small), ("prefill-wide", wide)):
        extra = {"additional_config": {"infinitehip": {**hip, "stages": stages}}}
        spec = {"engine": {**ENGINE_KW, **extra}, "prompts": prompts, "max_tokens": 24,
                "report": True}  # fmt: skip
        runs[name] = generate_in_subprocess(tiny_model, "infinitehip", spec, tmp_path, name)
    assert runs["prefill-small"]["tokens"] == runs["prefill-wide"]["tokens"]
    # the tiny model's tokens move little with the masks; the pairs decode attended follow
    # the decode budget exactly (prefill is dense: every sparse pair is decode's)
    small_run, wide_run = runs["prefill-small"], runs["prefill-wide"]
    assert (small_run["report"]["stats"]["sparse_attended_pairs"]
            == wide_run["report"]["stats"]["sparse_attended_pairs"])  # fmt: skip
    for run in runs.values():
        counts = run["report"]["stats"]
        assert counts["sparse_prefill_queries"] == 0
        assert counts["sparsity"] > 0.3


def test_auto_decode_stages_resolve_against_the_served_model(tiny_model, tmp_path):
    """``decode_stages`` ``"auto"`` inside vLLM: with RoPE extension on, the 5K decode span
    (sink 32 + 4096 + window 256) fits half of a 16K trained length, and decode keeps every key
    of these prompts (sparsity 0); against a 1280-token trained length it does not, and decode
    prunes with the small ``stages`` (the tokens of an engine given those stages alone)."""
    hip = {**SMALL_HIP, "dense_threshold": 64, "prefill_dense_threshold": 1 << 20,
           "rope_extension": True, "decode_stages": "auto"}
    prompts = [long_prompt(900, "mu"), long_prompt(1300, "nu")]
    engines = {"auto-16k": {**hip, "trained_context": 16384},
               "auto-1280": {**hip, "trained_context": 1280},
               "stages-1280": {**SMALL_HIP, "dense_threshold": 64, "rope_extension": True,
                               "prefill_dense_threshold": 1 << 20, "trained_context": 1280}}
    runs = {}
    for name, config in engines.items():
        spec = {"engine": {**ENGINE_KW, "additional_config": {"infinitehip": config}},
                "prompts": prompts, "max_tokens": 12, "report": True}  # fmt: skip
        runs[name] = generate_in_subprocess(tiny_model, "infinitehip", spec, tmp_path, name)
    assert runs["auto-16k"]["report"]["stats"]["sparsity"] == 0.0
    assert runs["auto-1280"]["report"]["stats"]["sparsity"] > 0.3
    assert runs["auto-1280"]["tokens"] == runs["stages-1280"]["tokens"]
    assert (runs["auto-1280"]["report"]["stats"]["sparse_attended_pairs"]
            == runs["stages-1280"]["report"]["stats"]["sparse_attended_pairs"])  # fmt: skip


def test_bad_config_raises_naming_the_field(tiny_model):
    from vllm import LLM

    with pytest.raises(ValueError, match=r"infinitehip\.stages\[1\]\.chunk_size"):
        LLM(
            tiny_model,
            attention_backend="infinitehip",
            additional_config={"infinitehip": {"stages": [
                {"chunk_size": 256, "keep_tokens": 4096},
                {"chunk_size": 48, "keep_tokens": 480},
                {"chunk_size": 8, "keep_tokens": 256},
            ]}},
            **ENGINE_KW,
        )
    with pytest.raises(ValueError, match=r"unknown field `infinitehip\.windw_tokens`"):
        LLM(tiny_model, attention_backend="infinitehip",
            additional_config={"infinitehip": {"windw_tokens": 5}}, **ENGINE_KW)


def test_prefill_chunks_start_and_end_on_the_query_block_grid(hip_llm):
    """Which queries share a pruning block must not depend on where vLLM cut the prompt: every
    prefill chunk starts on the block_size_q grid and ends on it, or at the prompt's end; a
    prefix-cache hit is shortened to the grid and leaves the last block_size_q tokens."""
    from vllm import SamplingParams

    engine = hip_llm.llm_engine
    sched = engine.engine_core.engine_core.scheduler
    bq = SMALL_HIP["stages"][0]["block_size_q"]
    tok = hip_llm.get_tokenizer()
    prompts = {rid: tok.encode(long_prompt(n, rid)) for rid, n in
               [("grid-a", 1500), ("grid-b", 1900), ("grid-c", 700)]}  # fmt: skip
    prompts["grid-a-again"] = prompts["grid-a"]
    block = sched.block_size
    # a prefix of grid-a whose cached blocks end 5 tokens short of its end: vLLM's own hit
    # would leave a 5-query tail block, so the hit must be shortened
    cut = (len(prompts["grid-a"]) // block - 1) * block + 5
    prompts["grid-a-prefix"] = prompts["grid-a"][:cut]
    chunks: dict[str, list[tuple[int, int]]] = {rid: [] for rid in prompts}
    outputs: dict[str, list[int]] = {}
    vllm_schedule = sched.schedule

    def recording_schedule(*args, **kwargs):
        out = vllm_schedule(*args, **kwargs)
        starts = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens))
        for internal_id, n in out.num_scheduled_tokens.items():
            rid = internal_id.rsplit("-", 1)[0]  # vLLM suffixes the id it was given
            if starts[internal_id] < len(prompts[rid]):
                chunks[rid].append((starts[internal_id], starts[internal_id] + n))
        return out

    def run(rids):
        for rid in rids:
            engine.add_request(rid, {"prompt_token_ids": prompts[rid]},
                               SamplingParams(temperature=0, max_tokens=3))  # fmt: skip
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    outputs[o.request_id] = list(o.outputs[0].token_ids)

    sched.schedule = recording_schedule
    try:
        run(["grid-a", "grid-b", "grid-c"])  # 2048-token budget: chunks cut by one another
        run(["grid-a-again"])
        run(["grid-a-prefix"])
    finally:
        del sched.schedule
    for rid, spans in chunks.items():
        n = len(prompts[rid])
        assert spans[0][0] % bq == 0 and spans[-1][1] == n
        assert all(s % bq == 0 and (e % bq == 0 or e == n) for s, e in spans), (rid, spans)
        assert all(e == s2 for (_, e), (s2, _) in itertools.pairwise(spans))
    # the budget cut a chunk short of the grid somewhere, or the alignment was not exercised
    assert any(e % 2048 for spans in chunks.values() for _, e in spans[:-1])
    grid = math.lcm(bq, block)  # a hit is whole KV blocks
    for rid in ("grid-a-again", "grid-a-prefix"):  # every full block of both is cached
        n = len(prompts[rid])
        vllm_hit = (n - 1) // block * block
        assert chunks[rid][0][0] == max(0, min(vllm_hit, n - bq)) // grid * grid
    n = len(prompts["grid-a-prefix"])
    assert chunks["grid-a-prefix"][0][0] < (n - 1) // block * block  # the hit was shortened
    assert outputs["grid-a-again"] == outputs["grid-a"]


def test_the_scheduler_skips_the_common_prefix_walk(hip_llm):
    """vLLM walks a running request's block list every step for cascade attention, which
    infinitehip never runs; the plugin's scheduler answers zero instead. Mid-generation the
    lone request shares each full block with itself, so vLLM's own walk counts them."""
    from vllm import SamplingParams

    from vllm_infinitehip.scheduler import InfiniteHiPAsyncScheduler, InfiniteHiPScheduler

    engine = hip_llm.llm_engine
    sched = engine.engine_core.engine_core.scheduler
    is_async = engine.vllm_config.scheduler_config.async_scheduling
    assert type(sched) is (InfiniteHiPAsyncScheduler if is_async else InfiniteHiPScheduler)
    engine.add_request("walk", long_prompt(1500, "walk"),
                       SamplingParams(temperature=0, max_tokens=4))  # fmt: skip
    engine.step()
    manager = sched.kv_cache_manager
    blocks = manager.coordinator.single_type_managers[0].req_to_blocks
    (running,) = blocks
    assert manager.coordinator.get_num_common_prefix_blocks(running)[0] == len(blocks[running]) > 0
    assert manager.get_num_common_prefix_blocks(running) == [0]
    while engine.has_unfinished_requests():
        engine.step()
