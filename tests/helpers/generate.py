"""Greedy generation in a fresh process: ``python generate.py MODEL BACKEND JSON_IN JSON_OUT``.

Used to get vLLM's default CPU backend outputs without a second engine in the test process;
tests call it through :func:`generate_in_subprocess`.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def generate_in_subprocess(model: str, backend: str, spec: dict, workdir: Path, name: str,
                           timeout: int = 600):
    """Run ``spec`` (``engine`` kwargs, ``prompts``, ``max_tokens``, optional ``report``, with
    ``recall`` the recall log in it) through this script in a fresh process; returns its output
    (token lists, or tokens and report)."""
    src, dst = Path(workdir) / f"{name}-in.json", Path(workdir) / f"{name}-out.json"
    src.write_text(json.dumps(spec))
    subprocess.run([sys.executable, __file__, model, backend, str(src), str(dst)], check=True,
                   timeout=timeout)  # fmt: skip
    return json.loads(dst.read_text())


def staggered_generate(llm, prompts: list, offsets: list[int], max_tokens: int) -> list[list[int]]:
    """Greedy tokens of ``prompts``, request ``i`` added at engine step ``offsets[i]``, so the
    requests decode side by side at different decode steps (different refresh levels)."""
    import itertools

    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    tag = f"stagger{next(_STAGGER_IDS)}-"
    pending = sorted(range(len(prompts)), key=lambda i: offsets[i])
    done: dict[int, list[int]] = {}
    for step in itertools.count():
        while pending and offsets[pending[0]] <= step:
            i = pending.pop(0)
            engine.add_request(f"{tag}{i}", prompts[i], params)
        if not pending and not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[int(out.request_id.removeprefix(tag).split("-")[0])] = list(
                    out.outputs[0].token_ids
                )
    return [done[i] for i in range(len(prompts))]


_STAGGER_IDS = iter(range(1 << 30))


def decode_forwards_raise_on_sync() -> list[int]:
    """Run every pure-decode forward (and its KV write) of the backend under
    ``torch.cuda.set_sync_debug_mode("error")``: any host sync there raises. Returns a list
    that counts the forwards checked."""
    import torch

    from vllm_infinitehip.backend import InfiniteHiPImpl

    checked: list[int] = []
    forward = InfiniteHiPImpl.forward

    def strict_forward(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kw):
        m = attn_metadata
        if m is None or m.prefill is not None or self._params is None:
            return forward(self, layer, query, key, value, kv_cache, m, *args, **kw)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            self.do_kv_cache_update(layer, key, value, kv_cache, m.slot_mapping)
            out = forward(self, layer, query, key, value, kv_cache, m, *args, **kw)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        checked.append(m.num_decodes)
        return out

    InfiniteHiPImpl.forward = strict_forward
    return checked


if __name__ == "__main__":
    model, backend, path_in, path_out = sys.argv[1:5]
    spec = json.load(open(path_in))
    from vllm import LLM, SamplingParams

    kw = dict(spec["engine"])
    if backend != "default":
        kw["attention_backend"] = backend  # "infinitehip" or any vLLM backend name
    checked = decode_forwards_raise_on_sync() if spec.get("sync_debug") else None
    llm = LLM(model, **kw)
    if spec.get("report"):  # not the warm-up run's counts
        llm.collective_rpc("infinitehip_stats", kwargs={"reset": True})
    if spec.get("recall"):  # log each sparse query's recall (metrics.collect_recall)
        llm.collective_rpc("infinitehip_recall")
    if spec.get("stagger"):
        tokens = staggered_generate(llm, spec["prompts"], spec["stagger"], spec["max_tokens"])
    else:
        params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"])
        # one_at_a_time: each prompt alone in the batch, one engine for all; batch_then_alone:
        # the batch, then each prompt alone (2 x the prompts' token lists)
        alone = [[p] for p in spec["prompts"]]
        groups = (alone if spec.get("one_at_a_time")
                  else [spec["prompts"], *alone] if spec.get("batch_then_alone")
                  else [spec["prompts"]])  # fmt: skip
        tokens = [list(o.outputs[0].token_ids) for g in groups for o in llm.generate(g, params)]
    if not spec.get("report"):
        json.dump(tokens, open(path_out, "w"))
        sys.exit(0)
    cfg = llm.llm_engine.vllm_config
    report = {
        "max_model_len": cfg.model_config.max_model_len,
        "max_position_embeddings": cfg.model_config.hf_text_config.max_position_embeddings,
        "trained_context": (cfg.additional_config or {}).get("infinitehip", {}).get("trained_context"),
        "stats": (per_rank := llm.collective_rpc("infinitehip_stats"))[0],
        "stats_per_rank": per_rank,
        "sync_checked_forwards": None if checked is None else len(checked),
        "recall": (llm.collective_rpc("infinitehip_recall", kwargs={"enable": False})[0]
                   if spec.get("recall") else None),
    }  # fmt: skip
    json.dump({"tokens": tokens, "report": report}, open(path_out, "w"))
