"""How long the server's OpenMP workers busy-wait: set before torch loads, since libgomp reads it only then.

The engine steps on two intra-op threads. Between two parallel regions (the Python between a step's ops, or between
steps) libgomp's idle worker spins for GOMP_SPINCOUNT iterations, 300000 by default, before it sleeps. Beside the
audio stage (Whisper, piper, Smart Turn) that spinning takes a CPU they need whenever the engine's main thread is in
Python or descheduled. 10000 spins still bridge the gaps inside a step, so a step is not slower for it, and the
worker sleeps soon after the engine does. docs/benchmarks-history.md ("OpenMP spin count") has the A/B behind the value.
"""
from __future__ import annotations

import os
import sys

SPIN_ENV = {"GOMP_SPINCOUNT": "10000"}


def bound_spinning() -> bool:
    """Set SPIN_ENV for this process's OpenMP runtime unless the user chose how OpenMP waits (GOMP_SPINCOUNT or
    OMP_WAIT_POLICY in the environment). Returns whether it applies: False once torch is loaded, when it is too late."""
    if "torch" in sys.modules:
        return False
    if "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ:
        return False
    os.environ.update(SPIN_ENV)
    return True
