"""Pre-flight for a Ray cluster that will run vLLM with InfiniteHiP: on every alive node, is the
plugin pip-installed (its ``vllm.general_plugins`` entry point exists, which is what vLLM loads;
Ray's ``py_modules`` does not make one), are vLLM 0.26.0 and Ray 2.58.1 there, and does
``VLLM_PLUGINS``, if set, list ``infinitehip``?

``python deploy/ray/check_nodes.py`` on a node of the cluster (launch_vllm.sh runs it first);
exits 1 naming the nodes and what is wrong. Connects with ``ray.init(address="auto")``, so with
token auth the node's RAY_AUTH_MODE and token are used.
"""

from __future__ import annotations

import json
import sys
from typing import Any

VLLM_VERSION = "0.26.0"
RAY_VERSION = "2.58.1"
PLUGIN = "infinitehip"


def node_report() -> dict[str, Any]:
    """What this process's node has (runs as a Ray task pinned to each node)."""
    import os
    import socket
    from importlib import metadata

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    eps = {e.name: e.value for e in metadata.entry_points(group="vllm.general_plugins")}
    return {
        "host": socket.gethostname(),
        "vllm": version("vllm"),
        "ray": version("ray"),
        "vllm_infinitehip": version("vllm-infinitehip"),
        "plugin_entry_point": eps.get(PLUGIN),
        "VLLM_PLUGINS": os.environ.get("VLLM_PLUGINS"),
    }


def inspect_nodes() -> list[dict[str, Any]]:
    """:func:`node_report` of every alive node of the connected (or local) cluster."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if not ray.is_initialized():
        ray.init(address="auto")
    task = ray.remote(num_cpus=0)(node_report)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    pinned = [NodeAffinitySchedulingStrategy(n["NodeID"], soft=False) for n in nodes]
    refs = [task.options(scheduling_strategy=s).remote() for s in pinned]
    return [{"node_id": n["NodeID"], "ip": n.get("NodeManagerAddress"), **r}
            for n, r in zip(nodes, ray.get(refs, timeout=300))]  # fmt: skip


def problems(reports: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in reports:
        where = f"node {r['ip']} ({r['host']})"
        if not r["plugin_entry_point"]:
            out.append(f"{where}: no `{PLUGIN}` vllm.general_plugins entry point: "
                       "pip install vllm-infinitehip there (py_modules is not enough)")  # fmt: skip
        if not (r["vllm"] or "").startswith(VLLM_VERSION):
            out.append(f"{where}: vllm {r['vllm']}, expected {VLLM_VERSION}")
        if r["ray"] != RAY_VERSION:
            out.append(f"{where}: ray {r['ray']}, expected {RAY_VERSION}")
        plugins = r["VLLM_PLUGINS"]
        if plugins is not None and PLUGIN not in [p.strip() for p in plugins.split(",")]:
            out.append(f"{where}: VLLM_PLUGINS={plugins!r} does not list `{PLUGIN}`")
    return out


def main() -> int:
    reports = inspect_nodes()
    print(json.dumps(reports, indent=2))
    found = problems(reports)
    for p in found:
        print(f"check_nodes: {p}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
