"""Attention and KV-store ops behind one interface: a pure-torch path (CPU) and Triton kernels (GPU).

On the CPU the torch path hands decode rows to a small C++ op (`kernels/csrc/paged_decode.cpp`, built on first use by
`kernels/cpu_ext.py`) that reads the paged cache in place; without a compiler it falls back to padded SDPA calls.

The backend is chosen once per process: `RTSERVE_ATTENTION_BACKEND=torch|triton` (or `set_backend`) overrides the
default, which is Triton when the tensors live on CUDA and torch otherwise. See `kernels/torch_ops.py` for the layout.
"""
from __future__ import annotations

import os

import torch

from kernels import torch_ops

_BACKEND: str | None = os.environ.get("RTSERVE_ATTENTION_BACKEND") or None
BACKENDS = ("torch", "triton")


def set_backend(name: str | None) -> None:
    """Force a backend ("torch" or "triton"); None restores the automatic choice."""
    global _BACKEND
    if name is not None and name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {BACKENDS}")
    _BACKEND = name


def resolve_backend(device: torch.device | str) -> str:
    if _BACKEND is not None:
        return _BACKEND
    return "triton" if torch.device(device).type == "cuda" else "torch"


def _impl(device):
    if resolve_backend(device) == "triton":
        from kernels import triton as triton_ops  # imported lazily: TRITON_INTERPRET must be set before triton loads
        return triton_ops
    return torch_ops


def store_kvcache(key, value, k_cache, v_cache, slot_mapping) -> None:
    _impl(key.device).store_kvcache(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, out=None):
    return _impl(q.device).paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, out=out)
