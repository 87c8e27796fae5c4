"""Counters of what the backend did, per layer, and a way to read them from a vLLM worker."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class AttentionStats:
    """Work done by one layer since start (or since :meth:`reset`)."""

    dense_queries: int = 0
    sparse_prefill_queries: int = 0
    sparse_decode_queries: int = 0
    # (query, key) pairs: attended by sparse attention, and what dense attention would attend
    sparse_attended_pairs: int = 0
    sparse_context_pairs: int = 0
    # decode steps by refresh level: "0".."N-1" rerun from stage i, "reuse" kept the mask
    refreshes: dict[str, int] = field(default_factory=dict)

    def count_refresh(self, level: int, n_stages: int) -> None:
        key = "reuse" if level >= n_stages else str(level)
        self.refreshes[key] = self.refreshes.get(key, 0) + 1

    def merge(self, other: AttentionStats) -> None:
        for name in (
            "dense_queries",
            "sparse_prefill_queries",
            "sparse_decode_queries",
            "sparse_attended_pairs",
            "sparse_context_pairs",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for k, v in other.refreshes.items():
            self.refreshes[k] = self.refreshes.get(k, 0) + v

    @property
    def sparsity(self) -> float:
        """Share of the dense (query, key) pairs that sparse attention skipped."""
        if not self.sparse_context_pairs:
            return 0.0
        return 1.0 - self.sparse_attended_pairs / self.sparse_context_pairs

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "sparsity": self.sparsity}


def _impls(worker: Any) -> list:
    from vllm_infinitehip.backend import InfiniteHiPImpl

    context = worker.model_runner.compilation_config.static_forward_context
    return [
        m.impl for m in context.values() if isinstance(getattr(m, "impl", None), InfiniteHiPImpl)
    ]


def collect_recall(worker: Any, enable: bool = True) -> list[dict[str, Any]]:
    """Attention-mass recall, per layer, since the last call: of each sparse prefill chunk's final
    query (``"query": "final-prompt"``) and of each sparse decode query (``"decode"``).

    ``llm.collective_rpc(collect_recall)`` turns logging on (``enable=False`` turns it off) and
    returns what was logged: ``{"query", "layer", "seq_len", "recall", "recall_min_head"}``.
    Recall is the share of the dense softmax mass (true positions) that falls on the keys the
    query attended; it costs one dense score row per layer and query, so leave it off when
    serving.
    """
    records: list[dict[str, Any]] = []
    for impl in _impls(worker):
        records.extend(impl.recall_log or [])
        impl.recall_log = [] if enable else None
    return sorted(records, key=lambda r: (r["seq_len"], r["layer"]))


def collect_stats(worker: Any, reset: bool = False) -> dict[str, Any]:
    """Sum the counters of every InfiniteHiP layer in a worker.

    Use through vLLM's own RPC: ``llm.collective_rpc(collect_stats)``. Returns a dict with the
    summed counters and ``layers``, the number of layers that contributed.
    """
    total = AttentionStats()
    impls = _impls(worker)
    for impl in impls:
        total.merge(impl.stats)
        if reset:
            impl.stats.reset()
    return {**total.to_dict(), "layers": len(impls)}
