"""Pure-torch KV-store and paged attention: the CPU path and the reference the Triton kernels are tested against.

Layout (shared with the Triton kernels):
  q                 [num_tokens, num_heads, head_dim]     queries of every scheduled token, sequences back to back
  key / value       [num_tokens, num_kv_heads, head_dim]
  k_cache / v_cache [num_blocks, block_size, num_kv_heads, head_dim]
  slot_mapping      [num_tokens] int64, slot = block * block_size + offset; -1 means "do not store"
  cu_seqlens_q      [B + 1] int32, query token offsets of each sequence in q
  seq_lens          [B] int32, context length of each sequence *including* this step's query tokens
  block_tables      [B, max_blocks] int32, padded with -1
Query token j of sequence b sits at position seq_lens[b] - q_len[b] + j and attends causally to positions <= its own.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Scatter this step's keys/values into their cache slots (slot -1 is skipped)."""
    num_blocks, block_size = k_cache.shape[:2]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    k_cache.view(num_blocks * block_size, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(num_blocks * block_size, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Contiguous [length, kv_heads, head_dim] view of one sequence's cached context."""
    block_size = cache.shape[1]
    nb = (length + block_size - 1) // block_size
    return cache[block_table[:nb].long()].flatten(0, 1)[:length]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of a mixed batch (prefill chunks + decodes) over the paged KV cache.

    Decodes (one query token) are batched into one padded matmul; prefill chunks run one SDPA call each, since a
    padded batch of a 256-token chunk next to 1-token decodes would waste most of its work.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    q_lens = [cu[i + 1] - cu[i] for i in range(len(lens))]

    decode = [i for i, n in enumerate(q_lens) if n == 1]
    if decode:
        _decode_batch(q, k_cache, v_cache, cu, lens, block_tables, decode, scale, group, out)
    for i, n in enumerate(q_lens):
        if n <= 1:
            continue
        start, ctx = cu[i], lens[i]
        k = _gather(k_cache, block_tables[i], ctx).to(q.dtype).transpose(0, 1)   # [kvh, ctx, d]
        v = _gather(v_cache, block_tables[i], ctx).to(q.dtype).transpose(0, 1)
        qi = q[start:start + n].transpose(0, 1)                                     # [h, n, d]
        # query j sits at position ctx - n + j; it sees keys at positions <= that.
        qpos = torch.arange(ctx - n, ctx, device=q.device).unsqueeze(1)
        mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= qpos                               # [n, ctx]
        o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale, enable_gqa=group > 1)
        out[start:start + n] = o.transpose(0, 1)
    return out


def _decode_batch(q, k_cache, v_cache, cu, lens, block_tables, decode, scale, group, out):
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    nd = len(decode)
    max_len = max(lens[i] for i in decode)
    nb = (max_len + block_size - 1) // block_size
    rows = torch.tensor(decode, dtype=torch.long)
    tok = torch.tensor([cu[i] for i in decode], dtype=torch.long)
    bt = block_tables[rows, :nb].long().clamp_min(0)                                # padded entries -> block 0, masked
    k = k_cache[bt].view(nd, nb * block_size, num_kv_heads, head_dim).to(q.dtype)   # [nd, L, kvh, d]
    v = v_cache[bt].view(nd, nb * block_size, num_kv_heads, head_dim).to(q.dtype)
    qd = q[tok].view(nd, num_kv_heads, group, head_dim)                             # [nd, kvh, g, d]
    scores = torch.einsum("bhgd,blhd->bhgl", qd, k).float() * scale
    ctx = torch.tensor([lens[i] for i in decode], device=q.device)
    invalid = torch.arange(nb * block_size, device=q.device).unsqueeze(0) >= ctx.unsqueeze(1)       # [nd, L]
    scores.masked_fill_(invalid[:, None, None, :], float("-inf"))
    probs = scores.softmax(-1).to(q.dtype)
    o = torch.einsum("bhgl,blhd->bhgd", probs, v)
    out[tok] = o.reshape(nd, num_kv_heads * group, head_dim)
