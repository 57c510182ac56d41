"""Paged attention on the CPU against a plain float64 reference: the C++ paged-decode op (kernels/csrc/paged_decode.cpp,
built on first use) and the pure-torch path it replaces for decodes where it is absent, on mixed batches of decodes and
prefill chunks with shuffled pages, GQA groups 1-4, head_dim 64 (the op's register-tiled path) and 32 (its generic
loop)."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_ext, torch_ops
from tests.kernels.batches import paged_batch

TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
SPECS = [(1, 17), (1, 1), (5, 5), (1, 300), (1, 16), (12, 40), (1, 33)]


def reference(q, k_cache, v_cache, cu, seq_lens, block_tables, scale):
    """Dense causal attention per sequence, in float64."""
    page_size, kvh = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kvh
    out = torch.empty(q.shape, dtype=torch.float64)
    for b in range(len(seq_lens)):
        ctx, start, n = int(seq_lens[b]), int(cu[b]), int(cu[b + 1] - cu[b])
        pages = block_tables[b, :-(-ctx // page_size)].long()
        k = k_cache[pages].flatten(0, 1)[:ctx].double().repeat_interleave(group, 1)   # [ctx, heads, d]
        v = v_cache[pages].flatten(0, 1)[:ctx].double().repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q[start:start + n].double(), k) * scale
        qpos = torch.arange(ctx - n, ctx).unsqueeze(1)
        s = s.masked_fill(torch.arange(ctx).unsqueeze(0) > qpos, float("-inf"))
        out[start:start + n] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
    return out


def test_the_cpp_op_builds_here():
    assert cpu_ext.paged_decode() is not None, "g++ and ninja are installed by `make test`; the op must build"


@pytest.mark.parametrize("ext", [True, False], ids=["cpp-op", "pure-torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("group,head_dim", [(3, 64), (1, 64), (4, 64), (2, 32)])
@pytest.mark.parametrize("page_size", [16, 8, 4, 32])
def test_mixed_batch_matches_reference(ext, dtype, group, head_dim, page_size, monkeypatch):
    if not ext:                                   # what torch_ops sees where the op is absent
        monkeypatch.setattr(cpu_ext, "paged_decode", lambda: None)
    q, k_cache, v_cache, cu, seq_lens, tables = paged_batch(SPECS, page_size, 2, group, head_dim, dtype,
                                                       seed=group * head_dim)
    scale = head_dim ** -0.5
    out = torch_ops.paged_attention(q, k_cache, v_cache, cu, seq_lens, tables, scale)
    ref = reference(q, k_cache, v_cache, cu, seq_lens, tables, scale)
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_op_writes_only_the_decode_rows():
    """Prefill rows belong to SDPA; the op must leave them alone (and handle a strided q view)."""
    q, k_cache, v_cache, cu, seq_lens, tables = paged_batch(SPECS, 16, 3, 3, 64, torch.bfloat16)
    plan = torch_ops._plan(cu, seq_lens, tables, 16, grouped=False)
    out = torch.full_like(q, 7.0)
    cpu_ext.paged_decode()(q, k_cache, v_cache, tables, seq_lens, plan.decode_rows, plan.decode_seqs, 0.125, out)
    decode = torch.zeros(q.shape[0], dtype=torch.bool)
    decode[plan.decode_rows] = True
    assert bool((out[~decode] == 7.0).all()) and not bool((out[decode] == 7.0).any())
    assert sorted(plan.decode_rows.tolist()) == [int(cu[i]) for i, (n, _) in enumerate(SPECS) if n == 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("page_size", [16, 8, 4])
def test_whole_sequence_tasks_equal_per_head_tasks(dtype, page_size):
    """With many decodes a task takes all kv heads of a sequence (and prefetches the other heads' lines); with few,
    one head. Both compute each head the same way, so the outputs are equal bit for bit, and match the reference."""
    specs = [(1, c) for c in (17, 1, 300, 16, 33, 64, 5, 250, 129, 48, 90, 31)] + [(12, 40)]
    q, k_cache, v_cache, cu, seq_lens, tables = paged_batch(specs, page_size, 3, 3, 64, dtype, seed=5)
    plan = torch_ops._plan(cu, seq_lens, tables, page_size, grouped=False)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 64):   # 12 decodes: >= 4 per thread at 1 thread (whole sequences), < 4 at 64 threads (per head)
            torch.set_num_threads(n)
            out = torch.zeros_like(q)
            cpu_ext.paged_decode()(q, k_cache, v_cache, tables, seq_lens, plan.decode_rows, plan.decode_seqs, 0.125,
                                   out)
            outs.append(out)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])
    ref = reference(q, k_cache, v_cache, cu, seq_lens, tables, 0.125)
    rows = plan.decode_rows
    torch.testing.assert_close(outs[0][rows].double(), ref[rows], atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prefill_chunks_run_sdpa_flash_kernel(dtype):
    """Prefill chunks (GQA, with and without a cached prefix) must stay on CPU SDPA's flash kernel: its math fallback
    is much slower."""
    from torch.profiler import profile
    q, k_cache, v_cache, cu, seq_lens, tables = paged_batch([(40, 40), (12, 60)], 16, 3, 3, 64, dtype, seed=1)
    with profile() as prof:
        torch_ops.paged_attention(q, k_cache, v_cache, cu, seq_lens, tables, 0.125)
    names = {e.key for e in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in names
    assert not any("math" in n for n in names), sorted(names)
