"""Every `RTSERVE_*` environment variable, with its default and meaning, in one place.

It lives in `kernels/` because that is the one package every other may import (gateway -> engine, audio -> kernels).
Values are read when asked for, not at import, so a test or a launcher that sets a variable before the engine starts
is heard. The README's configuration table is `python -m kernels.settings` (tests/kernels/test_settings.py keeps the
two equal).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Variable:
    name: str
    default: str          # "" = unset
    meaning: str


VARIABLES: dict[str, Variable] = {v.name: v for v in (
    Variable("RTSERVE_CACHE", "~/.cache/rtserve",
             "Where converted model files are cached: the dequantized GGUF model, Whisper's weights, the split piper "
             "voice."),
    Variable("RTSERVE_API_KEY", "",
             "The key clients must send (`Authorization: Bearer`, `api-key`, or the browser subprotocol); "
             "`--api-key` wins. Unset: no key is asked for."),
    Variable("RTSERVE_ATTENTION_BACKEND", "",
             "`torch` or `triton`: the attention backend. Unset: Triton for CUDA tensors, torch otherwise."),
    Variable("RTSERVE_CPU_EXT", "1",
             "`0`: do not build or load the C++ CPU ops (kernels/csrc/); the pure-torch path serves, slower."),
    Variable("RTSERVE_PACKED_LINEAR", "1",
             "`0`: no packed linear kernels (AMX, AVX-512 FP16, AVX-512 fp32); linear layers go to torch. For A/B "
             "runs."),
    Variable("RTSERVE_VNNI", "1",
             "`0`: on an AVX-512 VNNI CPU without AMX or AVX-512 FP16, GGUF blocks run as fp32 FMAs on dequantized "
             "weights instead of int8 dot products against int8-quantized activations (llama.cpp's scheme, the "
             "default there, much faster; its activation rounding changes some greedy outputs, docs/kernels.md); on "
             "an AMX CPU, batches of up to 8 rows run on the AMX tiles too instead of the int8 dot products. For A/B "
             "runs."),
    Variable("RTSERVE_DECODE_STACK", "1",
             "`0`: decode steps run the decoder layers one Python call at a time instead of in one C++ call. For A/B "
             "runs."),
    Variable("RTSERVE_WHISPER_DTYPE", "bfloat16",
             "`bfloat16` (the fast path: linear layers on 8-bit blocks for the packed kernel), `float32` (exact) or "
             "`float16`: Whisper's compute dtype."),
    Variable("RTSERVE_WHISPER_THREADS", "1",
             "Intra-op threads of the Whisper worker. More than one, beside the in-thread engine's own team, leaves "
             "more OpenMP threads than CPUs, and libgomp then throttles every team's spin-waits: the engine's decode "
             "steps slow down."),
    Variable("RTSERVE_WHISPER_GRAPH", "1",
             "`0`: Whisper's encoder and decoder step run as Python modules, one op at a time, instead of as traced "
             "TorchScript graphs that hold no GIL while they run. For A/B runs."),
    Variable("RTSERVE_TTS_THREADS", "2", "Speech synthesis threads (one piper voice and one ONNX thread each)."),
    Variable("RTSERVE_TTS_LOOKAHEAD_S", "1.0",
             "How far ahead of its listener a reply's speech is synthesized; the rest waits its turn."),
    Variable("RTSERVE_TTS_YIELD_SLACK_S", "0.4",
             "How much buffered speech lets a reply's synthesis yield to a reply someone is waiting on."),
    Variable("RTSERVE_ENGINE_SHARES_CPUS", "1",
             "`0`: the in-thread LLM engine keeps all its threads while the audio stage computes, instead of "
             "stepping on one. For A/B runs."),
    Variable("RTSERVE_TEST_DEVICE", "cpu", "Tests only: `cuda` runs the Triton tests compiled on a GPU."),
    Variable("RTSERVE_ARTIFACTS", "",
             "Tests only: the folder tests save screenshots in (the web demo's under `web_demo/`). Unset: "
             "`rtserve-artifacts` in the system's temp folder."),
)}


def raw(name: str) -> str:
    """The variable's value, or its default when unset or empty."""
    return os.environ.get(name) or VARIABLES[name].default


def enabled(name: str) -> bool:
    """A switch: anything but "0" is on."""
    return raw(name) != "0"


def integer(name: str) -> int:
    return int(raw(name))


def number(name: str) -> float:
    return float(raw(name))


@functools.cache
def cache_dir() -> Path:
    """$RTSERVE_CACHE with `~` expanded, resolved once per process."""
    return Path(raw("RTSERVE_CACHE")).expanduser()


def markdown_table() -> str:
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for v in VARIABLES.values():
        rows.append(f"| `{v.name}` | {f'`{v.default}`' if v.default else 'unset'} | {v.meaning} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
