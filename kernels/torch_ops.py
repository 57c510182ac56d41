"""Pure-torch KV-store and paged attention: the CPU path and the reference the Triton kernels are tested against.

Layout (shared with the Triton kernels):
  q                 [num_tokens, num_heads, head_dim]     queries of every scheduled token, sequences back to back
  key / value       [num_tokens, num_kv_heads, head_dim]
  k_cache / v_cache [num_pages, page_size, num_kv_heads, head_dim]    the cache in pages of page_size token slots
  slot_mapping      [num_tokens] int64, slot = page * page_size + offset; -1 means "do not store"
  cu_seqlens_q      [B + 1] int32, query token offsets of each sequence in q
  seq_lens          [B] int32, context length of each sequence *including* this step's query tokens
  block_tables      [B, max_pages] int32, padded with -1: each sequence's pages in order (vLLM's name; its entries
                    are pages, not the engine's 16-token prefix-cache blocks)
Query token j of sequence b sits at position seq_lens[b] - q_len[b] + j and attends causally to positions <= its own.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import cpu_ext
from kernels.cpu import cpu_isa, without_amx


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Scatter this step's keys/values into their cache slots (slot -1 is skipped)."""
    num_pages, page_size = k_cache.shape[:2]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    k_cache.view(num_pages * page_size, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(num_pages * page_size, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


@dataclass(slots=True)
class _DecodeGroup:
    tokens: torch.Tensor        # [nd] rows of q that are single-token decodes
    pages: torch.Tensor         # [nd * n_pages] page ids; padded entries point at page 0 and are masked
    mask: torch.Tensor          # [nd, 1, 1, n_pages * page_size] True = attend


@dataclass(slots=True)
class _Plan:
    """Index tensors for one step, shared by every layer (the metadata tensors are the same objects in all layers)."""
    decode_rows: torch.Tensor   # [nd] int64 rows of q that are single-token decodes (for the C++ op)
    decode_seqs: torch.Tensor   # [nd] int64 their sequence indices
    decodes: list               # _DecodeGroup per bucket of similar context lengths (pure-torch path only)
    prefills: list              # (start, n, ctx, page ids, mask [n, ctx] or None = causal) per prefill chunk


_last_plan: list = [None, None]             # [key tensors, plan]
GROUP_COST_TOKENS = 2048                    # one more SDPA call costs about as much as this many padded keys


def _split_by_length(lens: list[int]) -> list[int]:
    """Cut points over ascending context lengths minimising padded work (n_g * max_len_g) plus a per-call cost, so a
    few long contexts do not pad every short one. O(n^2) DP over at most max_num_seqs entries, once per step."""
    best = [(0, [])]
    for j in range(1, len(lens) + 1):
        best.append(min((best[i][0] + (j - i) * lens[j - 1] + GROUP_COST_TOKENS, best[i][1] + [j]) for i in range(j)))
    return best[-1][1]


def _plan(cu_seqlens_q, seq_lens, block_tables, page_size: int, grouped: bool) -> _Plan:
    key = (cu_seqlens_q, seq_lens, block_tables, page_size, grouped)
    cached_key, plan = _last_plan
    if cached_key is not None and all(a is b for a, b in zip(cached_key, key)):
        return plan
    dev = cu_seqlens_q.device
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    q_lens = [cu[i + 1] - cu[i] for i in range(len(lens))]
    decode = sorted((i for i, n in enumerate(q_lens) if n == 1), key=lambda i: lens[i])
    groups = []
    start = 0
    for end in (_split_by_length([lens[i] for i in decode]) if decode and grouped else []):
        idx = decode[start:end]
        start = end
        n_pages = -(-lens[idx[-1]] // page_size)
        rows = torch.tensor(idx, dtype=torch.long, device=dev)
        ctx = torch.tensor([lens[i] for i in idx], device=dev)
        groups.append(_DecodeGroup(
            tokens=torch.tensor([cu[i] for i in idx], dtype=torch.long, device=dev),
            pages=block_tables[rows, :n_pages].long().clamp_min(0).flatten(),
            mask=(torch.arange(n_pages * page_size, device=dev).unsqueeze(0) < ctx.unsqueeze(1))[:, None, None, :]))
    prefills = []
    for i, n in enumerate(q_lens):
        if n > 1:
            ctx = lens[i]
            pages = block_tables[i, :-(-ctx // page_size)].long()
            if ctx == n:          # no cached context: plain causal
                pmask = None
            else:                 # query j sits at position ctx - n + j and sees keys at positions <= that
                qpos = torch.arange(ctx - n, ctx, device=dev).unsqueeze(1)
                pmask = torch.arange(ctx, device=dev).unsqueeze(0) <= qpos
            prefills.append((cu[i], n, ctx, pages, pmask))
    plan = _Plan(torch.tensor([cu[i] for i in decode], dtype=torch.long, device=dev),
                 torch.tensor(decode, dtype=torch.long, device=dev), groups, prefills)
    _last_plan[:] = [key, plan]
    return plan


def _prefill_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype prefill chunks run SDPA in: bf16 queries in fp32 on a CPU without AMX. Why: there torch's bf16 flash
    kernel converts every tile to fp32 and runs slower than its fp32 one (docs/benchmarks.md); the result is rounded
    back to bf16 once."""
    if q.dtype == torch.bfloat16 and q.device.type == "cpu" and _cpu_without_amx():
        return torch.float32
    return q.dtype


@functools.cache
def _cpu_without_amx() -> bool:
    """An AVX-512 CPU on which the C++ ops found no usable AMX."""
    return without_amx(cpu_isa())


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of a mixed batch (prefill chunks + decodes) over the paged KV cache.

    Decodes (one query token) go to the C++ op in `kernels/csrc/` when it is built (one call, reading the cache in
    place); otherwise they are batched into padded SDPA calls, bucketed by context length. Prefill chunks run one SDPA
    call each, since a padded batch of a 256-token chunk next to 1-token decodes would waste most of its work. Pages
    are gathered with `index_select` (faster than advanced indexing on CPU), and the index plan is built once per
    step.
    """
    num_tokens, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    op = cpu_ext.paged_decode() if q.device.type == "cpu" else None
    plan = _plan(cu_seqlens_q, seq_lens, block_tables, page_size, grouped=op is None)
    if op is not None and plan.decode_rows.numel():   # all decodes in one C++ call, straight from the block tables
        op(q, k_cache, v_cache, block_tables, seq_lens, plan.decode_rows, plan.decode_seqs, scale, out)
    for g in plan.decodes:
        nd = g.tokens.numel()
        k = k_cache.index_select(0, g.pages).view(nd, -1, num_kv_heads, head_dim).transpose(1, 2)
        v = v_cache.index_select(0, g.pages).view(nd, -1, num_kv_heads, head_dim).transpose(1, 2)
        qd = q.index_select(0, g.tokens).view(nd, num_kv_heads, group, head_dim)   # GQA groups as query rows
        o = F.scaled_dot_product_attention(qd, k.to(q.dtype), v.to(q.dtype), attn_mask=g.mask, scale=scale)
        out[g.tokens] = o.reshape(nd, num_heads, head_dim)
    dtype = _prefill_dtype(q)
    for start, n, ctx, pages, mask in plan.prefills:
        k = _heads(k_cache.index_select(0, pages).flatten(0, 1)[:ctx].to(dtype))   # [1, kvh, ctx, d]
        v = _heads(v_cache.index_select(0, pages).flatten(0, 1)[:ctx].to(dtype))
        qi = q[start:start + n].transpose(0, 1).unsqueeze(0).to(dtype)              # [1, h, n, d]
        o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                           enable_gqa=group > 1)
        out[start:start + n] = o[0].transpose(0, 1)
    return out


def _heads(kv: torch.Tensor) -> torch.Tensor:
    """[ctx, kvh, d] -> [1, kvh, ctx, d] (a view). CPU SDPA runs its flash kernel on 4-D inputs; torch 2.13's also
    takes GQA itself (`enable_gqa`), bit for bit what repeating each KV head for its query heads gave, without the
    copy. (3-D inputs, or older torch with `enable_gqa`, fall back to the much slower math path.)"""
    return kv.permute(1, 0, 2).unsqueeze(0)
