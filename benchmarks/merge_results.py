"""Join the result files of runs made side by side (benchmarks/gpu_quality_run.sh: one output
folder per run) into one file per kind, and redraw its plot and table.

    python benchmarks/merge_results.py benchmarks/results /tmp/out/smol-a /tmp/out/smol-b \
        --rename passkey=passkey-settings

Each ``<kind>-<gpu|cpu>-<date>.json`` under the given folders is merged into the file of the same
name in the destination (``--rename KIND=NEW`` writes ``NEW-<gpu|cpu>-<date>.json`` instead):
its rows are added to the destination's, a row replacing any earlier one of the same cell (later
folders win), and the commands are joined. RULER's summary is computed again from the merged rows.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# what identifies a row of each kind: a later row of the same cell replaces it
CELLS = {
    "passkey": ("model", "context", "depth", "backend", "config", "ops"),
    "recall": ("model", "config", "ops", "context", "depth", "query", "layer"),
    "ruler": ("model", "backend", "config", "ops", "context", "task"),
    "ruler-samples": ("model", "backend", "config", "ops", "context", "task", "index"),
}
NAME = re.compile(r"^(?P<kind>[a-z-]+?)-(?P<device>gpu|cpu)-(?P<date>\d{4}-\d{2}-\d{2})\.json$")


def merge(dest: dict | None, src: dict, kind: str) -> dict:
    if dest is None:
        return src
    key = CELLS[kind]
    rows = {tuple(r.get(k) for k in key): r for r in dest["rows"]}
    rows.update({tuple(r.get(k) for k in key): r for r in src["rows"]})
    commands = [c for c in (dest["command"], src["command"]) if c]
    return {**dest, "command": "; ".join(dict.fromkeys(commands)), "rows": list(rows.values())}


def write(path: Path, result: dict, kind: str) -> None:
    import passkey  # benchmarks/passkey.py: the one-row-per-line JSON layout
    import plot
    import ruler

    head = {k: v for k, v in result.items() if k not in ("rows", "summary")}
    text = passkey.dump_rows(head, result["rows"])
    if kind == "ruler":
        summary = ruler.summarize(result["rows"])
        text = text.rstrip()[:-1] + ', "summary": [\n' + ",\n".join(
            json.dumps(ruler._rounded(r)) for r in summary) + "\n]}\n"
    path.write_text(text)
    result = json.loads(text)
    if kind == "ruler":
        plot.plot_ruler(result, path.with_suffix(".png"))
        ruler.print_table(result)
    elif kind == "passkey":
        plot.plot_passkey(result, path.with_suffix(".png"))
    elif kind == "recall":
        plot.plot_recall(result, path.with_suffix(".png"))
    print(f"wrote {path} ({len(result['rows'])} rows)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dest", type=Path)
    parser.add_argument("sources", type=Path, nargs="+")
    parser.add_argument("--rename", nargs="*", default=[], metavar="KIND=NEW")
    args = parser.parse_args()
    rename = dict(r.split("=", 1) for r in args.rename)
    merged: dict[Path, tuple[str, dict]] = {}
    for folder in args.sources:
        for f in sorted(folder.glob("*.json")):
            m = NAME.match(f.name)
            if m is None or m["kind"] not in CELLS:
                continue
            kind = m["kind"]
            target = args.dest / f"{rename.get(kind, kind)}-{m['device']}-{m['date']}.json"
            if target not in merged:
                merged[target] = (kind, json.loads(target.read_text()) if target.exists() else None)
            merged[target] = (kind, merge(merged[target][1], json.loads(f.read_text()), kind))
    for target, (kind, result) in merged.items():
        write(target, result, kind)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
