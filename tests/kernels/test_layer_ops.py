"""The per-layer C++ ops (kernels/csrc/layer_ops.cpp) against torch: RMSNorm with HF's rounding points, the fused
residual add + RMSNorm, SiLU-and-multiply, rotary embedding fused with the KV store, and greedy argmax."""
from __future__ import annotations

import pytest
import torch

import kernels
from kernels import cpu_ext


@pytest.mark.parametrize("rows", [1, 7, 512])
def test_rms_norm_rounds_where_hf_rounds(rows):
    """bf16 RMSNorm rounds where HF's LlamaRMSNorm does (fp32 normalise, round, multiply by the bf16 weight, round):
    equal but for a rare last-bit difference from the order of the sum of squares."""
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=g) * 3).to(torch.bfloat16)
    w = torch.randn(576, generator=g).to(torch.bfloat16)
    xf = x.float()
    hf = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    out = cpu_ext.rms_norm()(x, w, 1e-5)
    assert (out == hf).float().mean() > 0.999
    assert bool(((out.float() - hf.float()).abs() <= hf.float().abs() * 2 ** -6 + 1e-30).all())   # two bf16 steps


@pytest.mark.parametrize("rows", [1, 33, 512])
def test_silu_and_mul_matches_torch(rows):
    """Same rounding points as torch's silu(gate) * up; only exp() may differ by an ulp before the bf16 rounding."""
    g = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 1536, generator=g) * 4).to(torch.bfloat16)
    gate, up = gate_up.chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    out = cpu_ext.silu_and_mul()(gate_up)
    assert (out == ref).float().mean() > 0.99
    ulp = ref.float().abs() * 2 ** -7 + 1e-30            # one bf16 step (8 significant bits)
    assert bool(((out.float() - ref.float()).abs() <= 2 * ulp + 1e-6).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("rows", [1, 33, 512])
def test_add_rms_norm_is_the_add_then_the_norm(rows, dtype):
    """The fused residual add + RMSNorm: the residual becomes exactly torch's `residual + x`, and the output is the
    C++ RMSNorm of that sum, bit for bit."""
    g = torch.Generator().manual_seed(rows)
    x, res = ((torch.randn(2, rows, 576, generator=g) * 3).to(dtype))
    w = torch.randn(576, generator=g).to(dtype)
    total = res + x
    out = kernels.add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(res, total)                                  # in place, rounded as torch's add
    assert torch.equal(out, cpu_ext.rms_norm()(total, w, 1e-5))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (8, 2, 128)])
def test_rope_and_store_matches_the_torch_ops(heads, kv_heads, head_dim, dtype, monkeypatch):
    """The fused rotary embedding + KV store equals torch's ops (`apply_rope`, then `store_kvcache`) exactly: the
    same q, the same cache contents, slot -1 left untouched."""
    g = torch.Generator().manual_seed(heads * head_dim)
    T, pages, page_size = 37, 8, 16
    qkv = torch.randn(T, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    pos = torch.randint(0, 4000, (T,), generator=g).float()
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    emb = torch.cat([pos[:, None] * inv] * 2, dim=-1)
    cos, sin = emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]
    slots = torch.randperm(pages * page_size, generator=g)[:T]
    slots[[3, 20]] = -1
    caches = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(cpu_ext, "rope_store", lambda: None)
        k_cache = torch.full((pages, page_size, kv_heads, head_dim), 7.0, dtype=dtype)
        v_cache = torch.full((pages, page_size, kv_heads, head_dim), 7.0, dtype=dtype)
        q = kernels.rope_and_store(qkv, cos, sin, k_cache, v_cache, slots, heads)
        caches[fused] = (q, k_cache, v_cache)
    for a, b in zip(caches[True], caches[False]):
        assert torch.equal(a, b)
    untouched = torch.ones(pages * page_size, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert bool((caches[True][1].view(pages * page_size, -1)[untouched] == 7.0).all())


def test_argmax_follows_torch_rules():
    """Greedy sampling's argmax (C++): torch.argmax's answer on every row, ties (first index), NaN (first NaN wins),
    rows of -inf, +inf, and widths that are and are not multiples of the 16-lane vectors."""
    assert cpu_ext.argmax_rows() is not None
    g = torch.Generator().manual_seed(0)
    for shape in [(32, 49152), (1, 49152), (3, 17), (5, 1), (2, 100003), (7, 16)]:
        x = torch.randn(*shape, generator=g)
        assert torch.equal(kernels.argmax(x), x.argmax(-1)), shape
    x = torch.zeros(7, 1000)
    x[0, 999] = float("nan")                         # NaN in the scalar tail
    x[1, 5] = x[1, 7] = float("nan")                 # two NaNs in the vector body
    x[2, :] = float("-inf")
    x[3, 10] = x[3, 900] = 1.0                       # tie: the first
    x[4, :] = float("nan")
    x[5, 40], x[5, 3] = float("inf"), float("-inf")
    x[6] = torch.randn(1000, generator=g).round()    # many ties
    assert torch.equal(kernels.argmax(x), x.argmax(-1))
    assert kernels.argmax(x).tolist()[:6] == [999, 5, 0, 10, 0, 40]


def test_top_candidates_equal_torch_topk_and_logsumexp():
    """Random sampling's candidates (C++): torch.topk's values, largest first, with their indices, and torch.logsumexp, on
    rows of the vocabulary's width and on widths that are not multiples of the 16-lane vectors, k from 1 to the
    whole row, rows masked to -inf (a grammar's) and a row of -inf."""
    assert cpu_ext.top_candidates() is not None
    g = torch.Generator().manual_seed(0)
    for shape, k in [((8, 49152), 128), ((1, 49152), 128), ((3, 17), 5), ((2, 100003), 128), ((4, 300), 300),
                     ((5, 1), 1), ((2, 1000), 1)]:
        x = torch.randn(*shape, generator=g) * 4
        vals, idx, lse = kernels.top_candidates(x, k)
        assert torch.equal(vals, x.topk(k, dim=-1).values), (shape, k)
        # the indices hold those values, each once (equal values may come in either order: topk does not say)
        assert torch.equal(x.gather(1, idx), vals) and all(len(set(row)) == k for row in idx.tolist()), (shape, k)
        assert torch.allclose(lse, x.logsumexp(-1), rtol=1e-6, atol=1e-5), (shape, k)
    x = torch.randn(3, 4096, generator=g)
    x[0, 100:] = float("-inf")
    x[1, :] = float("-inf")
    x[2, ::2] = float("-inf")
    vals, idx, lse = kernels.top_candidates(x, 128)
    assert torch.equal(vals[0, :100], x[0].topk(100).values) and set(idx[0, :100].tolist()) == set(range(100))
    assert torch.isneginf(vals[0, 100:]).all() and torch.isneginf(lse[1])
    assert torch.equal(vals[2], x[2].topk(128).values) and (idx[2] % 2 == 1).all()
    assert torch.allclose(lse[[0, 2]], x[[0, 2]].logsumexp(-1), rtol=1e-6)
