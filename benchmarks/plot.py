"""Plot a benchmark results JSON: ``python benchmarks/plot.py benchmarks/results/attention-gpu-DATE.json``.

Writes the PNG beside the JSON (latency vs context, log-log; dense vs InfiniteHiP).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def plot_attention(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    ctx = [r["context"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    a.loglog(ctx, [r["decode_us_dense"] for r in rows], "o-", label="dense SDPA (flash)")
    a.loglog(ctx, [r["decode_us_amortized"] for r in rows], "s-", label="InfiniteHiP, amortized")
    a.loglog(ctx, [r["decode_us_refresh"] for r in rows], "^--", label="InfiniteHiP, full refresh")
    a.loglog(ctx, [r["decode_us_reuse"] for r in rows], "v--", label="InfiniteHiP, mask reuse")
    a.set(title="decode, one layer", xlabel="context (tokens)", ylabel="µs")
    b.loglog(ctx, [r["prefill_ms_dense"] for r in rows], "o-", label="dense SDPA (flash)")
    b.loglog(ctx, [r["prefill_ms"] for r in rows], "s-", label="InfiniteHiP")
    b.set(title="32K-query prefill chunk, one layer", xlabel="context (tokens)", ylabel="ms")
    for ax in (a, b):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{result['gpu']}, {result['date']}, preset {rows[0]['preset']}")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    path = Path(sys.argv[1])
    result = json.loads(path.read_text())
    out = path.with_suffix(".png")
    {"attention": plot_attention}[result["name"]](result, out)
    print(f"wrote {out}")
