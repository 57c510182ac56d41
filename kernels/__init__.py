"""Attention and KV-store ops behind one interface: a pure-torch path (CPU) and Triton kernels (GPU).

On the CPU the torch path hands decode rows to a small C++ op (`kernels/csrc/paged_decode.cpp`, built on first use by
`kernels/cpu_ext.py`) that reads the paged cache in place; without a compiler it falls back to padded SDPA calls.

The backend is chosen once per process: `RTSERVE_ATTENTION_BACKEND=torch|triton` (or `set_backend`) overrides the
default, which is Triton when the tensors live on CUDA and torch otherwise. See `kernels/torch_ops.py` for the layout.
"""
from __future__ import annotations

import ctypes
import os
import sys

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


def empty_kv_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed KV-cache tensor. On a Linux CPU it asks for 2 MiB pages (madvise MADV_HUGEPAGE) before the first
    touch. Why: decode attention reads scattered KV pages, each a TLB entry of its own in 4 KiB pages; measured, 30
    layers x 32 sequences x 180 tokens in 4-slot pages from DRAM: 9.7 -> 8.9 ms. Zeros, not garbage: a masked-out
    NaN would still poison P @ V. zero_() writes every page now; torch.zeros would map them lazily and the first
    requests would take the page faults."""
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


def store_kvcache(key, value, k_cache, v_cache, slot_mapping) -> None:
    _impl(key.device).store_kvcache(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, out=None):
    return _impl(q.device).paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, out=out)


AMX_MAX_ROWS = 64   # bf16 packed kernels up to this many rows: on AMX 1.2-5x oneDNN at 1-64, on par or slower from ~96
# fp16 tiles only for weights below this magnitude (others stay with torch): x is scaled to at most 16, so 64 products
# of a lane's partial sum stay below 64 * 16 * 32 = 32768 < 65504 (fp16's largest) however their signs fall
FP16_MAX_WEIGHT = 32.0


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [N, K] in the tile order of `linear` (kernels/csrc/amx_linear.cpp), or None where that kernel does not
    apply: not bf16 on the CPU, no packed kernel (or `RTSERVE_AMX=0`), or N or K not a multiple of 32.

    The tiles are bf16 (AMX, or fp32 FMAs on AVX-512 BF16), or fp16 on an AVX-512 FP16 CPU without AMX, where fp16
    FMAs run at twice the fp32 rate; bf16 values convert to fp16 exactly unless they are below 2^-14 (subnormal in
    fp16: below 2^-24 they flush to zero), which changes such a weight by less than 3e-8. A weight matrix with an
    entry of magnitude FP16_MAX_WEIGHT or more is not packed there (SmolLM2-135M's largest is 9.25)."""
    n, k = weight.shape
    isa = weight_isa(weight)
    if isa is None or n % 32 or k % 32:
        return None
    w = weight.detach()
    return tile_order(w.half() if isa == "avx512fp16" else w)


def weight_isa(weight: torch.Tensor) -> str | None:
    """packed_isa() for this weight: None unless it is a bf16 CPU weight, and on "avx512fp16" unless all its entries
    are below FP16_MAX_WEIGHT in magnitude (the same rule for dense and GGUF weights)."""
    isa = packed_isa() if weight.device.type == "cpu" and weight.dtype == torch.bfloat16 else None
    if isa == "avx512fp16" and not bool(weight.detach().abs().max() < FP16_MAX_WEIGHT):
        return None
    return isa


def tile_order(w: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N/32 column blocks, K/32 k blocks, 2 tiles of 16 columns, 16 k pairs, 16 columns x 2 k]."""
    n, k = w.shape
    return w.view(n // 32, 2, 16, k // 32, 16, 2).permute(0, 3, 1, 4, 2, 5).reshape(n // 32, k // 32, 2, 16, 32) \
        .contiguous()


def pack_wide_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """An fp32 copy of a bf16 CPU weight for batches above AMX_MAX_ROWS (prefill chunks) where the packed kernel runs
    as fp32 FMAs (AVX-512 BF16 with neither AMX nor FP16), else None. Why: without AMX, oneDNN's bf16 GEMM reached
    0.17 TFLOP/s here against 0.31 for MKL's fp32 one on the same bf16 values (the products are exact in fp32;
    accumulation is fp32 either way, and the output is rounded once to bf16 as oneDNN does). Costs 2x the bf16
    weight's memory."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or packed_isa() != "avx512":
        return None
    return weight.detach().float()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None, wide: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias; bf16 batches go to the packed kernel when `packed` (from pack_linear_weight) is given: fp16
    tiles at any size, bf16 ones (AMX, or fp32 FMAs on an AVX-512 CPU without AMX) at decode sizes; larger ones to
    MKL's fp32 GEMM when `wide` (from pack_wide_weight) is, everything else to torch (oneDNN)."""
    if x.dim() == 2 and packed is not None and (packed.dtype == torch.float16 or x.shape[0] <= AMX_MAX_ROWS):
        return cpu_ext.ops().amx_linear(x, packed, bias)
    if x.dim() == 2 and x.shape[0] > AMX_MAX_ROWS and wide is not None:
        return torch.nn.functional.linear(x.float(), wide, None if bias is None else bias.float()).to(x.dtype)
    return torch.nn.functional.linear(x, weight, bias)


_ISAS = {1: "avx512", 2: "amx", 3: "avx512fp16"}


def packed_isa() -> str | None:
    """Which instruction set runs the packed kernels (`linear`, `linear_gguf`): "amx" (bf16 AMX tiles), "avx512fp16"
    (fp16 FMAs on fp16 tiles, for AVX-512 FP16 CPUs without AMX), "avx512" (fp32 FMAs on bf16 tiles, for AVX-512
    BF16 CPUs with neither), or None: no such CPU, the C++ ops not built, or switched off (`RTSERVE_AMX=0`, for A/B
    runs)."""
    if os.environ.get("RTSERVE_AMX", "1") == "0":
        return None
    lib = cpu_ext.ops()
    return _ISAS.get(int(lib.packed_isa())) if lib is not None else None


def pack_gguf_q4_1(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_1 weights w = d * q + m (q [N, K] uint8 0..15; d, m [N, K/32] fp16) in the tile order of `linear_gguf`:
    qs [N/32, K/32, 2, 16, 16] uint8, byte i of a tile row holding lanes i and i + 16; dm [N/32, K/32, 2, 2, 16] fp16."""
    n, k = q.shape
    lanes = q.view(n // 32, 2, 16, k // 32, 16, 2).permute(0, 3, 1, 4, 2, 5).reshape(n // 32, k // 32, 2, 16, 32)
    qs = (lanes[..., :16] | (lanes[..., 16:] << 4)).contiguous()
    dm = torch.stack([d, m]).view(2, n // 32, 2, 16, k // 32).permute(1, 4, 2, 0, 3).contiguous()
    return qs, dm


def pack_gguf_q8_0(q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 weights w = d * q (q [N, K] int8; d [N, K/32] fp16) in the tile order of `linear_gguf`:
    qs [N/32, K/32, 2, 16, 32] int8; dm [N/32, K/32, 2, 16] fp16."""
    n, k = q.shape
    qs = q.view(n // 32, 2, 16, k // 32, 16, 2).permute(0, 3, 1, 4, 2, 5).reshape(n // 32, k // 32, 2, 16, 32)
    return qs.contiguous(), d.view(n // 32, 2, 16, k // 32).permute(0, 3, 1, 2).contiguous()


def linear_gguf(x: torch.Tensor, qs: torch.Tensor, dm: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T + bias on packed GGUF blocks (bf16 x). With bf16 tiles (AMX, or AVX-512 without FP16) each weight is
    dequantized in fp32 and rounded to bf16 exactly as the dense bf16 model's weight was, so the result equals
    `linear` on that dense weight; on an AVX-512 FP16 CPU it is the file's weight rounded once to fp16 (3 bits more
    than bf16), and the result equals `linear` on fp16 tiles of those weights, at any number of rows."""
    return cpu_ext.ops().amx_linear_gguf(x, qs, dm, bias)


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


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Per-row argmax of fp32 [rows, vocab] logits with torch.argmax's rules (first index on ties, NaN wins); C++ on
    the CPU when built (torch's CPU argmax is single-threaded and scalar), else torch."""
    op = cpu_ext.argmax_rows() if logits.device.type == "cpu" and logits.dim() == 2 and \
        logits.dtype == torch.float32 and logits.shape[1] > 0 else None
    return op(logits) if op is not None else logits.argmax(-1)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for [rows, 2 * inter] laid out gate | up (C++ on the CPU when built, else torch)."""
    op = cpu_ext.silu_and_mul() if gate_up.device.type == "cpu" and gate_up.dim() == 2 else None
    if op is not None:
        return op(gate_up.contiguous())
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def default_thread_count() -> int:
    """torch's own default intra-op thread count (OMP_NUM_THREADS, else the CPUs this process may use), whatever
    `torch.set_num_threads` calls other threads have made since."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def set_thread_count(n: int) -> None:
    """Give the calling thread `n` intra-op threads for its torch and C++ ops, whatever other threads set.

    Why: torch's count is per thread (OpenMP's), but a thread takes the process-wide value of the last
    `torch.set_num_threads` call, from any thread, on its first parallel op. So each worker thread (the engine, Whisper)
    fixes its own at start: first trigger that lazy initialisation (`get_num_threads` does), then set."""
    torch.get_num_threads()
    torch.set_num_threads(max(1, int(n)))
