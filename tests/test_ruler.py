"""RULER in the evaluation harness (benchmarks/ruler.py): NVIDIA's packaged RULER generating
samples offline for a real tokenizer, its metrics on hand-made answers, the rows and summary, and
one sample through vLLM with infinitehip (plumbing, not the score: the tiny model is random)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import socket
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import ruler  # noqa: E402  (benchmarks/ruler.py)
import ruler_answers  # noqa: E402  (benchmarks/ruler_answers.py)

from tests.conftest import SMALL_HIP  # noqa: E402

LENGTH = 2048
# one task of each of RULER's five generator scripts; niah_single_2 has the essay haystack, the
# one that splits sentences with nltk
TASKS = ["niah_single_2", "vt", "cwe", "fwe", "qa_1"]


@pytest.fixture(scope="module")
def samples(tiny_model):
    """Chat-template samples (SmolLM2's template), generated with downloads made impossible."""
    import nltk

    def no_network(*args, **kwargs):
        raise AssertionError("RULER generation tried the network")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(nltk, "download", no_network)
        mp.setattr(socket.socket, "connect", no_network)
        return {task: ruler.generate(task, tiny_model, LENGTH, 2, chat=True) for task in TASKS}


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def test_the_13_tasks_are_rulers():
    assert list(ruler.task_configs()) == ruler.ALL_TASKS


@pytest.mark.parametrize("task", TASKS)
def test_samples_are_generated_offline_at_the_asked_length(samples, tokenizer, task):
    config = ruler.task_configs()[task]
    made = samples[task]
    assert [s.index for s in made] == [0, 1] and made[0].prompt != made[1].prompt
    for s in made:
        assert ruler.SEP not in s.prompt
        assert s.tokens == len(tokenizer.encode(s.prompt))
        assert s.max_tokens == config["tokens_to_generate"]
        # RULER's length counts the answer budget (fwe's own search fills the prompt alone)
        assert LENGTH // 2 < s.tokens <= LENGTH - (0 if task == "fwe" else s.max_tokens)
        # the question in a user turn, RULER's answer prefix opening the assistant's
        user, _, answer = s.prompt.rpartition("<|im_start|>assistant\n")
        assert "<|im_start|>user\n" in user and user.endswith("<|im_end|>\n")
        assert answer.startswith(config["answer_prefix"].strip()[:10])
        found = [ref in user for ref in s.outputs]
        assert any(found) if task.startswith("qa") else all(found)


def test_plain_samples_are_rulers_base_template_and_are_cached(tiny_model, tmp_path):
    first = ruler.generate_cached("vt", tiny_model, LENGTH, 1, False, 42, tmp_path)
    (path,) = tmp_path.rglob("vt-2048-n1-seed42.jsonl")
    again = ruler.generate_cached("vt", tiny_model, LENGTH, 1, False, 42, tmp_path)
    assert again == first
    prompt = first[0].prompt
    # the few-shot chain first (RULER inserts it), then the question and answer prefix as its
    # base template has them, without a chat turn
    assert "<|im_start|>" not in prompt and ruler.SEP not in prompt
    assert prompt.index("Memorize and track") < prompt.rindex("Question: Find all variables")
    assert prompt.endswith(", they are: ")
    assert "in the text above. Answer: According to the chain(s)" in prompt[-300:]
    assert path.stat().st_size > 0
    # the same tokenizer at another path (the model rebuilt on another machine) finds them: the
    # cache is keyed by what the tokenizer does, not where it lies
    elsewhere = tmp_path / "elsewhere" / Path(tiny_model).name
    shutil.copytree(tiny_model, elsewhere)
    path.write_text(path.read_text().replace("Memorize and track", "Memorise and track"))
    moved = ruler.generate_cached("vt", str(elsewhere), LENGTH, 1, False, 42, tmp_path)
    assert moved[0].prompt == prompt.replace("Memorize and track", "Memorise and track")
    assert list(tmp_path.rglob("vt-2048-n1-seed42.jsonl")) == [path]


def test_scores_are_rulers_metrics_on_hand_made_answers():
    from long_context_eval.eval.synthetic import constants

    for task in ruler.ALL_TASKS:
        want = constants.string_match_part if task.startswith("qa") else constants.string_match_all
        assert ruler.metric(task) is want
    # string_match_all: the share of a sample's references in its answer (any case), averaged
    assert ruler.score("niah_single_1", [" 1234567.", "I do not know"],
                       [["1234567"], ["7654321"]]) == 50.0
    assert ruler.score("niah_multivalue", ["5661907, then 3608513 and 1"],
                       [["5661907", "3608513", "4612365", "6647119"]]) == 50.0
    vt = ["IGDQL", "YYAQO", "CNNDJ", "BGHLO", "HZUNR"]
    assert ruler.score("vt", ["igdql, yyaqo, CNNDJ", " ".join(vt)], [vt, vt]) == 80.0
    assert ruler.score("cwe", ["1. Apple 2. kiwi"], [["apple", "pear", "fig"]]) == 33.33
    # string_match_part (QA): one reference found is enough
    assert ruler.score("qa_1", ["the City of Paris", "1067"],
                       [["Paris", "City of Paris"], ["1066"]]) == 50.0
    assert ruler.score("qa_2", ["Yes."], [["yes"]]) == 100.0
    # RULER's postprocess_pred: stripped, control characters to newlines, a missing answer empty
    assert ruler.postprocess(" \x00Paris\x1fFrance ") == "Paris\nFrance"
    assert ruler.score("qa_1", [None], [["Paris"]]) == 0.0


def sample(task: str, context: int, index: int, outputs: list[str]) -> ruler.Sample:
    return ruler.Sample(task, context, index, "prompt", outputs, context - 200, 32)


def test_wrong_answers_are_split_where_they_leave_the_truth():
    # one token per character, as Qwen's and SmolLM2's tokenizers write digits; the needle's
    # value 1234567 starts at position 14, so its digit 2 (index 2) is the first token of the
    # 8-token block at 16
    prompt = list(map(ord, "filler filler 1234567 filler"))
    rows = [{"model": "m", "backend": b, "config": "", "context": 32768, "task": t, "index": 0,
             "outputs": ["1234567"], "score": s, "pred": p}
            for b, t, s, p in [
                ("infinitehip", "niah_multikey_1", 0.0, " 1299999."),  # diverges at digit 2
                ("infinitehip", "niah_single_1", 0.0, " 1239999."),  # at digit 3
                ("infinitehip", "niah_single_2", 0.0, " 7654321."),  # from the first digit
                ("infinitehip", "niah_multikey_2", 0.0, " 123."),  # a right prefix, then nothing
                ("infinitehip", "niah_single_1", 100.0, " 1234567."),
                ("infinitehip", "vt", 0.0, " 1299999."),  # not a single-number needle task
                ("default", "niah_single_1", 0.0, " no number")]]  # fmt: skip
    got = ruler_answers.classify(rows, lambda task, context, index: prompt,
                                 lambda text: list(map(ord, text)), block_size=8)
    by = {r["backend"]: r for r in got}
    assert {k: by["infinitehip"][k] for k in ("samples", "wrong", "wrong_from_first_digit",
            "diverged", "short", "diverged_at_chunk_start", "chunk_start_share")} == {
        "samples": 5, "wrong": 4, "wrong_from_first_digit": 1, "diverged": 2, "short": 1,
        "diverged_at_chunk_start": 1, "chunk_start_share": 0.5}  # fmt: skip
    assert (by["default"]["wrong"], by["default"]["wrong_from_first_digit"]) == (1, 1)
    assert ruler_answers.divergence("1234567", " 12.") == 2
    assert ruler_answers.needle_start([1, 2, 1, 2], [1, 2]) is None  # not one occurrence


def test_rows_summary_and_a_later_run_replacing_only_its_cells(tmp_path):
    def results(command):
        return ruler.Results(tmp_path, "cpu", "cpu", "smollm2-135m", 8192, command)

    hip = ("infinitehip", "{}", "pytorch")
    first = results("python benchmarks/ruler.py --lengths 8192 16384")
    first.add_batch(*hip, [sample("niah_single_1", 8192, 0, ["111"]),
                           sample("niah_single_1", 8192, 1, ["222"])], ["111", "333"])
    first.add(*hip, sample("qa_1", 8192, 0, ["Paris"]), "Paris")
    first.add(*hip, sample("niah_single_1", 16384, 0, ["444"]), "444")
    first.add("default", "", "", sample("niah_single_1", 16384, 0, ["444"]), "no")
    saved = json.loads(first.paths["ruler"].read_text())
    assert saved["name"] == "ruler" and saved["gpu"] == "cpu"
    assert first.paths["ruler"].name == "ruler-cpu.json"  # one current file, whatever the date
    row = next(r for r in saved["rows"] if r["task"] == "niah_single_1" and r["context"] == 8192)
    assert row == {"model": "smollm2-135m", "trained_context": 8192, "context": 8192,
                   "multiple": 1.0, "task": "niah_single_1", "backend": "infinitehip",
                   "config": "{}", "ops": "pytorch", "score": 50.0, "n": 2, "nulls": 0,
                   "tokens": 7992.0, "date": first.date, "gpu": "cpu",
                   "command": first.command}
    summary = {(s["backend"], s["context"]): s for s in saved["summary"]}
    assert summary["infinitehip", 8192]["average"] == 75.0
    assert summary["infinitehip", 8192]["ratio_to_1x"] == 1.0
    # 2x has niah only: its ratio compares it with niah at 1x (100 / 50)
    assert summary["infinitehip", 16384]["tasks"] == 1
    assert summary["infinitehip", 16384]["ratio_to_1x"] == 2.0
    assert summary["default", 16384]["ratio_to_1x"] is None  # no 1x row of the default backend
    answers = json.loads(first.paths["ruler-samples"].read_text())["rows"]
    assert len(answers) == 5 and {a["score"] for a in answers} == {0.0, 100.0}

    # a later run (any later day: the file is the same) measuring 2x qa_1 and remeasuring 2x
    # niah keeps every other cell
    later = results("python benchmarks/ruler.py --lengths 16384")
    later.add(*hip, sample("niah_single_1", 16384, 0, ["444"]), "wrong")
    later.add(*hip, sample("qa_1", 16384, 0, ["Paris"]), "Paris")
    saved = json.loads(later.paths["ruler"].read_text())
    cells = {(r["backend"], r["context"], r["task"]): r["score"] for r in saved["rows"]}
    assert cells == {("infinitehip", 8192, "niah_single_1"): 50.0,
                     ("infinitehip", 8192, "qa_1"): 100.0,
                     ("infinitehip", 16384, "niah_single_1"): 0.0,
                     ("infinitehip", 16384, "qa_1"): 100.0,
                     ("default", 16384, "niah_single_1"): 0.0}
    # both runs still have cells in the file
    assert saved["command"] == ("python benchmarks/ruler.py --lengths 8192 16384; "
                                "python benchmarks/ruler.py --lengths 16384")
    assert len(json.loads(later.paths["ruler-samples"].read_text())["rows"]) == 6

    ruler.print_table(saved)
    ruler.write_outputs(later)
    assert later.paths["ruler"].with_suffix(".png").stat().st_size > 0


@pytest.mark.vllm
def test_one_sample_through_vllm_with_infinitehip(hip_llm, samples, tmp_path):
    # ~1.8K tokens, past SMALL_HIP's dense threshold: the sparse path; a few answer tokens
    s = dataclasses.replace(samples["vt"][0], max_tokens=4)
    hip_llm.collective_rpc("infinitehip_stats", kwargs={"reset": True})
    preds = ruler.run_samples(hip_llm, [s])
    assert len(preds) == 1 and isinstance(preds[0], str)
    stats = hip_llm.collective_rpc("infinitehip_stats", kwargs={"reset": True})[0]
    assert stats["sparse_prefill_queries"] > 0 and stats["sparse_decode_queries"] > 0
    results = ruler.Results(tmp_path, "cpu", "cpu", "tiny-llama", 32768)
    results.add_batch("infinitehip", json.dumps(SMALL_HIP, sort_keys=True), "pytorch", [s], preds)
    (row,) = json.loads(results.paths["ruler"].read_text())["rows"]
    assert (row["task"], row["context"], row["n"], row["tokens"]) == ("vt", LENGTH, 1, s.tokens)
    assert 0.0 <= row["score"] <= 100.0
