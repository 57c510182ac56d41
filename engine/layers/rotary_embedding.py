"""Rotary position embedding: the inverse frequencies of a config (default, linear and Llama 3 scaling) and the
cos / sin of a step's positions. Applying them is fused with the KV store (kernels.rope_and_store)."""
from __future__ import annotations

import math

import torch


def rope_inv_freq(config: dict, head_dim: int) -> torch.Tensor:
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "linear":
        inv_freq = inv_freq / params["factor"]
    elif rope_type == "llama3":   # Llama 3.x frequency-dependent scaling
        factor, lo, hi = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old_ctx = params["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old_ctx / lo, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_ctx / lo) & (wavelen >= old_ctx / hi)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    elif rope_type != "default":
        raise NotImplementedError(f"rope type {rope_type!r}")
    return inv_freq


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, 1, head_dim] of each position's angles (HF's rotate_half layout), in `dtype`."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]
