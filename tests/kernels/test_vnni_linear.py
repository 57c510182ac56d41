"""The integer-dot kernel (kernels/csrc/packed_linear/avx512_vnni.cpp) on the GGUF file's own weights, and the engine on
the path this CPU runs, end to end.

The kernel quantizes each row of x per block of 32 to int8, x^ = dx * round(x * 127 / amax) with dx = amax / 127, and
multiplies by the file's weights exactly (integer sums, one fp32 scaling per block). So the bounds tested are:
- against W x^ + b (the file's weights in float64; x^ with the kernel's roundings, reproduced here): one bf16 rounding
  of the output (2^-8 relative) plus fp32 accumulation, 1e-5 of the row's largest output;
- against W x + b: the quantization adds w . (x - x^), and |x - x^| <= dx / 2 per element, so per output at most
  sum over blocks of dx_b / 2 * ||w_b||_1 (computed here for every output), plus the same bf16 rounding. For rows
  without outliers that is ~0.4 % of ||w||_1 * max|x| / 127 per block, far under the 4-bit weights' own error.
The kernel test needs the instruction (skipped with the reason elsewhere); the engine test runs on every CPU and
compares its default path with the one `RTSERVE_VNNI=0` selects (the same one where the CPU has no VNNI).
"""
from __future__ import annotations

import functools

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize

import kernels
from engine import LLM, SamplingParams
from engine.layers.gguf_linear import READERS
from engine.models.loader import default_model_path
from kernels import Isa
from tests.engine.prompts import PROMPTS


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())


HAS_VNNI = {"avx512f", "avx512_bf16", "avx512_vnni"} <= _cpu_flags()
needs_vnni = pytest.mark.skipif(not HAS_VNNI, reason="this CPU has no AVX-512 VNNI: the integer-dot kernel cannot run")

# (tensor, rows of it): Q4_1 layers of both K sizes (576, 1536) and the Q8_0 embedding / lm_head (a slice: speed)
TENSORS = [("blk.0.attn_q.weight", None), ("blk.29.ffn_down.weight", None), ("blk.14.ffn_gate.weight", None),
           ("token_embd.weight", 4096)]
ROWS = [1, 3, 8, 13, 64, 100]   # one pass, tails of the 8-row passes, a full 64-row chunk and a second chunk


@functools.cache
def _file_tensor(name: str, rows: int | None) -> tuple[str, np.ndarray, torch.Tensor]:
    """(GGUF type, raw block rows, the file's weights dequantized by the gguf library, as float64)."""
    t = next(t for t in gguf.GGUFReader(str(default_model_path())).tensors if t.name == name)
    raw = np.ascontiguousarray(t.data[:rows])
    w = dequantize(raw, t.tensor_type).reshape(raw.shape[0], -1)
    return t.tensor_type.name, raw, torch.from_numpy(w.astype(np.float64))


def _pack_vnni(kind: str, raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    b = READERS[kind](raw)
    q, d = torch.from_numpy(b.q), torch.from_numpy(b.d)
    if b.m is None:
        return kernels.pack_gguf_vnni_q8_0(q, d)
    return kernels.pack_gguf_vnni_q4_1(q, d, torch.from_numpy(b.m))


def _quantized(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x^, dx per block [rows, K / 32]) with the kernel's fp32 roundings: dx = amax * fp32(1 / 127), and
    round-half-even(x * fp32(127 / amax)) (a true division: torch's `127 / t` is 127 * (1 / t), two roundings)."""
    xf = x.float().view(x.shape[0], -1, 32)
    amax = xf.abs().amax(-1, keepdim=True)
    dx = amax * torch.tensor(1 / 127, dtype=torch.float32)
    inv = torch.where(amax > 0, torch.full_like(amax, 127) / amax, torch.zeros_like(amax))
    return (torch.round(xf * inv) * dx).view(x.shape).double(), dx[..., 0].double()


def _activations(rows: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Normal rows with a few outliers (as hidden states have), and a zero row (dx = 0) where there is room."""
    x = torch.randn(rows, k, generator=gen)
    x[:, torch.randint(0, k, (4,), generator=gen)] *= 20
    if rows > 2:
        x[1] = 0
    return x.bfloat16()


@needs_vnni
@pytest.mark.parametrize("name,rows_of_tensor", TENSORS, ids=[n for n, _ in TENSORS])
def test_vnni_kernel_on_the_files_weights(name, rows_of_tensor):
    kind, raw, w = _file_tensor(name, rows_of_tensor)
    qs, dm = _pack_vnni(kind, raw)
    assert qs.shape[-1] == 64 and qs.shape[-2] == (4 if kind == "Q4_1" else 8)
    n, k = w.shape
    gen = torch.Generator().manual_seed(n + k)
    w_block_l1 = w.abs().view(n, k // 32, 32).sum(-1)                           # ||w_b||_1 [N, K / 32]
    for rows in ROWS:
        x = _activations(rows, k, gen)
        bias = torch.randn(n, generator=gen).bfloat16() if rows == 13 else None
        b = 0 if bias is None else bias.double()
        y = kernels.linear_gguf(x, qs, dm, bias).double()
        assert y.shape == (rows, n)
        xq, dx = _quantized(x)
        on_xq = xq @ w.T + b
        scale = on_xq.abs().amax(1, keepdim=True).clamp_min(1e-30)
        assert ((y - on_xq).abs() - on_xq.abs() * 2 ** -8 <= 1e-5 * scale).all(), (name, rows)
        exact = x.double() @ w.T + b
        bound = (dx / 2) @ w_block_l1.T                                           # sum_b dx_b / 2 * ||w_b||_1
        err = (y - exact).abs() - exact.abs() * 2 ** -8 - 1e-5 * scale
        assert (err <= bound).all(), (name, rows, (err - bound).max().item())
        if rows > 2:
            assert torch.equal(y[1], torch.zeros(n, dtype=torch.float64) + b)    # a zero row: just the bias


@needs_vnni
def test_vnni_order_and_switch(monkeypatch):
    """On a VNNI CPU without AMX / FP16, GGUF blocks are packed in the integer-dot order; on an AMX CPU they get that
    packing too, for small batches, beside the tile order. `RTSERVE_VNNI=0` (read when asked) packs them in tile order
    only (for the fp32 FMAs, or AMX). Tile-order blocks still run (as fp32 FMAs) either way."""
    monkeypatch.delenv("RTSERVE_VNNI", raising=False)   # the default, whatever the run's environment says
    kind, raw, w = _file_tensor("blk.0.attn_q.weight", None)
    b = READERS[kind](raw)
    args = torch.from_numpy(b.q), torch.from_numpy(b.d), torch.from_numpy(b.m)
    isa = kernels.cpu_isa()
    assert (kernels.pack_gguf(*args)[0].shape[-1] == 64) == (isa is Isa.AVX512_VNNI)
    small = kernels.pack_gguf_small_batches(*args)     # AMX: a second packing, in that order, for small batches
    assert (small is not None) == (isa is Isa.AMX) == kernels.int8_small_batches()
    assert small is None or small[0].shape[-1] == 64
    monkeypatch.setenv("RTSERVE_VNNI", "0")
    assert kernels.packed_isa() is (Isa.AVX512_FP32 if isa is Isa.AVX512_VNNI else isa)
    assert kernels.pack_gguf(*args)[0].shape[-1] == 16
    assert kernels.pack_gguf_small_batches(*args) is None and not kernels.int8_small_batches()
    x = torch.randn(5, w.shape[1]).bfloat16()
    tile = kernels.linear_gguf(x, *kernels.pack_gguf_q4_1(*args)).double()          # bf16(w), fp32 FMAs
    vnni = kernels.linear_gguf(x, *kernels.pack_gguf_vnni_q4_1(*args)).double()     # w on x^
    ref = x.double() @ w.T
    assert not torch.equal(tile, vnni)
    for y in (tile, vnni):
        assert ((y - ref).abs().max() < 0.02 * ref.abs().max())


def test_bad_vnni_blocks_are_refused():
    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(RuntimeError, match="packed_linear_gguf expects"):    # dm of the wrong size for these blocks
        torch.ops.rtserve_cpu.packed_linear_gguf(x, torch.zeros(2, 2, 2, 4, 64, dtype=torch.uint8),
                                                 torch.zeros(2 * 2 * 2 * 16, dtype=torch.float16), None)


GREEDY_TOKENS = 24
LOGPROB_TOL = 0.25    # per token, on the same context: the activation rounding moves logits by hundredths
NEAR_TIE = 1.0        # where the texts part, the default path's pick is this close to the fp32 path's best


def test_greedy_text_on_int8_activations_matches_the_fp32_path(monkeypatch):
    """The engine's default path on this CPU (on a VNNI CPU: int8 activations in every GGUF layer, prefill included;
    on AMX: in decode steps of up to kernels.AMX_VNNI_MAX_ROWS rows) against the one `RTSERVE_VNNI=0` selects (bf16
    weights times bf16 activations in fp32; on AMX, the tiles), greedy on 4 prompts.
    Asserted: up to where the two texts part, every token's logprob agrees within LOGPROB_TOL (same context, so the
    same distribution up to the rounding); where they part, the fp32 path itself ranked the default path's pick within
    NEAR_TIE of its best (a near-tie went the other way, not a wrong token); the text is words. Why not equal texts:
    the activation rounding (~0.4 % of a block's largest value) moves logits by a few hundredths, enough to decide a
    near-tie the other way, after which greedy texts continue differently (observed here at the 4th token of one
    prompt)."""
    prompts = PROMPTS[:4]
    params = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True, logprobs=5)

    def run() -> list:
        llm = LLM(kv_cache_memory="64MiB", dtype="bfloat16", quantization="gguf")
        outs = llm.generate(prompts, params)
        assert llm.engine.block_manager.num_free == llm.engine.block_manager.num_pages
        return outs

    monkeypatch.delenv("RTSERVE_VNNI", raising=False)   # the default path
    default = run()
    monkeypatch.setenv("RTSERVE_VNNI", "0")
    fp32 = run()
    for prompt, a, b in zip(prompts, default, fp32):
        part = next((i for i, (s, t) in enumerate(zip(a.token_ids, b.token_ids)) if s != t), len(a.token_ids))
        for step in range(part):
            assert abs(a.logprobs[step][0] - b.logprobs[step][0]) < LOGPROB_TOL, (prompt, step)
        if part < len(a.token_ids):
            top = dict(b.logprobs[part][1])
            picked = a.token_ids[part]
            assert picked in top and top[b.token_ids[part]] - top[picked] < NEAR_TIE, (prompt, part)
        assert len(a.text.split()) >= 5, a.text                                  # words, not a repeated symbol
