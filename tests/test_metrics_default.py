"""The ``vllm:infinitehip_*`` series are on by default: with infinitehip chosen and stats logging
on, the engine arguments get the plugin's metrics connector unless the user configured a KV
connector (then the log says how to combine them) or vLLM would refuse one (then the log says
why the series are absent). The live ``/metrics`` check is in tests/test_server.py."""

from __future__ import annotations

import logging

import pytest

from vllm_infinitehip.prometheus import is_metrics_connector


@pytest.fixture
def logged():
    """The compat module's log records."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("vllm.vllm_infinitehip.compat")
    handler = Keep(level=logging.DEBUG)
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def _args(tiny_model, **kw):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=tiny_model, attention_backend="infinitehip", max_model_len=4096, **kw)


def test_a_server_engine_gets_the_metrics_connector_and_an_llm_engine_does_not(tiny_model):
    from vllm.engine.arg_utils import EngineArgs

    cfg = _args(tiny_model).create_engine_config()  # vllm serve: stats logging on
    assert is_metrics_connector(cfg.kv_transfer_config)
    # LLM(...) turns stats logging off: nothing would reach /metrics
    quiet = _args(tiny_model, disable_log_stats=True).create_engine_config()
    assert quiet.kv_transfer_config is None
    # another backend is left alone
    plain = EngineArgs(model=tiny_model, max_model_len=4096).create_engine_config()
    assert plain.kv_transfer_config is None


def test_a_users_connector_stays_and_the_log_says_how_to_combine(tiny_model, logged):
    from vllm.config import KVTransferConfig

    from vllm_infinitehip.compat import enable_metrics_connector

    theirs = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both")
    args = _args(tiny_model, kv_transfer_config=theirs)
    enable_metrics_connector(args)
    assert args.kv_transfer_config is theirs
    (record,) = logged
    text = record.getMessage()
    assert "MultiConnector" in text and "ExampleConnector" in text
    assert "InfiniteHiPMetricsConnector" in text

    # ours inside a MultiConnector already: nothing to say
    logged.clear()
    multi = KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both",
                             kv_connector_extra_config={"connectors": [
                                 {"kv_connector": "ExampleConnector", "kv_role": "kv_both"},
                                 {"kv_connector": "InfiniteHiPMetricsConnector",
                                  "kv_connector_module_path": "vllm_infinitehip.prometheus",
                                  "kv_role": "kv_both"}]})  # fmt: skip
    args = _args(tiny_model, kv_transfer_config=multi)
    enable_metrics_connector(args)
    assert args.kv_transfer_config is multi and not logged


def test_where_vllm_refuses_a_connector_the_engine_starts_without_the_series(
        tiny_model, logged, monkeypatch):  # fmt: skip
    from vllm_infinitehip.compat import enable_metrics_connector

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    args = _args(tiny_model)
    enable_metrics_connector(args)
    assert args.kv_transfer_config is None
    (record,) = logged
    assert record.levelno == logging.WARNING
    assert "expandable_segments" in record.getMessage()
    # with the cumem allocator vLLM accepts a connector again
    enable_metrics_connector(cumem := _args(tiny_model, enable_cumem_allocator=True))
    assert is_metrics_connector(cumem.kv_transfer_config)


def test_kv_offloading_keeps_vllms_connector(tiny_model, logged):
    from vllm_infinitehip.compat import enable_metrics_connector

    args = _args(tiny_model, kv_offloading_size=1.0)
    enable_metrics_connector(args)
    assert args.kv_transfer_config is None
    assert "kv_offloading_size" in logged[0].getMessage()
