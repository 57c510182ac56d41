"""The server runs numpy's OpenBLAS on one thread (gateway/app.py `blas_on_one_thread`) unless the user set its
count; torch's OpenMP pool keeps its threads."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

REPORT = """
import numpy, torch
from threadpoolctl import threadpool_info
from gateway.app import blas_on_one_thread
blas_on_one_thread()
print(sorted((p["internal_api"], p["num_threads"]) for p in threadpool_info()))
"""


def run(**env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", REPORT], cwd=ROOT, env={**base, **env}, capture_output=True,
                         text=True, timeout=120, check=True)
    return out.stdout.strip()


def test_openblas_on_one_thread_and_openmp_untouched():
    cpus = len(os.sched_getaffinity(0))
    report = run(OMP_NUM_THREADS=str(cpus))
    assert f"('openblas', 1)" in report and f"('openmp', {cpus})" in report, report


def test_the_users_count_is_kept():
    assert "('openblas', 2)" in run(OPENBLAS_NUM_THREADS="2"), run(OPENBLAS_NUM_THREADS="2")
