"""Plot a benchmark results JSON: ``python benchmarks/plot.py benchmarks/results/attention-gpu-DATE.json``.

Writes the PNG beside the JSON (latency vs context, log-log; dense baselines vs InfiniteHiP).
"""

from __future__ import annotations

import json
import sys
import textwrap
from collections import Counter
from pathlib import Path


def plot_attention(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    ctx = [r["context"] for r in rows]

    def line(ax, key: str, style: str, label: str) -> None:
        # a baseline that failed or was not run at some context is a gap (NaN), and one absent
        # everywhere (older results, or all failed) is left out of the legend
        ys = [float("nan") if r.get(key) is None else r[key] for r in rows]
        if any(y == y for y in ys):
            ax.loglog(ctx, ys, style, label=label)

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    line(a, "decode_us_dense", "o-", "dense SDPA (flash)")
    line(a, "decode_us_fa3", "D-", "vLLM FLASH_ATTN (FA3), paged")
    line(a, "decode_us_xformers", "P-", "xformers fmha")
    line(a, "decode_us_xformers_splitk", "X:", "xformers Triton split-K")
    line(a, "decode_us_amortized", "s-", "InfiniteHiP, amortized")
    line(a, "decode_us_refresh", "^--", "InfiniteHiP, full refresh")
    line(a, "decode_us_reuse", "v--", "InfiniteHiP, mask reuse")
    a.set(title="decode, one layer", xlabel="context (tokens)", ylabel="µs")
    line(b, "prefill_ms_dense", "o-", "dense SDPA (flash)")
    line(b, "prefill_ms_fa3", "D-", "vLLM FLASH_ATTN (FA3), paged")
    line(b, "prefill_ms_xformers", "P-", "xformers fmha")
    line(b, "prefill_ms", "s-", "InfiniteHiP")
    b.set(title="32K-query prefill chunk, one layer", xlabel="context (tokens)", ylabel="ms")
    for ax in (a, b):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{result['gpu']}, {result['date']}, preset {rows[0]['preset']}")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def _gpus(result: dict, panels: list[tuple]) -> str:
    """The GPUs of the rows plotted: a row that ran elsewhere than the file's GPU names its own."""
    names = dict.fromkeys(r.get("gpu", result["gpu"]) for _, rows, *_ in panels for r in rows)
    return " and ".join(names)


def plot_passkey(result: dict, out: Path) -> None:
    """Heatmaps of accuracy by context length (x) and needle depth (y): a row per model, a column
    per backend (the default one, and infinitehip with default settings, or the first compared)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in result["rows"]))
    panels = []
    for model in models:
        mine = [r for r in result["rows"] if r["model"] == model]
        # infinitehip's settings: the newest measured, then the one at the most cells
        hip = Counter(r["config"] for r in mine if r.get("config"))
        newest = {c: max(r.get("date", "") for r in mine if r.get("config") == c) for c in hip}
        config = max(hip, key=lambda c: (newest[c], hip[c]), default="")
        rows = [r for r in mine if r.get("config", "") in ("", config)]
        # one panel per backend: its execution path with the most cells (a spot check of the
        # other path, e.g. by --ops compare, stays in the JSON)
        cells = Counter((r["backend"], r.get("ops", "")) for r in rows)
        shown = sorted(max((k for k in cells if k[0] == b), key=cells.get)
                       for b in {b for b, _ in cells})
        rows = [r for r in rows if (r["backend"], r.get("ops", "")) in shown]
        panels.append((model, rows, shown, config))
    ncols = max(len(backends) for _, _, backends, _ in panels)
    fig, axes = plt.subplots(len(panels), ncols, figsize=(4.5 * ncols, 4.0 * len(panels)),
                             squeeze=False, gridspec_kw={"hspace": 0.45, "wspace": 0.3})
    title_lines = 2
    for ax_row, (model, rows, backends, config) in zip(axes, panels):
        lengths = sorted({r["context"] for r in rows})
        depths = sorted({r["depth"] for r in rows})
        for ax in ax_row[len(backends):]:
            ax.axis("off")
        for ax, (backend, ops) in zip(ax_row, backends):
            grid = [[next((r["accuracy"] for r in rows if r["backend"] == backend
                           and r.get("ops", "") == ops and r["context"] == n
                           and r["depth"] == d), float("nan"))
                     for n in lengths] for d in depths]
            im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="lower")
            ax.set_xticks(range(len(lengths)), [f"{n // 1024}K" for n in lengths])
            ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
            for i, row in enumerate(grid):
                for j, v in enumerate(row):
                    ax.text(j, i, "not run" if v != v else f"{v:.2f}", ha="center",
                            va="center", fontsize=8)
            ax.set(xlabel="context", ylabel="needle depth")
            label = f"{backend} ({ops} path)" if ops else backend
            settings = ", ".join(f"{k}={v}" for k, v in json.loads(config).items()
                                 if backend == "infinitehip") if config else ""
            title = (f"{model} (trained {rows[0]['trained_context'] // 1024}K)\n{label}"
                     + (f"\n{textwrap.fill(settings, 48)}" if settings else ""))
            ax.set_title(title, fontsize=8)
            title_lines = max(title_lines, title.count("\n") + 1)
        fig.colorbar(im, ax=ax_row.tolist(), shrink=0.8, label="passkey accuracy")
    # above the first row's titles (8-point lines): the default height overlaps them
    fig.suptitle(f"passkey retrieval, {_gpus(result, panels)}, {result['date']}",
                 y=1.0 + (0.1 + 0.14 * title_lines) / fig.get_figheight())
    fig.savefig(out, dpi=110, bbox_inches="tight")


def plot_recall(result: dict, out: Path) -> None:
    """Attention-mass recall by layer, a panel per model, one line per context length and query
    kind (mean over prompts): solid for the final prompt query, dashed for decode queries; where
    the rows have it, the recall under the layer's remapping in the same colour, paler."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in result["rows"]))
    fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 3.8), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [r for r in result["rows"] if r["model"] == model]
        first = (mine[0].get("config"), mine[0].get("ops"))
        rows = [r for r in mine if (r.get("config"), r.get("ops")) == first]
        for query, style in (("final-prompt", "-"), ("decode", "--")):
            for n in sorted({r["context"] for r in rows}):
                line = None
                kinds = (("recall", "", 1.0), ("recall_remapped", ", remapped", 0.45))
                for key, tag, alpha in kinds:
                    by_layer: dict[int, list[float]] = {}
                    for r in rows:
                        if (r["context"], r.get("query", "final-prompt")) == (n, query) and key in r:
                            by_layer.setdefault(r["layer"], []).append(r[key])
                    layers = sorted(by_layer)
                    if layers:
                        line = ax.plot(
                            layers, [sum(by_layer[k]) / len(by_layer[k]) for k in layers], style,
                            marker="o", markersize=3, alpha=alpha,
                            label=f"{n // 1024}K {query}{tag}",
                            color=None if line is None else line[0].get_color(),
                        )  # fmt: skip
        path = f", {first[1]} path" if first[1] else ""
        ax.set(xlabel="layer", ylabel="attention-mass recall", ylim=(0, 1.02),
               title=f"{model}{path}, {result['gpu']}, {result['date']}")
        ax.axhline(0.95, color="grey", linestyle=":", linewidth=1)
        ax.legend(title="context, query", fontsize=7)
    fig.savefig(out, dpi=110, bbox_inches="tight")


def plot_mask_heads(result: dict, out: Path) -> None:
    """Remapped recall by layer of a decode-like query (benchmarks/mask_heads.py), mean over
    prompts, one line per context and mask mode: solid for one mask per layer, dashed for one
    per KV group; the needle kept or not marked per layer (filled: kept by every prompt)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    rows = result["rows"]
    for model, config, n in sorted({(r["model"], r.get("config", "{}"), r["context"])
                                    for r in rows}):  # fmt: skip
        line = None
        settings = "" if config == "{}" else f" {config}"
        for mode, style in (("layer", "-"), ("kv_group", "--")):
            by_layer: dict[int, list[dict]] = {}
            for r in rows:
                if (r["model"], r.get("config", "{}"), r["context"], r["mode"]) == (
                        model, config, n, mode):  # fmt: skip
                    by_layer.setdefault(r["layer"], []).append(r)
            layers = sorted(by_layer)
            means = [sum(r["recall"] for r in by_layer[k]) / len(by_layer[k]) for k in layers]
            line = ax.plot(layers, means, style,
                           label=f"{model}{settings} {round(n / 1024)}K, one mask per {mode}",
                           color=None if line is None else line[0].get_color())
            kept = [all(r["needle_kept"] for r in by_layer[k]) for k in layers]
            ax.scatter(layers, means, s=14, color=line[0].get_color(),
                       facecolors=[line[0].get_color() if k else "none" for k in kept])
    ax.set(xlabel="layer", ylabel="recall under the remapping", ylim=(0, 1.02),
           title=f"decode-like query, {result['gpu']}, {result['date']}")
    ax.axhline(0.95, color="grey", linestyle=":", linewidth=1)
    ax.legend(fontsize=7)
    fig.savefig(out, dpi=110, bbox_inches="tight")


def plot_ruler(result: dict, out: Path) -> None:
    """Heatmaps of RULER scores by context length (x) and task (y, with the mean of the tasks
    last): a row per model, a column per engine: the default backend, infinitehip with the
    settings measured at the most cells, and infinitehip with the settings that score best at
    the trained length (1x) among the others, when there are others."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks_of = {t: i for i, t in enumerate(
        ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
         "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1",
         "qa_2"])}
    models = list(dict.fromkeys(r["model"] for r in result["rows"]))
    panels = []
    for model in models:
        mine = [r for r in result["rows"] if r["model"] == model]
        cells = Counter((r["backend"], r["ops"], r["config"]) for r in mine)
        default = [k for k in cells if k[0] != "infinitehip"]
        hip = sorted((k for k in cells if k[0] == "infinitehip"), key=lambda k: (-cells[k], k))
        shown = sorted(default, key=lambda k: -cells[k])[:1] + hip[:1]
        trained = mine[0]["trained_context"]

        def at_1x(k: tuple) -> float:
            scores = [r["score"] for r in mine if (r["backend"], r["ops"], r["config"]) == k
                      and r["context"] == trained]
            return sum(scores) / len(scores) if len(scores) == len(tasks_of) else -1.0

        # of the settings measured at every 1× task, the best there (then the most cells)
        rest = [k for k in hip[1:] if at_1x(k) >= 0]
        if rest:
            shown.append(max(rest, key=lambda k: (at_1x(k), cells[k])))
        panels.append((model, [r for r in mine if (r["backend"], r["ops"], r["config"]) in shown],
                       shown))
    ncols = max(len(backends) for _, _, backends in panels)
    height = 1.5 + 0.3 * (len({r["task"] for r in result["rows"]}) + 1)
    width = 2.2 + 0.7 * len({r["context"] for r in result["rows"]})
    fig, axes = plt.subplots(len(panels), ncols, figsize=(width * ncols + 1, height * len(panels)),
                             squeeze=False, gridspec_kw={"hspace": 0.6, "wspace": 0.6})
    for ax_row, (model, rows, backends) in zip(axes, panels):
        lengths = sorted({r["context"] for r in rows})
        tasks = sorted({r["task"] for r in rows}, key=lambda t: (tasks_of.get(t, 99), t))
        for ax in ax_row[len(backends):]:
            ax.axis("off")
        for ax, (backend, ops, config) in zip(ax_row, backends):
            mine = {(r["task"], r["context"]): r for r in rows
                    if (r["backend"], r["ops"], r["config"]) == (backend, ops, config)}
            grid = [[mine[t, n]["score"] if (t, n) in mine else float("nan") for n in lengths]
                    for t in tasks]
            # the mean over the tasks measured at that length
            grid.append([sum(v for v in col if v == v) / max(1, sum(v == v for v in col))
                         if any(v == v for v in col) else float("nan") for col in zip(*grid)])
            im = ax.imshow(grid, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
            ax.set_xticks(range(len(lengths)), [f"{n // 1024}K" for n in lengths])
            ax.set_yticks(range(len(tasks) + 1), [*tasks, "average"], fontsize=8)
            ax.axhline(len(tasks) - 0.5, color="black", linewidth=1)
            for i, row in enumerate(grid):
                for j, v in enumerate(row):
                    ax.text(j, i, "-" if v != v else f"{v:.0f}", ha="center", va="center",
                            fontsize=7)
            ax.set(xlabel="context (RULER max_seq_length)")
            label = f"{backend} ({ops} path)" if ops else backend
            settings = ", ".join(f"{k}={v}" for k, v in json.loads(config).items()) if config else ""
            ax.set_title(f"{model} (trained {rows[0]['trained_context'] // 1024}K)\n{label}"
                         + (f"\n{textwrap.fill(settings, 48)}" if settings else ""), fontsize=8)
        fig.colorbar(im, ax=ax_row.tolist(), shrink=0.8, label="RULER score")
    fig.suptitle(f"RULER, {_gpus(result, panels)}, {result['date']}", y=0.93 + 0.9 / fig.get_figheight())
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)


def plot_decode_breakdown(result: dict, out: Path) -> None:
    """Stacked bars per variant: the reuse step's kernels in a 32-layer graph, and the amortized
    refresh on top (µs per layer)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(rows)), 4.2))
    labels = [f"{r['variant']}\n{r['context'] // 1024}K" for r in rows]
    colors: dict[str, str] = {}
    seen: set[str] = set()

    def bar(i: int, us: float, bottom: float, name: str, **kw) -> None:
        color = colors.setdefault(name, f"C{len(colors) % 10}")
        ax.bar(i, us, bottom=bottom, color=color, edgecolor="white",
               label=None if name in seen else name.lstrip("_"), **kw)  # fmt: skip
        seen.add(name)

    for i, r in enumerate(rows):
        bottom = 0.0
        for name, us in r["reuse_in_graph_kernels"]:
            bar(i, us, bottom, name)
            bottom += us
        bar(i, r["reuse_in_graph_us"] - bottom, bottom, "gaps between kernels")
        bar(i, r["amortized_in_graph_us"] - r["reuse_in_graph_us"], r["reuse_in_graph_us"],
            "refresh, amortized", hatch="//")  # fmt: skip
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set(ylabel="µs per layer", title=f"decode layer by kernel, {result['gpu']}, "
           f"{result['date']}")  # fmt: skip
    ax.legend(fontsize=7)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)


def plot_prefill_breakdown(result: dict, out: Path) -> None:
    """Stacked bars per (RoPE mode, variant): the chunk's kernels (ms), dense SDPA as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(rows)), 4.2))
    colors: dict[str, str] = {}
    seen: set[str] = set()
    for i, r in enumerate(rows):
        bottom = 0.0
        for name, ms in sorted(r["kernels_ms"].items(), key=lambda kv: -kv[1]):
            color = colors.setdefault(name, f"C{len(colors) % 10}")
            ax.bar(i, ms, bottom=bottom, color=color, edgecolor="white",
                   label=None if name in seen else name.lstrip("_")[:32])  # fmt: skip
            seen.add(name)
            bottom += ms
        ax.hlines(r["prefill_ms_dense"], i - 0.4, i + 0.4, colors="k",
                  label=None if "dense" in seen else "dense SDPA")  # fmt: skip
        seen.add("dense")
    labels = [f"{r['rope']}\n{r.get('representatives', 'bisection')}\n{r['variant']}\n"
              f"{r['context'] // 1024}K" for r in rows]  # fmt: skip
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set(ylabel="ms per 32K-query chunk and layer",
           title=f"sparse prefill chunk by kernel, {result['gpu']}, {result['date']}")
    ax.legend(fontsize=7)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)


if __name__ == "__main__":
    path = Path(sys.argv[1])
    result = json.loads(path.read_text())
    out = path.with_suffix(".png")
    plots = {"attention": plot_attention, "passkey": plot_passkey, "recall": plot_recall,
             "ruler": plot_ruler, "decode-breakdown": plot_decode_breakdown,
             "prefill-breakdown": plot_prefill_breakdown, "mask-heads": plot_mask_heads}
    if result["name"] in plots:
        plots[result["name"]](result, out)
    else:  # a benchmark that draws its own figure: plot(rows, path) in its module, beside this
        import importlib

        importlib.import_module(result["name"].replace("-", "_")).plot(result["rows"], out)
    print(f"wrote {out}")
