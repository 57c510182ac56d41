"""Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2) over a paged KV cache.

One forward call serves a whole mixed batch: tokens of all sequences are flattened into one [num_tokens, hidden] tensor, so
every GEMM sees all of them at once; only attention needs to know where sequences start (`AttentionMetadata`). q/k/v and
gate/up projections are fused into one GEMM each. RMSNorm is computed in fp32 exactly as HF does, so fp32 runs match HF.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from engine.layers.layernorm import RMSNorm
from engine.layers.linear import Linear
from engine.layers.rotary_embedding import rope_cos_sin, rope_inv_freq
from kernels import decode_stack, settings
from kernels.decode_stack import DecodeLayerWeights


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor     # [num_tokens] int64
    cu_seqlens_q: torch.Tensor     # [B + 1] int32
    seq_lens: torch.Tensor         # [B] int32, including this step's tokens
    block_tables: torch.Tensor     # [B, max_pages] int32, each sequence's KV pages, -1 padded


class Attention(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        hidden = config["hidden_size"]
        self.num_heads = config["num_attention_heads"]
        self.num_kv_heads = config.get("num_key_value_heads", self.num_heads)
        self.head_dim = config.get("head_dim") or hidden // self.num_heads
        bias = bool(config.get("attention_bias", config.get("model_type") == "qwen2"))
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(hidden, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = Linear(self.q_size, hidden, bias=False)
        self.scale = self.head_dim ** -0.5

    def forward(self, x, cos, sin, meta: AttentionMetadata, k_cache, v_cache):
        T = x.shape[0]
        q = kernels.rope_and_store(self.qkv_proj(x), cos, sin, k_cache, v_cache, meta.slot_mapping, self.num_heads)
        o = kernels.paged_attention(q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
                                    self.scale)
        return self.o_proj(o.view(T, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        self.inter = config["intermediate_size"]
        self.gate_up_proj = Linear(config["hidden_size"], 2 * self.inter, bias=False)
        self.down_proj = Linear(self.inter, config["hidden_size"], bias=False)

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        if gate_up.dtype != torch.float32:   # 16-bit: one fused pass; fp32 keeps HF's exact op order
            return self.down_proj(kernels.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        eps = config.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(config["hidden_size"], eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config["hidden_size"], eps)
        self.mlp = MLP(config)

    def forward(self, x, residual, cos, sin, meta, k_cache, v_cache):
        """Returns (this layer's MLP output, the residual stream before it). Each residual add happens inside the
        next norm (vLLM's layout): one fused op instead of an add and a norm; the same numbers as HF's order."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(h, cos, sin, meta, k_cache, v_cache), residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config["vocab_size"], config["hidden_size"])
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config["num_hidden_layers"]))
        self.norm = RMSNorm(config["hidden_size"], config.get("rms_norm_eps", 1e-6))
        self.lm_head = Linear(config["hidden_size"], config["vocab_size"], bias=False)
        attn = self.layers[0].self_attn
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        self.register_buffer("inv_freq", rope_inv_freq(config, attn.head_dim), persistent=False)
        self._stack: tuple[list, int] | None | bool = None   # decode stack weights (built on first use), False = off

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        return rope_cos_sin(positions, self.inv_freq, dtype)

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        """Returns final hidden states [num_tokens, hidden]; kv_cache is [layers, 2, pages, page_size, kv_heads, d]."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rope(positions, x.dtype)
        if x.shape[0] == meta.seq_lens.numel():         # decode-only step: one token per sequence
            stack = self._decode_stack(x, kv_cache)
            if stack is not None:
                weights, int4_max_rows = stack
                attn = self.layers[0].self_attn
                return decode_stack.decode_layers(x, cos, sin, meta.slot_mapping, meta.block_tables, meta.seq_lens,
                                                  kv_cache, weights, attn.num_heads, self.norm.eps, attn.scale,
                                                  int4_max_rows)
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, cos, sin, meta, kv_cache[i, 0], kv_cache[i, 1])
        return self.norm(x, residual)

    def _decode_stack(self, x: torch.Tensor, kv_cache: torch.Tensor) -> tuple[list, int] | None:
        """(weight slots, int4 row limit) for the C++ decode stack, or None where it does not apply: fp32 (HF's exact
        op order stays in Python), not the CPU's torch backend, no C++ ops, `RTSERVE_DECODE_STACK=0` (A/B runs), or a
        layer it does not know. Built once; `pack_weights` rebuilds it."""
        if x.dtype == torch.float32 or x.device.type != "cpu" or kv_cache.dtype != x.dtype or self._stack is False:
            return None
        if self._stack is None:
            self._stack = self._build_decode_stack() or False
        return self._stack or None

    def _build_decode_stack(self) -> tuple[list, int] | None:
        if not settings.enabled("RTSERVE_DECODE_STACK") or kernels.resolve_backend("cpu") != "torch" \
                or not decode_stack.available():
            return None
        layers = []
        for layer in self.layers:
            if {layer.input_layernorm.eps, layer.post_attention_layernorm.eps} != {self.norm.eps}:
                return None
            attn, mlp = layer.self_attn, layer.mlp
            linears = [lin.decode_weights() for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            if None in linears:
                return None
            layers.append(DecodeLayerWeights(layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                                             *linears))
        return decode_stack.flatten(layers, self.norm.weight)

    def pack_weights(self) -> int:
        """Give every linear layer its packed copy (bf16 tiles on an AMX or AVX-512 BF16 CPU, fp16 ones on AVX-512
        FP16 without AMX; a no-op elsewhere), and its fp32 one on AVX-512 BF16 without either; returns how many got a
        packed copy."""
        self._stack = None
        return sum(module.pack() for module in self.modules() if isinstance(module, Linear))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Map HF parameter names onto ours, fusing q/k/v and gate/up; every parameter must be filled."""
        ours = {}
        for name, t in state.items():
            name = name.removeprefix("model.")
            ours[name] = t
        n = len(self.layers)
        for i in range(n):
            p = f"layers.{i}."
            a = p + "self_attn."
            ours[a + "qkv_proj.weight"] = torch.cat([ours.pop(a + f"{x}_proj.weight") for x in "qkv"])
            if self.layers[i].self_attn.qkv_proj.bias is not None:
                ours[a + "qkv_proj.bias"] = torch.cat([ours.pop(a + f"{x}_proj.bias") for x in "qkv"])
            m = p + "mlp."
            ours[m + "gate_up_proj.weight"] = torch.cat([ours.pop(m + "gate_proj.weight"), ours.pop(m + "up_proj.weight")])
        if "lm_head.weight" not in ours:
            ours["lm_head.weight"] = ours["embed_tokens.weight"]   # tied embeddings (one tensor, shared)
        for key in [k for k in ours if k.endswith("rotary_emb.inv_freq")]:
            ours.pop(key)
        missing, unexpected = self.load_state_dict(ours, strict=False, assign=True)
        if missing or unexpected:
            raise ValueError(f"weight mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
