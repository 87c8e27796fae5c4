"""The passkey prompts and the evaluation harness's bookkeeping (benchmarks/passkey.py), no engine."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import passkey as harness  # noqa: E402  (benchmarks/passkey.py)

from vllm_infinitehip.passkey import QUESTION, make_passkey_prompt  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)  # SmolLM2's, with its chat template


@pytest.mark.parametrize("chat", [False, True])
def test_prompt_hides_the_passkey_at_its_depth_and_has_the_asked_length(tokenizer, chat):
    for depth in (0.1, 0.9):
        p = make_passkey_prompt(tokenizer, 2000, depth, seed=7, chat=chat)
        assert p.text.count(p.passkey) == 2 and len(p.passkey) == 5
        where = p.text.index(p.passkey) / len(p.text)
        assert abs(where - depth) < 0.05
        assert 1900 <= p.num_tokens <= 2000
        assert p.text.endswith("The pass key is")
        if chat:
            # the question in a user turn, the answer opened in the assistant's
            assert "What is the pass key?" in p.text and QUESTION not in p.text
            assert p.text.index("What is the pass key?") < p.text.rindex("assistant")
        else:
            assert p.text.endswith(QUESTION)
        assert p.is_correct(f" {p.passkey}.") and not p.is_correct(" 12.")


def test_decode_recall_is_one_row_per_layer_with_its_worst_head():
    steps = [{"query": "decode", "layer": layer, "seq_len": 100 + step, "recall": 0.5 + step / 10,
              "recall_min_head": 0.3 - step / 10} for step in range(3) for layer in range(2)]
    final = [{"query": "final-prompt", "layer": 0, "seq_len": 99, "recall": 0.9,
              "recall_min_head": 0.8}]
    rows = harness.per_layer(final + steps)
    assert len(rows) == 3
    d0 = next(r for r in rows if r["query"] == "decode" and r["layer"] == 0)
    assert d0["steps"] == 3 and d0["seq_len"] == 100
    assert d0["recall"] == pytest.approx(0.6) and d0["recall_min_head"] == pytest.approx(0.1)


def test_a_run_replaces_only_the_rows_it_produces(tmp_path):
    def results(produced, command="python benchmarks/passkey.py"):
        return harness.Results(tmp_path, "cpu", "cpu", "smollm2-135m", 8192, produced, command)

    default, hip = ("default", "", ""), ("infinitehip", "{}", "pytorch")
    first = results({default, hip})
    first.add("default", "", "", 16384, 0.5, False, 10.0, [], [])
    first.add("infinitehip", "{}", "pytorch", 16384, 0.5, True, 15.0, [], [])
    saved = json.loads(first.paths["passkey"].read_text())["rows"]
    hip_row = next(r for r in saved if r["backend"] == "infinitehip")
    # each prompt's generate time, and its ratio to the default backend's on the same cell
    assert hip_row["generate_s"] == 15.0 and hip_row["generate_s_vs_default"] == 1.5
    # another model, then another setting of the same model: both keep the first rows
    other = harness.Results(tmp_path, "cpu", "cpu", "qwen2.5-coder-0.5b", 32768, {hip},
                            "python benchmarks/passkey.py --model qwen2.5-coder-0.5b")
    other.add("infinitehip", "{}", "pytorch", 65536, 0.5, True, 1.0, [], [])
    five_k = results({("infinitehip", '{"preset": "5k"}', "pytorch")},
                     """python benchmarks/passkey.py --infinitehip '{"preset": "5k"}'""")
    five_k.add("infinitehip", '{"preset": "5k"}', "pytorch", 16384, 0.5, True, 1.0, [], [])
    path = first.paths["passkey"]
    saved = json.loads(path.read_text())
    assert len(saved["rows"]) == 4
    assert path.name == "passkey-cpu.json"  # one current file, whatever the date
    assert saved["command"].count("; ") == 2  # the command of every run with rows in the file
    # a rerun of the default settings replaces their rows, and only theirs
    again = results({hip})
    again.add("infinitehip", "{}", "pytorch", 32768, 0.1, False, 1.0, [], [])
    rows = json.loads(path.read_text())["rows"]
    mine = [(r["model"], r["config"], r["context"]) for r in rows if r["backend"] == "infinitehip"]
    assert ("smollm2-135m", "{}", 16384) not in mine
    assert {("smollm2-135m", "{}", 32768), ("qwen2.5-coder-0.5b", "{}", 65536),
            ("smollm2-135m", '{"preset": "5k"}', 16384)} <= set(mine)
    assert any(r["backend"] == "default" for r in rows)
