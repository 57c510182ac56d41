"""nn.Linear with the CPU's packed copies of its weight behind its interface (kernels.linear).

`pack()` gives the layer what the CPU's packed kernels read: its weight in their tile order (bf16 tiles on AMX or
AVX-512 BF16, fp16 ones on AVX-512 FP16 without AMX) and, on AVX-512 BF16 without either, an fp32 copy for
prefill-sized batches; forward then sends each batch where `kernels.linear` says. `decode_weights()` hands the same
tensors to the C++ decode stack.
"""
from __future__ import annotations

import torch
from torch import nn

import kernels
from kernels.decode_stack import LinearWeights


class Linear(nn.Linear):
    _packed: torch.Tensor | None = None   # tile order, for decode-sized bf16 batches (fp16 tiles: every size)
    _wide: torch.Tensor | None = None     # fp32 copy for prefill-sized batches on AVX-512 BF16 (no AMX, no FP16)

    def pack(self) -> bool:
        """Make the packed copies this CPU uses (none elsewhere); True when the layer got packed tiles."""
        self._packed = kernels.pack_linear_weight(self.weight)
        self._wide = kernels.pack_wide_weight(self.weight)
        return self._packed is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.linear(x, self.weight, self.bias, self._packed, self._wide)

    def decode_weights(self) -> LinearWeights:
        return LinearWeights(weight=self.weight, bias=self.bias, packed=self._packed, wide=self._wide)
