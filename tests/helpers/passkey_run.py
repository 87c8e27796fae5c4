"""One passkey prompt through vLLM in a fresh process; prints one JSON line (prefixed RESULT).

    python passkey_run.py MODEL BACKEND TOKENS DEPTH SEED MAX_MODEL_LEN [INFINITEHIP_JSON]
"""

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

if __name__ == "__main__":
    model, backend, tokens, depth, seed, max_len = sys.argv[1:7]
    hip = json.loads(sys.argv[7]) if len(sys.argv) > 7 else {}
    from vllm import LLM, SamplingParams

    from vllm_infinitehip.metrics import collect_stats
    from vllm_infinitehip.passkey import make_passkey_prompt

    kw = {}
    if backend == "infinitehip":
        kw = dict(attention_backend="infinitehip", additional_config={"infinitehip": hip})
    elif int(max_len) > 8192:  # the default backend needs the longer rotary cache by hand
        kw = dict(hf_overrides={"max_position_embeddings": int(max_len)})
    llm = LLM(model, max_model_len=int(max_len), dtype="float32", enforce_eager=True,
              compilation_config={"mode": 0}, kv_cache_memory_bytes=1 << 30, max_num_seqs=2,
              max_num_batched_tokens=4096, **kw)
    if backend == "infinitehip":
        llm.collective_rpc(collect_stats, kwargs={"reset": True})
    prompt = make_passkey_prompt(llm.get_tokenizer(), int(tokens), float(depth), int(seed))
    out = llm.generate([prompt.text], SamplingParams(temperature=0, max_tokens=8))
    answer = out[0].outputs[0].text
    cfg = llm.llm_engine.vllm_config
    result = {
        "tokens": prompt.num_tokens,
        "passkey": prompt.passkey,
        "answer": answer,
        "correct": prompt.is_correct(answer),
        "max_model_len": cfg.model_config.max_model_len,
        "max_position_embeddings": cfg.model_config.hf_text_config.max_position_embeddings,
        "trained_context": (cfg.additional_config or {}).get("infinitehip", {}).get("trained_context"),
        "stats": llm.collective_rpc(collect_stats)[0] if backend == "infinitehip" else None,
    }
    print("RESULT " + json.dumps(result), flush=True)
