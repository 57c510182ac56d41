"""A linear layer on the GGUF file's own Q4_1 / Q8_0 blocks, used where the batch is small (`quantization="gguf"`).

Why: a decode step of a few sequences is a stack of GEMVs, and a GEMV only streams its weight matrix, so reading 5
(Q4_1) or 9 (Q8_0) bits a weight instead of 16 is what makes it fast. The shipped GGUF stores every linear layer as
Q4_1 (blocks of 32: w = d * q + m, q in 0..15) and the tied embedding / lm_head as Q8_0 (w = d * q, q int8). Two
kernels run on those blocks, each at the batch sizes where it measured fastest (docs/benchmarks.md):

- torch's CPU kernel for group-wise 4-bit weights (`_weight_int4pack_mm_for_cpu`, which computes (q - 8) * scale +
  zero; scale = d and zero = m + 8d is the file's weight, rounded only by the bf16 scales), up to INT4_MAX_ROWS[isa]
  rows. Not for a Q8_0 matrix (the lm_head) where a packed kernel exists: its two 4-bit planes lose to it.
- `kernels.linear_gguf` (kernels/csrc/packed_linear/): dequantizes tile by tile to exactly the dense bf16 weights (AMX,
  or fp32 FMAs on an AVX-512 CPU without AMX), up to kernels.PACKED_MAX_ROWS rows. On an AVX-512 FP16 CPU without
  AMX it runs as fp16 FMAs on blocks dequantized to fp16 and takes every batch size, prefill included; on an AVX-512
  VNNI CPU with neither (`Isa.AVX512_VNNI`) as int8 dot products against x quantized to int8 per block of 32, as
  llama.cpp does, also at every batch size (it beats the fp32 FMAs, the 4-bit kernel and MKL at each one measured).
  On AMX the same int8 dot products take batches of up to kernels.AMX_VNNI_MAX_ROWS rows (`small_blocks`, a second
  packing): there the tiles' cost is the dequantization, whatever the batch, and the dots beat it and the 4-bit kernel.

Elsewhere prefill chunks and larger batches keep the dense bf16 weights (oneDNN on AMX; without AMX, MKL's fp32 GEMM
on an fp32 copy, `kernels.pack_wide_weight`).
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

import kernels
from kernels import Isa
from kernels.decode_stack import LinearWeights

GROUP = 32            # Q4_1 and Q8_0 block size; also the kernel's group size
# torch's 4-bit kernel up to this many rows, by the instruction set of the packed kernel (kernels.packed_isa): the
# crossover with the packed kernel (or, with none, with dense bf16) measured for each (docs/benchmarks.md). The fp16
# FMAs on blocks dequantized into an L1 ring, and the int8 dot products, are faster from 1 row, so there the 4-bit
# kernel is not used.
INT4_MAX_ROWS = {Isa.NONE: 8, Isa.AMX: 2, Isa.AVX512_FP32: 4, Isa.AVX512_FP16: 0, Isa.AVX512_VNNI: 0}
_Q4_1_BYTES = 20      # per block: fp16 d, fp16 m, 16 bytes of nibbles
_Q8_0_BYTES = 34      # per block: fp16 d, 32 int8


class Int4Plane:
    """One packed 4-bit matrix with its per-group (scale, zero): the kernel multiplies by (q - 8) * scale + zero."""

    __slots__ = ("packed", "scales_and_zeros")

    def __init__(self, q: np.ndarray, scale: np.ndarray, zero: np.ndarray, dtype: torch.dtype):
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(q.astype(np.int32)), 1)
        sz = torch.stack([torch.from_numpy(scale), torch.from_numpy(zero)], dim=-1)   # [rows, groups, 2]
        self.scales_and_zeros = sz.transpose(0, 1).contiguous().to(dtype)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_and_zeros)


class GGUFLinear(nn.Module):
    """A linear layer with its weight as GGUF Q4_1 or Q8_0 blocks (small batches) and dense (everything else).

    The blocks become planes for torch's 4-bit kernel: a Q4_1 matrix is one plane; a Q8_0 matrix is two, its int8
    q + 128 = 16 * hi + lo split into two 4-bit matrices that together still read half the bytes of bf16. With bf16
    weights on a CPU with a packed kernel they are also packed for `kernels.linear_gguf` (`packed_blocks`)."""

    def __init__(self, dense: nn.Linear, blocks: "GgufBlocks"):
        super().__init__()
        self.weight, self.bias = dense.weight, dense.bias
        isa = kernels.weight_isa(self.weight)   # NONE also where fp16 tiles could overflow (FP16_MAX_WEIGHT)
        # (qs, dm) in the packed kernel's tile order, or None where it does not apply
        self.packed_blocks: tuple[torch.Tensor, torch.Tensor] | None = None if isa is Isa.NONE else blocks.pack()
        self.packed_any_rows = isa in kernels.GGUF_ANY_ROWS
        # prefill-sized batches on AVX-512 without FP16 or AMX, unless the blocks take those too
        self.wide = None if self.packed_any_rows else kernels.pack_wide_weight(self.weight)
        # (qs, dm) in the integer-dot order for small batches on AMX (kernels.pack_gguf_small_batches), or None
        self.small_blocks = None if isa is not Isa.AMX else blocks.pack_small_batches()
        self.int4_planes = blocks.int4_planes(self.weight.dtype)
        self.int4_max_rows = INT4_MAX_ROWS[isa]
        if self.small_blocks is not None or (self.packed_blocks is not None and len(self.int4_planes) > 1):
            # the integer dots beat the 4-bit kernel from 1 row; and for Q8_0 (lm_head) its two 4-bit passes lose to
            # the packed kernel at every size
            self.int4_max_rows = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.small_blocks is not None and rows <= kernels.AMX_VNNI_MAX_ROWS:
            return kernels.linear_gguf(x, *self.small_blocks, self.bias)
        if rows > self.int4_max_rows:
            if self.packed_blocks is not None and (rows <= kernels.PACKED_MAX_ROWS or self.packed_any_rows):
                return kernels.linear_gguf(x, *self.packed_blocks, self.bias)
            return kernels.linear(x, self.weight, self.bias, None, self.wide)
        x = x.contiguous()
        y = self.int4_planes[0].mm(x)
        for plane in self.int4_planes[1:]:
            y += plane.mm(x)
        return y if self.bias is None else y + self.bias

    def decode_weights(self) -> LinearWeights | None:
        """This layer's tensors for the C++ decode stack, which takes one 4-bit plane (None for Q8_0)."""
        if len(self.int4_planes) != 1:
            return None
        qs, dm = self.packed_blocks if self.packed_blocks is not None else (None, None)
        vnni_qs, vnni_dm = self.small_blocks if self.small_blocks is not None else (None, None)
        plane = self.int4_planes[0]
        return LinearWeights(weight=self.weight, bias=self.bias, gguf_qs=qs, gguf_dm=dm, int4_weight=plane.packed,
                             int4_scales_and_zeros=plane.scales_and_zeros, wide=self.wide,
                             int4_max_rows=self.int4_max_rows, vnni_qs=vnni_qs, vnni_dm=vnni_dm)

    def dequantized_int4(self) -> torch.Tensor:
        """The weight torch's 4-bit kernel multiplies by, as a dense matrix (for checks)."""
        eye = torch.eye(self.weight.shape[1], dtype=self.weight.dtype)
        return sum(plane.mm(eye) for plane in self.int4_planes).T

    def dequantized_packed(self) -> torch.Tensor:
        """The weight the packed kernel multiplies by, as a dense matrix (for checks). The integer-dot kernel
        (AVX512_VNNI) quantizes the one-hot rows exactly, but scales them by 127 * (amax / 127), within an fp32 ulp of
        1: its entries can be one bf16 step off the weight."""
        eye = torch.eye(self.weight.shape[1], dtype=self.weight.dtype)
        return kernels.linear_gguf(eye, *self.packed_blocks).T


class GgufBlocks:
    """One matrix's GGUF blocks, unpacked to arrays: Q4_1 (w = d * q + m) or Q8_0 (w = d * q, m None)."""

    __slots__ = ("q", "d", "m")

    def __init__(self, q: np.ndarray, d: np.ndarray, m: np.ndarray | None):
        self.q, self.d, self.m = q, d, m

    def pack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(qs, dm) in the order `kernels.linear_gguf` runs them in on this CPU (kernels.pack_gguf)."""
        return kernels.pack_gguf(torch.from_numpy(self.q), torch.from_numpy(self.d),
                                 None if self.m is None else torch.from_numpy(self.m))

    def pack_small_batches(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(qs, dm) for small batches on an AMX CPU (kernels.pack_gguf_small_batches), or None."""
        return kernels.pack_gguf_small_batches(torch.from_numpy(self.q), torch.from_numpy(self.d),
                                               None if self.m is None else torch.from_numpy(self.m))

    def int4_planes(self, dtype: torch.dtype) -> list[Int4Plane]:
        d = self.d.astype(np.float32)
        if self.m is not None:   # scale d, zero m + 8d gives d * q + m
            return [Int4Plane(self.q, d, self.m.astype(np.float32) + 8 * d, dtype)]
        # Q8_0 with u = q + 128 = 16 * hi + lo: w = 16d * hi + d * lo - 128d. Plane hi: scale 16d, zero 0 gives
        # 16d * hi - 128d; plane lo: scale d, zero 8d gives d * lo.
        u = self.q.astype(np.int16) + 128
        hi, lo = (u >> 4).astype(np.uint8), (u & 0x0F).astype(np.uint8)
        return [Int4Plane(hi, 16 * d, np.zeros_like(d), dtype), Int4Plane(lo, d, 8 * d, dtype)]


def read_q4_1(raw: np.ndarray) -> GgufBlocks:
    """Raw Q4_1 rows [rows, cols / 32 * 20] uint8. ggml's block layout: fp16 d, fp16 m, then 16 bytes whose low
    nibbles are elements 0-15 and high nibbles elements 16-31."""
    blocks = raw.reshape(raw.shape[0], -1, _Q4_1_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    qs = blocks[..., 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(raw.shape[0], -1)
    return GgufBlocks(q, d, m)


def read_q8_0(raw: np.ndarray) -> GgufBlocks:
    """Raw Q8_0 rows [rows, cols / 32 * 34] uint8: fp16 d, then 32 int8."""
    blocks = raw.reshape(raw.shape[0], -1, _Q8_0_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    return GgufBlocks(np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(raw.shape[0], -1), d, None)


READERS = {"Q4_1": read_q4_1, "Q8_0": read_q8_0}   # by GGUF tensor type
