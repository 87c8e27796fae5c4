"""Masks under tensor parallelism: greedy agreement of TP = 2 with TP = 1, per ``tp_mask`` mode.

    python benchmarks/tp_mask.py                      # the CPU: tiny Llama, vLLM's mp executor
    python benchmarks/tp_mask.py --model PATH --device gpu --tp 2 [--executor ray]

Each rank holds ``H_kv / TP`` heads. With ``tp_mask: "per-rank"`` (default) a rank's pruning
stages take the max over its own heads, so its masks differ from TP = 1; ``"global"`` max-reduces
the stage scores over the TP group first. Engines, each in its own process, on the same sparse
prompts (above ``dense_threshold``), greedy:

- infinitehip at TP = 1 (the reference), TP = N ``global`` and TP = N ``per-rank``;
- vLLM's default backend at TP = 1 and TP = N, the control: how far TP's own arithmetic (the
  row-parallel all-reduce sums in another order) moves the tokens with no masks at all.

TP > 1 runs on vLLM's ``mp`` executor, or with ``--executor ray`` on its Ray executor (a GPU
only: vLLM's CPU platform refuses Ray). Rows ``{backend, tp_mask, tp, executor, prompt_tokens,
decode_tokens, token_agreement, first_divergence, equal}``: agreement with the same backend at
TP = 1, position by position. Writes ``tp-mask-<cpu|gpu>.json``, a PNG and a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import common  # noqa: E402  (--model, command line)
from e2e import gpu_name, markdown_table  # noqa: E402

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

# tests/conftest.py's small settings: a few-thousand-token prompt prunes for real
SMALL_HIP = {
    "sink_tokens": 32, "window_tokens": 256, "dense_threshold": 1024, "dense_layers": [],
    "prefill_dense_threshold": None,
    "stages": [
        {"chunk_size": 64, "keep_tokens": 1024, "block_size_q": 32, "query_stride": 4},
        {"chunk_size": 16, "keep_tokens": 512, "block_size_q": 32, "query_stride": 4},
        {"chunk_size": 8, "keep_tokens": 256, "block_size_q": 32, "query_stride": 1},
    ],
    "refresh_intervals": [8, 4, 2],
}  # fmt: skip


def prompts(n: int) -> list[str]:
    words = (1200, 1500, 1800, 2200, 2500, 2800)  # about 2.3 tokens a word: all < 8192
    return [f"tag{i}. " + " ".join(f"item{(j * (i + 3)) % 97}" for j in range(words[i % 6]))
            + " The end is" for i in range(n)]  # fmt: skip


def engine_kwargs(device: str, backend: str, tp: int, tp_mask: str, max_len: int,
                  executor: str = "mp") -> dict:  # fmt: skip
    kw: dict = dict(max_model_len=max_len, max_num_seqs=8, max_num_batched_tokens=2048, seed=0,
                    tensor_parallel_size=tp)  # fmt: skip
    if tp > 1:
        kw["distributed_executor_backend"] = executor
    if device == "cpu":
        kw.update(dtype="float32", enforce_eager=True, compilation_config={"mode": 0},
                  kv_cache_memory_bytes=1 << 30)  # fmt: skip
    else:
        kw.update(dtype="bfloat16", gpu_memory_utilization=0.5)
    if backend == "infinitehip":
        kw.update(attention_backend="infinitehip",
                  additional_config={"infinitehip": {**SMALL_HIP, "tp_mask": tp_mask}})  # fmt: skip
    return kw


def run_worker(model: str, spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model, **spec["engine"])
    outs = llm.generate(spec["prompts"], SamplingParams(temperature=0, max_tokens=spec["tokens"]))
    toks = [list(o.outputs[0].token_ids) for o in outs]
    if spec["engine"].get("attention_backend") == "infinitehip":
        per_rank = llm.collective_rpc("infinitehip_stats")
        assert all(s["sparse_decode_queries"] > 0 for s in per_rank), per_rank
    lens = [len(llm.get_tokenizer().encode(p)) for p in spec["prompts"]]
    return {"tokens": toks, "prompt_tokens": lens}


def cpu_binds_per_rank(ranks: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``ranks`` CPU workers: this process's cores split
    evenly (vLLM's automatic binding wants a NUMA node per worker, and CI has one)."""
    cpus = sorted(os.sched_getaffinity(0))
    per = max(1, len(cpus) // ranks)
    return "|".join(",".join(map(str, cpus[r * per : (r + 1) * per] or cpus[-1:]))
                    for r in range(ranks))  # fmt: skip


def agreement(a: list[int], b: list[int]) -> tuple[float, int | None]:
    same = [x == y for x, y in zip(a, b)]
    first = next((i for i, s in enumerate(same) if not s), None)
    return sum(same) / len(same), first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-llama", help=common.MODEL_HELP)
    ap.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--executor", choices=("mp", "ray"), default="mp",
                    help="vLLM's executor at TP > 1 (ray: a GPU only)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--out", default=str(common.RESULTS))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        spec_path, out_path = args.worker.split("=", 1)
        spec = json.loads(Path(spec_path).read_text())
        Path(out_path).write_text(json.dumps(run_worker(spec["model"], spec)))
        return
    if args.executor == "ray" and args.device == "cpu":
        ap.error("--executor ray needs --device gpu: vLLM's CPU platform refuses the Ray executor")
    model = common.resolve_model(args.model)
    texts = prompts(args.prompts)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    engines = [("infinitehip", 1, "per-rank"), ("infinitehip", args.tp, "global"),
               ("infinitehip", args.tp, "per-rank"), ("default", 1, ""),
               ("default", args.tp, "")]  # fmt: skip
    results: dict[tuple[str, int, str], dict] = {}
    for backend, tp, mode in engines:
        name = f"{backend}-tp{tp}-{mode or 'none'}"
        spec = {"model": model, "prompts": texts, "tokens": args.tokens,
                "engine": engine_kwargs(args.device, backend, tp, mode, 8192,
                                        args.executor)}  # fmt: skip
        spec_path, res_path = out_dir / f".tp-mask-{name}-in.json", out_dir / f".tp-mask-{name}.json"
        spec_path.write_text(json.dumps(spec))
        print(f"[tp-mask] {name}", flush=True)
        env = dict(os.environ)
        if args.device == "cpu" and tp > 1:  # vLLM's auto binding wants a NUMA node per rank
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binds_per_rank(tp)
        subprocess.run([sys.executable, __file__, "--worker", f"{spec_path}={res_path}"],
                       check=True, env=env)  # fmt: skip
        results[(backend, tp, mode)] = json.loads(res_path.read_text())
        spec_path.unlink()
        res_path.unlink()
    rows = []
    for (backend, tp, mode), res in results.items():
        if tp == 1:
            continue
        base = results[(backend, 1, "per-rank" if backend == "infinitehip" else "")]
        for i, toks in enumerate(res["tokens"]):
            agree, first = agreement(toks, base["tokens"][i])
            rows.append({"model": common.model_name(args.model), "backend": backend,
                         "tp_mask": mode or None, "tp": tp,
                         "executor": args.executor,
                         "prompt_tokens": res["prompt_tokens"][i], "decode_tokens": len(toks),
                         "token_agreement": round(agree, 4), "first_divergence": first,
                         "equal": toks == base["tokens"][i]})  # fmt: skip
    date = datetime.date.today().isoformat()
    path = out_dir / f"tp-mask-{args.device}.json"
    path.write_text(json.dumps({"name": "tp-mask", "date": date, "gpu": gpu_name(),
                                "command": common.command_line(), "rows": rows},
                               indent=1))  # fmt: skip
    plot(rows, path.with_suffix(".png"))
    print(table(rows))


def table(rows: list[dict]) -> str:
    return markdown_table(rows, ["backend", "tp_mask", "tp", "executor", "prompt_tokens",
                                 "decode_tokens",
                                 "token_agreement", "first_divergence", "equal"])  # fmt: skip


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = sorted({f"{r['backend']} {r['tp_mask'] or ''}".strip() for r in rows})
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(labels))
    prompt_lens = sorted({r["prompt_tokens"] for r in rows})
    for j, label in enumerate(labels):
        ys = [next((r["token_agreement"] for r in rows if r["prompt_tokens"] == n and
                    f"{r['backend']} {r['tp_mask'] or ''}".strip() == label), 0.0)
              for n in prompt_lens]  # fmt: skip
        ax.bar([i + j * width for i in range(len(prompt_lens))], ys, width, label=label)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(prompt_lens))],
                  [str(n) for n in prompt_lens])  # fmt: skip
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("greedy agreement with TP = 1")
    ax.set_ylim(0, 1.05)
    ax.legend()
    ax.set_title(f"TP = {rows[0]['tp'] if rows else '?'} against TP = 1")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    main()
