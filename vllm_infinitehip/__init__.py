"""InfiniteHiP long-context attention for an unmodified vLLM 0.26.

vLLM calls :func:`register` (entry point ``vllm.general_plugins: infinitehip``) in every process it
starts. After it, ``--attention-backend infinitehip`` and ``LLM(..., attention_backend="infinitehip")``
select :class:`vllm_infinitehip.backend.InfiniteHiPBackend`.
"""

from __future__ import annotations

__all__ = ["register", "InfiniteHiPConfig", "InfiniteHiPConfigError"]

from vllm_infinitehip.config import InfiniteHiPConfig, InfiniteHiPConfigError

_registered = False


def register() -> None:
    """Make the ``infinitehip`` backend selectable; idempotent and cheap (no heavy imports)."""
    global _registered
    if _registered:
        return
    from vllm_infinitehip import compat

    compat.add_backend_enum_member()
    compat.route_cpu_platform()
    compat.validate_at_config_time()
    compat.extend_context_at_engine_args()
    _registered = True
