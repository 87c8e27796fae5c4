"""Registration: the enum member, its pickling into fresh processes, and the CPU route."""

from __future__ import annotations

import pickle
import subprocess
import sys

import vllm_infinitehip
from vllm_infinitehip import compat


def test_register_is_idempotent_and_adds_the_member():
    vllm_infinitehip.register()
    vllm_infinitehip.register()
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    member = AttentionBackendEnum["INFINITEHIP"]
    assert AttentionBackendEnum.INFINITEHIP is member
    assert member.get_path() == compat.BACKEND_CLASS_PATH
    assert list(AttentionBackendEnum).count(member) == 1
    assert member.get_class().get_name() == member.name  # Attention looks it up by name
    # untouched built-ins keep their value pickling
    assert pickle.loads(pickle.dumps(AttentionBackendEnum.FLASH_ATTN)) is AttentionBackendEnum.FLASH_ATTN


def test_attention_config_parses_the_cli_name():
    vllm_infinitehip.register()
    from vllm.config import AttentionConfig

    assert AttentionConfig(backend="infinitehip").backend.name == "INFINITEHIP"
    assert AttentionConfig(backend="auto").backend is None


def test_member_unpickles_in_a_fresh_process_before_plugins_load():
    vllm_infinitehip.register()
    from vllm.config import AttentionConfig

    blob = pickle.dumps(AttentionConfig(backend="infinitehip"))
    code = (
        "import pickle, sys\n"
        "cfg = pickle.loads(sys.stdin.buffer.read())\n"
        "print('RESULT', cfg.backend.name, cfg.backend.get_path())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], input=blob, capture_output=True, check=True, timeout=300
    )
    result = [line for line in out.stdout.decode().splitlines() if line.startswith("RESULT ")]
    assert result == [f"RESULT INFINITEHIP {compat.BACKEND_CLASS_PATH}"]


def test_entry_point_is_installed():
    from importlib.metadata import entry_points

    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "infinitehip"]
    assert len(eps) == 1 and eps[0].value == "vllm_infinitehip:register"


def test_cpu_platform_routes_only_an_explicit_choice():
    vllm_infinitehip.register()
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig
    import torch

    sel = AttentionSelectorConfig(head_size=64, dtype=torch.float32, kv_cache_dtype=None, block_size=16)
    assert CpuPlatform.get_attn_backend_cls(AttentionBackendEnum["INFINITEHIP"], sel) == compat.BACKEND_CLASS_PATH
    assert CpuPlatform.get_attn_backend_cls(None, sel) == AttentionBackendEnum.CPU_ATTN.get_path()


def test_infinitehip_picks_its_scheduler_unless_one_is_named(tiny_model):
    from vllm.engine.arg_utils import EngineArgs

    vllm_infinitehip.register()
    kw = dict(model=tiny_model, attention_backend="infinitehip", max_model_len=2048)
    cfg = EngineArgs(**kw).create_engine_config().scheduler_config
    assert cfg.scheduler_cls == compat.SCHEDULERS[bool(cfg.async_scheduling)]
    named = "vllm.v1.core.sched.scheduler.Scheduler"
    assert EngineArgs(**kw, scheduler_cls=named).create_engine_config().scheduler_config \
        .scheduler_cls == named
    assert EngineArgs(model=tiny_model, max_model_len=2048).create_engine_config() \
        .scheduler_config.scheduler_cls is None  # another backend: vLLM's choice
