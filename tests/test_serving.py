"""`vllm serve --attention-backend infinitehip` under load and faults, watched through `/metrics`.

One server per fixture, shared by the module (a start costs ~30-60 s on 2 cores). The dev-mode
endpoints (`VLLM_SERVER_DEV_MODE=1`: `/abort_requests`, `/reset_prefix_cache`) give the tests an
abort through the API and a cold prefix cache on demand.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import SMALL_HIP
from tests.test_server import VLLM, free_port, start_server
from tests.test_vllm_cpu import long_prompt
from vllm_infinitehip.prometheus import metrics_connector_config

pytestmark = pytest.mark.vllm

aiohttp = pytest.importorskip("aiohttp")

MAX_MODEL_LEN = 8192


def serve_cmd(model: str, port: int, hip: dict, *extra: str) -> list[str]:
    return [
        VLLM, "serve", model, "--host", "127.0.0.1", "--port", str(port),
        "--attention-backend", "infinitehip",
        "--additional-config", json.dumps({"infinitehip": hip}),
        "--kv-transfer-config", json.dumps(metrics_connector_config()),
        "--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float32", "--enforce-eager",
        "--kv-cache-memory-bytes", str(1 << 30), "--max-num-seqs", "8",
        # whole prompts per step: a sparse prefill's query blocks and tail window follow its
        # chunk's bounds, so a prompt chunked differently in a batch than alone differs
        "--no-enable-chunked-prefill", "--max-num-batched-tokens", str(MAX_MODEL_LEN),
        "--compilation-config", '{"mode": 0}', "--seed", "0",
        *extra,
    ]  # fmt: skip


def serve_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    return {**env, "VLLM_SERVER_DEV_MODE": "1"}


def start(cmd: list[str], log: Path):
    return start_server(cmd, log, serve_env(), timeout=300)


def stop(proc) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _server(tiny_model, tmp_path_factory, name: str, hip: dict):
    log = tmp_path_factory.mktemp(name) / "serve.log"
    proc, base = start(serve_cmd(tiny_model, free_port(), hip), log)
    return proc, base, log


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    proc, base, log = _server(tiny_model, tmp_path_factory, "serve", SMALL_HIP)
    yield base, tiny_model, log
    stop(proc)


@pytest.fixture(scope="module")
def tier_server(tiny_model, tmp_path_factory):
    hip = {**SMALL_HIP, "offload": {"host_gib": 0.25}}
    proc, base, log = _server(tiny_model, tmp_path_factory, "serve-tier", hip)
    yield base, tiny_model, log
    stop(proc)


# ------------------------------------------------------------------ HTTP helpers
def request(url: str, body: dict | None = None, timeout: float = 120,
            key: str | None = None) -> tuple[int, dict | str]:  # fmt: skip
    """GET (no body) or POST JSON; ``key``: sent as ``Authorization: Bearer``."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers=headers,
                                 method="GET" if body is None else "POST")  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read().decode()
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw


def complete(base: str, model: str, prompt: str, max_tokens: int, **kw) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **kw}
    status, out = request(base + "/v1/completions", body)
    assert status == 200, out
    return out


def scrape(base: str) -> dict[str, float]:
    """``/metrics`` samples summed over label sets, keyed ``name`` and ``name{label=value}``
    (the label that is not model_name or engine)."""
    from prometheus_client.parser import text_string_to_metric_families

    status, text = request(base + "/metrics")
    assert status == 200
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
            for k, v in s.labels.items():
                if k not in ("model_name", "engine"):
                    key = f"{s.name}{{{k}={v}}}"
                    out[key] = out.get(key, 0.0) + s.value
    return out


def wait_metric(base: str, name: str, ok, timeout: float = 20) -> float:
    """The frontend records a step's stats after the step: poll until ``ok(value)``."""
    deadline = time.time() + timeout
    while True:
        value = scrape(base).get(name)
        if value is not None and ok(value):
            return value
        if time.time() > deadline:
            pytest.fail(f"{name} stayed {value}")
        time.sleep(0.25)


async def stream(session, base: str, model: str, prompt: str, max_tokens: int,
                 disconnect_after: int | None = None) -> str:  # fmt: skip
    """Streamed greedy text; ``disconnect_after`` events, the client closes the connection."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True}  # fmt: skip
    pieces: list[str] = []
    async with session.post(base + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            event = json.loads(line[6:])
            assert "error" not in event, event
            pieces.extend(c["text"] for c in event["choices"])
            if disconnect_after is not None and len(pieces) >= disconnect_after:
                r.close()
                break
    return "".join(pieces)


# ------------------------------------------------------------------ load
SHORT = ["Hello, my name is", "The capital of France is", "def fibonacci(n):",
         "In a hole in the ground there lived a hobbit. " * 8]  # fmt: skip


def mixed_prompts() -> list[str]:
    prompts = [f"{SHORT[i % 4]} {i}" for i in range(28)]
    longs = [long_prompt(n, tag) for n, tag in ((700, "alpha"), (900, "beta"), (1100, "gamma"),
                                                 (1300, "delta"))]  # fmt: skip
    for i, p in zip((3, 11, 19, 27), longs):
        prompts[i] = p
    return prompts


def test_32_concurrent_streams_equal_the_prompts_one_at_a_time(server):
    base, model, log = server
    before = scrape(base)
    prompts = mixed_prompts()

    async def run() -> list[str]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
            return await asyncio.gather(*(stream(s, base, model, p, 12) for p in prompts))

    together = asyncio.run(run())
    assert all(together)
    usage = [complete(base, model, p, 1)["usage"]["prompt_tokens"] for p in prompts[3::8]]
    assert min(usage) > 2000 and max(usage) < MAX_MODEL_LEN  # "a few thousand tokens"
    alone = []
    for p in prompts:
        assert request(base + "/reset_prefix_cache", {})[0] == 200  # alone means computed alone
        alone.append(complete(base, model, p, 12)["choices"][0]["text"])
    assert together == alone

    after = scrape(base)
    grew = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert grew["vllm:infinitehip_attended_pairs_total"] > 0
    assert 0 < grew["vllm:infinitehip_attended_pairs_total"] < grew[
        "vllm:infinitehip_context_pairs_total"]  # fmt: skip
    assert 0 < after["vllm:infinitehip_sparse_attention_ratio"] < 1
    for kind in ("dense", "sparse_prefill", "sparse_decode"):
        assert grew[f"vllm:infinitehip_queries_total{{kind={kind}}}"] > 0
    assert grew["vllm:infinitehip_mask_refreshes_total{level=0}"] > 0
    assert "Traceback" not in log.read_text()


def test_prefix_cache_hits_give_the_text_of_a_cold_cache(server):
    base, model, _ = server
    prefix = long_prompt(800, "shared")
    a, b = prefix + " one two", prefix + " three four five"
    cold = []
    for p in (a, b):
        request(base + "/reset_prefix_cache", {})
        cold.append(complete(base, model, p, 16)["choices"][0]["text"])
    request(base + "/reset_prefix_cache", {})
    hits = scrape(base)["vllm:prefix_cache_hits_total"]
    warm = [complete(base, model, p, 16)["choices"][0]["text"] for p in (a, b)]
    assert scrape(base)["vllm:prefix_cache_hits_total"] - hits > 2000  # b reused a's prefix
    assert warm == cold


def test_bad_requests_get_vllms_errors_and_the_server_stays_up(server):
    base, model, log = server
    body = {"model": model, "prompt": "Hello", "max_tokens": 4}
    status, out = request(base + "/v1/completions", {**body, "prompt": long_prompt(3500, "big")})
    assert status == 400 and "maximum context length" in json.dumps(out), out
    for bad, field in (({"temperature": -1}, "temperature"), ({"top_p": 1.5}, "top_p"),
                       ({"max_tokens": -3}, "max_tokens"), ({"n": 0}, "n")):  # fmt: skip
        status, out = request(base + "/v1/completions", {**body, **bad})
        assert status == 400 and field in json.dumps(out), (bad, out)
    assert request(base + "/health")[0] == 200
    assert complete(base, model, long_prompt(700, "after"), 4)["usage"]["completion_tokens"] == 4
    assert "Traceback" not in log.read_text()


def _disconnect_and_abort_leave_nothing(base: str, model: str, tier: bool) -> None:
    prompts = [long_prompt(700 + 100 * i, f"leave{i}") for i in range(4)]

    async def run() -> list[str]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
            gone = [asyncio.create_task(stream(s, base, model, p, 400, disconnect_after=3))
                    for p in prompts[:2]]  # fmt: skip
            kept = [asyncio.create_task(stream(s, base, model, p, 400)) for p in prompts[2:]]
            await asyncio.gather(*gone)
            # decoding state exists while the kept ones stream (so the gauges do move) ...
            await asyncio.to_thread(wait_metric, base, "vllm:infinitehip_live_mask_slots",
                                    lambda v: v > 0)  # fmt: skip
            if tier:
                await asyncio.to_thread(wait_metric, base, "vllm:infinitehip_tier_resident_pages",
                                        lambda v: v > 0)  # fmt: skip
            status, out = await asyncio.to_thread(request, base + "/abort_requests", {})
            assert status == 200, out
            return await asyncio.gather(*kept)

    asyncio.run(run())
    assert request(base + "/health")[0] == 200
    wait_metric(base, "vllm:num_requests_running", lambda v: v == 0)
    # ... and is gone after: a slot is freed at the step after its request leaves
    complete(base, model, "The capital of France is", 2)
    wait_metric(base, "vllm:infinitehip_live_mask_slots", lambda v: v == 0)
    if tier:
        assert wait_metric(base, "vllm:infinitehip_tier_occupancy", lambda v: v == 0) == 0
        assert scrape(base)["vllm:infinitehip_tier_resident_pages"] == 0


def test_disconnects_and_aborts_free_the_mask_state(server):
    base, model, log = server
    _disconnect_and_abort_leave_nothing(base, model, tier=False)
    assert "Traceback" not in log.read_text()


def test_disconnects_and_aborts_empty_the_host_tier(tier_server):
    base, model, log = tier_server
    _disconnect_and_abort_leave_nothing(base, model, tier=True)
    after = scrape(base)
    assert after["vllm:infinitehip_tier_bank_slots"] > 0
    assert after["vllm:infinitehip_tier_filled_pages_total"] > 0
    assert after["vllm:infinitehip_tier_host_read_bytes_total"] > 0
    assert "Traceback" not in log.read_text()


# ------------------------------------------------------------------ startup faults
def test_bad_startup_configs_stop_the_server_with_a_clear_message(tiny_model, tmp_path):
    cases = {
        "additional-config": (serve_cmd(tiny_model, free_port(), {"windw_tokens": 256}),
                              "unknown field `infinitehip.windw_tokens`"),
        "kv-cache-dtype": (serve_cmd(tiny_model, free_port(), SMALL_HIP,
                                     "--kv-cache-dtype", "fp8_e5m2"),
                           "kv_cache_dtype not supported"),
    }  # fmt: skip
    procs = {}
    try:
        for name, (cmd, _) in cases.items():  # both at once: each mostly waits on its imports
            with open(tmp_path / f"{name}.log", "w") as f:
                procs[name] = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                               env=serve_env(), start_new_session=True)  # fmt: skip
        for name, proc in procs.items():
            rc = proc.wait(timeout=240)
            text = (tmp_path / f"{name}.log").read_text()
            assert rc != 0 and cases[name][1] in text, text[-3000:]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)


def test_the_host_tier_accepts_our_metrics_connector_and_no_other(tiny_model):
    from vllm.config import KVTransferConfig

    from tests.test_offload_config import _engine_config
    from vllm_infinitehip.compat import HOST_TIER_WORKERS

    def multi(*children: dict) -> KVTransferConfig:
        return KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both",
                                kv_connector_extra_config={"connectors": list(children)})  # fmt: skip

    ours = metrics_connector_config()
    for transfer in (KVTransferConfig(**ours), multi(ours)):
        cfg = _engine_config(tiny_model, {"offload": True}, kv_transfer_config=transfer)
        assert cfg.parallel_config.worker_cls in HOST_TIER_WORKERS.values()
    other = {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}
    with pytest.raises(ValueError, match=r"`infinitehip\.offload` cannot run with a KV connector"):
        _engine_config(tiny_model, {"offload": True}, kv_transfer_config=multi(ours, other))


def test_vllm_bench_serve_runs_against_the_server(server, tmp_path):
    """The recipe's tool (benchmarks/serve_recipe.sh) against infinitehip, at a size the CPU
    runs: every request succeeds and the run reaches the sparse path, on /metrics."""
    base, model, _ = server
    sparse = "vllm:infinitehip_queries_total{kind=sparse_decode}"
    before = scrape(base).get(sparse, 0.0)
    cmd = [VLLM, "bench", "serve", "--backend", "vllm", "--base-url", base, "--model", model,
           "--dataset-name", "random", "--random-input-len", "1600", "--random-output-len", "8",
           "--ignore-eos", "--num-prompts", "4", "--max-concurrency", "2", "--seed", "0",
           "--save-result", "--result-dir", str(tmp_path), "--result-filename", "bench.json"]  # fmt: skip
    subprocess.run(cmd, check=True, timeout=300, env=serve_env(), capture_output=True)
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["completed"] == 4 and result.get("failed", 0) == 0
    assert result["total_output_tokens"] == 4 * 8
    wait_metric(base, sparse, lambda v: v >= before + 4 * 7)  # 7 decode steps per request
