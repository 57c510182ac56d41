"""Attention and KV-store ops behind one interface: a pure-torch path (CPU) and Triton kernels (GPU).

On the CPU the torch path hands decode rows to a small C++ op (`kernels/csrc/paged_decode.cpp`, built on first use by
`kernels/cpu_ext.py`) that reads the paged cache in place; without a compiler it falls back to padded SDPA calls.

The backend is chosen once per process: `RTSERVE_ATTENTION_BACKEND=torch|triton` (or `set_backend`) overrides the
default, which is Triton when the tensors live on CUDA and torch otherwise. See `kernels/torch_ops.py` for the layout.
"""
from __future__ import annotations

import os

import torch

from kernels import cpu_ext, torch_ops

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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of a 16-bit [rows, n] tensor with HF's rounding points (C++ on the CPU when built, else torch)."""
    op = cpu_ext.rms_norm() if x.device.type == "cpu" and x.dim() == 2 else None
    if op is not None:
        return op(x.contiguous(), weight, eps)
    return torch.nn.functional.rms_norm(x, weight.shape, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for [rows, 2 * inter] laid out gate | up (C++ on the CPU when built, else torch)."""
    op = cpu_ext.silu_and_mul() if gate_up.device.type == "cpu" and gate_up.dim() == 2 else None
    if op is not None:
        return op(gate_up.contiguous())
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
