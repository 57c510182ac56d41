"""The C++ CPU ops in `kernels/csrc/`, compiled on first use with torch's extension builder and cached by torch (once
per machine and source change). Each accessor returns its op, or None when the ops cannot be built (no C++ compiler
or ninja) or `RTSERVE_CPU_EXT=0`; the pure-torch code then serves, only slower.

- `paged_decode`: decode attention straight from the paged cache (paged_decode.cpp).
- `rms_norm`, `silu_and_mul`, `add_rms_norm` (residual add fused into the norm), `rope_store` (rotary embedding of q
  and k fused with the KV-cache store): 16-bit only, fp32 math per row, rounded where torch rounds (layer_ops.cpp).
- `packed_linear`, `packed_linear_gguf`, `packed_isa`: bf16 linear layers on packed weights, one kernel per
  instruction set (AMX, AVX-512 fp32 FMAs, AVX-512 FP16 FMAs, AVX-512 VNNI int8 dots) behind one dispatch
  (packed_linear/; `kernels.cpu`).
- `decode_layers`, `decode_stack_slots`: every decoder layer of a decode-only step in one call, the kernels above in
  the Python layers' order, and the names of its weight slots (decode_stack.cpp; `kernels.decode_stack`).
- `argmax_rows`: greedy sampling's argmax over fp32 logits rows, torch.argmax's tie and NaN rules (layer_ops.cpp).
- `top_candidates`: each fp32 logits row's k largest values (largest first) with their indices, and its log-sum-exp,
  for random sampling's top-k / top-p / min-p (sampling.cpp).
"""
from __future__ import annotations

import hashlib
import logging
import threading
import time
from pathlib import Path

import torch

from kernels import settings

_CSRC = Path(__file__).parent / "csrc"
_state: dict = {}
_lock = threading.Lock()   # the engine and Whisper's loader thread both ask at start-up; the second must wait for the
#                            build, not read the "unavailable" placeholder and fall back to the torch path for good
log = logging.getLogger("rtserve.kernels")


def ops():
    """torch.ops.rtserve_cpu, built or loaded on the first call (None if unavailable or disabled by
    `RTSERVE_CPU_EXT=0`, read on that first call: ops() runs hundreds of times a decode step)."""
    if "ops" in _state:
        return _state["ops"]
    with _lock:
        if "ops" not in _state:
            _state["ops"] = _load() if settings.enabled("RTSERVE_CPU_EXT") else None
    return _state["ops"]


def _load():
    """Build or load the extension; None when it cannot be built."""
    t0 = time.perf_counter()
    try:
        from torch.utils.cpp_extension import load

        # -fopenmp: at::parallel_for is inline OpenMP, one thread without it; the loader then binds the ops to the
        # libgomp.so.1 torch already loaded, so they share torch's thread pool
        # torch rebuilds when a listed source changes but does not see headers, nor the CPU that -march=native built
        # for (a cached AMX build would crash on a CPU without AMX): their hash goes into the flags
        files = sorted(p for p in _CSRC.rglob("*") if p.is_file())
        digest = hashlib.sha1(b"".join(p.read_bytes() for p in files) + _cpu_flags()).hexdigest()
        load("rtserve_cpu", sources=[str(p) for p in files if p.suffix == ".cpp"],
             extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp", f"-DRTSERVE_CSRC={digest[:12]}"],
             extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
        # torch's cache makes this a load when the sources and the CPU are unchanged, a build (minutes) otherwise
        log.info("C++ CPU ops built or loaded in %.1f s", time.perf_counter() - t0)
        return torch.ops.rtserve_cpu
    except Exception as e:  # no compiler, no ninja, read-only cache: fall back to the torch path
        log.warning("C++ CPU ops unavailable, using the pure-torch path: %s", str(e).splitlines()[0][:300])
        return None


def _cpu_flags() -> bytes:
    """The CPU's feature flags (Linux), which decide what -march=native compiles."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        return b""


def _op(name: str):
    lib = ops()
    return getattr(lib, name) if lib is not None else None


def paged_decode():
    return _op("paged_decode")


def rms_norm():
    return _op("rms_norm")


def silu_and_mul():
    return _op("silu_and_mul")


def add_rms_norm():
    return _op("add_rms_norm")


def rope_store():
    return _op("rope_store")


def decode_layers():
    return _op("decode_layers")

def argmax_rows():
    return _op("argmax_rows")


def top_candidates():
    return _op("top_candidates")
