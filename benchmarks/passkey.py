"""Passkey retrieval by context length and depth, through vLLM: infinitehip vs the default backend.

    python benchmarks/passkey.py --lengths 8192 16384 32768 65536 --depths 0.1 0.3 0.5 0.7 0.9 --n 2

``--model``: a Hugging Face id, a local directory, or a short name of this repository's small
models (benchmarks/common.py); ``trained_context`` in the rows comes from the model's config
(``--trained-context`` overrides it).

For each backend, one engine serves every prompt (``--max-model-len`` = the longest prompt + 512;
the default backend gets the same rotary cache through ``hf_overrides``, and is expected to fail
past the trained length). Writes, under ``--out``:

- ``passkey-<cpu|gpu>.json``: rows ``{model, trained_context, context, depth, backend, config, ops,
  accuracy, n, generate_s, generate_s_vs_default, date, command}`` (``config``: the infinitehip
  settings of that engine, ``--infinitehip`` takes several to compare; ``ops``: which execution path
  served it; ``generate_s``: the mean wall time of one prompt's ``generate``, 8 tokens, and its
  ratio to the default backend's on the same prompts; with recall on it includes the recall's dense
  reference and runs infinitehip eagerly, so time with ``--no-recall``), a PNG heatmap per backend
  (length x depth) beside it, and a printed table;
- ``recall-<cpu|gpu>.json``: attention-mass recall on the real model's Q/K, of the final
  prompt query and of the decode queries, rows ``{model, trained_context, config, ops, context,
  depth, query, layer, seq_len, steps, recall, recall_min_head}`` (share of the dense softmax mass
  on the keys infinitehip attended; mean over heads and over a prompt's decode steps, and the
  worst head of any step), and a per-layer plot. With RoPE extension on, ``recall_remapped``
  and ``recall_remapped_min_head`` are the same against dense attention under the layer's
  position remapping (``reference.remapped_attention_recall``): what the selection missed, where
  the true-position reference sees distances the model never saw.

- with ``--ops compare``, ``ops-compare-<cpu|gpu>.json``: the Triton path against the
  PyTorch reference on every call of the run (benchmarks/compare_ops.py).

Results are rewritten after every prompt, so a run cut short keeps what it measured. A run
replaces the rows of the (model, backend, settings, execution path) it produces and keeps every
other row of the files, from any day.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import common  # noqa: E402  (benchmarks/common.py: --model, trained length, command line)


def engine_kwargs(backend: str, max_len: int, device: str, hip: dict,
                  kv_cache_gib: float | None = None) -> dict:
    kw: dict = dict(max_model_len=max_len, max_num_seqs=1, max_num_batched_tokens=8192)
    if device == "cpu":
        kw.update(dtype="float32", enforce_eager=True, compilation_config={"mode": 0},
                  kv_cache_memory_bytes=4 << 30)
    else:
        # bf16: vLLM's default GPU backend (FlashAttention) has no fp32 kernels. 0.15 of the GPU
        # each, or a fixed KV cache (runs side by side on one GPU: vLLM's profiling counts the
        # device's free memory, so a neighbour's allocations would be charged to this engine;
        # the 0.02 is only what its startup check asks to be free).
        kw.update(dtype="bfloat16", max_num_batched_tokens=16384, gpu_memory_utilization=0.15)
        if kv_cache_gib:
            kw.update(kv_cache_memory_bytes=int(kv_cache_gib * 2**30), gpu_memory_utilization=0.02)
    if backend == "infinitehip":
        kw.update(attention_backend="infinitehip", additional_config={"infinitehip": hip})
    else:
        kw.update(hf_overrides={"max_position_embeddings": max_len})
    return kw


class Results:
    """Rows of both result files, rewritten on every update."""

    def __init__(self, out: Path, device: str, gpu: str, model: str, trained: int,
                 produced: set[tuple[str, str, str]], command: str | None = None) -> None:
        self.date = datetime.date.today().isoformat()
        self.paths = {n: out / f"{n}-{device}.json" for n in ("passkey", "recall", "ops-compare")}
        model = common.model_name(model)
        self.gpu, self.model, self.trained = gpu, model, trained
        self.command = command or common.command_line()
        self.hits: dict[tuple[str, str, str, int, float], list[tuple[bool, float]]] = {}
        self.recall: list[dict] = []
        self.compare: list[dict] = []
        out.mkdir(parents=True, exist_ok=True)
        # One file per device kind, across models and days: this run replaces the rows of the
        # (backend, config, execution path) it produces for its model; every other row stays.
        self.kept: dict[str, list[dict]] = {}
        for name, path in self.paths.items():
            old = json.loads(path.read_text()) if path.exists() else {"rows": []}
            self.kept[name] = [r for r in old["rows"] if r["model"] != model or (
                r.get("backend", "infinitehip"), r.get("config", ""), r.get("ops", "")
            ) not in produced]

    def add(self, backend: str, config: str, ops: str, context: int, depth: float,
            correct: bool, seconds: float, recall: list[dict], compare: list[dict]):
        self.hits.setdefault((backend, config, ops, context, depth), []).append((correct, seconds))
        base = {"model": self.model, "trained_context": self.trained, "config": config,
                "ops": ops, "context": context, "depth": depth}
        self.recall.extend({**base, **r} for r in per_layer(recall))
        self.compare.extend({**base, **r} for r in compare)
        self.write()

    def passkey_rows(self) -> list[dict]:
        rows = [{"model": self.model, "trained_context": self.trained, "context": n, "depth": d,
                 "backend": b, "config": c, "ops": o,
                 "accuracy": sum(ok for ok, _ in h) / len(h), "n": len(h),
                 "generate_s": sum(t for _, t in h) / len(h),
                 "date": self.date, "gpu": self.gpu, "command": self.command}
                for (b, c, o, n, d), h in sorted(self.hits.items())]  # fmt: skip
        default = {(r["context"], r["depth"]): r["generate_s"] for r in rows
                   if r["backend"] == "default"}  # fmt: skip
        for r in rows:
            base = default.get((r["context"], r["depth"]))
            r["generate_s_vs_default"] = None if base is None else r["generate_s"] / base
        return rows

    def write(self) -> None:
        passkey_rows = self.kept["passkey"] + self.passkey_rows()
        # the runs whose rows the files hold (recall and ops-compare rows come from the same runs)
        command = "; ".join(dict.fromkeys(
            r["command"] for r in passkey_rows if r.get("command")))
        for name, rows in (("passkey", self.passkey_rows()), ("recall", self.recall),
                           ("ops-compare", self.compare)):
            rows = self.kept[name] + rows
            if rows:
                head = {"name": name, "date": self.date, "gpu": self.gpu, "command": command}
                self.paths[name].write_text(dump_rows(head, rows))


def per_layer(recall: list[dict]) -> list[dict]:
    """One row per query kind and layer: the mean recall over its steps (decode has one per
    generated token), the worst head of any step, and the first step's sequence length."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in recall:
        groups.setdefault((r["query"], r["layer"]), []).append(r)
    rows = []
    for (query, layer), rs in groups.items():
        row = {"query": query, "layer": layer, "seq_len": rs[0]["seq_len"], "steps": len(rs),
               "recall": sum(r["recall"] for r in rs) / len(rs),
               "recall_min_head": min(r["recall_min_head"] for r in rs)}  # fmt: skip
        if "recall_remapped" in rs[0]:  # RoPE extension on: under the layer's remapping too
            row["recall_remapped"] = sum(r["recall_remapped"] for r in rs) / len(rs)
            row["recall_remapped_min_head"] = min(r["recall_remapped_min_head"] for r in rs)
        rows.append(row)
    return rows


def dump_rows(head: dict, rows: list[dict]) -> str:
    """The result as JSON with one row per line: recall files hold thousands of rows, and a row a
    line keeps them readable and their diffs small."""
    rounded = [{k: round(v, 5) if isinstance(v, float) else v for k, v in r.items()} for r in rows]
    body = ",\n".join(json.dumps(r) for r in rounded)
    return json.dumps(head)[:-1] + f', "rows": [\n{body}\n]}}\n'


def run_backend(model: str, backend: str, cells, max_len: int, device: str, hip: dict,
                results: Results, deadline: float, ops: str, log_recall: bool = True,
                kv_cache_gib: float | None = None) -> None:
    from tqdm import tqdm
    from vllm import LLM, SamplingParams

    from compare_ops import install  # benchmarks/compare_ops.py, beside this file

    name = "infinitehip" if backend == "infinitehip" else "default"
    comparing = install(ops) if name == "infinitehip" else None
    path = execution_path(ops, device) if name == "infinitehip" else ""
    kw = engine_kwargs(backend, max_len, device, hip, kv_cache_gib)
    if name == "infinitehip" and log_recall:
        # decode steps replayed from CUDA graphs run no Python: no recall would be logged
        kw["enforce_eager"] = True
    llm = LLM(model, **kw)
    config = json.dumps(hip, sort_keys=True) if name == "infinitehip" else ""
    params = SamplingParams(temperature=0, max_tokens=8)
    for context, depth, prompt in tqdm(cells, desc=name, unit="prompt"):
        if time.monotonic() > deadline:
            print(f"time budget spent: {name} stops before {context}/{depth}")
            break
        recording = name == "infinitehip" and log_recall
        if recording:
            llm.collective_rpc("infinitehip_recall")  # on, and forget earlier prompts
        t0 = time.perf_counter()
        out = llm.generate([prompt.text], params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        recall = []
        if recording:
            # the prompt's final query (in its last prefill chunk) and the decode steps
            recall = [r for r in llm.collective_rpc("infinitehip_recall", kwargs={"enable": False})[0]
                      if r["query"] == "decode" or r["seq_len"] == prompt.num_tokens]
        answer = out[0].outputs[0].text
        if not prompt.is_correct(answer):
            tqdm.write(f"{name}{config} {context}/{depth}: wanted {prompt.passkey}, got {answer!r}")
        compared = []
        if comparing is not None:
            compared, comparing.rows = comparing.rows, []
            print_comparison(compared, f"{context}/{depth}")
        results.add(name, config, path, context, depth, prompt.is_correct(answer), seconds,
                    recall, compared)
    shutdown(llm)
    del llm
    gc.collect()


def shutdown(llm) -> None:
    """Let an in-process engine's memory go once it is deleted (before the next one starts):
    vLLM freezes the garbage collector over what the engine allocated until its core shuts
    down."""
    llm.llm_engine.engine_core.shutdown()


def execution_path(ops: str, device: str) -> str:
    """What serves infinitehip's sparse calls: the Triton kernels or the PyTorch reference."""
    return "triton" if ops == "kernels" and device == "gpu" else "pytorch"


def print_comparison(rows: list[dict], label: str) -> None:
    """Per layer: the worst mask agreement and the largest output difference of one prompt."""
    layers = sorted({r["layer"] for r in rows})
    print(f"\nTriton vs reference, {label}: layer  min mask agreement  max |out diff|  max |out|")
    for layer in layers:
        mine = [r for r in rows if r["layer"] == layer]
        agree = min((r["mask_agreement"] for r in mine if r["call"] == "prune"), default=1.0)
        diff = max((r["max_abs_diff"] for r in mine if r["call"] == "attend"), default=0.0)
        size = max((r["ref_max_abs"] for r in mine if r["call"] == "attend"), default=0.0)
        print(f"  {layer:>3}  {agree:>8.4f}  {diff:>10.3g}  {size:>8.3g}")


def print_tables(results: Results, lengths: list[int], depths: list[float]) -> None:
    rows = results.passkey_rows()
    print(f"\n{'backend':<12} {'context':>8} " + " ".join(f"d={d:<4}" for d in depths) + "  mean")
    for backend, config, ops in sorted({(r["backend"], r["config"], r["ops"]) for r in rows}):
        if config not in ("", "{}") or ops:
            print(f"  {config} {ops}")
        for n in lengths:
            accs = {r["depth"]: r["accuracy"] for r in rows
                    if (r["backend"], r["config"], r["ops"]) == (backend, config, ops)
                    and r["context"] == n}
            if accs:
                cells = " ".join(f"{accs[d]:>6.2f}" if d in accs else "     -" for d in depths)
                print(f"{backend:<12} {n:>8} {cells}  {sum(accs.values()) / len(accs):.2f}")
    if results.recall:
        # the first settings' recall (the default settings unless told otherwise)
        first = results.recall[0]["config"]
        print(f"\n{'query':<13} {'recall':<9} {'context':>8} {'mean recall':>12} "
              f"{'worst layer':>12} {'worst head':>11}")
        for query in ("final-prompt", "decode"):
            # true positions, then (RoPE extension on) under the layer's remapping
            for key, label in (("recall", "true pos"), ("recall_remapped", "remapped")):
                for n in lengths:
                    rs = [r for r in results.recall if r["context"] == n and key in r
                          and r["config"] == first and r["query"] == query]  # fmt: skip
                    if not rs:
                        continue
                    by_layer: dict[int, list[float]] = {}
                    for r in rs:
                        by_layer.setdefault(r["layer"], []).append(r[key])
                    layer_means = {k: sum(v) / len(v) for k, v in by_layer.items()}
                    worst = min(layer_means, key=layer_means.get)
                    mean = sum(layer_means.values()) / len(layer_means)
                    print(f"{query:<13} {label:<9} {n:>8} {mean:>12.3f} "
                          f"{f'L{worst} {layer_means[worst]:.3f}':>12} "
                          f"{min(r[key + '_min_head'] for r in rs):>11.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help=common.MODEL_HELP)
    parser.add_argument("--trained-context", type=int, default=None,
                        help="the model's trained length; default: from its config")
    parser.add_argument("--template", choices=["auto", "chat", "plain"], default="auto",
                        help="the prompt in the model's chat template or as plain text; auto: "
                        "a short name's own choice, else the chat template when there is one")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    parser.add_argument("--n", type=int, default=1, help="prompts per (length, depth)")
    parser.add_argument("--backends", nargs="+", default=["infinitehip", "default"])
    parser.add_argument("--infinitehip", nargs="+", default=["{}"],
                        help="JSON settings for additional_config; several: one engine each")
    parser.add_argument("--out", default=str(common.RESULTS))
    parser.add_argument("--ops", choices=["kernels", "reference", "compare"], default="kernels",
                        help="infinitehip's execution path: its own choice (Triton on a GPU), "
                        "the PyTorch reference, or both compared call by call (compare_ops.py)")
    parser.add_argument("--time-budget", type=float, default=float("inf"),
                        help="seconds; prompts not started by then are skipped")
    parser.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto",
                        help="auto: the GPU when there is one")
    parser.add_argument("--kv-cache-gib", type=float, default=None,
                        help="GPU: each engine's KV cache, fixed (runs side by side on one GPU); "
                        "default 0.15 of the GPU")
    parser.add_argument("--no-recall", dest="recall", action="store_false",
                        help="skip the recall logging (its dense reference costs time): for timing")
    args = parser.parse_args()
    deadline = time.monotonic() + args.time_budget

    import torch
    from transformers import AutoTokenizer

    from vllm_infinitehip.passkey import make_passkey_prompt

    model = common.resolve_model(args.model)
    trained = common.trained_length(model, args.trained_context)
    tok = AutoTokenizer.from_pretrained(model)
    chat = (common.prefers_chat(args.model, tok) if args.template == "auto"
            else args.template == "chat")
    # shortest contexts first, so a time budget cuts the longest
    cells = [(n, d, make_passkey_prompt(tok, n, d, seed=1000 * i + int(d * 100) + n, chat=chat))
             for n in sorted(args.lengths) for d in args.depths for i in range(args.n)]
    max_len = max(c[2].num_tokens for c in cells) + 512
    device = args.device
    if device == "auto":
        device = "gpu" if torch.cuda.is_available() else "cpu"
    if device == "gpu" and not torch.cuda.is_available():
        parser.error("--device gpu: no CUDA device")
    gpu = torch.cuda.get_device_name() if device == "gpu" else "cpu"
    path = execution_path(args.ops, device)
    produced = {("infinitehip", json.dumps(json.loads(h), sort_keys=True), path)
                for h in args.infinitehip} if "infinitehip" in args.backends else set()
    produced |= {("default", "", "")} if "default" in args.backends else set()
    results = Results(Path(args.out), device, gpu, args.model, trained, produced)
    for backend in args.backends:
        for hip in args.infinitehip if backend == "infinitehip" else ["{}"]:
            run_backend(model, backend, cells, max_len, device, json.loads(hip), results,
                        deadline, args.ops, args.recall, args.kv_cache_gib)
    print_tables(results, sorted(args.lengths), args.depths)
    from plot import plot_passkey, plot_recall  # benchmarks/plot.py, beside this file

    for name, plot in (("passkey", plot_passkey), ("recall", plot_recall)):
        if results.paths[name].exists():
            result = json.loads(results.paths[name].read_text())
            plot(result, results.paths[name].with_suffix(".png"))
            print(f"wrote {results.paths[name]} and its .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
