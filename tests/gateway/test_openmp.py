"""`rtserve serve` bounds libgomp's spinning before torch loads, unless the user chose how OpenMP waits."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(code: str, **env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**base, **env}, capture_output=True,
                         text=True, timeout=120, check=True)
    return out.stdout.strip()


SERVE_THEN_REPORT = """
import os, sys
from gateway import cli
try:
    cli.serve(["--log-stats-interval", "-1"])   # refused after the OpenMP setting, before any model loads
except SystemExit:
    pass
import torch   # what the engine's OpenMP runtime reads when it loads
print(os.environ.get("GOMP_SPINCOUNT"))
"""


def test_serve_sets_the_spin_count_before_torch_loads():
    assert run(SERVE_THEN_REPORT) == "10000"


def test_the_users_choice_is_kept():
    assert run(SERVE_THEN_REPORT, GOMP_SPINCOUNT="300000") == "300000"
    assert run(SERVE_THEN_REPORT, OMP_WAIT_POLICY="PASSIVE") == "None"


def test_too_late_once_torch_is_loaded():
    code = "import os, torch\nfrom gateway import openmp\nprint(openmp.bound_spinning(), os.environ.get('GOMP_SPINCOUNT'))"
    assert run(code) == "False None"
