"""Greedy generation in a fresh process: ``python generate.py MODEL BACKEND JSON_IN JSON_OUT``.

Used to get vLLM's default CPU backend outputs without a second engine in the test process.
"""

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

if __name__ == "__main__":
    model, backend, path_in, path_out = sys.argv[1:5]
    spec = json.load(open(path_in))
    from vllm import LLM, SamplingParams

    kw = dict(spec["engine"])
    if backend != "default":
        kw["attention_backend"] = backend
    llm = LLM(model, **kw)
    outs = llm.generate(spec["prompts"], SamplingParams(temperature=0, max_tokens=spec["max_tokens"]))
    json.dump([o.outputs[0].token_ids for o in outs], open(path_out, "w"))
