"""The backend on Ray and under tensor parallelism, on the CPU: a real local Ray cluster
(``ray.init`` on 127.0.0.1, shut down at the end), vLLM's ``mp`` executor for TP = 2."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.conftest import ENGINE_KW, SMALL_HIP
from tests.helpers.generate import generate_in_subprocess
from tests.test_vllm_cpu import greedy

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from tp_mask import cpu_binds_per_rank  # noqa: E402  (benchmarks/tp_mask.py)

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[1]
# Above dense_threshold (1024) with room for the stages to prune: the sparse path, prefill and
# decode, in both layers. Its own first words: the session engine's prefix cache must not serve
# another module's prompts from it (their prefill counts are exact).
SPARSE_PROMPT = "ray-tp. " + " ".join(f"item{i % 97}" for i in range(1500)) + " The end is"
DECODE_TOKENS = 16


@pytest.fixture(scope="module")
def local_ray():
    import ray

    # the workers import this checkout's tests (the actor's module) and see the test env
    env = {"PYTHONPATH": str(ROOT), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    ray.init(address="local", num_cpus=2, include_dashboard=False,
             _node_ip_address="127.0.0.1", runtime_env={"env_vars": env})  # fmt: skip
    yield ray
    ray.shutdown()


class EngineActor:
    """A vLLM engine inside a Ray actor, as a user writes one: nothing here imports the
    plugin; vLLM loads it through its ``vllm.general_plugins`` entry point."""

    def __init__(self, model: str, engine_kw: dict):
        import sys

        self.imported_before = "vllm_infinitehip" in sys.modules
        from vllm import LLM

        self.llm = LLM(model, attention_backend="infinitehip", **engine_kw)

    def plugin_state(self) -> dict:
        import sys

        from vllm.plugins import plugins_loaded

        return {"imported_before_engine": self.imported_before,
                "imported_now": "vllm_infinitehip" in sys.modules,
                "plugins_loaded": plugins_loaded}  # fmt: skip

    def generate(self, prompts: list[str], max_tokens: int) -> list[list[int]]:
        from vllm import SamplingParams

        outs = self.llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))
        return [list(o.outputs[0].token_ids) for o in outs]

    def stats(self, reset: bool = False) -> list[dict]:
        return self.llm.collective_rpc("infinitehip_stats", kwargs={"reset": reset})


def test_engine_in_a_ray_actor_runs_infinitehip_and_reports_stats(local_ray, tiny_model,
                                                                  hip_llm, tp1_tokens):  # fmt: skip
    actor_cls = local_ray.remote(num_cpus=1)(EngineActor)
    engine = actor_cls.remote(tiny_model, {**ENGINE_KW, "additional_config": {"infinitehip": SMALL_HIP}})
    try:
        state = local_ray.get(engine.plugin_state.remote(), timeout=300)
        assert state == {"imported_before_engine": False, "imported_now": True,
                         "plugins_loaded": True}  # fmt: skip
        local_ray.get(engine.stats.remote(reset=True), timeout=60)
        tokens = local_ray.get(engine.generate.remote([SPARSE_PROMPT], DECODE_TOKENS), timeout=300)
        (stats,) = local_ray.get(engine.stats.remote(), timeout=60)
    finally:
        local_ray.kill(engine)
    n_prompt = len(hip_llm.get_tokenizer().encode(SPARSE_PROMPT))
    assert stats["layers"] == 2
    assert stats["sparse_prefill_queries"] == 2 * n_prompt
    assert stats["sparse_decode_queries"] == 2 * (DECODE_TOKENS - 1)
    assert tokens == [tp1_tokens]  # the same engine settings in this process


def test_ray_executor_on_the_cpu_fails_at_startup_with_vllms_error(local_ray, tiny_model):
    from vllm import LLM

    with pytest.raises(Exception, match="does not support ray"):
        LLM(tiny_model, attention_backend="infinitehip", distributed_executor_backend="ray",
            additional_config={"infinitehip": SMALL_HIP}, **ENGINE_KW)  # fmt: skip


def _tp2(tiny_model, tmp_path, tp_mask: str, monkeypatch) -> dict:
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", cpu_binds_per_rank(2))
    hip = {**SMALL_HIP, "tp_mask": tp_mask}
    engine = {**ENGINE_KW, "tensor_parallel_size": 2, "distributed_executor_backend": "mp",
              "additional_config": {"infinitehip": hip}}  # fmt: skip
    spec = {"engine": engine, "prompts": [SPARSE_PROMPT], "max_tokens": DECODE_TOKENS,
            "report": True}  # fmt: skip
    return generate_in_subprocess(tiny_model, "infinitehip", spec, tmp_path, tp_mask)


@pytest.fixture(scope="module")
def tp1_tokens(hip_llm):
    (tokens,) = greedy(hip_llm, [SPARSE_PROMPT], DECODE_TOKENS)
    return tokens


def _check_tp2_ran_sparse(out: dict, n_prompt: int) -> None:
    per_rank = out["report"]["stats_per_rank"]
    assert len(per_rank) == 2  # the named method answered from both worker processes
    for s in per_rank:
        assert s["layers"] == 2
        assert s["sparse_prefill_queries"] == 2 * n_prompt
        assert s["sparse_decode_queries"] == 2 * (DECODE_TOKENS - 1)


def test_tp2_global_masks_give_tp1_greedy_tokens(tiny_model, tmp_path, hip_llm, tp1_tokens,
                                                  monkeypatch):  # fmt: skip
    out = _tp2(tiny_model, tmp_path, "global", monkeypatch)
    _check_tp2_ran_sparse(out, len(hip_llm.get_tokenizer().encode(SPARSE_PROMPT)))
    assert out["tokens"] == [tp1_tokens]


def test_tp2_per_rank_masks_generate_and_their_agreement_is_recorded(
    tiny_model, tmp_path, hip_llm, tp1_tokens, record_property, monkeypatch
):
    out = _tp2(tiny_model, tmp_path, "per-rank", monkeypatch)
    _check_tp2_ran_sparse(out, len(hip_llm.get_tokenizer().encode(SPARSE_PROMPT)))
    (tokens,) = out["tokens"]
    assert len(tokens) == DECODE_TOKENS
    agreement = sum(a == b for a, b in zip(tokens, tp1_tokens)) / DECODE_TOKENS
    record_property("per_rank_token_agreement_with_tp1", agreement)
    print(json.dumps({"per_rank_token_agreement_with_tp1": agreement}))
