"""Where RULER's wrong numeric answers leave the truth, per backend and setting, from a RULER run's
recorded answers (``ruler-samples-<gpu|cpu>.json``) and the samples' prompts.

    python benchmarks/ruler_answers.py benchmarks/results/ruler-samples-gpu.json \\
        [--models qwen2.5-coder-0.5b smollm2-135m] [--cache .cache/ruler]

For the single-number needle tasks (niah_single_1/2, niah_multikey_1/2; Qwen's and SmolLM2's
tokenizers write one digit per token), each wrong answer is one of:

- ``wrong_from_first_digit``: the first digit is already wrong (the needle was not found, or a
  distractor's value was read), or nothing numeric came back;
- ``short``: no wrong digit, but too few (or too many);
- ``diverged``: one or more leading digits right, then a wrong one: the prompt's last query found
  the needle and a decode step lost it. Of these, ``diverged_at_chunk_start`` counts the ones
  whose first wrong digit is the first token of a block-sparse attention block
  (``--block-size``, the final stage's chunk: 8 in the presets; blocks start at multiples of it
  because the sink is one): the digit a decode step had to read lay in a block its mask had not
  kept. Without that effect the share is about 1 / block size (``chance``).

Writes ``ruler-answers-<device>.json`` (the samples file's device; its date), a PNG and a
table.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import common  # noqa: E402  (--model)
from e2e import markdown_table  # noqa: E402

TASKS = ("niah_single_1", "niah_single_2", "niah_multikey_1", "niah_multikey_2")
NAME = re.compile(r"^ruler-samples-(?P<device>gpu|cpu)(-[\w.-]+)?\.json$")


def divergence(truth: str, pred: str) -> int:
    """Index of the first digit of ``pred`` that differs from ``truth`` (``len`` of the shorter
    when one is a prefix of the other)."""
    digits = re.sub(r"[^0-9]", "", pred or "")
    n = min(len(truth), len(digits))
    return next((i for i in range(n) if truth[i] != digits[i]), n)


def answer_kind(truth: str, pred: str) -> tuple[str, int]:
    """A wrong answer's kind (``wrong_from_first_digit``, ``short`` or ``diverged``) and the
    index of its first wrong digit (:func:`divergence`)."""
    j = divergence(truth, pred)
    if j == 0:
        return "wrong_from_first_digit", j
    if j >= min(len(truth), len(re.sub(r"[^0-9]", "", pred or ""))):
        return "short", j  # no wrong digit: a right prefix, then nothing (or more digits)
    return "diverged", j


def needle_start(prompt_ids: list[int], truth_ids: list[int]) -> int | None:
    """Token position of the needle's value in the prompt, when it occurs exactly once."""
    n = len(truth_ids)
    hits = [i for i in range(len(prompt_ids) - n + 1) if prompt_ids[i:i + n] == truth_ids]
    return hits[0] if len(hits) == 1 else None


def classify(rows: list[dict], prompt_ids, digit_ids, block_size: int) -> list[dict]:
    """One row per (model, backend, config, context): counts of the wrong answers' kinds.
    ``prompt_ids(task, context, index)`` and ``digit_ids(text)`` tokenize like the run did."""
    cells: dict[tuple, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in rows:
        if r["task"] not in TASKS:
            continue
        key = (r["model"], r["backend"], r["config"], r["context"])
        cell = cells[key]
        cell["samples"] += 1
        truth = r["outputs"][0]
        if r["score"] >= 100 or not truth.isdigit():
            continue
        cell["wrong"] += 1
        kind, j = answer_kind(truth, r["pred"])
        if kind != "diverged":
            cell[kind] += 1
            continue
        start = needle_start(prompt_ids(r["task"], r["context"], r["index"]), digit_ids(truth))
        if start is None:
            cell["needle_not_located"] += 1
            continue
        cell["diverged"] += 1
        cell["diverged_at_chunk_start"] += (start + j) % block_size == 0
    out = []
    for (model, backend, config, context), c in sorted(cells.items(), key=str):
        out.append({"model": model, "backend": backend, "config": config, "context": context,
                    "samples": c["samples"], "wrong": c["wrong"],
                    "wrong_from_first_digit": c["wrong_from_first_digit"],
                    "diverged": c["diverged"], "short": c["short"],
                    "needle_not_located": c["needle_not_located"],
                    "diverged_at_chunk_start": c["diverged_at_chunk_start"],
                    "chunk_start_share": (round(c["diverged_at_chunk_start"] / c["diverged"], 3)
                                          if c["diverged"] else None),
                    "chance": round(1 / block_size, 3)})  # fmt: skip
    return out


def run_tokens(model: str, cache: Path, n: int, seed: int):
    """``(model_dir, tok, prompt_ids)`` of a ruler.py run's model: its offline directory, its
    tokenizer, and ``prompt_ids(task, context, index)``, a sample's chat prompt tokenized as the
    run did. The samples come from ruler.py's own cache (``generate_cached``: keyed by the
    tokenizer's behaviour and RULER's release), made again only if missing."""
    from ruler import generate_cached
    from transformers import AutoTokenizer

    model_dir = common.resolve_model(model)
    tok = AutoTokenizer.from_pretrained(model_dir)

    @functools.cache
    def prompts(task: str, context: int) -> dict[int, str]:
        samples = generate_cached(task, model_dir, context, n, True, seed, cache)
        return {s.index: s.prompt for s in samples}

    @functools.cache
    def prompt_ids(task: str, context: int, index: int) -> list[int]:
        return tok(prompts(task, context)[index], add_special_tokens=False)["input_ids"]

    return model_dir, tok, prompt_ids


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['model']} {r['backend']} {r['config'] or ''} {r['context'] // 1024}K"
              for r in rows]
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(rows) + 1.5))
    y = range(len(rows))
    first = [r["wrong_from_first_digit"] for r in rows]
    at = [r["diverged_at_chunk_start"] for r in rows]
    other = [r["diverged"] - r["diverged_at_chunk_start"] for r in rows]
    ax.barh(y, first, label="wrong from the first digit")
    ax.barh(y, at, left=first, label="diverged at a block's first token")
    ax.barh(y, other, left=[a + b for a, b in zip(first, at)], label="diverged elsewhere")
    ax.set_yticks(list(y), labels, fontsize=7)
    ax.set_xlabel("wrong answers (niah_single_1/2, niah_multikey_1/2)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("samples", type=Path, help="ruler.py's ruler-samples-<cpu|gpu>.json")
    ap.add_argument("--models", nargs="+", default=["qwen2.5-coder-0.5b", "smollm2-135m"],
                    help="the run's --model values: " + common.MODEL_HELP)
    ap.add_argument("--cache", type=Path, default=Path(".cache/ruler"),
                    help="ruler.py's --cache, where the samples' prompts are")
    ap.add_argument("--n", type=int, default=20, help="the run's --n")
    ap.add_argument("--seed", type=int, default=42, help="the run's --seed")
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--out", type=Path, default=common.RESULTS)
    args = ap.parse_args()
    m = NAME.match(args.samples.name)
    if m is None:
        ap.error(f"{args.samples.name}: not a ruler-samples-<gpu|cpu>.json")

    src = json.loads(args.samples.read_text())
    rows = []
    for model in args.models:
        mine = [r for r in src["rows"] if r["model"] == common.model_name(model)]
        if not mine:
            continue
        _, tok, prompt_ids = run_tokens(model, args.cache, args.n, args.seed)
        rows += classify(mine, prompt_ids, lambda text, tok=tok: tok(
            text, add_special_tokens=False)["input_ids"], args.block_size)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"ruler-answers-{m['device']}.json"
    path.write_text(json.dumps({
        "name": "ruler-answers", "date": src.get("date"), "gpu": src.get("gpu"),
        "command": common.command_line(),
        "rows": rows}, indent=1))  # fmt: skip
    plot(rows, path.with_suffix(".png"))
    print(markdown_table(rows, ["model", "backend", "config", "context", "samples", "wrong",
                                "wrong_from_first_digit", "diverged", "diverged_at_chunk_start",
                                "chunk_start_share", "chance"]))  # fmt: skip


if __name__ == "__main__":
    main()
