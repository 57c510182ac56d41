"""Triton backend: `store_kvcache` and `paged_attention` with the layout of `kernels/torch_ops.py`.

Triton is imported on first use, never at package import, because `TRITON_INTERPRET` must be set before the kernels
are decorated. Without CUDA the interpreter is switched on here (unless the caller chose), so the same kernels run
(slowly) on CPU tensors for tests.
"""
from __future__ import annotations

import functools
import os

import torch

__all__ = ["store_kvcache", "paged_attention", "interpreted"]

_K = None  # the kernels module, once loaded
_INTERP = False


def _load():
    global _K, _INTERP
    if _K is None:
        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")
        import kernels.triton._kernels as k
        from triton.runtime.interpreter import InterpretedFunction
        _INTERP = isinstance(k._unified_attention_kernel, InterpretedFunction)
        _K = k
    return _K


def interpreted() -> bool:
    """True when the kernels run under the Triton CPU interpreter (decided when they were decorated)."""
    _load()
    return _INTERP


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Scatter this step's keys/values into their cache slots (slot -1 is skipped); one program per token."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    k = _load()
    k._store_kvcache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        PAGE_SIZE=k_cache.shape[1], NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_P=_pow2(num_kv_heads, 1), HEAD_DIM_P=_pow2(head_dim, 1), INTERP=_INTERP,
    )


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                    out: torch.Tensor | None = None, *, block_m: int | None = None,
                    tile: int | None = None, num_splits: int | None = None) -> torch.Tensor:
    """Causal attention of a mixed batch (prefill chunks + decodes) over the paged KV cache, in one launch.

    Grid: (query blocks of all sequences, kv heads, kv splits). `block_m` (rows per program = query tokens x GQA
    group), `tile` (keys per inner step) and `num_splits` (split-KV: each split covers part of the keys, a second
    small launch merges them; default >1 only for GPU decode batches too small to fill the SMs) are tuning knobs,
    exposed so tests can force every path. Reads no tensor values on the host, so it never synchronises.
    """
    num_tokens, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    group = num_heads // num_kv_heads
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    k = _load()
    interp = _INTERP
    decode_only = num_tokens == num_seqs  # every sequence has >= 1 query token, so this is known from shapes
    if block_m is None:
        block_m = _pow2(group) if decode_only else max(64, _pow2(group))
    if block_m < group or block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m={block_m} must be a power of two >= max(16, group={group})")
    block_q = block_m // group
    if tile is None:
        tile = 64 if interp else 32
    if tile < 16 or tile & (tile - 1):
        raise ValueError(f"tile={tile} must be a power of two >= 16")
    if num_splits is None:
        num_splits = _default_splits(q.device, num_seqs * num_kv_heads) if decode_only and not interp else 1
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits={num_splits} must be a power of two >= 1")
    head_dim_p = _pow2(head_dim)
    if num_splits > 1:
        part_acc = torch.empty(num_tokens, num_heads, num_splits, head_dim_p, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(num_tokens, num_heads, num_splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    cast_fp32 = interp or q.dtype == torch.float32
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    k._unified_attention_kernel[grid](
        q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_tables, part_acc, part_ml,
        float(scale) * 1.4426950408889634, num_seqs, num_heads,
        *q.stride(), *out.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(),
        PAGE_SIZE=page_size, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, GROUP=group,
        BLOCK_Q=block_q, BLOCK_M=block_m, TILE=tile,
        CAST_FP32=cast_fp32, DOT_PRECISION="ieee" if cast_fp32 else "tf32", INTERP=interp, NUM_SPLITS=num_splits,
    )
    if num_splits > 1:
        k._merge_splits_kernel[(num_tokens, num_heads)](
            part_acc, part_ml, out, num_heads, *out.stride(),
            NUM_SPLITS=num_splits, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, INTERP=interp,
        )
    return out


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _default_splits(device: torch.device, programs: int) -> int:
    """Split the keys only when the batch leaves at least half the SMs idle (few sequences decoding)."""
    if device.type != "cuda":
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    if programs * 2 > sms:
        return 1
    return min(16, 1 << ((sms // programs).bit_length() - 1))
