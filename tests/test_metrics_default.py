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


@pytest.fixture
def own_process(monkeypatch):
    """Engines as vllm serve builds them: the engine core in a process of its own (the tests'
    own engines run in this process)."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")


def test_a_server_engine_gets_the_metrics_connector_and_an_llm_engine_does_not(tiny_model,
                                                                              own_process):
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
        tiny_model, logged, monkeypatch, own_process):  # fmt: skip
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


def test_an_engine_in_this_process_gets_no_connector_and_the_log_says_how(tiny_model, logged):
    """vLLM keeps a worker's KV connector process-wide until an explicit shutdown, so an engine
    whose worker runs in this process is left without one; the log gives the flag."""
    from vllm_infinitehip.compat import enable_metrics_connector

    args = _args(tiny_model)
    enable_metrics_connector(args)
    assert args.kv_transfer_config is None
    assert "--kv-transfer-config" in logged[0].getMessage()


@pytest.mark.vllm
def test_an_engine_after_one_with_the_metrics_connector_in_this_process_runs(tiny_model):
    """An in-process engine given the metrics connector installs it as vLLM's process-wide KV
    connector; dropped without a shutdown, it is left behind. The next engine built in this
    process, with no connector of its own, still runs (vLLM's runner would assert connector
    metadata on its first step) and gives the same tokens."""
    import gc

    from vllm import LLM, SamplingParams

    from tests.conftest import ENGINE_KW, SMALL_HIP

    from vllm_infinitehip.prometheus import metrics_connector_config

    greedy = SamplingParams(temperature=0, max_tokens=6)
    kw = {**ENGINE_KW, "additional_config": {"infinitehip": SMALL_HIP}}
    first = LLM(tiny_model, attention_backend="infinitehip", disable_log_stats=False,
                kv_transfer_config=metrics_connector_config(), **kw)  # fmt: skip
    assert is_metrics_connector(first.llm_engine.vllm_config.kv_transfer_config)
    want = first.generate(["the pass key is"], greedy)[0].outputs[0].token_ids
    del first
    gc.collect()
    second = LLM(tiny_model, attention_backend="infinitehip", **kw)  # stats off: no connector
    try:
        assert second.llm_engine.vllm_config.kv_transfer_config is None
        assert second.generate(["the pass key is"], greedy)[0].outputs[0].token_ids == want
    finally:
        del second
        gc.collect()
