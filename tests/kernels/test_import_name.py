"""`kernels` is a top-level import name that Hugging Face's `kernels` distribution also takes (transformers 5.25 and
newer require it). With both installed one shadows the other: `import transformers` then fails on ours, or our
kernels are not the ones imported. A fresh interpreter, as a user's process starts, must see ours and import
transformers' modules that probe for theirs."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_kernels_is_ours_and_transformers_imports_beside_it():
    code = ("import importlib.metadata as md, kernels, transformers.activations\n"
            "try:\n    md.distribution('kernels'); print('foreign kernels installed')\n"
            "except md.PackageNotFoundError:\n    pass\n"
            "print(kernels.__file__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.split()
    assert "foreign" not in out.stdout, out.stdout
    assert Path(lines[-1]).resolve().is_relative_to(ROOT / "kernels")
