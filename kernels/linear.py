"""Linear layers on the CPU's packed kernels (kernels/csrc/packed_linear/): weight packing, done once at load in plain
torch, and the dispatch that sends each batch to the packed kernel, MKL's fp32 GEMM or torch.

Which kernel runs is `kernels.cpu.packed_isa()`: on AMX and AVX-512 BF16 the tiles are bf16, on an AVX-512 FP16 CPU
without AMX they are fp16 (fp16 FMAs have twice the lanes of fp32 ones). GGUF Q4_1 / Q8_0 blocks are packed in the
same tile order and dequantized by the kernel right before use, except on AVX512_VNNI, where they are packed in the
integer-dot kernel's order and multiplied as int8 dot products against x quantized per block (`pack_gguf` picks).
"""
from __future__ import annotations

import torch

from kernels import cpu_ext, settings
from kernels.cpu import Isa, packed_isa

# bf16 tiles up to this many rows; above, oneDNN's bf16 GEMM (AMX) or MKL's fp32 one (`wide`) is at least as fast
PACKED_MAX_ROWS = 64
# fp16 tiles only for weights below this magnitude (others stay with torch): x is scaled to at most 16, so 64 products
# of a lane's partial sum stay below 64 * 16 * 32 = 32768 < 65504 (fp16's largest) however their signs fall
FP16_MAX_WEIGHT = 32.0
# where `linear_gguf` takes every batch size, prefill included: fp16 FMAs and int8 dot products beat MKL's fp32 GEMM
# there too (docs/benchmarks.md); elsewhere it takes up to PACKED_MAX_ROWS rows
GGUF_ANY_ROWS = (Isa.AVX512_FP16, Isa.AVX512_VNNI)
# On AMX the tile kernel dequantizes every GGUF block to bf16 whatever the batch, which at a few rows costs more than
# the integer dots (AMX CPUs have VNNI too); there the blocks are packed a second time, in the integer-dot order, for
# batches up to this many rows (the crossover, measured for Q4_1 and Q8_0 matrices: docs/benchmarks.md)
AMX_VNNI_MAX_ROWS = 8


def weight_isa(weight: torch.Tensor) -> Isa:
    """packed_isa() for this weight: NONE unless it is a bf16 CPU weight, and on AVX512_FP16 unless all its entries
    are below FP16_MAX_WEIGHT in magnitude (the same rule for dense and GGUF weights)."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return Isa.NONE
    isa = packed_isa()
    if isa is Isa.AVX512_FP16 and not bool(weight.detach().abs().max() < FP16_MAX_WEIGHT):
        return Isa.NONE
    return isa


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [N, K] in the tile order of `linear` (kernels/csrc/packed_linear/tiles.h), or None where that kernel
    does not apply: not bf16 on the CPU, no packed kernel (or `RTSERVE_PACKED_LINEAR=0`), or N or K not a multiple of
    32.

    The tiles are bf16 (AMX, or fp32 FMAs on AVX-512 BF16), or fp16 on an AVX-512 FP16 CPU without AMX; bf16 values
    convert to fp16 exactly unless they are below 2^-14 (subnormal in fp16: below 2^-24 they flush to zero), which
    changes such a weight by less than 3e-8. A weight matrix with an entry of magnitude FP16_MAX_WEIGHT or more is not
    packed there."""
    n, k = weight.shape
    isa = weight_isa(weight)
    if isa is Isa.NONE or n % 32 or k % 32:
        return None
    w = weight.detach()
    return tile_order(w.half() if isa is Isa.AVX512_FP16 else w)


def tile_order(w: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N/32 column blocks, K/32 k blocks, 2 tiles of 16 columns, 16 k pairs, 16 columns x 2 k]."""
    n, k = w.shape
    return w.view(n // 32, 2, 16, k // 32, 16, 2).permute(0, 3, 1, 4, 2, 5).reshape(n // 32, k // 32, 2, 16, 32) \
        .contiguous()


def pack_wide_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """An fp32 copy of a bf16 CPU weight for batches above PACKED_MAX_ROWS (prefill chunks) where the packed kernel
    runs bf16 tiles as fp32 FMAs (AVX-512 BF16 with neither AMX nor FP16, VNNI or not), else None. Why: without AMX,
    oneDNN's bf16 GEMM is slower than MKL's fp32 one on the same bf16 values (docs/benchmarks.md); the products are
    exact in fp32, accumulation is fp32 either way, and the output is rounded once to bf16 as oneDNN does. Costs 2x
    the bf16 weight's memory."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or \
            packed_isa() not in (Isa.AVX512_FP32, Isa.AVX512_VNNI):
        return None
    return weight.detach().float()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None, wide: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias; bf16 batches go to the packed kernel when `packed` (from pack_linear_weight) is given: fp16
    tiles at any size, bf16 ones (AMX, or fp32 FMAs on an AVX-512 CPU without AMX) at decode sizes; larger ones to
    MKL's fp32 GEMM when `wide` (from pack_wide_weight) is, everything else to torch (oneDNN)."""
    if x.dim() == 2 and packed is not None and (packed.dtype == torch.float16 or x.shape[0] <= PACKED_MAX_ROWS):
        return cpu_ext.ops().packed_linear(x, packed, bias)
    if x.dim() == 2 and x.shape[0] > PACKED_MAX_ROWS and wide is not None:
        return torch.nn.functional.linear(x.float(), wide, None if bias is None else bias.float()).to(x.dtype)
    return torch.nn.functional.linear(x, weight, bias)


def quantize_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF's Q8_0 of a dense weight [N, K] (K a multiple of 32), as llama.cpp quantizes it: per block of 32 along K,
    d = amax / 127 stored as fp16, q = round(w / d) in int8. Returns (q [N, K] int8, d [N, K/32] fp16), as
    `pack_gguf` takes them. q is rounded against the stored fp16 d, so d * q is the nearest such weight."""
    n, k = weight.shape
    blocks = weight.detach().float().reshape(n, k // 32, 32)
    d = (blocks.abs().amax(-1) / 127).half()
    inv = torch.where(d > 0, 1.0 / d.float(), torch.zeros((), dtype=torch.float32))
    q = torch.round(blocks * inv.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q.reshape(n, k), d


def pack_gguf_q4_1(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_1 weights w = d * q + m (q [N, K] uint8 0..15; d, m [N, K/32] fp16) in the tile order of `linear_gguf`:
    qs [N/32, K/32, 2, 16, 16] uint8, byte i of a tile row holding lanes i and i + 16; dm [N/32, K/32, 2, 2, 16] fp16."""
    n, k = q.shape
    lanes = q.view(n // 32, 2, 16, k // 32, 16, 2).permute(0, 3, 1, 4, 2, 5).reshape(n // 32, k // 32, 2, 16, 32)
    qs = (lanes[..., :16] | (lanes[..., 16:] << 4)).contiguous()
    return qs, _dm_q4_1(d, m)


def _dm_q4_1(d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """[N, K/32] d and m -> [N/32, K/32, 2 tiles, (d, m), 16 columns]."""
    n = d.shape[0]
    return torch.stack([d, m]).view(2, n // 32, 2, 16, d.shape[1]).permute(1, 4, 2, 0, 3).contiguous()


def _dm_q8_0(d: torch.Tensor) -> torch.Tensor:
    """[N, K/32] d -> [N/32, K/32, 2 tiles, 16 columns]."""
    return d.view(d.shape[0] // 32, 2, 16, d.shape[1]).permute(0, 3, 1, 2).contiguous()


def pack_gguf_q8_0(q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 weights w = d * q (q [N, K] int8; d [N, K/32] fp16) in the tile order of `linear_gguf`:
    qs [N/32, K/32, 2, 16, 32] int8; dm [N/32, K/32, 2, 16] fp16."""
    n, k = q.shape
    qs = q.view(n // 32, 2, 16, k // 32, 16, 2).permute(0, 3, 1, 4, 2, 5).reshape(n // 32, k // 32, 2, 16, 32)
    return qs.contiguous(), _dm_q8_0(d)


def pack_gguf_vnni_q4_1(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_1 weights (as pack_gguf_q4_1 takes them) in the order of the integer-dot kernel
    (kernels/csrc/packed_linear/avx512_vnni.cpp): qs [N/32, K/32, 2 tiles, 4, 64] uint8, where vector v's byte 4c + b
    of a 16-column tile holds q[c][8v + b] in its low nibble and q[c][8v + 4 + b] in its high one; dm as
    pack_gguf_q4_1's."""
    n, k = q.shape
    nib = q.view(n // 32, 2, 16, k // 32, 4, 2, 4).permute(0, 3, 1, 4, 2, 5, 6)   # nb, kb, tile, v, c, half, b
    qs = (nib[..., 0, :] | (nib[..., 1, :] << 4)).reshape(n // 32, k // 32, 2, 4, 64).contiguous()
    return qs, _dm_q4_1(d, m)


def pack_gguf_vnni_q8_0(q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 weights (as pack_gguf_q8_0 takes them) in the order of the integer-dot kernel: qs [N/32, K/32, 2 tiles, 8,
    64] uint8, where vector v's byte 4c + b of a 16-column tile is q[c][4v + b] + 128 (the instruction's unsigned
    operand; the kernel takes 128 * sum(x) back off); dm as pack_gguf_q8_0's."""
    n, k = q.shape
    u = (q.to(torch.int16) + 128).to(torch.uint8)
    qs = u.view(n // 32, 2, 16, k // 32, 8, 4).permute(0, 3, 1, 4, 2, 5).reshape(n // 32, k // 32, 2, 8, 64)
    return qs.contiguous(), _dm_q8_0(d)


def pack_gguf(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_1 (m given) or Q8_0 blocks for `linear_gguf`, in the order of the kernel packed_isa() runs them on: the
    integer-dot kernel's on AVX512_VNNI, tile order elsewhere."""
    vnni = packed_isa() is Isa.AVX512_VNNI
    if m is None:
        return pack_gguf_vnni_q8_0(q, d) if vnni else pack_gguf_q8_0(q, d)
    return pack_gguf_vnni_q4_1(q, d, m) if vnni else pack_gguf_q4_1(q, d, m)


def int8_small_batches() -> bool:
    """Whether GGUF blocks get a second packing, in the integer-dot order, for batches of up to AMX_VNNI_MAX_ROWS
    rows: on an AMX CPU whose build has the VNNI kernel, unless `RTSERVE_VNNI=0`. (Elsewhere `pack_gguf` picks one
    order for every batch size.)"""
    return packed_isa() is Isa.AMX and settings.enabled("RTSERVE_VNNI") and bool(cpu_ext.ops().vnni_usable())


def pack_gguf_small_batches(q: torch.Tensor, d: torch.Tensor,
                             m: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The blocks (as `pack_gguf` takes them) in the integer-dot order for small batches (`int8_small_batches`), or
    None where they get no second packing."""
    if not int8_small_batches():
        return None
    return pack_gguf_vnni_q8_0(q, d) if m is None else pack_gguf_vnni_q4_1(q, d, m)


def linear_gguf(x: torch.Tensor, qs: torch.Tensor, dm: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T + bias on packed GGUF blocks (bf16 x). With bf16 tiles (AMX, or AVX-512 without FP16) each weight is
    dequantized in fp32 and rounded to bf16 exactly as the dense bf16 model's weight was, so the result equals
    `linear` on that dense weight; on an AVX-512 FP16 CPU it is the file's weight rounded once to fp16 (3 bits more
    than bf16), and the result equals `linear` on fp16 tiles of those weights, at any number of rows."""
    return cpu_ext.ops().packed_linear_gguf(x, qs, dm, bias)
