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
    """Run ``spec`` (``engine`` kwargs, ``prompts``, ``max_tokens``, optional ``report``) through
    this script in a fresh process; returns its output (token lists, or tokens and report)."""
    src, dst = Path(workdir) / f"{name}-in.json", Path(workdir) / f"{name}-out.json"
    src.write_text(json.dumps(spec))
    subprocess.run([sys.executable, __file__, model, backend, str(src), str(dst)], check=True,
                   timeout=timeout)  # fmt: skip
    return json.loads(dst.read_text())


if __name__ == "__main__":
    model, backend, path_in, path_out = sys.argv[1:5]
    spec = json.load(open(path_in))
    from vllm import LLM, SamplingParams

    kw = dict(spec["engine"])
    if backend != "default":
        kw["attention_backend"] = backend  # "infinitehip" or any vLLM backend name
    llm = LLM(model, **kw)
    if spec.get("report"):
        from vllm_infinitehip.metrics import collect_stats

        llm.collective_rpc(collect_stats, kwargs={"reset": True})  # not the warm-up run's counts
    outs = llm.generate(spec["prompts"], SamplingParams(temperature=0, max_tokens=spec["max_tokens"]))
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    if not spec.get("report"):
        json.dump(tokens, open(path_out, "w"))
        sys.exit(0)
    cfg = llm.llm_engine.vllm_config
    report = {
        "max_model_len": cfg.model_config.max_model_len,
        "max_position_embeddings": cfg.model_config.hf_text_config.max_position_embeddings,
        "trained_context": (cfg.additional_config or {}).get("infinitehip", {}).get("trained_context"),
        "stats": llm.collective_rpc(collect_stats)[0],
    }
    json.dump({"tokens": tokens, "report": report}, open(path_out, "w"))
