"""Host time of vLLM's scheduler per decode step, against context length: vLLM's own scheduler
against infinitehip's (``vllm_infinitehip.scheduler``), in the same run.

    python benchmarks/scheduler_host.py [--contexts 8192 131072 524288 917504] [--steps 200]
        [--model DIR]

vLLM's real ``Scheduler`` / ``AsyncScheduler`` and KV cache manager, with one request of the
given prompt length (prefix caching on, as vLLM's default), driven through chunked prefill and
then timed over ``--steps`` decode steps of ``schedule()`` plus ``update_from_output()``. The model
runner is left out: each step returns one sampled token, so what is timed is the engine core's
own host work, the part that must fit under the GPU's step when scheduling is asynchronous. No
GPU needed; the numbers depend on the host's CPU.

Rows ``{context, scheduler, async_scheduling, host_ms_per_step, speedup_vs_vllm}``. Writes
``scheduler-host-<cpu|gpu>.json`` (``gpu``: the host of a GPU machine, named in the file),
a PNG and a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import common  # noqa: E402  (--model, command line)
from e2e import gpu_name, markdown_table  # noqa: E402

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

BLOCK = 16


def host_ms_per_step(model: str, context: int, scheduler_cls: type, steps: int) -> float:
    import torch
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    max_len = context + 2 * steps + 1024
    cfg = EngineArgs(model=model, max_model_len=max_len, max_num_batched_tokens=32768,
                     max_num_seqs=8, hf_overrides={"max_position_embeddings": max_len},
                     ).create_engine_config()  # fmt: skip
    num_blocks = max_len // BLOCK + 64
    cfg.cache_config.num_gpu_blocks = num_blocks
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])  # fmt: skip
    sched = scheduler_cls(cfg, kv, StructuredOutputManager(cfg), block_size=BLOCK)
    init_none_hash(sha256)
    req = Request("r0", list(range(context)), SamplingParams(max_tokens=4 * steps, temperature=0),
                  None, block_hasher=get_request_block_hasher(BLOCK, sha256))  # fmt: skip
    sched.add_request(req)

    def step() -> None:
        out = sched.schedule()
        ids = list(out.num_scheduled_tokens)
        sched.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            # a partial prefill samples nothing (the async scheduler counts placeholders)
            sampled_token_ids=[[] if sched.requests[r].is_prefill_chunk else [7] for r in ids],
            logprobs=None, prompt_logprobs_dict={},
            pooler_output=[],
        ))  # fmt: skip

    while req.num_computed_tokens < context:
        step()
    for _ in range(10):  # warm-up
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 131072, 524288, 917504])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--model", default="tiny-llama",
                    help=common.MODEL_HELP + "; only its config is read")
    ap.add_argument("--out", default=str(common.RESULTS))
    args = ap.parse_args()

    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_infinitehip import scheduler as ours

    model = common.resolve_model(args.model)
    pairs = [("vllm", False, Scheduler), ("infinitehip", False, ours.InfiniteHiPScheduler),
             ("vllm", True, AsyncScheduler), ("infinitehip", True, ours.InfiniteHiPAsyncScheduler)]
    rows = []
    for context in args.contexts:
        base = {}
        for name, is_async, cls in pairs:
            ms = host_ms_per_step(model, context, cls, args.steps)
            if name == "vllm":
                base[is_async] = ms
            rows.append({"context": context, "scheduler": name, "async_scheduling": is_async,
                         "host_ms_per_step": round(ms, 3),
                         "speedup_vs_vllm": round(base[is_async] / ms, 2)})  # fmt: skip
            print(rows[-1], flush=True)
    gpu = gpu_name()
    device = "gpu" if gpu else "cpu"
    date = datetime.date.today().isoformat()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"scheduler-host-{device}.json"
    command = common.command_line()
    path.write_text(json.dumps({"name": "scheduler-host", "date": date, "gpu": gpu,
                                "cpu": _cpu_name(), "command": command, "rows": rows}, indent=1))
    plot(rows, path.with_suffix(".png"))
    print(markdown_table(rows, ["context", "scheduler", "async_scheduling", "host_ms_per_step",
                                "speedup_vs_vllm"]))  # fmt: skip
    print(f"wrote {path}")


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in ("vllm", "infinitehip"):
        for is_async in (False, True):
            rs = [r for r in rows if r["scheduler"] == name and r["async_scheduling"] == is_async]
            ax.plot([r["context"] / 1024 for r in rs], [r["host_ms_per_step"] for r in rs],
                    marker="o", linestyle="-" if is_async else "--",
                    label=f"{name} ({'async' if is_async else 'sync'})")  # fmt: skip
    ax.set_xlabel("context (K tokens)")
    ax.set_ylabel("scheduler host ms per decode step")
    ax.set_title("vLLM scheduler host time, batch 1")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
