"""Every decoder layer of a decode-only step in one C++ call (kernels/csrc/decode_stack.cpp), fed by name.

The model hands each layer's weights over as a `DecodeLayerWeights`; the C++ op defines the order of its slots once
and says it (`decode_stack_slots`), and `flatten` lays the dataclasses out by those names, so nothing here has to
match a position by hand.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import cpu_ext
from kernels.linear import AMX_VNNI_MAX_ROWS, PACKED_MAX_ROWS


@dataclass(slots=True)
class LinearWeights:
    """One linear layer's tensors as the stack picks its kernel by row count (None where absent)."""
    weight: torch.Tensor                                # dense [N, K]: torch's GEMM
    bias: torch.Tensor | None = None
    packed: torch.Tensor | None = None                  # packed 16-bit tiles (kernels.linear.pack_linear_weight)
    gguf_qs: torch.Tensor | None = None                 # GGUF blocks in tile order (kernels.linear.pack_gguf_*)
    gguf_dm: torch.Tensor | None = None
    int4_weight: torch.Tensor | None = None             # torch's 4-bit CPU kernel, up to int4_max_rows rows
    int4_scales_and_zeros: torch.Tensor | None = None
    wide: torch.Tensor | None = None                    # fp32 copy for batches above PACKED_MAX_ROWS
    int4_max_rows: int | None = None                    # None: no 4-bit weight
    vnni_qs: torch.Tensor | None = None                 # GGUF blocks in the integer-dot order, up to AMX_VNNI_MAX_ROWS
    vnni_dm: torch.Tensor | None = None                 # rows on an AMX CPU (kernels.linear.pack_gguf_small_batches)


@dataclass(slots=True)
class DecodeLayerWeights:
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    qkv: LinearWeights
    o: LinearWeights
    gate_up: LinearWeights
    down: LinearWeights


def available() -> bool:
    return cpu_ext.decode_layers() is not None


def flatten(layers: list[DecodeLayerWeights], final_norm: torch.Tensor) -> tuple[list, int] | None:
    """(the op's weight list, the 4-bit row limit), or None where the stack cannot take these layers (linear layers
    with different 4-bit row limits)."""
    names = [name.split(".") for name in cpu_ext.ops().decode_stack_slots()]
    limits = {lin.int4_max_rows for layer in layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)
              if lin.int4_max_rows is not None}
    if len(limits) > 1:
        return None
    weights: list[torch.Tensor | None] = []
    for layer in layers:
        for path in names:
            value = layer
            for part in path:
                value = getattr(value, part)
            weights.append(value)
    return weights + [final_norm], limits.pop() if limits else 0


def decode_layers(x, cos, sin, slot_mapping, block_tables, seq_lens, kv_cache, weights: list, num_heads: int,
                  eps: float, scale: float, int4_max_rows: int) -> torch.Tensor:
    """The final hidden states of a decode-only step (one token per sequence), `weights` from `flatten`."""
    rows = torch.arange(x.shape[0])
    return cpu_ext.decode_layers()(x, cos, sin, slot_mapping, block_tables, seq_lens, rows, rows, kv_cache, weights,
                                   num_heads, eps, scale, int4_max_rows, AMX_VNNI_MAX_ROWS, PACKED_MAX_ROWS)
