"""The benchmarks' shared command-line pieces (benchmarks/common.py): ``--model``, the trained
length, and the command a results file records."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import common  # noqa: E402  (benchmarks/common.py)


def test_model_is_a_short_name_or_passed_on_as_given(tiny_model, tmp_path):
    assert common.resolve_model("tiny-llama") == tiny_model
    assert common.resolve_model("meta-llama/Meta-Llama-3-8B") == "meta-llama/Meta-Llama-3-8B"
    assert common.resolve_model(str(tmp_path)) == str(tmp_path)
    # rows name a local directory by its own name, never by its host path
    assert common.model_name(tiny_model) == Path(tiny_model).name
    assert common.model_name("Qwen/Qwen2.5-7B-Instruct") == "Qwen/Qwen2.5-7B-Instruct"
    assert common.model_label("Qwen/Qwen2.5-7B-Instruct") == "qwen2.5-7b-instruct"
    assert common.model_label("qwen2.5-coder-0.5b") == "qwen2.5-coder-0.5b"


def test_trained_length_comes_from_the_config_unless_overridden(tiny_model, tmp_path):
    assert common.trained_length(tiny_model) == 32768
    assert common.trained_length(tiny_model, 8192) == 8192
    config = json.loads((Path(tiny_model) / "config.json").read_text())
    # a scaled RoPE declares the length it was trained on before scaling
    config.update(max_position_embeddings=131072,
                  rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                "original_max_position_embeddings": 32768})
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert common.trained_length(str(tmp_path)) == 32768


def test_the_recorded_command_has_no_host_path():
    root = common.ROOT
    argv = [str(root / "benchmarks" / "ruler.py"), "--model", "/data/models/Llama-3-8B",
            "--cache", "/var/cache/ruler", f"--out={root}/benchmarks/results",
            "--infinitehip", '{"preset": "5k"}', "--n", "20"]
    assert common.command_line(argv) == (
        "python benchmarks/ruler.py --model Llama-3-8B --cache ruler "
        "--out=benchmarks/results --infinitehip '{\"preset\": \"5k\"}' --n 20")
