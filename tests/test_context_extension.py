"""Training-free context extension through vLLM on the CPU: SmolLM2-135M (trained on 8K tokens)
served with --max-model-len past its trained length retrieves a passkey at 16K (2x)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

HELPER = Path(__file__).parent / "helpers" / "passkey_run.py"


@pytest.fixture(scope="module")
def smollm2() -> str:
    from vllm_infinitehip.offline_models import smollm2_135m

    return str(smollm2_135m())


def passkey(model: str, backend: str, tokens: int, max_len: int) -> dict:
    out = subprocess.run(
        [sys.executable, str(HELPER), model, backend, str(tokens), "0.5", "3", str(max_len)],
        capture_output=True, text=True, timeout=1500,
    )
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_passkey_at_twice_the_trained_length(smollm2):
    r = passkey(smollm2, "infinitehip", 16384, 16384 + 512)
    # it started past the trained length: the plugin raised the rotary cache, kept the trained length
    assert r["max_model_len"] == 16384 + 512
    assert r["max_position_embeddings"] == 16384 + 512 and r["trained_context"] == 8192
    assert r["tokens"] > 16000
    assert r["correct"], r
    assert r["stats"]["sparse_prefill_queries"] > 0 and r["stats"]["sparse_decode_queries"] > 0


def test_unsupported_rope_type_names_the_flag(tmp_path, smollm2):
    import vllm_infinitehip
    from vllm.engine.arg_utils import EngineArgs

    vllm_infinitehip.register()
    model = tmp_path / "yarn-model"
    shutil.copytree(smollm2, model, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = json.loads((model / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 2.0, "rope_theta": 100000.0,
                              "original_max_position_embeddings": 8192}
    (model / "config.json").write_text(json.dumps(cfg))
    args = EngineArgs(model=str(model), attention_backend="infinitehip", max_model_len=40000)
    with pytest.raises(ValueError, match=r"--hf-overrides '\{\"max_position_embeddings\": 40000\}'"):
        args.create_model_config()
