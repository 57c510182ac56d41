"""Triton kernels: KV-cache store and unified paged attention (prefill chunks + decodes in one launch).

Imported only through `kernels.triton`, which decides about the interpreter first: `@triton.jit` reads
TRITON_INTERPRET when this module is imported, not when triton is.

The cache is in pages of PAGE_SIZE token slots, found through the block table (kernels/torch_ops.py). BLOCK_Q /
BLOCK_M are Triton's tiles of query rows, not KV memory.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _cast(x, dst_ty: tl.constexpr, INTERP: tl.constexpr):
    """Cast to the output dtype. The interpreter truncates fp32 -> bf16 (GPUs round to nearest even), so there we
    add the rounding bias to the fp32 bits first and the truncation then rounds to nearest even, as torch does."""
    if INTERP:
        if dst_ty == tl.bfloat16:
            u = x.to(tl.float32).to(tl.uint32, bitcast=True)
            u = u + 0x7FFF + ((u >> 16) & 1)
            x = u.to(tl.float32, bitcast=True)
    return x.to(dst_ty)


@triton.jit
def _store_kvcache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcp, stride_kcs, stride_kch, stride_kcd,
    stride_vcp, stride_vcs, stride_vch, stride_vcd,
    PAGE_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_P: tl.constexpr, HEAD_DIM_P: tl.constexpr, INTERP: tl.constexpr,
):
    """One program per token: copy its [kv_heads, head_dim] key and value into cache slot `slot_mapping[t]`."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding token / already cached: nothing to store
        return
    page = slot // PAGE_SIZE
    off = slot % PAGE_SIZE
    offs_h = tl.arange(0, HEADS_P)
    offs_d = tl.arange(0, HEAD_DIM_P)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]

    k = tl.load(key_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd, mask=mask)
    heads_k = offs_h[:, None] * stride_kch + offs_d[None, :] * stride_kcd
    heads_v = offs_h[:, None] * stride_vch + offs_d[None, :] * stride_vcd
    kc = k_cache_ptr + page * stride_kcp + off * stride_kcs + heads_k
    vc = v_cache_ptr + page * stride_vcp + off * stride_vcs + heads_v
    tl.store(kc, _cast(k, k_cache_ptr.dtype.element_ty, INTERP), mask=mask)
    tl.store(vc, _cast(v, v_cache_ptr.dtype.element_ty, INTERP), mask=mask)


@triton.jit
def _find_seq_idx(cu_q_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """Sequence that owns global query block `q_block`.

    Sequence s owns the blocks from cu_q[s] // BLOCK_Q + s on (an upper bound on the blocks of the sequences before
    it), so the owner is the largest s whose start <= q_block: a binary search, no host-side map and no host sync.
    """
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(cu_q_ptr + mid) // BLOCK_Q + mid
        if start <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _unified_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, cu_q_ptr, seq_lens_ptr, block_tables_ptr,
    part_acc_ptr, part_ml_ptr, scale_log2e, num_seqs, num_heads,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_kp, stride_ks, stride_kh, stride_kd,
    stride_vp, stride_vs, stride_vh, stride_vd,
    stride_bts, stride_btb,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE: tl.constexpr,
    CAST_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERP: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    """Program (query block, kv head, kv split): BLOCK_Q query tokens of one sequence x the GROUP query heads that
    share the kv head, flattened into BLOCK_M = BLOCK_Q * GROUP rows (row m: token m // GROUP, head m % GROUP), so
    GQA reuses each K/V tile for the whole group. Online softmax over TILE-key tiles gathered through the block table.
    With NUM_SPLITS > 1 each program covers 1/NUM_SPLITS of the key tiles and writes an unnormalised partial result
    (acc, max, sum) that `_merge_splits_kernel` combines: more programs when few sequences decode long contexts."""
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = _find_seq_idx(cu_q_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    local_block = q_block - (q_start // BLOCK_Q + seq)
    if local_block * BLOCK_Q >= q_len:  # slack block of the upper-bound numbering
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len  # keys already in the cache before this step's queries

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_P)
    q_tok = local_block * BLOCK_Q + offs_m // GROUP  # query index within the sequence
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_tok < q_len)
    d_ok = offs_d < HEAD_DIM
    q_pos = ctx_len + q_tok  # absolute position: causal limit of the row

    tok = (q_start + q_tok).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if CAST_FP32:  # fp32 inputs, or the interpreter, whose tl.dot on bf16 is wrong
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)

    # Keys past the query block's last position are invisible to every row: stop the loop there.
    kv_end = ctx_len + tl.minimum((local_block + 1) * BLOCK_Q, q_len)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bts
    offs_t = tl.arange(0, TILE)
    num_tiles = tl.cdiv(kv_end, TILE)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)
    for t in range(tile_lo, tile_hi):
        pos = t * TILE + offs_t
        pos_ok = pos < kv_end
        phys = tl.load(bt_row + (pos // PAGE_SIZE) * stride_btb, mask=pos_ok, other=0).to(tl.int64)
        in_page = pos % PAGE_SIZE
        k_off = phys * stride_kp + in_page * stride_ks + kv_head * stride_kh
        v_off = phys * stride_vp + in_page * stride_vs + kv_head * stride_vh
        k = tl.load(k_cache_ptr + k_off[None, :] + offs_d[:, None] * stride_kd,
                    mask=d_ok[:, None] & pos_ok[None, :], other=0.0)  # [D, TILE]
        v = tl.load(v_cache_ptr + v_off[:, None] + offs_d[None, :] * stride_vd,
                    mask=pos_ok[:, None] & d_ok[None, :], other=0.0)  # [TILE, D]
        k = k.to(q.dtype)
        v = v.to(q.dtype)

        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2e
        visible = row_ok[:, None] & pos_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # fully masked rows: avoid inf - inf
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
                 _cast(out, out_ptr.dtype.element_ty, INTERP), mask=row_ok[:, None] & d_ok[None, :])
    else:  # partials, fp32, contiguous [num_tokens, num_heads, NUM_SPLITS, HEAD_DIM_P] and [..., NUM_SPLITS, 2]
        row = (tok * num_heads + head) * NUM_SPLITS + split
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM_P + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + row * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr, num_heads, stride_ot, stride_oh, stride_od,
    NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, INTERP: tl.constexpr,
):
    """Program (token, head): rescale each split's partial sum to the global max and normalise once."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM_P)
    row = (tok * num_heads + head) * NUM_SPLITS + offs_s
    m = tl.load(part_ml_ptr + row * 2)
    l = tl.load(part_ml_ptr + row * 2 + 1)
    acc = tl.load(part_acc_ptr + row[:, None] * HEAD_DIM_P + offs_d[None, :])
    m_max = tl.max(m, 0)
    w = tl.exp2(m - m_max)  # empty splits have m = -inf: weight 0 (split 0 always sees key 0, so m_max is finite)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + offs_d * stride_od,
             _cast(out, out_ptr.dtype.element_ty, INTERP), mask=offs_d < HEAD_DIM)
