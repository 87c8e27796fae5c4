"""InfiniteHiP's counters on vLLM's own ``/metrics``, through vLLM's KV-connector stats path.

vLLM 0.26 has one channel from the workers to the process that serves ``/metrics``: a KV
connector's ``get_kv_connector_stats()``, called on every worker after every step
(``KVConnectorModelRunnerMixin._get_kv_connector_output``), summed over TP/PP workers with
``KVConnectorStats.aggregate`` (``KVOutputAggregator``), shipped in ``SchedulerStats`` and handed
to the connector class's ``build_prom_metrics`` object in the frontend (``KVConnectorProm``, or
Ray's metric wrappers under Ray). ``vllm.stat_logger_plugins`` loggers see only scheduler-side
stats, so they cannot reach the workers' counters. This module is a connector that moves no KV
at all: it only reports. The plugin turns it on by itself wherever infinitehip serves with stats
logging on, no KV connector configured and the engine core in a process of its own
(``compat.enable_metrics_connector``; ``vllm serve``'s default), as if the user had passed::

    --kv-transfer-config '{"kv_connector": "InfiniteHiPMetricsConnector",
                           "kv_connector_module_path": "vllm_infinitehip.prometheus",
                           "kv_role": "kv_both"}'

A deployment that needs its own connector keeps it (the startup log shows the combined flag):
wrapping both in vLLM's ``MultiConnector`` gives both; this connector never claims tokens, so
``MultiConnector`` loads from the other one.

When to read device counters: reading them syncs the device, and vLLM asks every step. The
scheduler-side half decides, once per step and the same for every worker, whether this step
reads: every ``interval_s`` (``kv_connector_extra_config``, default 1 s), and on any step that
schedules no tokens (the engine is draining, so the sync costs nothing and the values an idle
server shows are final). Other steps return ``None``, which vLLM skips.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

CONNECTOR_NAME = "InfiniteHiPMetricsConnector"
MODULE_PATH = "vllm_infinitehip.prometheus"
DEFAULT_INTERVAL_S = 1.0

def metrics_connector_config(**extra: Any) -> dict[str, Any]:
    """The ``kv_transfer_config`` (or ``MultiConnector`` entry) that turns the metrics on."""
    cfg: dict[str, Any] = {
        "kv_connector": CONNECTOR_NAME, "kv_connector_module_path": MODULE_PATH,
        "kv_role": "kv_both",
    }  # fmt: skip
    if extra:
        cfg["kv_connector_extra_config"] = extra
    return cfg


def is_metrics_connector(entry: Any) -> bool:
    """A ``KVTransferConfig`` or ``MultiConnector`` entry (dict) that names this connector."""
    get = entry.get if isinstance(entry, dict) else lambda k: getattr(entry, k, None)
    path = get("kv_connector_module_path")
    return get("kv_connector") == CONNECTOR_NAME and path in (None, MODULE_PATH)


def _totals(impls: list, tp_rank: int) -> tuple[dict[str, int], dict[str, int]]:
    """Cumulative counters and current gauges of one worker, flattened for the wire."""
    from vllm_infinitehip.metrics import stats_of_impls

    s = stats_of_impls(impls)
    counters = {"attended_pairs": s["sparse_attended_pairs"], "context_pairs": s["sparse_context_pairs"]}
    gauges = {"live_slots": s["live_slots"]}
    if tp_rank == 0:
        counters["queries_dense"] = s["dense_queries"]
        counters["queries_sparse_prefill"] = s["sparse_prefill_queries"]
        counters["queries_sparse_decode"] = s["sparse_decode_queries"]
        for level, n in s["refreshes"].items():
            counters[f"refreshes_{level}"] = n
    tier = s.get("tier")
    if tier:
        for key in ("attn_bank_pages_refresh", "attn_host_pages_refresh", "attn_bank_pages_reuse",
                    "attn_host_pages_reuse", "filled_pages", "promote_hits", "promote_misses"):
            counters[f"tier_{key}"] = tier[key]
        counters["tier_host_read_bytes"] = tier["host_read_bytes"] + tier.get("key_row_host_bytes", 0)
        gauges["tier_resident_pages"] = tier["resident_pages"]
        gauges["tier_bank_slots"] = tier["bank_slots"]
        if "key_row_hits" in tier:  # the pruning stages' key rows (GPU)
            for key in ("key_row_hits", "key_row_misses", "key_rows_filled"):
                counters[f"tier_{key}"] = tier[key]
            gauges["tier_key_rows_resident"] = tier["key_rows_resident"]
            gauges["tier_key_row_slots"] = tier["key_row_slots"]
    return counters, gauges


@dataclass
class InfiniteHiPStats(KVConnectorStats):
    """``data = {"counters": {name: increase}, "gauges": {rank: {name: value}}}``.

    ``aggregate`` serves two callers: over the workers of one step (distinct ranks: counters
    add, gauges merge) and, in vLLM's log line, over the steps of an interval (the same ranks:
    counters add, the newer gauges win). Both are right with gauges keyed by rank.
    """

    def __post_init__(self) -> None:
        self.data.setdefault("counters", {})
        self.data.setdefault("gauges", {})

    def reset(self) -> None:
        self.data = {"counters": {}, "gauges": {}}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        counters = self.data["counters"]
        for k, v in other.data.get("counters", {}).items():
            counters[k] = counters.get(k, 0) + v
        self.data["gauges"].update(other.data.get("gauges", {}))
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(self.data["counters"])
        out.update(summarize_gauges(self.data["gauges"]))
        return out

    def is_empty(self) -> bool:
        return not self.data["counters"] and not self.data["gauges"]


def summarize_gauges(by_rank: dict[str, dict[str, int]]) -> dict[str, int]:
    """One value per gauge over the workers: live slots are the same requests on every rank
    (max); bank pages are per rank (sum)."""
    ranks = list(by_rank.values())
    out: dict[str, int] = {}
    if ranks:
        out["live_slots"] = max(r.get("live_slots", 0) for r in ranks)
    for name in ("tier_resident_pages", "tier_bank_slots", "tier_key_rows_resident",
                 "tier_key_row_slots"):
        if any(name in r for r in ranks):
            out[name] = sum(r.get(name, 0) for r in ranks)
    return out


@dataclass
class InfiniteHiPMetricsMetadata(KVConnectorMetadata):
    read: bool = False


class InfiniteHiPMetricsConnector(KVConnectorBase_V1, SupportsHMA):
    """Reports InfiniteHiP's counters; moves no KV (see the module docstring)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._interval_s = float(extra.get("interval_s", DEFAULT_INTERVAL_S))
        self._last_read = float("-inf")
        self._impls: list | None = None
        self._seen: dict[str, int] = {}
        self._tp_rank, self._rank = 0, "0"

    # scheduler side: claim nothing, decide when the workers read
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        return None

    def request_finished(self, request: Any, block_ids: Any):
        return False, None

    def request_finished_all_groups(self, request: Any, block_ids: Any):
        return False, None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        now = time.monotonic()
        read = (now - self._last_read >= self._interval_s
                or not scheduler_output.total_num_scheduled_tokens)  # fmt: skip
        if read:
            self._last_read = now
        return InfiniteHiPMetricsMetadata(read=read)

    # worker side: no KV moves
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any):
        return None

    def wait_for_save(self) -> None:
        return None

    def _worker_impls(self) -> list:
        if self._impls is None:
            from vllm.distributed import parallel_state as ps

            from vllm_infinitehip.metrics import impls_in

            self._impls = impls_in(self._vllm_config.compilation_config.static_forward_context)
            if ps.model_parallel_is_initialized():
                self._tp_rank = ps.get_tp_group().rank_in_group
                self._rank = str(ps.get_world_group().rank)
        return self._impls

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._role != KVConnectorRole.WORKER or not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        if not isinstance(meta, InfiniteHiPMetricsMetadata) or not meta.read:
            return None
        impls = self._worker_impls()
        if not impls:
            return None
        totals, gauges = _totals(impls, self._tp_rank)
        increases = {}
        for k, v in totals.items():
            # a lower total means someone ran collect_stats(reset=True): count from zero
            seen = self._seen.get(k, 0)
            increase = v - seen if v >= seen else v
            if increase:
                increases[k] = increase
        self._seen = totals
        return InfiniteHiPStats(data={"counters": increases, "gauges": {self._rank: gauges}})

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return InfiniteHiPStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return InfiniteHiPPromMetrics(vllm_config, metric_types, labelnames,
                                      per_engine_labelvalues)  # fmt: skip


class InfiniteHiPPromMetrics(KVConnectorPromMetrics):
    """The ``vllm:infinitehip_*`` series, labelled ``model_name`` and ``engine`` like vLLM's."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:  # fmt: skip
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        from vllm_infinitehip.compat import uses_infinitehip
        from vllm_infinitehip.config import InfiniteHiPConfig

        # another backend's engine never had our config validated: no tier series for it
        self.tier_on = uses_infinitehip(vllm_config) and (
            InfiniteHiPConfig.from_vllm_config(vllm_config).offload.enabled
        )

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
            return self._counter_cls(name=f"vllm:infinitehip_{name}", documentation=doc,
                                     labelnames=[*labelnames, *extra])  # fmt: skip

        def gauge(name: str, doc: str) -> Any:
            return self._gauge_cls(name=f"vllm:infinitehip_{name}", documentation=doc,
                                   multiprocess_mode="mostrecent", labelnames=labelnames)  # fmt: skip

        self.attended = counter("attended_pairs", "(query, key) pairs sparse attention attended.")
        self.context = counter("context_pairs", "(query, key) pairs dense attention would have "
                               "attended, for the queries that ran sparse.")  # fmt: skip
        self.ratio = gauge("sparse_attention_ratio", "attended_pairs / context_pairs over the "
                           "last read window that ran sparse attention (1 = dense).")  # fmt: skip
        self.queries = counter("queries", "Query tokens times layers, by path: dense, "
                               "sparse_prefill, sparse_decode.", ("kind",))  # fmt: skip
        self.refreshes = counter("mask_refreshes", "Sparse decode steps times layers, by mask "
                                 "refresh level: i reran from stage i, reuse kept the mask.",
                                 ("level",))  # fmt: skip
        self.live_slots = gauge("live_mask_slots", "Per-request sparse decode state slots owned "
                                "now (freed at the step after a request leaves).")  # fmt: skip
        if self.tier_on:
            self.tier_pages = counter("tier_attn_pages", "Pages sparse decode attention read, by "
                                      "where they were (bank, host) and step (refresh, reuse).",
                                      ("source", "step"))  # fmt: skip
            self.tier_promotions = counter("tier_promotions", "Bank promotions' lookups, by "
                                           "result: hit, miss.", ("result",))  # fmt: skip
            self.tier_filled = counter("tier_filled_pages", "Pages copied into the bank.")
            self.tier_host_bytes = counter("tier_host_read_bytes", "Bytes read from host memory: "
                                           "attention reads of pages not in the bank, plus the "
                                           "copies into it, plus pruning probes of K rows not "
                                           "in the key-row bank.")  # fmt: skip
            self.tier_probes = counter("tier_key_row_probes", "Pruning stages' K row probes "
                                       "(GPU, refresh steps), by where the row was: bank, "
                                       "host.", ("source",))  # fmt: skip
            self.tier_rows_filled = counter("tier_key_rows_filled", "K rows copied into the "
                                            "key-row bank.")  # fmt: skip
            self.tier_rows_resident = gauge("tier_key_rows_resident", "K rows resident in the "
                                            "key-row bank now (all layers).")  # fmt: skip
            self.tier_row_slots = gauge("tier_key_row_slots", "Key-row bank capacity in rows "
                                        "(all layers).")  # fmt: skip
            self.tier_hit_ratio = gauge("tier_hit_ratio", "Share of sparse decode attention's "
                                        "page reads served from the bank, over the last read "
                                        "window that read any.")  # fmt: skip
            self.tier_resident = gauge("tier_resident_pages", "Pages resident in the bank now.")
            self.tier_slots = gauge("tier_bank_slots", "Bank capacity in pages (all layers).")
            self.tier_occupancy = gauge("tier_occupancy", "tier_resident_pages / tier_bank_slots.")

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        c = transfer_stats_data.get("counters", {})
        gauges = summarize_gauges(transfer_stats_data.get("gauges", {}))

        def inc(metric: Any, key: str, *extra: str) -> None:
            if c.get(key):
                metric.labels(*labels, *extra).inc(c[key])

        inc(self.attended, "attended_pairs")
        inc(self.context, "context_pairs")
        if c.get("context_pairs"):
            self.ratio.labels(*labels).set(c.get("attended_pairs", 0) / c["context_pairs"])
        for kind in ("dense", "sparse_prefill", "sparse_decode"):
            inc(self.queries, f"queries_{kind}", kind)
        for key in c:
            if key.startswith("refreshes_"):
                inc(self.refreshes, key, key[len("refreshes_"):])
        if "live_slots" in gauges:
            self.live_slots.labels(*labels).set(gauges["live_slots"])
        if not self.tier_on:
            return
        for source in ("bank", "host"):
            for step in ("refresh", "reuse"):
                inc(self.tier_pages, f"tier_attn_{source}_pages_{step}", source, step)
        inc(self.tier_promotions, "tier_promote_hits", "hit")
        inc(self.tier_promotions, "tier_promote_misses", "miss")
        inc(self.tier_filled, "tier_filled_pages")
        inc(self.tier_host_bytes, "tier_host_read_bytes")
        inc(self.tier_probes, "tier_key_row_hits", "bank")
        inc(self.tier_probes, "tier_key_row_misses", "host")
        inc(self.tier_rows_filled, "tier_key_rows_filled")
        if "tier_key_row_slots" in gauges:
            self.tier_rows_resident.labels(*labels).set(gauges["tier_key_rows_resident"])
            self.tier_row_slots.labels(*labels).set(gauges["tier_key_row_slots"])
        bank = sum(c.get(f"tier_attn_bank_pages_{s}", 0) for s in ("refresh", "reuse"))
        host = sum(c.get(f"tier_attn_host_pages_{s}", 0) for s in ("refresh", "reuse"))
        if bank + host:
            self.tier_hit_ratio.labels(*labels).set(bank / (bank + host))
        if "tier_bank_slots" in gauges:
            slots = gauges["tier_bank_slots"]
            self.tier_resident.labels(*labels).set(gauges["tier_resident_pages"])
            self.tier_slots.labels(*labels).set(slots)
            self.tier_occupancy.labels(*labels).set(gauges["tier_resident_pages"] / max(1, slots))


# MultiConnector rebuilds its children's stats by class name through the factory's registry
# (MultiConnector.build_kv_connector_stats), and vLLM imports this module by its path in every
# process that builds the connector or its metrics, so registering on import is enough.
if CONNECTOR_NAME not in KVConnectorFactory._registry:
    KVConnectorFactory.register_connector(CONNECTOR_NAME, MODULE_PATH, CONNECTOR_NAME)
