"""The few places where vLLM 0.26 has no extension point, patched in one small, documented spot each.

1. ``AttentionBackendEnum`` has no way to add a name in 0.26 (``register_backend`` only overrides
   existing members), yet ``--attention-backend infinitehip`` is looked up as
   ``AttentionBackendEnum["INFINITEHIP"]``. :func:`add_backend_enum_member` adds the member.
   Enum members pickle by value and vLLM pickles ``VllmConfig`` into spawned and Ray processes
   *before* plugins load there, so the member pickles as a call that imports this plugin first.
2. ``CpuPlatform.get_attn_backend_cls`` ignores the selected backend. :func:`route_cpu_platform`
   routes an explicit ``infinitehip`` choice to our backend and leaves every other choice alone.
3. There is no config hook for plugins, so :func:`validate_at_config_time` wraps the platform's
   ``check_and_update_config`` (run while ``VllmConfig`` is built, in the user's process) to
   validate ``additional_config["infinitehip"]`` where the user gave it; to pick a scheduler
   without the per-step common-prefix walk (:func:`use_scheduler`); and, with
   ``infinitehip.offload`` on, to set ``parallel_config.worker_cls`` to the host tier's worker
   (:func:`use_host_tier_worker`).
4. vLLM refuses ``--max-model-len`` above the trained length and sizes its rotary cache to it;
   :func:`extend_context_at_engine_args` raises both for infinitehip (see there). The same
   engine-arguments hook turns the ``vllm:infinitehip_*`` series on: the plugin's metrics
   connector is the only channel from the workers to ``/metrics``, and vLLM has no other way
   to add one (:func:`enable_metrics_connector`).

Each function is idempotent: ``register()`` runs in every vLLM process, sometimes more than once.
"""

from __future__ import annotations

import json
import os
from enum import Enum
from typing import Any

BACKEND_NAME = "INFINITEHIP"
BACKEND_CLASS_PATH = "vllm_infinitehip.backend.InfiniteHiPBackend"
_PATCHED_MARK = "_infinitehip_patched"


def _backend_member() -> Enum:
    """Unpickling target: make sure the member exists in this process, then return it."""
    from vllm_infinitehip import register

    register()
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum[BACKEND_NAME]


def _reduce_member(self: Enum, protocol: Any = None) -> tuple[Any, tuple[()]]:
    return (_backend_member, ())


def add_backend_enum_member() -> Enum:
    """Add ``AttentionBackendEnum.INFINITEHIP`` (value: our backend's class path)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    members = AttentionBackendEnum._member_map_
    if BACKEND_NAME in members:
        return members[BACKEND_NAME]
    member = object.__new__(AttentionBackendEnum)
    member._name_ = BACKEND_NAME
    member._value_ = BACKEND_CLASS_PATH
    member._sort_order_ = len(AttentionBackendEnum._member_names_)
    # Instance attribute: pickle looks __reduce_ex__ up on the object, so only this member
    # changes how it pickles.
    member.__reduce_ex__ = _reduce_member.__get__(member)  # type: ignore[method-assign]
    type.__setattr__(AttentionBackendEnum, BACKEND_NAME, member)
    members[BACKEND_NAME] = member
    AttentionBackendEnum._member_names_.append(BACKEND_NAME)
    AttentionBackendEnum._value2member_map_[BACKEND_CLASS_PATH] = member
    return member


def route_cpu_platform() -> None:
    """Let an explicit ``infinitehip`` choice reach our backend on vLLM's CPU platform."""
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.get_attn_backend_cls
    if getattr(original, _PATCHED_MARK, False):
        return
    original_func = original.__func__

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if selected_backend is not None and selected_backend.name == BACKEND_NAME:
            _refuse_invalid_configuration(attn_selector_config)
            return BACKEND_CLASS_PATH
        return original_func(cls, selected_backend, attn_selector_config, num_heads)

    setattr(get_attn_backend_cls, _PATCHED_MARK, True)
    CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)  # type: ignore


def _refuse_invalid_configuration(attn_selector_config: Any) -> None:
    """What ``CudaPlatform`` checks for an explicitly selected backend and ``CpuPlatform`` does
    not: without it a ``--kv-cache-dtype`` the backend refuses (fp8_e5m2) would run on the CPU,
    its uint8 storage read as e4m3. Same message as vLLM's."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    backend_cls = AttentionBackendEnum[BACKEND_NAME].get_class()
    reasons = backend_cls.validate_configuration(
        device_capability=None, **attn_selector_config._asdict()
    )
    if reasons:
        raise ValueError(
            f"Selected backend {AttentionBackendEnum[BACKEND_NAME]} is not valid for this "
            f"configuration. Reason: {reasons}"
        )


def uses_infinitehip(vllm_config: Any) -> bool:
    attention_config = getattr(vllm_config, "attention_config", None)
    backend = getattr(attention_config, "backend", None)
    return backend is not None and getattr(backend, "name", None) == BACKEND_NAME


def validate_at_config_time() -> None:
    """Validate our config and adjust vLLM's while ``VllmConfig`` is built (user's process)."""
    from vllm.platforms import current_platform

    platform_cls = type(current_platform)
    original = platform_cls.check_and_update_config
    if getattr(original, _PATCHED_MARK, False):
        return
    original_func = original.__func__

    def check_and_update_config(cls, vllm_config):
        ours = uses_infinitehip(vllm_config)
        if ours:
            from vllm_infinitehip.config import InfiniteHiPConfig

            # Raises InfiniteHiPConfigError (a ValueError) naming the bad field.
            config = InfiniteHiPConfig.from_vllm_config(vllm_config)
            add_worker_extension(vllm_config, host_tier=config.offload.enabled)
            if config.offload.enabled:
                # before the platform's own hook, which turns worker_cls "auto" into its default
                use_host_tier_worker(vllm_config)
        original_func(cls, vllm_config)
        if ours:  # after the platform's hook, which may turn async scheduling off
            use_scheduler(vllm_config)

    setattr(check_and_update_config, _PATCHED_MARK, True)
    platform_cls.check_and_update_config = classmethod(check_and_update_config)  # type: ignore


SCHEDULERS = {
    False: "vllm_infinitehip.scheduler.InfiniteHiPScheduler",
    True: "vllm_infinitehip.scheduler.InfiniteHiPAsyncScheduler",
}


def use_scheduler(vllm_config: Any) -> None:
    """vLLM's scheduler minus its per-step walk over a request's blocks for cascade attention,
    which infinitehip never runs (:mod:`vllm_infinitehip.scheduler`). A scheduler class the
    user named stays; it keeps the walk."""
    sched = vllm_config.scheduler_config
    if sched.scheduler_cls is None:
        sched.scheduler_cls = SCHEDULERS[bool(sched.async_scheduling)]


WORKER_EXTENSION = "vllm_infinitehip.metrics.InfiniteHiPWorkerExtension"


def add_worker_extension(vllm_config: Any, host_tier: bool) -> None:
    """Give every worker the plugin's named methods (``collective_rpc("infinitehip_stats")``).

    vLLM takes one extension class. A user's own stays. Without the host tier, if it does not
    subclass ours, the methods are missing, which is said here once rather than at the first
    RPC. The host tier's workers have the methods as a base already, so there an extension
    that subclasses ours would define them twice, which vLLM refuses inside the worker: it is
    refused here instead.
    """
    parallel = vllm_config.parallel_config
    current = parallel.worker_extension_cls
    if not current:
        parallel.worker_extension_cls = WORKER_EXTENSION
        return
    if current == WORKER_EXTENSION:
        return
    from vllm.logger import init_logger
    from vllm.utils.import_utils import resolve_obj_by_qualname

    from vllm_infinitehip.config import InfiniteHiPConfigError
    from vllm_infinitehip.metrics import InfiniteHiPWorkerExtension

    theirs_has_ours = issubclass(resolve_obj_by_qualname(current), InfiniteHiPWorkerExtension)
    if host_tier and theirs_has_ours:
        raise InfiniteHiPConfigError(
            f"worker_extension_cls={current!r} subclasses {WORKER_EXTENSION}, which the host "
            f"tier's worker (`infinitehip.offload`) already has: drop that base class"
        )
    if not host_tier and not theirs_has_ours:
        init_logger(f"vllm.{__name__}").warning(
            "worker_extension_cls=%s does not subclass %s: collective_rpc(\"infinitehip_stats\") "
            "will not find its method (subclass it to keep both)", current, WORKER_EXTENSION,
        )  # fmt: skip


HOST_TIER_WORKERS = {
    "cuda": "vllm_infinitehip.worker.InfiniteHiPWorker",
    "cpu": "vllm_infinitehip.worker.InfiniteHiPCPUWorker",
}


def use_host_tier_worker(vllm_config: Any) -> None:
    """Run the host KV tier's worker (``infinitehip.offload``); refuse what cannot go with it.

    A KV connector (``kv_transfer_config``, or ``kv_offloading_size``, which vLLM turns into one
    after this hook) moves the same KV blocks between tiers of its own, and a user's
    ``worker_cls`` would be replaced silently; both fail here, in the user's process. Our own
    metrics connector (alone, or all a ``MultiConnector`` holds) moves no KV, so it may stay.
    """
    from vllm.platforms import current_platform

    from vllm_infinitehip.config import InfiniteHiPConfigError

    transfer = vllm_config.kv_transfer_config
    connector = getattr(transfer, "kv_connector", None)
    offloading = getattr(vllm_config.cache_config, "kv_offloading_size", None)
    if connector is not None and offloading is None and _only_metrics_connector(transfer):
        connector = None
    if connector is not None or offloading is not None:
        given = (f"kv_transfer_config.kv_connector={connector!r}" if connector is not None
                 else f"kv_offloading_size={offloading}")  # fmt: skip
        raise InfiniteHiPConfigError(
            f"`infinitehip.offload` cannot run with a KV connector ({given}): both decide where "
            f"vLLM's KV blocks live. Drop the connector, or turn `infinitehip.offload` off"
        )
    if getattr(vllm_config.model_config, "enable_sleep_mode", False):
        # sleep frees and restores vLLM's cumem pool; the host KV lives outside it
        raise InfiniteHiPConfigError(
            "`infinitehip.offload` cannot run with enable_sleep_mode: the host tier's KV lives "
            "outside the memory pool that sleep and wake_up manage. Turn one of them off"
        )
    kind = "cpu" if current_platform.is_cpu() else "cuda" if current_platform.is_cuda() else None
    if kind is None:
        raise InfiniteHiPConfigError(
            f"`infinitehip.offload` runs on CUDA GPUs and the CPU, not on "
            f"{current_platform.device_name}"
        )
    wanted = HOST_TIER_WORKERS[kind]
    parallel = vllm_config.parallel_config
    if parallel.worker_cls not in ("auto", wanted):
        raise InfiniteHiPConfigError(
            f"`infinitehip.offload` runs vLLM's KV through its own worker ({wanted}), but "
            f"worker_cls={parallel.worker_cls!r} is set: drop worker_cls, or turn "
            f"`infinitehip.offload` off"
        )
    parallel.worker_cls = wanted


def _only_metrics_connector(transfer: Any) -> bool:
    """The KV connector config names only InfiniteHiP's metrics connector, which moves no KV."""
    from vllm_infinitehip.prometheus import is_metrics_connector

    if transfer.kv_connector == "MultiConnector":
        children = (transfer.kv_connector_extra_config or {}).get("connectors") or []
        return bool(children) and all(is_metrics_connector(c) for c in children)
    return is_metrics_connector(transfer)


def _chose_infinitehip(engine_args: Any) -> bool:
    chosen = getattr(engine_args, "attention_backend", None)
    if chosen is None:
        chosen = getattr(getattr(engine_args, "attention_config", None), "backend", None)
    name = chosen if isinstance(chosen, str) else getattr(chosen, "name", None)
    return isinstance(name, str) and name.upper() == BACKEND_NAME


# RoPE types whose rotary cache vLLM sizes by max_position_embeddings alone, so raising it to the
# served length changes nothing else about the model.
_CACHE_ONLY_ROPE_TYPES = (None, "default", "llama3")


def extend_context_at_engine_args() -> None:
    """Let ``--max-model-len`` exceed the trained length when the backend is infinitehip.

    vLLM refuses a ``max_model_len`` above the model's ``max_position_embeddings`` and builds its
    rotary cache only that long. InfiniteHiP keeps every position a layer sees inside the trained
    range, so for RoPE types whose cache length is all that ``max_position_embeddings`` controls,
    the plugin raises it to the served length (through vLLM's own ``hf_overrides``) and records
    the trained length as ``infinitehip.trained_context``. Other RoPE types fail with the flag to
    add. Runs where the user gave the arguments (``LLM(...)`` or ``vllm serve``).
    """
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_model_config
    if getattr(original, _PATCHED_MARK, False):
        return

    def create_model_config(self):
        release_stale_metrics_connector()
        if _chose_infinitehip(self):
            _extend_context(self)
            enable_metrics_connector(self)
        return original(self)

    setattr(create_model_config, _PATCHED_MARK, True)
    EngineArgs.create_model_config = create_model_config  # type: ignore[method-assign]


def _extend_context(args: Any) -> None:
    from vllm.transformers_utils.config import get_config

    additional = dict(args.additional_config or {})
    hip = additional.get("infinitehip") or {}
    if not isinstance(hip, dict):
        return  # a bad value: InfiniteHiPConfig reports it when VllmConfig is built
    hip = dict(hip)
    cfg = get_config(args.model, args.trust_remote_code, revision=args.revision)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    trained = getattr(text, "max_position_embeddings", None)
    if trained is None:
        return
    hip.setdefault("trained_context", int(trained))
    additional["infinitehip"] = hip
    args.additional_config = additional
    wanted = args.max_model_len
    if not isinstance(wanted, int) or wanted <= trained:
        return
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else "nested"
    flag = f"--hf-overrides '{{\"max_position_embeddings\": {wanted}}}'"
    user_overrides = args.hf_overrides
    if isinstance(user_overrides, dict) and "max_position_embeddings" in user_overrides:
        return  # the user sized the rotary cache; vLLM's own length check still applies
    if rope_type not in _CACHE_ONLY_ROPE_TYPES or callable(user_overrides):
        raise ValueError(
            f"--max-model-len {wanted} exceeds {args.model}'s trained length {trained}, and its "
            f"RoPE type {rope_type!r} (or a callable hf_overrides) is not one the infinitehip "
            f"plugin extends by itself. Add {flag} if a longer rotary cache is all it needs."
        )
    args.hf_overrides = {**(user_overrides or {}), "max_position_embeddings": wanted}


def enable_metrics_connector(args: Any) -> None:
    """Put the ``vllm:infinitehip_*`` series on ``/metrics`` with no flag from the user.

    With infinitehip chosen, stats logging on (``vllm serve``'s default; ``LLM`` turns it off) and
    no KV connector configured, ``args.kv_transfer_config`` becomes the plugin's metrics
    connector (:mod:`vllm_infinitehip.prometheus`), which moves no KV. Where the user configured
    a connector of their own, or vLLM would add one (``kv_offloading_size``), theirs stays and
    the log says how to run both through vLLM's ``MultiConnector``. Where vLLM refuses any
    connector, the log says why the series are absent and the engine starts without them.
    """
    from vllm.logger import init_logger

    from vllm_infinitehip.prometheus import metrics_connector_config

    if getattr(args, "disable_log_stats", False):
        return  # nothing reaches /metrics (an LLM(...) engine by default)
    logger = init_logger(f"vllm.{__name__}")
    ours = metrics_connector_config()
    transfer = getattr(args, "kv_transfer_config", None)
    if getattr(transfer, "kv_connector", None) is not None:
        if not _names_metrics_connector(transfer):
            theirs = {"kv_connector": transfer.kv_connector, "kv_role": transfer.kv_role}
            if getattr(transfer, "kv_connector_module_path", None):
                theirs["kv_connector_module_path"] = transfer.kv_connector_module_path
            logger.info(
                "kv_transfer_config names %s, so the vllm:infinitehip_* series are off. vLLM "
                "runs one connector; to have both, wrap them in its MultiConnector: "
                "--kv-transfer-config '%s' (with your connector's extra config in its entry)",
                transfer.kv_connector, json.dumps(_multi_connector(theirs, ours)),
            )  # fmt: skip
        return
    offloading = getattr(args, "kv_offloading_size", None)
    if offloading is not None:
        logger.info(
            "kv_offloading_size=%s makes vLLM add its own KV connector, so the "
            "vllm:infinitehip_* series are off. To have both, configure the offloading "
            "connector and ours in vLLM's MultiConnector through --kv-transfer-config "
            "(ours: %s) instead of --kv-offloading-size", offloading, json.dumps(ours),
        )  # fmt: skip
        return
    refused = _connector_refused(args)
    if refused:
        logger.warning("The vllm:infinitehip_* series are off: %s. The engine starts "
                       "without them", refused)  # fmt: skip
        return
    import vllm.envs as envs

    if not envs.VLLM_ENABLE_V1_MULTIPROCESSING:
        # The engine's worker runs in this process, and vLLM keeps a worker's KV connector
        # process-wide until an explicit shutdown: it would outlive an engine that is just
        # dropped and break another one of this process (release_stale_metrics_connector covers
        # only engines built after it). Servers run their engine core in a process of its own.
        logger.info("The vllm:infinitehip_* series are off for an engine in this process "
                    "(VLLM_ENABLE_V1_MULTIPROCESSING=0); --kv-transfer-config '%s' turns them "
                    "on", json.dumps(ours))  # fmt: skip
        return
    from vllm.config import KVTransferConfig

    args.kv_transfer_config = KVTransferConfig(**ours)


def release_stale_metrics_connector() -> None:
    """Drop the metrics connector an earlier engine of this process left installed.

    vLLM keeps a worker's KV connector process-wide and removes it only when the worker shuts
    down. An engine whose worker ran in this process (``LLM`` with
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and was then dropped without a shutdown leaves ours
    behind; the next engine built here, if its scheduler runs no connector, would fail on its
    first step (vLLM's runner asserts connector metadata whenever a connector is installed).
    Ours moves no KV, so dropping it loses nothing; any other connector is left alone.
    """
    from vllm.distributed.kv_transfer import (
        ensure_kv_transfer_shutdown,
        get_kv_transfer_group,
        has_kv_transfer_group,
    )

    from vllm_infinitehip.prometheus import InfiniteHiPMetricsConnector

    if has_kv_transfer_group() and isinstance(get_kv_transfer_group(),
                                              InfiniteHiPMetricsConnector):  # fmt: skip
        ensure_kv_transfer_shutdown()


def _names_metrics_connector(transfer: Any) -> bool:
    """The KV connector config includes the plugin's metrics connector (alone or in a
    ``MultiConnector``)."""
    from vllm_infinitehip.prometheus import is_metrics_connector

    if transfer.kv_connector == "MultiConnector":
        children = (transfer.kv_connector_extra_config or {}).get("connectors") or []
        return any(is_metrics_connector(c) for c in children)
    return is_metrics_connector(transfer)


def _multi_connector(*children: dict) -> dict:
    return {"kv_connector": "MultiConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"connectors": list(children)}}  # fmt: skip


def _connector_refused(args: Any) -> str | None:
    """Why vLLM 0.26 would refuse any KV connector with these arguments, or None."""
    alloc = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "expandable_segments:True" in alloc and not getattr(args, "enable_cumem_allocator", False):
        return ("vLLM runs no KV connector with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
                "unless --enable-cumem-allocator is on, and the series reach /metrics through "
                "one")  # fmt: skip
    if getattr(args, "enable_return_routed_experts", False):
        return ("vLLM runs no KV connector with --enable-return-routed-experts, and the series "
                "reach /metrics through one")  # fmt: skip
    return None
