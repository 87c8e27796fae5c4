"""Tensor parallelism over Ray on two GPUs: decode speed and greedy agreement, in one results file.

    python benchmarks/tp.py --model-8b meta-llama/Meta-Llama-3-8B \\
        --model-real qwen2.5-coder-0.5b [--contexts 131072 524288] [--parts speed greedy]

Two parts, each run by the benchmark that owns it, each engine in its own processes:

- ``speed``: ``benchmarks/e2e.py`` on ``--model-8b``'s architecture with dummy weights, engines
  ``3k-fast`` (TP = 1), ``3k-fast+tp2+ray`` and ``flash_attn+tp2+ray`` (``--engines`` to change
  them): decode tok/s at batch 1 and 8 per context, with ``decode_vs_tp1`` (against the same
  engine at TP = 1) and ``decode_speedup_vs_flash_attn`` (against FLASH_ATTN at the same TP);
- ``greedy``: ``benchmarks/tp_mask.py --device gpu --executor ray`` on a real small model whose
  KV heads split over two ranks (Qwen2.5-Coder-0.5B: 2; SmolLM2-135M's 3 do not): greedy tokens
  at TP = 2 with ``tp_mask`` "global" and "per-rank" against TP = 1 (``greedy_match_tp1``), and
  the default backend at TP = 2 against TP = 1, TP's own arithmetic with no masks.

Each part writes its own file as it goes (``e2e-gpu.json``, ``tp-mask-gpu.json`` under
``<out>/tp-parts``), so a run cut short keeps what it finished; the join into ``tp-gpu.json`` (rows
``tp``, ``executor``, ``context``, ``batch``, ``decode_tok_s``, ``greedy_match_tp1``), its PNG and
table runs last, and again with ``--parts`` empty.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import common  # noqa: E402  (command line)
from e2e import DEFAULT_MODEL, gpu_name, markdown_table  # noqa: E402

HERE = Path(__file__).parent
SPEED_ENGINES = ["3k-fast", "3k-fast+tp2+ray", "flash_attn+tp2+ray"]
COLUMNS = ["kind", "engine", "tp_mask", "tp", "executor", "context", "batch", "decode_tok_s",
           "decode_vs_tp1", "decode_speedup_vs_flash_attn", "greedy_match_tp1",
           "token_agreement"]  # fmt: skip


def join(speed_rows: list[dict], greedy_rows: list[dict]) -> list[dict]:
    """The two parts' rows in the issue's shape. A speed row has no greedy match (dummy
    weights); a greedy row (one prompt of the batch that ``tp_mask.py`` serves together) has
    no speed, its ``context`` is the prompt's length and ``greedy_match_tp1`` whether its
    tokens equal TP = 1's."""
    rows = []
    for r in speed_rows:
        rows.append({"kind": "speed", "engine": r["engine"], "backend": r["backend"],
                     "tp_mask": "per-rank" if r["backend"] == "infinitehip" else None,
                     "tp": r.get("tp", 1), "executor": r.get("executor"),
                     "context": r["context"], "batch": r["batch"],
                     "prefill_s": r.get("prefill_s"), "decode_tok_s": r["decode_tok_s"],
                     "decode_vs_tp1": r.get("decode_vs_tp1"),
                     "decode_speedup_vs_flash_attn": r.get("decode_speedup_vs_flash_attn"),
                     "greedy_match_tp1": None, "token_agreement": None})  # fmt: skip
    for r in greedy_rows:
        same = [g for g in greedy_rows
                if (g["backend"], g["tp_mask"], g["tp"]) == (r["backend"], r["tp_mask"], r["tp"])]
        batch = len(same)
        rows.append({"kind": "greedy", "engine": None, "backend": r["backend"],
                     "tp_mask": r["tp_mask"], "tp": r["tp"], "executor": r.get("executor"),
                     "context": r["prompt_tokens"], "batch": batch, "prefill_s": None,
                     "decode_tok_s": None, "decode_vs_tp1": None,
                     "decode_speedup_vs_flash_attn": None, "greedy_match_tp1": r["equal"],
                     "token_agreement": r["token_agreement"],
                     "first_divergence": r["first_divergence"]})  # fmt: skip
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    speed = [r for r in rows if r["kind"] == "speed"]
    cells = sorted({(r["context"], r["batch"]) for r in speed})
    engines = sorted({r["engine"] for r in speed})
    width = 0.8 / max(1, len(engines))
    for j, engine in enumerate(engines):
        ys = [next((r["decode_tok_s"] for r in speed
                    if r["engine"] == engine and (r["context"], r["batch"]) == c), 0.0)
              for c in cells]  # fmt: skip
        ax.bar([i + j * width for i in range(len(cells))], ys, width, label=engine)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cells))],
                  [f"{c // 1024}K, b{b}" for c, b in cells])  # fmt: skip
    ax.set_ylabel("decode tokens / s")
    ax.set_title("dummy weights, bf16")
    ax.legend(fontsize=8)
    greedy = [r for r in rows if r["kind"] == "greedy"]
    labels = sorted({f"{r['backend']} {r['tp_mask'] or ''}".strip() for r in greedy})
    for j, label in enumerate(labels):
        mine = [r for r in greedy if f"{r['backend']} {r['tp_mask'] or ''}".strip() == label]
        bx.bar(j, sum(r["token_agreement"] for r in mine) / len(mine), 0.6, label=label)
    bx.set_xticks(range(len(labels)), labels, fontsize=8)
    bx.set_ylim(0, 1.05)
    bx.set_ylabel("greedy agreement with TP = 1 (mean over prompts)")
    bx.set_title("a real small model, TP = 2")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-8b", default=DEFAULT_MODEL,
                    help="the speed part's model (dummy weights): " + common.MODEL_HELP)
    ap.add_argument("--model-real", default="qwen2.5-coder-0.5b",
                    help="the greedy part's model, whose KV heads split over two ranks: "
                    + common.MODEL_HELP)
    ap.add_argument("--contexts", type=int, nargs="+", default=[131072, 524288])
    ap.add_argument("--engines", nargs="+", default=SPEED_ENGINES)
    ap.add_argument("--parts", nargs="*", choices=("speed", "greedy"), default=["speed", "greedy"])
    ap.add_argument("--budget-s", type=float, default=1e9, help="per speed engine")
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args()
    out = Path(args.out)
    parts = out / "tp-parts"
    parts.mkdir(parents=True, exist_ok=True)
    date = datetime.date.today().isoformat()
    commands = []
    if "speed" in args.parts:
        cmd = [sys.executable, str(HERE / "e2e.py"), "--model", args.model_8b, "--contexts",
               *map(str, args.contexts), "--batch8-contexts", *map(str, args.contexts),
               "--engines", *args.engines, "--budget-s", str(args.budget_s), "--merge",
               "--out", str(parts)]  # fmt: skip
        commands.append(common.command_line(cmd[1:]))
        subprocess.run(cmd, check=False)  # a failed engine is reported by e2e.py; join the rest
    if "greedy" in args.parts:
        cmd = [sys.executable, str(HERE / "tp_mask.py"), "--model", args.model_real,
               "--device", "gpu",
               "--tp", "2", "--executor", "ray", "--out", str(parts)]  # fmt: skip
        commands.append(common.command_line(cmd[1:]))
        subprocess.run(cmd, check=False)

    def rows_of(name: str) -> list[dict]:
        path = parts / f"{name}-gpu.json"
        return json.loads(path.read_text())["rows"] if path.exists() else []

    rows = join(rows_of("e2e"), rows_of("tp-mask"))
    path = out / "tp-gpu.json"
    if path.exists():  # a run of one part after the other: both parts' commands
        commands = list(dict.fromkeys(json.loads(path.read_text())["parts"] + commands))
    path.write_text(json.dumps({
        "name": "tp", "date": date, "gpu": gpu_name(),
        "command": common.command_line(),
        "parts": commands, "rows": rows}, indent=1))  # fmt: skip
    if rows:
        plot(rows, path.with_suffix(".png"))
    print(markdown_table(rows, COLUMNS))


if __name__ == "__main__":
    main()
