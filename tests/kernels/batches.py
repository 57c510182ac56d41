"""Test batches for the attention kernels: a paged KV cache filled through the reference store, with each sequence's
pages shuffled in memory and its block table padded with -1 (the layout of kernels/torch_ops.py)."""
from __future__ import annotations

import torch

from kernels import torch_ops


def paged_batch(specs, page_size, num_kv_heads, group, head_dim, dtype, seed=0):
    """specs: (query tokens, context length including them) per sequence. Returns q, k_cache, v_cache, cu_seqlens_q,
    seq_lens, block_tables."""
    g = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-c // page_size) for _, c in specs) + 3
    k_cache = torch.zeros(num_pages, page_size, num_kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    free = torch.randperm(num_pages, generator=g).tolist()
    max_pages = max(-(-c // page_size) for _, c in specs) + 1
    block_tables = torch.full((len(specs), max_pages), -1, dtype=torch.int32)
    for i, (_, ctx) in enumerate(specs):
        for j in range(-(-ctx // page_size)):
            block_tables[i, j] = free.pop()
        k = torch.randn(ctx, num_kv_heads, head_dim, generator=g)
        v = torch.randn(ctx, num_kv_heads, head_dim, generator=g)
        slots = torch.tensor([int(block_tables[i, p // page_size]) * page_size + p % page_size for p in range(ctx)])
        torch_ops.store_kvcache(k, v, k_cache, v_cache, slots)
    q_lens = torch.tensor([n for n, _ in specs])
    cu = torch.zeros(len(specs) + 1, dtype=torch.int32)
    cu[1:] = q_lens.cumsum(0)
    seq_lens = torch.tensor([c for _, c in specs], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), num_kv_heads * group, head_dim, generator=g).to(dtype)
    return q, k_cache, v_cache, cu, seq_lens, block_tables
