"""RMSNorm, optionally with the previous sublayer's residual add fused in (vLLM's layout)."""
from __future__ import annotations

import torch
from torch import nn

import kernels


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm(x), or with `residual`: residual += x (in place), then RMSNorm(residual)."""
        if x.dtype != torch.float32:   # 16-bit: one fused kernel (fp32 math inside); fp32 keeps HF's exact op order
            if residual is not None:
                return kernels.add_rms_norm(x, residual, self.weight, self.eps)
            return kernels.rms_norm(x, self.weight, self.eps)
        if residual is not None:
            x = residual.add_(x)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
