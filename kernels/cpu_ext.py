"""The C++ CPU ops in `kernels/csrc/`, compiled on first use with torch's extension builder and cached by torch
(~30 s once per machine, then milliseconds). `paged_decode()` returns the op, or None when it cannot be built (no C++
compiler or ninja) or `RTSERVE_CPU_EXT=0`; the pure-torch path then serves, only slower."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"
_state: dict = {}
log = logging.getLogger("rtserve.kernels")


def enabled() -> bool:
    return os.environ.get("RTSERVE_CPU_EXT", "1") != "0"


def paged_decode():
    """torch.ops.rtserve_cpu.paged_decode, built once per process (None if unavailable or disabled)."""
    if not enabled():
        return None
    if "op" not in _state:
        _state["op"] = None
        try:
            from torch.utils.cpp_extension import load

            # -fopenmp: at::parallel_for is inline OpenMP, one thread without it; the loader then binds the op to the
            # libgomp.so.1 torch already loaded, so it shares torch's thread pool
            load("rtserve_cpu", sources=[str(_SOURCE)], extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
                 extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
            _state["op"] = torch.ops.rtserve_cpu.paged_decode
        except Exception as e:  # no compiler, no ninja, read-only cache: fall back to the torch path
            log.warning("C++ CPU attention unavailable, using the pure-torch path: %s", str(e).splitlines()[0][:300])
    return _state["op"]
