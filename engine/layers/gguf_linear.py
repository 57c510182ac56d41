"""Linear layers on the GGUF file's own 4-bit blocks, used where the batch is small (`quantization="gguf"`).

Why: a decode step of a few sequences is a stack of GEMVs, and a GEMV only streams its weight matrix: SmolLM2-135M's
linear layers are 268 MB in bf16, which this CPU reads at ~9-12 GB/s. The shipped GGUF stores every linear layer as
Q4_1 (blocks of 32: w = d * q + m, q in 0..15), 5 bits a weight with its scales, and the tied embedding / lm_head as
Q8_0 (w = d * q, q int8). Two kernels run on those blocks, each where it measured fastest (all linear layers of the
model, bf16 activations; docs/benchmarks.md):

- torch's CPU kernel for group-wise 4-bit weights (`_weight_int4pack_mm_for_cpu`, which computes (q - 8) * scale +
  zero; scale = d and zero = m + 8d is the file's weight, rounded only by the bf16 scales): ~11 ms at 1 row against
  ~18 ms for the AMX kernel, but ~40 ms from 8 rows. Used up to INT4_MAX_ROWS[isa] rows, except for a Q8_0 matrix
  (the lm_head) where a packed kernel exists: its two planes take 2.0-2.4 ms at 1-2 rows, AMX 1.4-1.6 ms.
- `kernels.linear_gguf` (kernels/csrc/amx_linear.cpp): dequantizes tile by tile to exactly the dense bf16 weights,
  ~17-29 ms at 4-32 rows against ~22-35 ms for bf16 AMX and ~35-55 ms for oneDNN. Used up to kernels.AMX_MAX_ROWS
  rows. On an AVX-512 CPU without AMX the same kernel runs as fp32 FMAs: all 120 body layers 4.7 / 6.5 / 11.9 / 23.2 /
  45.1 ms with the 4-bit kernel at 1 / 4 / 8 / 16 / 32 rows, 7.0 / 8.8 / 11.5 / 18.5 / 26.8 ms packed; the lm_head
  1.9 / 3.8 / 7.2 ms at 1 / 4 / 8 rows against 1.9 / 2.6 / 3.4 ms packed.

Prefill chunks and larger batches keep the dense bf16 weights (oneDNN on AMX; without AMX, MKL's fp32 GEMM on an fp32
copy, `kernels.pack_wide_weight`). On an AVX-512 FP16 CPU without AMX ("avx512fp16") the packed kernel runs as fp16
FMAs on blocks dequantized to fp16 and takes every batch size, prefill included. Up to 12 rows (one pass over the rows)
each tile pair is dequantized into a 2-slot L1 ring right before use; above, a column block is dequantized once into a
K-long buffer. All 120 body layers, interleaved runs of the ring against the buffer: 3.9-5.1 / 4.7-6.9 / 6.3-8.6 /
8.4-8.6 ms at 1 / 4 / 8 / 12 rows against 6.8-7.2 / 6.6-7.5 / 8.3-9.2 / 9.4-13.0 (4-bit kernel 3.8-5.5 / 7.3-8.8 /
11.9-15.8 / 18.5-19.9 ms); buffered 18.8 ms at 32 rows, 216 ms at 512 rows against ~375 for MKL's fp32 GEMM.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import kernels
from engine.errors import ModelLoadError

GROUP = 32            # Q4_1 and Q8_0 block size; also the kernel's group size
# torch's 4-bit kernel up to this many rows, by the ISA of the packed kernel (kernels.packed_isa): with no packed
# kernel 2x dense bf16 at 1 row, 1.07x at 8; AMX is as fast from ~4 rows and faster from 8; AVX-512 FMAs from ~8;
# fp16 FMAs on blocks dequantized into an L1 ring as fast at 1 row (3.9-5.1 against 3.8-5.5 ms for all body layers,
# three interleaved runs) and faster from 2, so there the 4-bit kernel is not used
INT4_MAX_ROWS = {None: 8, "amx": 2, "avx512": 4, "avx512fp16": 0}
_Q4_1_BYTES = 20      # per block: fp16 d, fp16 m, 16 bytes of nibbles
_Q8_0_BYTES = 34      # per block: fp16 d, 32 int8


class Plane:
    """One packed 4-bit matrix with its per-group (scale, zero): the kernel multiplies by (q - 8) * scale + zero."""

    __slots__ = ("packed", "scales_and_zeros")

    def __init__(self, q: np.ndarray, scale: np.ndarray, zero: np.ndarray, dtype: torch.dtype):
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(q.astype(np.int32)), 1)
        sz = torch.stack([torch.from_numpy(scale), torch.from_numpy(zero)], dim=-1)   # [rows, groups, 2]
        self.scales_and_zeros = sz.transpose(0, 1).contiguous().to(dtype)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_and_zeros)


class Q4Linear(nn.Module):
    """A linear layer with its weight as GGUF blocks (small batches) and dense (everything else).

    The blocks become planes for torch's 4-bit kernel: a Q4_1 matrix is one plane; a Q8_0 matrix is two, its int8
    q + 128 = 16 * hi + lo split into two 4-bit matrices that together still read half the bytes of bf16. With bf16
    weights on a CPU with a packed kernel (AMX or AVX-512) they are also packed for `kernels.linear_gguf`."""

    def __init__(self, dense: nn.Linear, blocks: "GgufBlocks"):
        super().__init__()
        self.weight, self.bias = dense.weight, dense.bias
        self.amx: tuple[torch.Tensor, torch.Tensor] | None = None   # the packed blocks (named for the first ISA)
        isa = kernels.weight_isa(self.weight)   # None also where fp16 tiles could overflow (FP16_MAX_WEIGHT)
        if isa is not None:
            self.amx = blocks.pack_amx()
        self.wide = kernels.pack_wide_weight(self.weight)   # prefill-sized batches on AVX-512 without FP16 or AMX
        self.planes = blocks.planes(self.weight.dtype)
        self.amx_any_rows = isa == "avx512fp16"   # fp16 FMAs beat MKL's fp32 GEMM at prefill sizes too
        self.int4_max_rows = INT4_MAX_ROWS[isa]
        if self.amx is not None and len(self.planes) > 1:
            self.int4_max_rows = 0   # Q8_0 (lm_head): its two 4-bit passes lose to the packed kernel at every size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows > self.int4_max_rows:
            if self.amx is not None and (rows <= kernels.AMX_MAX_ROWS or self.amx_any_rows):
                return kernels.linear_gguf(x, *self.amx, self.bias)
            return kernels.linear(x, self.weight, self.bias, None, self.wide)
        x = x.contiguous()
        y = self.planes[0].mm(x)
        for plane in self.planes[1:]:
            y += plane.mm(x)
        return y if self.bias is None else y + self.bias

    def stack_slots(self) -> list[torch.Tensor | None] | None:
        """This layer's slots in the C++ decode stack (kernels/csrc/decode_stack.cpp), which takes one 4-bit plane."""
        if len(self.planes) != 1:
            return None
        qs, dm = self.amx if self.amx is not None else (None, None)
        return [self.weight, self.bias, None, qs, dm, self.planes[0].packed, self.planes[0].scales_and_zeros, self.wide]

    def dequantized(self) -> torch.Tensor:
        """The weight torch's 4-bit kernel multiplies by, as a dense matrix (for checks)."""
        eye = torch.eye(self.weight.shape[1], dtype=self.weight.dtype)
        return sum(plane.mm(eye) for plane in self.planes).T

    def dequantized_amx(self) -> torch.Tensor:
        """The weight the AMX kernel multiplies by, as a dense matrix (for checks)."""
        eye = torch.eye(self.weight.shape[1], dtype=self.weight.dtype)
        return kernels.linear_gguf(eye, *self.amx).T


class GgufBlocks:
    """One matrix's GGUF blocks, unpacked to arrays: Q4_1 (w = d * q + m) or Q8_0 (w = d * q, m None)."""

    __slots__ = ("q", "d", "m")

    def __init__(self, q: np.ndarray, d: np.ndarray, m: np.ndarray | None):
        self.q, self.d, self.m = q, d, m

    def pack_amx(self) -> tuple[torch.Tensor, torch.Tensor]:
        q, d = torch.from_numpy(self.q), torch.from_numpy(self.d)
        if self.m is None:
            return kernels.pack_gguf_q8_0(q, d)
        return kernels.pack_gguf_q4_1(q, d, torch.from_numpy(self.m))

    def planes(self, dtype: torch.dtype) -> list[Plane]:
        d = self.d.astype(np.float32)
        if self.m is not None:   # scale d, zero m + 8d gives d * q + m
            return [Plane(self.q, d, self.m.astype(np.float32) + 8 * d, dtype)]
        # Q8_0 with u = q + 128 = 16 * hi + lo: w = 16d * hi + d * lo - 128d. Plane hi: scale 16d, zero 0 gives
        # 16d * hi - 128d; plane lo: scale d, zero 8d gives d * lo.
        u = self.q.astype(np.int16) + 128
        hi, lo = (u >> 4).astype(np.uint8), (u & 0x0F).astype(np.uint8)
        return [Plane(hi, 16 * d, np.zeros_like(d), dtype), Plane(lo, d, 8 * d, dtype)]


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


_READERS = {"Q4_1": read_q4_1, "Q8_0": read_q8_0}


def cached_gguf_blocks(gguf_path: Path, cache_dir: Path) -> dict[str, np.ndarray]:
    """The raw blocks of every Q4_1 / Q8_0 tensor in the file, keyed "<type>:<gguf name>". gguf's reader parses all
    metadata (the whole tokenizer vocabulary) in seconds, so the blocks are copied once into `cache_dir/gguf/`."""
    from safetensors.numpy import load_file, save_file

    path = cache_dir / "gguf" / "blocks.safetensors"
    if not path.is_file():
        import gguf

        reader = gguf.GGUFReader(str(gguf_path))
        state = {f"{t.tensor_type.name}:{t.name}": np.ascontiguousarray(t.data) for t in reader.tensors
                 if t.tensor_type.name in _READERS}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        save_file(state, str(tmp))
        tmp.replace(path)
    return load_file(str(path))


def _unpermute_rows(n_rows: int, n_head: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation for its interleaved rope (transformers does the same on load)."""
    idx = np.arange(n_rows)
    return idx.reshape(n_head, n_rows // n_head // 2, 2).swapaxes(2, 1).reshape(n_rows)


def attach_gguf_q4(model: nn.Module, gguf_path: Path, cache_dir: Path) -> int:
    """Swap the linear layers of `model` (and lm_head when it is Q8_0 or Q4_1) for Q4Linear layers built from
    `gguf_path`; returns the number swapped.

    Raises ModelLoadError when the file is not a llama-family GGUF with Q4_1 layer weights, or when its blocks do not
    dequantize to the weights the model was loaded with (the check catches layout or permutation mistakes)."""
    cfg = model.config
    if cfg.get("model_type") not in ("llama", "mistral"):
        raise ModelLoadError(f"quantization='gguf' supports llama-family GGUF files, not {cfg.get('model_type')!r}")
    tensors = cached_gguf_blocks(gguf_path, cache_dir)
    blocks = {key.split(":", 1)[1]: key for key in tensors}
    n_head, n_kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    dtype = model.lm_head.weight.dtype

    def raw(name: str, permute_heads: int | None = None, types=("Q4_1",)) -> tuple[str, np.ndarray]:
        key = blocks.get(name)
        if key is None or key.split(":")[0] not in types:
            raise ModelLoadError(f"quantization='gguf' needs {'/'.join(types)} blocks for {name} in {gguf_path.name}")
        rows = tensors[key]
        if permute_heads:
            rows = rows[_unpermute_rows(rows.shape[0], permute_heads)]
        return key.split(":")[0], rows

    def planes(*parts) -> GgufBlocks:
        kinds = {kind for kind, _ in parts}
        return _READERS[kinds.pop()](np.concatenate([rows for _, rows in parts]))

    swapped = 0
    for i, layer in enumerate(model.layers):
        b = f"blk.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = Q4Linear(attn.qkv_proj, planes(raw(b + "attn_q.weight", n_head),
                                                       raw(b + "attn_k.weight", n_kv), raw(b + "attn_v.weight")))
        attn.o_proj = Q4Linear(attn.o_proj, planes(raw(b + "attn_output.weight")))
        mlp.gate_up_proj = Q4Linear(mlp.gate_up_proj, planes(raw(b + "ffn_gate.weight"), raw(b + "ffn_up.weight")))
        mlp.down_proj = Q4Linear(mlp.down_proj, planes(raw(b + "ffn_down.weight")))
        swapped += 4
    head = "output.weight" if "output.weight" in blocks else "token_embd.weight"   # tied embeddings: no output.weight
    if head in blocks and blocks[head].split(":")[0] in _READERS:
        model.lm_head = Q4Linear(model.lm_head, planes(raw(head, types=tuple(_READERS))))
        swapped += 1
    checks = [model.layers[i].self_attn.qkv_proj for i in {0, len(model.layers) - 1}]   # first and last layer
    checks += [model.layers[-1].mlp.down_proj] + ([model.lm_head] if isinstance(model.lm_head, Q4Linear) else [])
    gen = torch.Generator().manual_seed(0)
    for lin in checks:       # cheap, and catches any layout or permutation error
        x = torch.randn(4, lin.weight.shape[1], generator=gen).to(dtype)
        dense = F.linear(x, lin.weight).float()
        err = (lin(x).float() - dense).abs().max().item()
        if err > 0.05 * dense.abs().max().item():
            raise ModelLoadError(f"the quantized blocks of {gguf_path.name} do not match the loaded weights "
                                 f"(max error {err:.3g}); cannot use quantization='gguf'")
    return swapped
