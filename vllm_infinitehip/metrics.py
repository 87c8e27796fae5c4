"""Counters of what the backend did, per layer, and a way to read them from a vLLM worker."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class AttentionStats:
    """Work done by the layers since start (or since the last ``collect_stats(reset=True)``)."""

    dense_queries: int = 0
    sparse_prefill_queries: int = 0
    sparse_decode_queries: int = 0
    # (query, key) pairs: attended by sparse attention, and what dense attention would attend
    sparse_attended_pairs: int = 0
    sparse_context_pairs: int = 0
    # decode steps by refresh level: "0".."N-1" rerun from stage i, "reuse" kept the mask
    refreshes: dict[str, int] = field(default_factory=dict)

    @property
    def sparsity(self) -> float:
        """Share of the dense (query, key) pairs that sparse attention skipped."""
        if not self.sparse_context_pairs:
            return 0.0
        return 1.0 - self.sparse_attended_pairs / self.sparse_context_pairs

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "sparsity": self.sparsity}


def impls_in(static_forward_context: dict[str, Any]) -> list:
    """The InfiniteHiP layers' impls among a ``compilation_config.static_forward_context``."""
    from vllm_infinitehip.backend import InfiniteHiPImpl

    return [
        m.impl
        for m in static_forward_context.values()
        if isinstance(getattr(m, "impl", None), InfiniteHiPImpl)
    ]


def _impls(worker: Any) -> list:
    return impls_in(worker.model_runner.compilation_config.static_forward_context)


def collect_recall(worker: Any, enable: bool = True) -> list[dict[str, Any]]:
    """Attention-mass recall, per layer, since the last call: of each sparse prefill chunk's final
    query (``"query": "final-prompt"``) and of each sparse decode query (``"decode"``).

    ``llm.collective_rpc(collect_recall)`` turns logging on (``enable=False`` turns it off) and
    returns what was logged: ``{"query", "layer", "seq_len", "recall", "recall_min_head"}``, and
    with RoPE extension on ``"recall_remapped"`` and ``"recall_remapped_min_head"`` (against
    dense attention under the layer's remapping: ``reference.remapped_attention_recall``).
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
    """Sum the counters of every InfiniteHiP layer in a worker (one host read of the device
    counters, so ask between steps, not per token).

    Use through vLLM's own RPC: ``llm.collective_rpc(collect_stats)``. Returns a dict with the
    summed counters, ``layers`` (the number of layers that contributed), ``live_slots`` (decode
    state slots owned now: a finished, aborted or preempted request's slot is freed at the next
    step) and ``decode_graph_gated_layers`` (layers whose pruning cascade a captured decode graph
    skips on steps that refresh no mask, through the step's branch or its own gate: all of them
    on a GPU where CUDA's conditional graph nodes work, see step_branches.py and
    kernels/graph_if.py).
    """
    out = stats_of_impls(_impls(worker), reset=reset)
    split = split_stats(worker)
    if split:
        out["split"] = split
    return out


def split_stats(worker: Any) -> dict[str, Any]:
    """The host tier's split layout (``offload.layout`` "split"): its sizes, V pages moved to
    the host so far, and where the V of the blocks live requests hold is now (``held_gpu_v`` /
    ``held_host_v`` blocks; ``gpu_kv_bytes`` / ``host_kv_bytes``: those blocks' K and V on the
    GPU and V on the host). Empty without it."""
    from vllm_infinitehip.block_manager import tier as host_tier

    tier = host_tier.current()
    owners = getattr(worker, "_block_owners", None)
    if tier is None or tier.layout != "split" or not tier.groups or owners is None:
        return {}
    held = [b for b, n in owners.holders.items() if n > 0]
    out = {"num_blocks": tier.num_blocks, "gpu_pages": tier.gpu_pages, "spilled_blocks": 0,
           "held_gpu_v": 0, "held_host_v": 0, "gpu_kv_bytes": 0, "host_kv_bytes": 0}  # fmt: skip
    for group in tier.groups:  # one per attention group; one for a plain decoder
        on_host = int((group.homes.home[held] < 0).sum()) if held else 0
        k_block, v_block = group.k_plane[:, 0].nbytes, group.v_dev[:, 0].nbytes
        out["spilled_blocks"] += group.spilled_blocks
        out["held_gpu_v"] = len(held) - on_host
        out["held_host_v"] = on_host
        out["gpu_kv_bytes"] += len(held) * k_block + (len(held) - on_host) * v_block
        out["host_kv_bytes"] += on_host * v_block
    return out


def stats_of_impls(impls: list, reset: bool = False) -> dict[str, Any]:
    """:func:`collect_stats` of the given layers (the Prometheus connector reads them here)."""
    total = AttentionStats()
    plans: dict[int, tuple[Any, int]] = {}
    for impl in impls:
        if impl.plan is None:  # never ran
            continue
        plan, n = plans.get(id(impl.plan), (impl.plan, 0))
        plans[id(impl.plan)] = (plan, n + 1)
        attended, context = impl.pairs.tolist()
        total.sparse_attended_pairs += attended
        total.sparse_context_pairs += context
        if reset:
            impl.pairs.zero_()
    live = gated = 0
    tier: dict[str, int] = {}
    for plan, n_layers in plans.values():
        gated += n_layers if plan.scratch.gate is not None else 0
        split_bank = plan.split.bank if plan.split is not None else None
        for bank in (plan.bank, plan.key_rows, split_bank):
            if bank is not None:
                for key, value in bank.stats(reset=reset).items():
                    tier[key] = tier.get(key, 0) + value
        # the builder counts once per step what every layer of its group does
        c = plan.counters
        total.dense_queries += n_layers * c.dense_queries
        total.sparse_prefill_queries += n_layers * c.sparse_prefill_queries
        total.sparse_decode_queries += n_layers * c.sparse_decode_queries
        levels = plan.slots.level_counts.tolist()
        n_stages = len(levels) - 2
        for i, count in enumerate(levels[: n_stages + 1]):
            if count:
                key = "reuse" if i == n_stages else str(i)
                total.refreshes[key] = total.refreshes.get(key, 0) + n_layers * count
        live += plan.slots.live()
        if reset:
            c.reset()
            plan.slots.level_counts.zero_()
    out = {**total.to_dict(), "layers": len(impls), "live_slots": live,
           "decode_graph_gated_layers": gated}  # fmt: skip
    if tier:
        out["tier"] = {**tier, **tier_ratios(tier)}
    return out


def tier_ratios(tier: dict[str, int]) -> dict[str, float]:
    """Hit ratios and host traffic of the host tier from its summed counters
    (``block_manager.bank.Bank.stats``): the decode attention's reads split into refresh and
    reuse steps, the promotions' hits, the pruning stages' probes served by the key-row bank
    (``hit_ratio_mask``: GPU only, refresh steps only, since only they prune), bytes read
    from the host per decode step (all layers: attention reads of pages not in the bank, probes
    of rows not in the key-row bank, and the copies into both), and the pages attention read
    through the tier per decode step (``attn_pages_per_step``, all layers, bank or host: in the
    split layout only the host-homed ones, so 0 means no such read rather than all missed)."""

    def ratio(hit: int, miss: int) -> float:
        return hit / (hit + miss) if hit + miss else 0.0

    bank_r, host_r = tier["attn_bank_pages_refresh"], tier["attn_host_pages_refresh"]
    bank_u, host_u = tier["attn_bank_pages_reuse"], tier["attn_host_pages_reuse"]
    steps = tier["decode_layer_steps"] / max(1, tier["layers"])
    return {
        "hit_ratio_attn": ratio(bank_r + bank_u, host_r + host_u),
        "hit_ratio_attn_refresh": ratio(bank_r, host_r),
        "hit_ratio_attn_reuse": ratio(bank_u, host_u),
        "hit_ratio_promote": ratio(tier["promote_hits"], tier["promote_misses"]),
        "hit_ratio_mask": (ratio(tier["key_row_hits"], tier["key_row_misses"])
                           if "key_row_hits" in tier else None),
        "host_bytes_per_step": ((tier["host_read_bytes"] + tier.get("key_row_host_bytes", 0))
                                / steps if steps else 0.0),
        "attn_pages_per_step": (bank_r + host_r + bank_u + host_u) / steps if steps else 0.0,
    }


class InfiniteHiPWorkerExtension:
    """Named worker methods, mixed into every vLLM worker (``parallel_config.
    worker_extension_cls``, set by the plugin), so that any engine reaches them by name:
    ``llm.collective_rpc("infinitehip_stats")``, the engine core's ``collective_rpc`` under
    ``vllm serve``, TP/PP workers and Ray Serve. Passing the functions themselves
    (``collective_rpc(collect_stats)``) works only in-process: other processes cannot unpickle
    a function sent by value.

    A deployment with a worker extension of its own keeps these methods by subclassing this."""

    def infinitehip_stats(self, reset: bool = False) -> dict[str, Any]:
        """:func:`collect_stats` of this worker."""
        return collect_stats(self, reset=reset)

    def infinitehip_recall(self, enable: bool = True) -> list[dict[str, Any]]:
        """:func:`collect_recall` of this worker."""
        return collect_recall(self, enable=enable)
