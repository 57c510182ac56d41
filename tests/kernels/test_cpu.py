"""Per-thread intra-op thread counts (kernels/cpu.py)."""
from __future__ import annotations

import subprocess
import sys


def test_worker_threads_keep_their_own_thread_count():
    """The engine thread keeps its intra-op threads when the Whisper worker (started later) sets one for itself, also
    across its first C++ op after that (the server's order: the engine thread waits idle while the audio stage
    starts), and a thread started after both takes its own. Plain torch.set_num_threads would not do it: a thread
    takes the last value set by any thread on its first parallel op, in torch and again in our C++ ops. A fresh
    process, since lazy initialisation is per thread."""
    code = ("import threading, torch, kernels\nres = {}\nstarted, whisper_set = threading.Event(), threading.Event()\n"
            "def engine():\n    kernels.set_thread_count(2); started.set(); whisper_set.wait()\n"
            "    kernels.cpu_ext.ops().rms_norm(torch.ones(64, 8, dtype=torch.bfloat16), "
            "torch.ones(8, dtype=torch.bfloat16), 1e-5)\n"
            "    res['engine'] = torch.get_num_threads()\n"
            "def whisper():\n    started.wait(); kernels.set_thread_count(1); whisper_set.set()\n"
            "    res['whisper'] = torch.get_num_threads()\n"
            "ts = [threading.Thread(target=engine), threading.Thread(target=whisper)]\n"
            "[t.start() for t in ts]\n[t.join() for t in ts]\n"
            "t = threading.Thread(target=lambda: (kernels.set_thread_count(2), res.update(late=torch.get_num_threads())))\n"
            "t.start(); t.join()\nprint(res['engine'], res['whisper'], res['late'])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split()[-3:] == ["2", "1", "2"], out.stdout + out.stderr
