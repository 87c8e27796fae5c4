"""`vllm serve --attention-backend infinitehip` on 127.0.0.1: completions, streaming, shutdown,
and a bad config that stops startup with a message naming the field."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

VLLM = shutil.which("vllm", path=str(Path(sys.executable).parent)) or "vllm"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(cmd: list[str], log: Path, env: dict[str, str], timeout: float):
    """Start ``vllm serve`` (``cmd``, its own process group, output to ``log``) and wait until
    it is healthy; returns the process and its base URL, or fails the test with the log."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip
    base = f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"vllm serve exited early:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, base
        except OSError:
            time.sleep(1)
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"vllm serve did not become healthy:\n{log.read_text()[-4000:]}")


def serve_cmd(model: str, port: int, hip_config: dict) -> list[str]:
    return [
        VLLM, "serve", model, "--host", "127.0.0.1", "--port", str(port),
        "--attention-backend", "infinitehip",
        "--additional-config", json.dumps({"infinitehip": hip_config}),
        "--max-model-len", "4096", "--dtype", "float32", "--enforce-eager",
        "--kv-cache-memory-bytes", str(1 << 30), "--max-num-seqs", "4",
        "--compilation-config", '{"mode": 0}',
    ]


def post(url: str, body: dict, timeout: float = 120) -> bytes:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    cfg = {"dense_threshold": 512, "prefill_dense_threshold": None, "sink_tokens": 32,
           "window_tokens": 256, "dense_layers": [],
           "stages": [{"chunk_size": 64, "keep_tokens": 1024, "block_size_q": 32},
                      {"chunk_size": 16, "keep_tokens": 512, "block_size_q": 32},
                      {"chunk_size": 8, "keep_tokens": 256, "block_size_q": 32}]}
    proc, base = start_server(serve_cmd(tiny_model, port, cfg), log, env, timeout=420)
    yield proc, base, tiny_model, log
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)


def test_completions_and_streaming(server):
    proc, base, model, log = server
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    full = json.loads(post(base + "/v1/completions", body))
    text = full["choices"][0]["text"]
    assert full["usage"]["completion_tokens"] == 8 and text
    # a long prompt through the sparse path
    long_prompt = " ".join(f"word{i % 50}" for i in range(1200))
    long = json.loads(post(base + "/v1/completions", {**body, "prompt": long_prompt}))
    assert long["usage"]["prompt_tokens"] > 1024 and long["usage"]["completion_tokens"] == 8
    # streamed: the same greedy text, in several server-sent events
    raw = post(base + "/v1/completions", {**body, "stream": True}).decode()
    events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    pieces = [json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"]]
    assert len(pieces) >= 2 and "".join(pieces) == text
    assert "InfiniteHiP config: preset=3k-5k sink=32 window=256" in log.read_text()


def test_metrics_has_the_infinitehip_series_with_no_flag(server):
    """No ``--kv-transfer-config``: the plugin turns its metrics connector on by itself."""
    proc, base, model, log = server
    long_prompt = " ".join(f"word{i % 50}" for i in range(1200))  # past the dense threshold
    post(base + "/v1/completions", {"model": model, "prompt": long_prompt, "max_tokens": 4,
                                    "temperature": 0})  # fmt: skip
    series: dict[str, float] = {}
    deadline = time.time() + 30  # the workers' counters reach /metrics at most every second
    while time.time() < deadline:
        with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
            text = r.read().decode()
        series = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                  for line in text.splitlines() if line.startswith("vllm:infinitehip_")}
        if any(k.startswith("vllm:infinitehip_queries_total") and "sparse_decode" in k and v > 0
               for k, v in series.items()):
            break
        time.sleep(1)
    assert any(k.startswith("vllm:infinitehip_attended_pairs_total") and v > 0
               for k, v in series.items()), sorted(series)
    assert any("sparse_decode" in k and v > 0 for k, v in series.items()
               if k.startswith("vllm:infinitehip_queries_total")), sorted(series)


def test_shuts_down_cleanly(server):
    proc, base, model, log = server
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]


def test_bad_config_stops_startup_naming_the_field(tiny_model):
    bad = {"stages": [{"chunk_size": 256, "keep_tokens": 4096}, {"chunk_size": 48, "keep_tokens": 480},
                      {"chunk_size": 8, "keep_tokens": 256}]}
    out = subprocess.run(serve_cmd(tiny_model, free_port(), bad), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode != 0
    assert "infinitehip.stages[1].chunk_size" in out.stdout + out.stderr
