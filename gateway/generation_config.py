"""Sampling defaults that fit the model (vLLM's `--generation-config auto|vllm|PATH`).

`auto` reads the sampling fields of the model's `generation_config.json`; `vllm` uses none (the engine's neutral
defaults: temperature 1, no top-k/top-p/min-p); a path reads `generation_config.json` from that folder (or the file
itself). A request's own value always wins over a default; a default only fills a field the client left out.

The embedded SmolLM2-135M-Instruct GGUF carries no generation_config.json, and HF's for that model holds only token
ids; at the neutral temperature 1 the 135M model rambles. Its defaults are the sampling its model card's example uses.
"""
from __future__ import annotations

import json
from pathlib import Path

from engine import SamplingParams
from engine.errors import InvalidRequestError

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
EMBEDDED_DEFAULTS = {"temperature": 0.2, "top_p": 0.9}   # HuggingFaceTB/SmolLM2-135M-Instruct model card


def realtime_defaults(defaults: dict) -> dict:
    """The defaults every Realtime response takes: all but the temperature, which the Realtime API sets (the
    session's temperature starts at the model's default and the client may change it); top_p, top_k, min_p and
    repetition_penalty have no Realtime field, so the model's values always hold there."""
    return {k: v for k, v in defaults.items() if k != "temperature"}


def sampling_defaults(source: str, model_dir: Path | None, embedded: bool) -> dict:
    """The default sampling fields for requests that do not set them. Raises ValueError for a bad source or file."""
    if source == "vllm":
        return {}
    if source == "auto":
        path = model_dir / "generation_config.json" if model_dir is not None else None
        if path is None or not path.is_file():
            return dict(EMBEDDED_DEFAULTS) if embedded else {}
    else:
        path = Path(source).expanduser()
        if path.is_dir():
            path = path / "generation_config.json"
        if not path.is_file():
            raise ValueError(f"--generation-config {source!r}: expected 'auto', 'vllm', or a folder or file with a "
                             f"generation_config.json")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--generation-config: cannot read {path}: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--generation-config: {path} is not a JSON object")
    defaults = {k: config[k] for k in SAMPLING_FIELDS if isinstance(config.get(k), (int, float))
                and not isinstance(config.get(k), bool)}
    if defaults.get("top_k") == 0:   # HF's "off"
        defaults["top_k"] = -1
    try:
        SamplingParams(**defaults)
    except InvalidRequestError as exc:
        raise ValueError(f"--generation-config: {path}: {exc}") from None
    return defaults
