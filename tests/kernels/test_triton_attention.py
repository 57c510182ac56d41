"""Triton KV-store and unified paged-attention kernels against the torch reference (kernels/torch_ops.py).

On CPU the kernels run under the Triton interpreter (set here, before anything decorates them; kernels.triton
imports triton lazily). `RTSERVE_TEST_DEVICE=cuda` runs the same tests compiled on a GPU (bench/gpu_check.sh).
Tolerances are against an fp32 reference computed from the same (already rounded) inputs:
fp32 atol=rtol=1e-5; fp16 atol=rtol=2e-3; bf16 atol=rtol=1e-2 (output rounding + P cast to 16 bit on GPU).
"""
from __future__ import annotations

import os

from kernels import settings  # triton is imported later, on first use: TRITON_INTERPRET is set before that

DEVICE = settings.raw("RTSERVE_TEST_DEVICE")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

import kernels  # noqa: E402
from kernels import torch_ops  # noqa: E402
from kernels import triton as triton_ops  # noqa: E402
from tests.kernels.batches import paged_batch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

# (query tokens, context length including them) per sequence
SCENARIOS = {
    "decode": [(1, 17), (1, 1), (1, 40), (1, 32)],
    "prefill": [(7, 7), (20, 20), (16, 16)],
    "mixed": [(1, 33), (9, 9), (1, 5), (13, 45)],
    "prefix_hit": [(3, 50), (18, 35)],  # context already cached before the query chunk
}


def test_runs_where_expected():
    assert triton_ops.interpreted() == (DEVICE == "cpu")


def _reference(q, k_cache, v_cache, cu, seq_lens, block_tables, scale):
    f = lambda t: t.cpu().float()  # noqa: E731
    return torch_ops.paged_attention(f(q), f(k_cache), f(v_cache), cu.cpu(), seq_lens.cpu(), block_tables.cpu(), scale)


def _on(*ts):
    return [t.to(DEVICE) for t in ts]


def _check(out, ref, dtype):
    assert out.dtype == dtype
    tol = TOL[dtype]
    torch.testing.assert_close(out.cpu().float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("scenario", SCENARIOS.keys())
def test_paged_attention_matches_reference(scenario, page_size, group, dtype):
    head_dim = 32 if group == 1 else 16
    batch = paged_batch(SCENARIOS[scenario], page_size, 2, group, head_dim, dtype)
    scale = head_dim ** -0.5
    ref = _reference(*batch, scale)
    out = triton_ops.paged_attention(*_on(*batch), scale)
    _check(out, ref, dtype)


@pytest.mark.parametrize("block_m,tile", [(16, 16), (16, 64), (32, 32), (64, 16)])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("page_size", [4, 8, 32])
def test_paged_attention_tilings(block_m, tile, group, page_size):
    """Several query blocks per sequence (binary search over cu_seqlens_q) and key tiles smaller / larger than a
    page (tiles and pages are independent): every tiling gives the same answer."""
    specs = SCENARIOS["mixed"] + SCENARIOS["prefix_hit"]
    batch = paged_batch(specs, page_size, 2, group, 16, torch.float32, seed=1)
    ref = _reference(*batch, 0.25)
    out = triton_ops.paged_attention(*_on(*batch), 0.25, block_m=block_m, tile=tile)
    _check(out, ref, torch.float32)


@pytest.mark.parametrize("num_splits,dtype", [(2, torch.float32), (8, torch.bfloat16)], ids=["2-fp32", "8-bf16"])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("scenario", ["decode", "mixed", "prefix_hit"])
def test_paged_attention_split_kv(scenario, group, num_splits, dtype):
    """Split-KV (each program covers part of the key tiles, a second kernel merges the partial softmaxes), including
    splits left empty by short contexts (seq_len 1 with 8 splits)."""
    batch = paged_batch(SCENARIOS[scenario], 16, 2, group, 16, dtype, seed=5)
    ref = _reference(*batch, 0.25)
    out = triton_ops.paged_attention(*_on(*batch), 0.25, tile=16, num_splits=num_splits)
    _check(out, ref, dtype)


def test_paged_attention_strided_views_and_out():
    """q sliced out of a fused qkv projection (non-contiguous) and `out` a view: strides are honoured and only the
    query rows are written."""
    specs = SCENARIOS["mixed"]
    q, k_cache, v_cache, cu, seq_lens, block_tables = paged_batch(specs, 16, 2, 3, 16, torch.float32, seed=2)
    qkv = torch.randn(q.shape[0], 10, 16)
    qkv[:, :6] = q
    out_buf = torch.full((q.shape[0], 6, 20), 7.0)
    q_view, out_view = qkv[:, :6], out_buf[:, :, 2:18]
    ref = _reference(q, k_cache, v_cache, cu, seq_lens, block_tables, 0.25)
    qkv, out_buf, k_cache, v_cache, cu, seq_lens, block_tables = _on(qkv, out_buf, k_cache, v_cache, cu, seq_lens,
                                                                     block_tables)
    q_view, out_view = qkv[:, :6], out_buf[:, :, 2:18]
    res = triton_ops.paged_attention(q_view, k_cache, v_cache, cu, seq_lens, block_tables, 0.25, out=out_view)
    assert res.data_ptr() == out_view.data_ptr()
    _check(out_view, ref, torch.float32)
    assert bool((out_buf[:, :, :2] == 7.0).all()) and bool((out_buf[:, :, 18:] == 7.0).all())


@pytest.mark.parametrize("cache_dtype", DTYPES.values(), ids=DTYPES.keys())
def test_store_kvcache_matches_reference(cache_dtype):
    """Strided fp32 keys/values scattered into a cache of another dtype; slot -1 leaves the cache untouched."""
    g = torch.Generator().manual_seed(3)
    num_pages, page_size, kvh, d = 5, 16, 3, 24  # head_dim and head count not powers of two: masked lanes
    k_cache = torch.randn(num_pages, page_size, kvh, d, generator=g).to(cache_dtype)
    v_cache = torch.randn(num_pages, page_size, kvh, d, generator=g).to(cache_dtype)
    kv = torch.randn(11, 2 * kvh, d, generator=g)
    key, value = kv[:, :kvh], kv[:, kvh:]
    slots = torch.randperm(num_pages * page_size, generator=g)[:11]
    slots[[2, 7]] = -1
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    torch_ops.store_kvcache(key, value, ref_k, ref_v, slots)
    kv, k_cache, v_cache, slots = _on(kv, k_cache, v_cache, slots)
    triton_ops.store_kvcache(kv[:, :kvh], kv[:, kvh:], k_cache, v_cache, slots)
    assert torch.equal(k_cache.cpu(), ref_k) and torch.equal(v_cache.cpu(), ref_v)


def test_backend_switch_dispatches_to_triton():
    """kernels.set_backend("triton") routes the public ops to these kernels."""
    specs = SCENARIOS["mixed"]
    batch = _on(*paged_batch(specs, 16, 2, 1, 16, torch.float32, seed=4))
    try:
        kernels.set_backend("triton")
        out = kernels.paged_attention(*batch, 0.25)
    finally:
        kernels.set_backend(None)
    torch.testing.assert_close(out, triton_ops.paged_attention(*batch, 0.25), atol=0, rtol=0)


def test_kernels_compile_for_hopper():
    """The non-interpreted path compiles to a CUDA sm_90 cubin (no GPU needed; ptxas ships with triton), with tensor
    cores for 16-bit inputs. A subprocess, because this module decorated the kernels for the interpreter."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-m", "kernels.triton.aot", "sm_90"], env=env, capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    assert len(lines) == 12, res.stdout
    assert "sm_90 paged_attention  bf16" in res.stdout and "tensor cores: True" in lines[0]
