"""Attention and KV-store ops behind one switch: a pure-torch path (CPU; `kernels/torch_ops.py`, which documents the
layout) and Triton kernels (GPU; `kernels/triton/`).

On the CPU the torch path hands decode rows to a small C++ op (`kernels/csrc/paged_decode.cpp`) that reads the paged
cache in place; without a compiler it falls back to padded SDPA calls.

The backend: `set_backend` (the engine's `attention_backend`) wins, then `RTSERVE_ATTENTION_BACKEND=torch|triton`,
else Triton when the tensors live on CUDA and torch otherwise.
"""
from __future__ import annotations

import ctypes
import sys

import torch

from kernels import settings, torch_ops

BACKENDS = ("torch", "triton")
_forced: str | None = None


def set_backend(name: str | None) -> None:
    """Force a backend ("torch" or "triton"); None restores the default choice."""
    global _forced
    if name is not None and name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {BACKENDS}")
    _forced = name


def resolve_backend(device: torch.device | str) -> str:
    chosen = _forced or settings.raw("RTSERVE_ATTENTION_BACKEND")
    if chosen:
        return chosen
    return "triton" if torch.device(device).type == "cuda" else "torch"


def backend_ops(device: torch.device | str):
    """The module whose `store_kvcache` / `paged_attention` serve tensors on `device`."""
    if resolve_backend(device) == "triton":
        from kernels import triton as triton_ops  # imported lazily: TRITON_INTERPRET must be set before triton loads
        return triton_ops
    return torch_ops


def store_kvcache(key, value, k_cache, v_cache, slot_mapping) -> None:
    backend_ops(key.device).store_kvcache(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, out=None):
    return backend_ops(q.device).paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale,
                                                 out=out)


def empty_kv_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed KV-cache tensor. On a Linux CPU it asks for 2 MiB pages (madvise MADV_HUGEPAGE) before the first
    touch. Why: decode attention reads scattered KV pages, each a TLB entry of its own in 4 KiB pages, and huge pages
    cut those misses (docs/benchmarks.md). Zeros, not garbage: a masked-out NaN would still poison P @ V. zero_()
    writes every page now; torch.zeros would map them lazily and the first requests would take the page faults."""
    cache = torch.empty(shape, dtype=dtype, device=device)
    if cache.device.type == "cpu" and sys.platform == "linux":
        _advise_huge_pages(cache.data_ptr(), cache.numel() * cache.element_size())
    return cache.zero_()


_MADV_HUGEPAGE = 14   # <sys/mman.h>


def _advise_huge_pages(addr: int, size: int) -> None:
    huge = 1 << 21
    start, end = (addr + huge - 1) & ~(huge - 1), (addr + size) & ~(huge - 1)
    if end > start:   # advice only: a kernel without THP says no, and the cache still works
        ctypes.CDLL(None).madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE)
