"""deploy/serve/ (its CPU variant) under ``serve.run`` on a real local Ray cluster (``ray.init`` on
127.0.0.1, shut down at the end): the app answers only with the API key, and its completions run
InfiniteHiP, which the workers' counters show (``infinitehip_stats`` through Ray Serve LLM's
``LLMServer.collective_rpc``, and through the app's ``/v1/infinitehip/stats``).

The app is built from deploy/serve/config-cpu.yaml as ``serve run`` builds it (its import_path and
args); only the model (a tiny random Llama) and the engine's sizes are swapped for test ones.
One ``serve.run`` for the module: a deploy costs about 2-3 minutes on 2 cores.
"""

from __future__ import annotations

import copy
import secrets
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import SMALL_HIP
from tests.test_server import free_port
from tests.test_serving import request

pytestmark = pytest.mark.vllm

pytest.importorskip("ray.serve.llm")
yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "deploy" / "serve" / "config-cpu.yaml"
APP_NAME = "infinitehip"
MODEL_ID = "tiny-llama"
MAX_MODEL_LEN = 4096
DEPLOY_TIMEOUT_S = 600
# 3185 tokens: above SMALL_HIP's dense_threshold (1024), with room for its stages to prune (the
# sparse path), and under MAX_MODEL_LEN with the completion
SPARSE_PROMPT = "alpha. " + " ".join(f"item{i % 97}" for i in range(1100)) + " The end is"
SHORT_PROMPT = "The capital of France is"


def app_spec(tiny_model: str) -> tuple[str, dict]:
    """The import path and args of config-cpu.yaml's application, with the test model."""
    cfg = yaml.safe_load(CONFIG.read_text())
    (app,) = cfg["applications"]
    args = copy.deepcopy(app["args"])
    (llm,) = args["llm_configs"]
    assert llm["accelerator_config"] == {"kind": "cpu"}
    kw = llm["engine_kwargs"]
    assert kw["attention_backend"] == "infinitehip" and kw["distributed_executor_backend"] == "mp"
    llm["model_loading_config"] = {"model_id": MODEL_ID, "model_source": tiny_model}
    kw.update(
        additional_config={"infinitehip": SMALL_HIP},
        max_model_len=MAX_MODEL_LEN,
        # whole prompts per step, as in tests/test_serving.py
        enable_chunked_prefill=False,
        max_num_batched_tokens=MAX_MODEL_LEN,
        kv_cache_memory_bytes=1 << 28,
        max_num_seqs=4,
        compilation_config={"mode": 0},
        seed=0,
    )
    return app["import_path"], args


def http(url: str, body: dict | None = None, key: str | None = None) -> tuple[int, dict | str]:
    return request(url, body, timeout=300, key=key)


@pytest.fixture(scope="module")
def serve_app(tiny_model, tmp_path_factory):
    import ray
    from ray import serve
    from ray._common.utils import import_attr
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    key = secrets.token_urlsafe(32)
    key_file = tmp_path_factory.mktemp("secrets") / "api_key"
    key_file.write_text(f"# test key\n{key}\n")
    key_file.chmod(0o600)
    # the replicas import deploy.serve.app from this checkout; the key file's path, not the key
    env = {"PYTHONPATH": str(ROOT), "INFINITEHIP_API_KEY_FILE": str(key_file)}
    ray.init(address="local", num_cpus=4, include_dashboard=False,
             _node_ip_address="127.0.0.1", runtime_env={"env_vars": env})  # fmt: skip
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        import_path, args = app_spec(tiny_model)
        app = call_user_app_builder_with_args_if_necessary(import_attr(import_path), args)
        started = time.time()
        serve.run_many([serve.RunTarget(target=app, name=APP_NAME, route_prefix="/")],
                       wait_for_applications_running=False)  # fmt: skip
        while True:
            status = serve.status().applications[APP_NAME]
            if status.status == "RUNNING":
                break
            if status.status == "DEPLOY_FAILED" or time.time() - started > DEPLOY_TIMEOUT_S:
                pytest.fail(f"{APP_NAME} did not deploy: {status}")
            time.sleep(2)
        deploy_s = time.time() - started
        yield {"base": f"http://127.0.0.1:{port}", "key": key, "deploy_s": deploy_s}
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def llm_server(name: str = MODEL_ID):
    from ray import serve

    return serve.get_deployment_handle(f"LLMServer:{name}", app_name=APP_NAME)


def worker_stats(reset: bool = False) -> list[dict]:
    """``infinitehip_stats`` of every worker of the replica, via ``LLMServer.collective_rpc``."""
    handle = llm_server()
    return handle.collective_rpc.remote(method="infinitehip_stats",
                                        kwargs={"reset": reset}).result(timeout_s=120)  # fmt: skip


def test_requests_without_the_api_key_get_401(serve_app):
    base, key = serve_app["base"], serve_app["key"]
    body = {"model": MODEL_ID, "prompt": SHORT_PROMPT, "max_tokens": 4}
    for sent in (None, "not-the-key-" + "x" * 20, key + "x"):
        for url, payload in ((base + "/v1/completions", body), (base + "/v1/models", None),
                             (base + "/v1/infinitehip/stats", None), (base + "/tokenize",
                              {"model": MODEL_ID, "prompt": "hi"})):  # fmt: skip
            status, out = http(url, payload, key=sent)
            assert status == 401, (url, sent, out)
            assert out["error"]["type"] == "authentication_error"
    # a malformed header (not Bearer) is refused too
    req = urllib.request.Request(base + "/v1/models", headers={"Authorization": f"Basic {key}"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == 401
    status, models = http(base + "/v1/models", key=key)
    assert status == 200 and [m["id"] for m in models["data"]] == [MODEL_ID]


def test_completions_run_infinitehip_dense_and_sparse(serve_app):
    base, key = serve_app["base"], serve_app["key"]
    worker_stats(reset=True)  # not the startup profiling's counts
    status, short = http(base + "/v1/completions", key=key,
                         body={"model": MODEL_ID, "prompt": SHORT_PROMPT, "max_tokens": 8,
                               "temperature": 0})  # fmt: skip
    assert status == 200, short
    assert short["choices"][0]["text"] and short["usage"]["completion_tokens"] >= 1
    (after_short,) = worker_stats()
    # a short prompt runs InfiniteHiP's exact dense path, in both layers
    assert after_short["layers"] == 2
    assert after_short["dense_queries"] > 0
    assert after_short["sparse_prefill_queries"] == after_short["sparse_decode_queries"] == 0

    status, long = http(base + "/v1/completions", key=key,
                        body={"model": MODEL_ID, "prompt": SPARSE_PROMPT, "max_tokens": 8,
                              "temperature": 0})  # fmt: skip
    assert status == 200, long
    n_prompt, n_out = long["usage"]["prompt_tokens"], long["usage"]["completion_tokens"]
    assert n_prompt > SMALL_HIP["dense_threshold"] + 1000 and n_out >= 1
    (stats,) = worker_stats()
    # every prompt token and every decode step of the long request ran sparse, in both layers
    assert stats["sparse_prefill_queries"] == 2 * n_prompt
    assert stats["sparse_decode_queries"] == 2 * (n_out - 1)
    assert stats["dense_queries"] == after_short["dense_queries"]
    assert stats["sparsity"] > 0.5

    # the app's own read-only route returns the same counters, with the key only
    status, via_http = http(base + "/v1/infinitehip/stats", key=key)
    assert status == 200, via_http
    assert via_http["model"] == MODEL_ID
    assert via_http["replicas"] == [[stats]]
    print(f"\ndeploy {serve_app['deploy_s']:.0f} s; stats {stats}")


def test_check_nodes_finds_the_plugin_on_every_node(serve_app):
    """deploy/ray/check_nodes.py, the launch script's pre-flight, on this cluster."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_nodes", ROOT / "deploy/ray/check_nodes.py")
    check_nodes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check_nodes)
    nodes = check_nodes.inspect_nodes()
    assert len(nodes) == 1
    assert check_nodes.problems(nodes) == []
    (node,) = nodes
    assert node["plugin_entry_point"] == "vllm_infinitehip:register"
    assert node["vllm"].startswith("0.26.0") and node["ray"] == "2.58.1"
