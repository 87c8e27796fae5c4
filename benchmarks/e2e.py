"""End to end through vLLM: infinitehip against vLLM's default GPU backend (FLASH_ATTN), one run.

Every engine is vLLM's own ``LLM`` (CUDA graphs as vLLM configures them), ``--model``'s architecture
with dummy weights (``load_format="dummy"``: only its config is read), bf16,
``max_num_batched_tokens=32768``, prefix caching on. Each engine runs in its own process (a deleted
in-process engine keeps GPU memory). Its engine core runs in that process (so the profilers see it),
or with ``+mp`` in the engine name in a process of its own, as ``LLM`` and ``vllm serve`` do by
default.

Per context and engine:

- ``prefill_s`` and ``ttft_s``: a cold prompt with ``max_tokens=1``; prefill is the engine's own
  ``first_token_ts - scheduled_ts``, TTFT its ``first_token_latency`` (arrival to first token);
- ``decode_tok_s`` at batch 1: the same prompt again (a prefix-cache hit, so no prefill), 128
  tokens over the engine core's own ``last_token_ts - first_token_ts`` of a 129-token call, the
  median of three calls. ``decode_tok_s_wall_diff`` is ``(t(129 tokens) - t(1 token)) / 128``
  of the calls' wall times, what this benchmark reported before 2026-12-02: it read 207.8 tok/s
  at 512K where the timestamps read 104.4 and the GPU allows about 178, so it is kept only to
  compare with the older files;
- ``decode_tok_s`` at batch 8 (``--batch8-contexts``): eight prompts sharing the context but their
  last 64 tokens (so their KV fits beside each other through prefix caching), tokens per second of
  the whole batch, from the same timestamps (of the slowest request);
- ``host_share`` and ``kernel_us_per_step`` (in-process engine cores only): the GPU time of a
  decode step, from ``torch.profiler`` CUDA activity of a 129-token call less that of a 1-token
  call (``decode_profile``; a prefix-cache hit recomputes the prompt's tail, which cancels),
  against the step's time from the engine timestamps: host_share = 1 - GPU busy / step.
  ``--host-profile`` adds ``host_ms_per_step``, the host functions of a decode call from
  ``cProfile``, and ``gpu_idle``: the GPU's idle gaps in a profiled decode call, each charged to
  the host call that ended it (``idle_gaps``), which says what keeps a host-bound step long.

Every engine first serves a warm-up prompt past the dense threshold (Triton compiles its kernels
on first use); no timing includes it. Results: ``e2e-gpu.json`` (rows per model, engine, context
and batch; a rerun replaces the file, or with ``--merge`` only the rows it measures), a PNG of
tok/s against context, and a table on stdout. Contexts whose FLASH_ATTN prefill
would not fit the run's time are skipped for that backend (``--skip``) and reported as not run.

    python benchmarks/e2e.py --model meta-llama/Meta-Llama-3-8B \\
        --contexts 32768 131072 524288 --engines flash_attn 3k-fast 3k-fast+ext 3k-fast+mp

``--model``: a Hugging Face id or a local directory (a config is enough), or a short name of this
repository's small models (benchmarks/common.py). ``+ext`` engines declare the model's trained
length from its config (``--trained-context`` overrides it).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (benchmarks/common.py: --model, trained length, command line)

WARMUP_TOKENS = 16384
DECODE_TOKENS = 128
DEFAULT_MODEL = "meta-llama/Meta-Llama-3-8B"


ENGINE_MODIFIERS = ("ext", "vllm-scheduler", "mp", "qb128", "qb256", "bk16", "tp2", "ray",
                    "rules", "paper", "extend", "landmark", "group")
# ``+rules``: the selection rules that are not the paper's (z-score head ranking, exact last
# stage, window candidates dropped at every stage, pruning remapped below the trained length);
# ``+paper``: the paper's (and this plugin's before them); ``+extend``: reused decode blocks
# read past their end. The defaults are ``+rules+extend``; ``+paper`` or ``+rules`` without
# ``+extend`` read blocks as chosen.
SELECTION_RULES = {"rules": dict(head_reduction="z-score", exact_last_stage=True,
                                 drop_window_candidates=True, remap_pruning="always"),
                   "paper": dict(head_reduction="max", exact_last_stage=False,
                                 drop_window_candidates=False, remap_pruning="past-trained"),
                   "extend": dict(extend_reused_blocks=True)}


def engine_parts(name: str) -> tuple[str, set[str]]:
    """An infinitehip engine name's preset and modifiers (``3k-fast+ext`` -> ``3k-fast, {ext}``)."""
    preset, *mods = name.split("+")
    unknown = set(mods) - set(ENGINE_MODIFIERS)
    if unknown:
        raise SystemExit(f"unknown engine modifier(s) {sorted(unknown)} in {name!r}")
    return preset, set(mods)


def engine_spec(name: str, max_len: int, trained: int | None = None) -> dict:
    """``flash_attn``, or an infinitehip preset with modifiers: ``+ext`` for context extension
    on, ``+vllm-scheduler`` for vLLM's own scheduler (with its per-step common-prefix walk,
    which infinitehip's scheduler skips: the A/B of that change). ``+mp`` (also on
    ``flash_attn``) runs the engine core in its own process, as ``LLM`` and ``vllm serve`` do by
    default; it is read in ``run_engine``, before vLLM is imported. ``+qb128`` / ``+qb256``: the
    first pruning stage scores query blocks of 128 / 256 queries (16 pooled each), the later
    stages 64 (neighbouring blocks share the first stage's prefill work). ``+bk16``: the last
    stage keeps its tokens in blocks of 16 (half as many blocks as 8). These three change
    ``stages``; a preset's ``decode_stages`` (``3k-5k``'s) stay as they are. ``+rules`` /
    ``+paper``: the selection rules set one way or the other, ``+extend``: reused decode
    blocks read past their end (:data:`SELECTION_RULES`). ``+landmark``: the prefill's
    stages score chunks by landmark representatives; ``+group``: the query heads of a KV
    group bisect one path in the prefill's stages. ``+tp2`` (also on
    ``flash_attn``): tensor parallelism over two GPUs, with vLLM's ``mp`` executor, or with
    ``+ray`` its Ray executor (``--distributed-executor-backend ray``, a local Ray cluster)."""
    kw = dict(load_format="dummy", dtype="bfloat16", max_model_len=max_len,
              max_num_batched_tokens=32768, enable_prefix_caching=True,
              gpu_memory_utilization=0.94, disable_log_stats=False, seed=0,
              hf_overrides={"max_position_embeddings": max_len},
              # CUDA graphs for the decode batches measured (1 and 8) and between, not vLLM's
              # 51 sizes: the same graphs serve the timed steps, and each engine starts sooner
              compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8]})  # fmt: skip
    preset, mods = engine_parts(name)
    tp, executor = engine_parallelism(name)
    if tp > 1:
        kw.update(tensor_parallel_size=tp, distributed_executor_backend=executor)
    if preset == "flash_attn":
        return {**kw, "attention_backend": "FLASH_ATTN"}
    hip = {"preset": preset, "rope_extension": "ext" in mods}
    for mod in mods & set(SELECTION_RULES):
        hip.update(SELECTION_RULES[mod])
    if mods & {"paper", "rules"}:  # named rules read blocks as chosen unless +extend
        hip["extend_reused_blocks"] = "extend" in mods
    if "ext" in mods:
        if trained is None:
            raise SystemExit(f"{name!r}: +ext needs the model's trained length")
        hip["trained_context"] = trained
    if mods & {"qb128", "qb256", "bk16"}:
        from vllm_infinitehip.config import PRESETS

        stages = [dataclasses.asdict(st) for st in PRESETS[preset]["stages"]]
        for block in (128, 256):
            if f"qb{block}" in mods:
                stages[0].update(block_size_q=block, query_stride=block // 16)
        if "bk16" in mods:
            stages[-1].update(chunk_size=16)
        hip["stages"] = stages
        # the modifiers change the preset's stages; a preset's own decode stages stay decode's
        # (given stages alone would serve decode too)
        decode = PRESETS[preset].get("decode_stages")
        if decode is not None:
            hip["decode_stages"] = decode if decode == "auto" else [
                dataclasses.asdict(st) for st in decode]  # fmt: skip
    if "landmark" in mods:  # prefill pruning by landmark representatives
        hip["prefill_representatives"] = "landmark"
    if "group" in mods:  # prefill pruning, one bisection path per KV group
        hip["prefill_representatives"] = "group-bisection"
    if "vllm-scheduler" in mods:  # async scheduling is on for these engines
        kw["scheduler_cls"] = "vllm.v1.core.sched.async_scheduler.AsyncScheduler"
    return {**kw, "attention_backend": "infinitehip", "additional_config": {"infinitehip": hip}}


def engine_parallelism(name: str) -> tuple[int, str | None]:
    """An engine name's tensor-parallel size and vLLM executor (None at TP = 1)."""
    _, mods = engine_parts(name)
    if "ray" in mods and "tp2" not in mods:
        raise SystemExit(f"{name!r}: +ray is an executor for +tp2")
    if "tp2" not in mods:
        return 1, None
    return 2, "ray" if "ray" in mods else "mp"


def random_prompt(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(1000, 100000) for _ in range(n)]


def _kernel_spans(prof) -> list[tuple[str, float, float]]:
    """Every CUDA kernel of a ``torch.profiler`` run (kernels inside CUDA graphs included)."""
    return [
        (e.name, e.time_range.start, e.time_range.end)
        for e in prof.events()
        if getattr(e, "device_type", None) is not None and e.device_type.name == "CUDA"
    ]


def _merged(spans) -> list[list[float]]:
    """The union of the spans' ``(name, start, end)`` intervals, as disjoint ``[start, end]``
    in time order."""
    merged: list[list[float]] = []
    for _, s, e in sorted(spans, key=lambda k: k[1]):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return merged


def _busy_us(spans) -> float:
    """Microseconds the GPU ran any kernel (the union of their intervals)."""
    return sum(e - s for s, e in _merged(spans))


def idle_gaps(kernels, launches, steps: int, min_gap_us: float = 5.0, top: int = 12) -> dict:
    """Where a run's GPU idled, and which host call ended each idle gap.

    ``kernels``: ``(name, start, end)`` of every kernel (µs, one clock with the host's);
    ``launches``: ``(name, start, end, context)`` of the host's CUDA runtime calls. A gap is a
    stretch of at least ``min_gap_us`` with no kernel running; it is charged to the last runtime
    call that began before the gap ended (the host was late to make it, or it waited on
    something), and, in ``by_call_in_flight``, to the runtime call the host was inside when
    the GPU went idle (a synchronize that the idle GPU then released: what the host did after it
    is the gap), or ``(host busy)`` when none was. Returns the idle µs and gaps per step (over
    ``steps``) and the ``top`` ``[context > call, idle µs per step, gaps per step]`` of each
    charge, most idle first."""
    import bisect

    merged = _merged(kernels)
    gaps = [(a[1], b[0]) for a, b in zip(merged, merged[1:]) if b[0] - a[1] >= min_gap_us]
    launches = sorted(launches, key=lambda c: c[1])
    starts = [c[1] for c in launches]

    def name(i: int) -> str:
        return f"{launches[i][3]} > {launches[i][0]}"

    def in_flight_at(t: float, lookback: int = 512) -> str:
        last = bisect.bisect_right(starts, t) - 1
        for j in range(last, max(-1, last - lookback), -1):
            if launches[j][2] > t:
                return name(j)
        return "(host busy)"

    ended: dict[str, list[float]] = {}
    in_flight: dict[str, list[float]] = {}
    for g0, g1 in gaps:
        i = bisect.bisect_right(starts, g1) - 1
        for charged, key in ((ended, name(i) if i >= 0 else "(no host call)"),
                             (in_flight, in_flight_at(g0))):  # fmt: skip
            entry = charged.setdefault(key, [0.0, 0])
            entry[0] += g1 - g0
            entry[1] += 1

    def ranked(charged: dict[str, list[float]]) -> list[list]:
        top_items = sorted(charged.items(), key=lambda kv: -kv[1][0])[:top]
        return [[k, round(us / steps, 1), round(n / steps, 2)] for k, (us, n) in top_items]

    return {
        "idle_us_per_step": round(sum(g1 - g0 for g0, g1 in gaps) / steps, 1),
        "gaps_per_step": round(len(gaps) / steps, 2),
        "by_host_call": ranked(ended),
        "by_call_in_flight": ranked(in_flight),
    }


def _runtime_calls(prof) -> list[tuple[str, float, float, str]]:
    """The host's CUDA runtime/driver calls of a ``torch.profiler`` run (``with_stack``), each
    with its context: the innermost vLLM or plugin frame of its stack, else its outermost op."""
    out = []
    for e in prof.events():
        dev = getattr(e, "device_type", None)
        if dev is None or dev.name != "CPU" or not e.name.startswith("cu"):
            continue
        frames = [f for f in (getattr(e, "stack", None) or []) if "vllm" in f or "benchmarks" in f]
        if frames:
            context = frames[0]
        else:
            top = e
            while getattr(top, "cpu_parent", None) is not None:
                top = top.cpu_parent
            context = top.name if top is not e else "(no op)"
        out.append((e.name, e.time_range.start, e.time_range.end, context))
    return out


def gap_profile(call, prompt, steps: int = 32) -> dict:
    """:func:`idle_gaps` of an in-process decode call of ``steps`` + 1 tokens (a prefix-cache
    hit; its first token's recompute is in the window too), host calls with Python stacks."""
    import torch

    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts, with_stack=True) as p:
        call([prompt], steps + 1)
    return idle_gaps(_kernel_spans(p), _runtime_calls(p), steps)


def decode_profile(call, prompts, step_s: float, top: int = 16) -> tuple[float, dict[str, float]]:
    """``(host_share, kernel_us_per_step)`` of decode steps alone: a profiled
    (DECODE_TOKENS + 1)-token call less a profiled 1-token call on the same prompts (both prefix
    hits, so the recomputed tail, the first token and the call's fixed costs cancel), divided by
    DECODE_TOKENS. ``host_share`` is 1 - the GPU's busy time per step / ``step_s`` (the engine
    timestamps' step); the table is each kernel's GPU µs per step, largest first."""
    import torch

    def profiled(n):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
            call(prompts, n)
        spans = _kernel_spans(p)
        totals: dict[str, float] = {}
        for name, s, e in spans:
            totals[name] = totals.get(name, 0.0) + (e - s)
        return _busy_us(spans), totals

    busy_1, k_1 = profiled(1)
    busy_n, k_n = profiled(DECODE_TOKENS + 1)
    per_step = {name: (us - k_1.get(name, 0.0)) / DECODE_TOKENS for name, us in k_n.items()}
    ranked = sorted(per_step.items(), key=lambda kv: -kv[1])
    table = {name[:80]: round(us, 1) for name, us in ranked[:top]}
    table["(all kernels)"] = round(sum(per_step.values()), 1)
    busy = (busy_n - busy_1) / DECODE_TOKENS
    table["(GPU busy)"] = round(busy, 1)
    return round(max(0.0, 1.0 - busy / (step_s * 1e6)), 3), table


def timed_generate(llm):
    """``call(prompts, max_tokens) -> (seconds, outputs)``: greedy, ``ignore_eos``, token-id
    prompts, token ids only; its first use (a warm-up prompt past the dense threshold, where
    Triton compiles the kernels) is made here and not timed."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    def call(prompts, max_tokens):
        # no detokenizing: tokenizers' DecodeStream, primed with the whole prompt, re-decodes
        # all of it while the output is not valid UTF-8 (0.2-0.5 s at 512K), which the dummy
        # weights' random tokens keep it, and in-process that is on the step's critical path
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            detokenize=False)  # fmt: skip
        t = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp,
                            use_tqdm=False)  # fmt: skip
        return time.perf_counter() - t, outs

    call([random_prompt(WARMUP_TOKENS, 1)], 8)
    return call


def cold_prefill(call, prompt) -> tuple[float, float]:
    """``(prefill_s, ttft_s)`` of a cold ``prompt`` with ``max_tokens=1``, from vLLM's request
    timestamps (``first_token_ts - scheduled_ts``, ``first_token_latency``), else the wall time."""
    wall, outs = call([prompt], 1)
    m = outs[0].metrics
    prefill = (m.first_token_ts - m.scheduled_ts) if m and m.first_token_ts else wall
    ttft = m.first_token_latency if m and m.first_token_latency else wall
    return prefill, ttft


def decode_seconds(call, prompts) -> tuple[float, float]:
    """Seconds of DECODE_TOKENS decode steps, measured two ways, each the median of three:

    - a (DECODE_TOKENS + 1)-token call less a 1-token call on the same prompts (prefix-cache
      hits), wall time;
    - the engine core's own timestamps of the long call, ``last_token_ts - first_token_ts``
      of its slowest request (the inter-token time, which no per-request fixed cost enters).

    Every request must have returned all its tokens (``ignore_eos``), or the row is invalid."""
    import statistics

    def engine_s(outs) -> float:
        for o in outs:
            if len(o.outputs[0].token_ids) != DECODE_TOKENS + 1:
                raise RuntimeError(f"{len(o.outputs[0].token_ids)} tokens back, "
                                   f"{DECODE_TOKENS + 1} asked")  # fmt: skip
        return max(o.metrics.last_token_ts - o.metrics.first_token_ts for o in outs)

    one = statistics.median(call(prompts, 1)[0] for _ in range(3))
    longs = [call(prompts, DECODE_TOKENS + 1) for _ in range(3)]
    many = statistics.median(t for t, _ in longs)
    return many - one, statistics.median(engine_s(outs) for _, outs in longs)


def host_profile(call, prompt, top: int = 25) -> list[list]:
    """The host functions of one in-process decode call of DECODE_TOKENS + 1 tokens (cProfile
    of this thread: the scheduler, the model runner's input preparation and the output
    processing), largest own time first, in ms per decode step: what can leave the GPU idle.
    The call's once-per-request costs (hashing the prompt's blocks, the prefix-cache lookup)
    are spread over its steps too."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    call([prompt], DECODE_TOKENS + 1)
    prof.disable()
    stats = pstats.Stats(prof).stats
    ranked = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [[f"{Path(f).name}:{line}:{fn}", calls, round(tt * 1e3 / DECODE_TOKENS, 3),
             round(ct * 1e3 / DECODE_TOKENS, 3)]
            for (f, line, fn), (_, calls, tt, ct, _) in ranked]  # fmt: skip


def run_engine(model: str, name: str, contexts: list[int], batch8: list[int], max_len: int,
               budget_s: float, profile_host: bool, trained: int | None = None) -> list[dict]:
    """``name``'s rows for ``model`` (``--model`` as given); ``trained``: the length ``+ext``
    declares, by default the model's own (:func:`common.trained_length`)."""
    preset, mods = engine_parts(name)
    path = common.resolve_model(model)
    if "ext" in mods:
        trained = common.trained_length(path, trained)
    tp, executor = engine_parallelism(name)
    # before vLLM is imported: vllm.envs reads it when the engine is built
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if "mp" in mods else "0"
    from vllm import LLM

    t_start = time.perf_counter()
    llm = LLM(path, **engine_spec(name, max_len, trained))
    init_s = time.perf_counter() - t_start

    call = timed_generate(llm)
    model_name = common.model_name(model)
    rows = []
    backend = "flash_attn" if preset == "flash_attn" else "infinitehip"
    t_ready = time.perf_counter()
    for i, ctx in enumerate(contexts):
        # from when the engine is ready, and never before its first context: an engine's start
        # (a minute or more) would otherwise spend a budget before anything is measured
        if i and time.perf_counter() - t_ready > budget_s:
            print(f"[e2e] {name}: time budget spent before {ctx}", flush=True)
            break
        prompt = random_prompt(ctx - 1, ctx)
        prefill, ttft = cold_prefill(call, prompt)
        wall_s, engine_s = decode_seconds(call, [prompt])
        decode, decode_engine = DECODE_TOKENS / wall_s, DECODE_TOKENS / engine_s
        base = dict(model=model_name, context=ctx, backend=backend,
                    preset=None if backend == "flash_attn" else preset,
                    rope_extension="ext" in mods, engine_core_process="mp" in mods,
                    tp=tp, executor=executor, engine=name, init_s=round(init_s, 1))  # fmt: skip
        row = {**base, "batch": 1, "prefill_s": round(prefill, 3), "ttft_s": round(ttft, 3),
               "decode_tok_s": round(decode_engine, 1), "decode_tok_s_wall_diff": round(decode, 1),
               "host_share": None}  # fmt: skip
        if "mp" not in mods and tp == 1:  # the profilers see the model only in this process
            row["host_share"], row["kernel_us_per_step"] = decode_profile(
                call, [prompt], engine_s / DECODE_TOKENS)
            print(f"[e2e] {name} {ctx}: GPU us per decode step by kernel: "
                  f"{row['kernel_us_per_step']}", flush=True)  # fmt: skip
            if profile_host:
                row["gpu_idle"] = gap_profile(call, prompt)
                print(f"[e2e] {name} {ctx}: GPU idle per step {row['gpu_idle']['idle_us_per_step']}"
                      f" us in {row['gpu_idle']['gaps_per_step']} gaps; charged to [context > "
                      f"call, us/step, gaps/step]:", flush=True)  # fmt: skip
                for charged in row["gpu_idle"]["by_host_call"]:
                    print(f"[e2e]   {charged}", flush=True)
                print("[e2e] and to the host call in flight when the GPU went idle:", flush=True)
                for charged in row["gpu_idle"]["by_call_in_flight"]:
                    print(f"[e2e]   {charged}", flush=True)
                row["host_ms_per_step"] = host_profile(call, prompt)
                print(f"[e2e] {name} {ctx}: host functions [name, calls, own ms/step, "
                      f"cumulative ms/step]:", flush=True)  # fmt: skip
                for fn in row["host_ms_per_step"]:
                    print(f"[e2e]   {fn}", flush=True)
        rows.append(row)
        print(f"[e2e] {rows[-1]}", flush=True)
        if ctx in batch8:
            prompts = [prompt[:-64] + random_prompt(64, 10 * ctx + i) for i in range(8)]
            call(prompts, 1)  # their suffixes' prefill
            wall_s, engine_s = decode_seconds(call, prompts)
            rows.append({**base, "batch": 8, "prefill_s": None, "ttft_s": None,
                         "decode_tok_s": round(8 * DECODE_TOKENS / engine_s, 1),
                         "decode_tok_s_wall_diff": round(8 * DECODE_TOKENS / wall_s, 1),
                         "host_share": None})  # fmt: skip
            print(f"[e2e] {rows[-1]}", flush=True)
    return rows


def add_ratios(rows: list[dict]) -> None:
    """Against FLASH_ATTN with the engine core in the same kind of process and the same TP
    (``*_vs_flash_attn``), and a TP > 1 engine against the same engine at TP = 1
    (``decode_vs_tp1``)."""
    def key(r):
        return (r.get("model"), r["context"], r["batch"], r.get("engine_core_process", False),
                r.get("tp", 1))

    def single(r: dict) -> tuple:  # the engine without its parallelism, in any modifier order
        preset, mods = engine_parts(r["engine"])
        return r.get("model"), preset, frozenset(mods - {"tp2", "ray"}), r["context"], r["batch"]

    fa = {key(r): r for r in rows if r["backend"] == "flash_attn"}
    tp1s = {single(r): r for r in rows if r.get("tp", 1) == 1}
    for r in rows:
        tp1 = tp1s.get(single(r))
        r["decode_vs_tp1"] = (round(r["decode_tok_s"] / tp1["decode_tok_s"], 2)
                              if r.get("tp", 1) > 1 and tp1 else None)  # fmt: skip
        base = fa.get(key(r))
        r["decode_speedup_vs_flash_attn"] = (
            round(r["decode_tok_s"] / base["decode_tok_s"], 2) if base else None
        )
        r["prefill_speedup_vs_flash_attn"] = (
            round(base["prefill_s"] / r["prefill_s"], 2)
            if base and base.get("prefill_s") and r.get("prefill_s") else None
        )


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    several = len({r.get("model") for r in rows}) > 1
    for (model, engine, batch) in sorted({(str(r.get("model")), r["engine"], r["batch"])
                                          for r in rows}):
        pts = sorted((r["context"], r["decode_tok_s"]) for r in rows
                     if (str(r.get("model")), r["engine"], r["batch"]) == (model, engine, batch))
        style = "-o" if batch == 1 else "--s"
        ax.plot([c / 1024 for c, _ in pts], [v for _, v in pts], style,
                label=f"{model + ' ' if several else ''}{engine}, batch {batch}")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (K tokens)")
    ax.set_ylabel("decode tokens / s")
    models = ", ".join(sorted({str(r.get("model") or "?") for r in rows}))
    ax.set_title(f"{models} (dummy weights), bf16, through vLLM 0.26", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def gpu_name() -> str | None:
    """The machine's CUDA GPU, or None: the results files' ``gpu`` field."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def markdown_table(rows: list[dict], cols: list[str]) -> str:
    """The rows' ``cols`` as a markdown table (missing or null: empty), in the given order."""
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join("" if r.get(c) is None else str(r[c]) for c in cols) + " |")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    cols = ["context", "engine", "batch", "prefill_s", "ttft_s", "decode_tok_s",
            "decode_tok_s_wall_diff",
            "decode_speedup_vs_flash_attn", "prefill_speedup_vs_flash_attn", "host_share"]
    if any(r.get("tp", 1) > 1 for r in rows):
        cols.append("decode_vs_tp1")
    return markdown_table(sorted(rows, key=lambda r: (r["context"], r["batch"], r["engine"])), cols)


def drive_engines(script: str, name: str, args, key, finish, plot_rows, notes: str) -> list[dict]:
    """Run each of ``args.engines`` in its own process (``script --worker ENGINE=TMP`` with this
    process's arguments; a deleted in-process engine keeps GPU memory), merge its rows into
    ``<name>-gpu.json`` (rows of the same ``key`` replaced), ``finish`` them (ratios),
    and rewrite the JSON and its plot after every engine, so a run cut short keeps its rows."""
    import torch

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    date = datetime.date.today().isoformat()
    path = out_dir / f"{name}-gpu.json"
    rows: list[dict] = []
    if args.merge and path.exists():
        rows = json.loads(path.read_text())["rows"]
    for engine in args.engines:
        tmp = out_dir / f".{name}-{engine.replace(':', '_')}.json"
        cmd = [sys.executable, script, "--worker", f"{engine}={tmp}", *sys.argv[1:]]
        proc = subprocess.run(cmd, check=False)  # a failed engine is reported, the rest still run
        if not tmp.exists():
            print(f"[{name}] {engine}: engine failed (exit {proc.returncode})", flush=True)
            continue
        new = json.loads(tmp.read_text())
        tmp.unlink()
        done = {key(r) for r in new}
        rows = [r for r in rows if key(r) not in done] + new
        finish(rows)
        result = {"name": name, "date": date, "gpu": torch.cuda.get_device_name(0),
                  "command": common.command_line(),
                  "notes": notes, "rows": rows}  # fmt: skip
        path.write_text(json.dumps(result, indent=1))
        plot_rows(rows, path.with_suffix(".png"))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help=common.MODEL_HELP + "; dummy weights")
    ap.add_argument("--trained-context", type=int, default=None,
                    help="the length +ext engines declare as trained; default: from the config")
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072, 524288])
    ap.add_argument("--engines", nargs="+", default=["flash_attn", "3k-5k", "3k-5k+ext"])
    ap.add_argument("--batch8-contexts", type=int, nargs="*", default=[131072])
    ap.add_argument("--skip", nargs="*", default=[],
                    help="ENGINE:CONTEXT pairs not to run (e.g. flash_attn:917504)")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--budget-s", type=float, default=1e9,
                    help="per engine, from when it is ready: no context starts after it (the "
                         "first always runs)")
    ap.add_argument("--out", default=str(common.RESULTS))
    ap.add_argument("--merge", action="store_true", help="keep rows of other engines/contexts "
                    "already in the file")  # fmt: skip
    ap.add_argument("--host-profile", action="store_true",
                    help="cProfile one decode call per in-process engine and context")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    max_len = args.max_model_len or max(args.contexts) + 128

    if args.worker:  # one engine, in this process
        name, out = args.worker.split("=", 1)
        skip = {int(s.split(":")[1]) for s in args.skip if s.split(":")[0] == name}
        contexts = [c for c in args.contexts if c not in skip]
        rows = run_engine(args.model, name, contexts, args.batch8_contexts, max_len,
                          args.budget_s, args.host_profile, args.trained_context)  # fmt: skip
        Path(out).write_text(json.dumps(rows))
        return

    notes = ("compiling warm-up call excluded from every timing; prefill_s and ttft_s from vLLM's "
             "request timestamps; decode_tok_s from the engine core's token timestamps on a "
             "prefix-cache hit; host_share and kernel_us_per_step from torch.profiler, a "
             "129-token call less a 1-token call")  # fmt: skip
    rows = drive_engines(__file__, "e2e", args,
                         lambda r: (r.get("model"), r["engine"], r["context"], r["batch"]),
                         add_ratios, plot, notes)  # fmt: skip
    print(table(rows))


if __name__ == "__main__":
    main()
