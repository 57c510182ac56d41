"""The small per-layer ops of the model: RMSNorm (with the residual add fused in), rotary embedding fused with the KV
store, SiLU-and-multiply, and greedy argmax. 16-bit CPU tensors take the C++ ops (kernels/csrc/layer_ops.cpp), which
round where torch rounds; everything else, and a machine without the C++ ops, takes torch."""
from __future__ import annotations

import torch

from kernels import cpu_ext
from kernels.attention import resolve_backend, store_kvcache


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of a 16-bit [rows, n] tensor with HF's rounding points (C++ on the CPU when built, else torch)."""
    op = cpu_ext.rms_norm() if x.device.type == "cpu" and x.dim() == 2 else None
    if op is not None:
        return op(x.contiguous(), weight, eps)
    return torch.nn.functional.rms_norm(x, weight.shape, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x (in place, rounded as torch's add), then RMSNorm of the new residual, for 16-bit [rows, n]: the
    residual add of one sublayer fused into the next norm, as vLLM does (C++ on the CPU when built, else torch)."""
    op = cpu_ext.add_rms_norm() if x.device.type == "cpu" and x.dim() == 2 else None
    if op is not None:
        return op(x.contiguous(), residual, weight, eps)
    residual.add_(x)
    return rms_norm(residual, weight, eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, 1, head_dim] (HF's rotate_half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rope_and_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rotary embedding of q and k in a step's fused qkv rows [T, (H + 2 KV) * D], k and v stored into their cache
    slots (-1 = skip); returns q [T, H, D]. 16-bit CPU rows on the torch backend take one C++ pass with torch's
    rounding points; everything else (fp32, which keeps HF's op order, the Triton backend) the torch rope and the
    backend's `store_kvcache`."""
    T, (kv_heads, d) = qkv.shape[0], k_cache.shape[2:]
    fused = qkv.device.type == "cpu" and qkv.dtype != torch.float32 and resolve_backend(qkv.device) == "torch"
    op = cpu_ext.rope_store() if fused else None
    if op is not None and qkv.is_contiguous() and k_cache.dtype == qkv.dtype:
        return op(qkv, cos.reshape(T, d), sin.reshape(T, d), slot_mapping, k_cache, v_cache, num_heads)
    qk, v = qkv.split([(num_heads + kv_heads) * d, kv_heads * d], dim=-1)
    qk = apply_rope(qk.view(T, num_heads + kv_heads, d), cos, sin)     # q and k in one go
    q, k = qk.split([num_heads, kv_heads], dim=1)
    store_kvcache(k, v.view(T, kv_heads, d), k_cache, v_cache, slot_mapping)
    return q


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for [rows, 2 * inter] laid out gate | up (C++ on the CPU when built, else torch)."""
    op = cpu_ext.silu_and_mul() if gate_up.device.type == "cpu" and gate_up.dim() == 2 else None
    if op is not None:
        return op(gate_up.contiguous())
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Per-row argmax of fp32 [rows, vocab] logits with torch.argmax's rules (first index on ties, NaN wins); C++ on
    the CPU when built (torch's CPU argmax is single-threaded and scalar), else torch."""
    op = cpu_ext.argmax_rows() if logits.device.type == "cpu" and logits.dim() == 2 and \
        logits.dtype == torch.float32 and logits.shape[1] > 0 else None
    return op(logits) if op is not None else logits.argmax(-1)


def top_candidates(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row of fp32 [rows, vocab] logits: its k largest values, largest first (ties: the lower index first), their
    indices, and the row's log-sum-exp. C++ on the CPU when built (one pass each for the max, the exponentials and the
    candidates, instead of torch's topk and logsumexp over the row), else torch."""
    op = cpu_ext.top_candidates() if logits.device.type == "cpu" and logits.dim() == 2 and \
        logits.dtype == torch.float32 and 1 <= k <= logits.shape[1] else None
    if op is not None:
        return op(logits, k)
    vals, idx = logits.topk(k, dim=-1)
    return vals, idx, logits.logsumexp(-1)
