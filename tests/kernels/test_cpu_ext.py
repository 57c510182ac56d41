"""Loading the C++ ops (kernels/cpu_ext.py): once, for every thread that asks."""
from __future__ import annotations

import subprocess
import sys


def test_concurrent_first_loads_all_get_the_ops():
    """The engine and Whisper's loader thread both ask for the ops at start-up. A second caller must wait for the
    build or load, not read an "unavailable" placeholder and run the slower torch path (with other rounding) for good.
    A fresh process, since this one has loaded them already."""
    code = ("import threading\nfrom kernels import cpu_ext\nres = []\n"
            "ts = [threading.Thread(target=lambda: res.append(cpu_ext.ops())) for _ in range(4)]\n"
            "[t.start() for t in ts]\n[t.join() for t in ts]\n"
            "print(sum(r is None for r in res), len(res))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split()[-2:] == ["0", "4"], out.stdout + out.stderr
