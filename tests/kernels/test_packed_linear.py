"""The packed linear kernels (kernels/csrc/packed_linear/) against plain references.

- `kernels.linear` with a packed weight: x @ W.T in fp32 accumulation, rounded once to bf16, for every row count the
  engine sends it (1-64, tails of 16 included) and with bias.
- `kernels.linear_gguf` on Q4_1 / Q8_0 blocks packed by `kernels.pack_gguf_*`: the weight it multiplies by is bit for bit
  the dense bf16 weight gguf's own dequantization gives (bf16(d * q + m)), so its outputs equal the bf16 kernel's; on
  an AVX-512 FP16 CPU it is fp16(d * q + m), and the outputs equal the fp16 kernel's on those weights.
On an AMX CPU the kernels run on AMX tiles; on an AVX-512 FP16 CPU without AMX (a VM may hide it) as fp16 FMAs on
fp16 tiles; on an AVX-512 BF16 CPU with neither as fp32 FMAs on bf16 tiles; elsewhere `kernels.linear` must fall back
to torch. The tests run whichever this CPU has; every instruction set's file is compiled for its own CPU here
(`test_every_instruction_set_compiles`), whatever this CPU runs."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import Isa

ROWS = [1, 2, 5, 16, 17, 32, 33, 64]
SHAPES = [(64, 32), (960, 576), (576, 1536)]    # (N, K): a minimal one and SmolLM2's qkv and down projections


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())


def test_packed_kernel_is_used_on_this_machine(monkeypatch):
    monkeypatch.delenv("RTSERVE_VNNI", raising=False)   # the default path, whatever the run's environment says
    flags = _cpu_flags()    # `make test` installs the compiler the op needs
    avx512 = {"avx512f", "avx512_bf16"} <= flags
    expected = Isa.AMX if "amx_bf16" in flags else Isa.AVX512_FP16 if avx512 and "avx512_fp16" in flags else \
        Isa.AVX512_VNNI if avx512 and "avx512_vnni" in flags else Isa.AVX512_FP32 if avx512 else Isa.NONE
    assert expected is not Isa.NONE, "the project's machines have AVX-512 BF16 (with or without AMX)"
    assert kernels.packed_isa() is expected
    packed = kernels.pack_linear_weight(torch.zeros(64, 64, dtype=torch.bfloat16))
    assert packed.dtype == (torch.float16 if expected is Isa.AVX512_FP16 else torch.bfloat16)
    if expected is Isa.AVX512_FP16:        # a weight near fp16's range stays with torch
        assert kernels.pack_linear_weight(torch.full((64, 64), kernels.FP16_MAX_WEIGHT, dtype=torch.bfloat16)) is None
    # what the kernel cannot take is left to torch
    assert kernels.pack_linear_weight(torch.zeros(64, 64)) is None                       # fp32
    assert kernels.pack_linear_weight(torch.zeros(48, 64, dtype=torch.bfloat16)) is None  # N not a multiple of 32


def test_the_switch_turns_every_packed_kernel_off(monkeypatch):
    """`RTSERVE_PACKED_LINEAR=0` (read when asked): no packed kernel, so no packed weights and torch for every layer."""
    monkeypatch.delenv("RTSERVE_VNNI", raising=False)   # with it at 0, the packed kernels differ from the CPU's own
    monkeypatch.setenv("RTSERVE_PACKED_LINEAR", "0")
    assert kernels.packed_isa() is Isa.NONE and kernels.cpu_isa() is not Isa.NONE
    w = torch.zeros(64, 64, dtype=torch.bfloat16)
    assert kernels.pack_linear_weight(w) is None and kernels.pack_wide_weight(w) is None
    monkeypatch.setenv("RTSERVE_PACKED_LINEAR", "1")
    assert kernels.packed_isa() is kernels.cpu_isa()


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_packed_linear_matches_fp32_reference(rows, n, k):
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    w = torch.randn(n, k, generator=gen).bfloat16()
    x = torch.randn(rows, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    packed = kernels.pack_linear_weight(w)
    for b in (None, bias):
        y = kernels.linear(x, w, b, packed)
        ref = x.double() @ w.double().T + (0 if b is None else b.double())
        assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
        # fp32 accumulation, one rounding to bf16: within one bf16 step (2^-8 relative) of the exact value; fp16
        # FMAs add their partial sums' rounding (2^-11 of up to 64 products a lane)
        err = (y.double() - ref).abs() - ref.abs() * 2 ** -8
        assert err.max().item() < (3e-3 if packed.dtype == torch.float16 else 1e-3) * ref.abs().max().item()
        assert torch.allclose(y.float(), F.linear(x, w, b).float(), rtol=2e-2, atol=2e-2 * ref.abs().max().item())


def test_packed_linear_keeps_range_and_precision_of_extreme_rows():
    """Rows far outside fp16's range (1e6, past 65504), tiny ones (1e-6, subnormal in fp16) and weights near the
    packing limit: the fp16 kernel scales each row by a power of two, so each row is as accurate as a normal one."""
    gen = torch.Generator().manual_seed(7)
    w = (torch.randn(256, 1536, generator=gen) * 4).clamp(-31, 31).bfloat16()
    x = torch.randn(5, 1536, generator=gen)
    x = (x * torch.tensor([[1e6], [1.0], [1e-6], [3e4], [1.0]])).bfloat16()
    x[4, 7] = 5e4                                              # one outlier in an otherwise normal row
    packed = kernels.pack_linear_weight(w)
    assert packed is not None
    y = kernels.linear(x, w, None, packed).double()
    ref = x.double() @ w.double().T
    assert torch.isfinite(y).all()
    for row in range(5):
        err = ((y[row] - ref[row]).abs() - ref[row].abs() * 2 ** -8).max() / ref[row].abs().max()
        assert err < 3e-3, (row, err.item())


def test_packed_linear_leaves_large_batches_to_torch():
    w = torch.randn(64, 64).bfloat16()
    b = torch.randn(64).bfloat16()
    x = torch.randn(kernels.PACKED_MAX_ROWS + 1, 64).bfloat16()
    packed, wide = kernels.pack_linear_weight(w), kernels.pack_wide_weight(w)
    if packed.dtype == torch.float16:       # fp16 FMAs beat MKL's fp32 GEMM at every size: no hand-over
        assert wide is None
        for rows in (kernels.PACKED_MAX_ROWS + 1, 512):
            x = torch.randn(rows, 64).bfloat16()
            y = kernels.linear(x, w, b, packed)
            assert torch.equal(y, torch.ops.rtserve_cpu.packed_linear(x, packed, b))
            ref = x.double() @ w.double().T + b.double()
            assert ((y.double() - ref).abs() - ref.abs() * 2 ** -8).max() < 3e-3 * ref.abs().max()
        return
    assert torch.equal(kernels.linear(x, w, b, packed), F.linear(x, w, b))      # oneDNN's bf16 GEMM
    assert (wide is not None) == kernels.without_amx(kernels.packed_isa())  # without AMX: MKL's fp32 GEMM
    if wide is not None:
        y = kernels.linear(x, w, b, packed, wide)
        assert torch.equal(y, F.linear(x.float(), w.float(), b.float()).bfloat16())
        ref = x.double() @ w.double().T + b.double()
        assert ((y.double() - ref).abs() - ref.abs() * 2 ** -8).max() < 1e-3 * ref.abs().max()


def _fp16_tiles() -> bool:
    return kernels.packed_isa() is Isa.AVX512_FP16


def _dense(w: np.ndarray) -> torch.Tensor:
    """The weight the packed GGUF kernel multiplies by: gguf's fp32 dequantization cast to bf16 as our load does, or
    on an FP16 CPU the exact value (float64 here) rounded once to fp16."""
    if _fp16_tiles():
        return torch.from_numpy(w.astype(np.float16))
    return torch.from_numpy(w.astype(np.float32)).bfloat16()


def _q4_1(n, k, rng):
    q = rng.integers(0, 16, (n, k), dtype=np.uint8)
    d = (rng.random((n, k // 32)) * 0.02).astype(np.float16)
    m = (-rng.random((n, k // 32)) * 0.1).astype(np.float16)
    wide = np.float32 if not _fp16_tiles() else np.float64   # gguf's dequantization: fp32 products and sums
    w = d.astype(wide).repeat(32, 1) * q.astype(wide) + m.astype(wide).repeat(32, 1)
    packed = kernels.pack_gguf_q4_1(torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m))
    return _dense(w), packed


def _q8_0(n, k, rng):
    q = rng.integers(-128, 128, (n, k)).astype(np.int8)
    d = (rng.random((n, k // 32)) * 0.01).astype(np.float16)
    w = q.astype(np.float64) * d.astype(np.float64).repeat(32, 1)
    return _dense(w), kernels.pack_gguf_q8_0(torch.from_numpy(q), torch.from_numpy(d))


@pytest.mark.parametrize("make", [_q4_1, _q8_0], ids=["q4_1", "q8_0"])
@pytest.mark.parametrize("n,k", SHAPES)
def test_gguf_blocks_dequantize_to_the_dense_bf16_weight(make, n, k):
    w, (qs, dm) = make(n, k, np.random.default_rng(n + k))
    eye = torch.eye(k, dtype=torch.bfloat16)
    for chunk in eye.split(48):     # one-hot rows pick weights out exactly (to the output's bf16); 48 rows take the
        # buffered path, the tail (k % 48) the fused one
        assert torch.equal(kernels.linear_gguf(chunk, qs, dm), w[:, chunk.argmax(1)].T.bfloat16())
    packed = kernels.tile_order(w) if w.dtype == torch.float16 else kernels.pack_linear_weight(w)
    gen = torch.Generator().manual_seed(k)
    for rows in ROWS + [65, 100]:              # the fused (<= 32 rows) and buffered paths, with bias
        x = torch.randn(rows, k, generator=gen).bfloat16()
        bias = torch.randn(n, generator=gen).bfloat16()
        same_weights = torch.ops.rtserve_cpu.packed_linear(x, packed, bias)
        assert torch.equal(kernels.linear_gguf(x, qs, dm, bias), same_weights), rows


def test_q8_0_quantization_rounds_each_weight_to_its_block():
    """kernels.quantize_q8_0 (llama.cpp's Q8_0): per block of 32, d = amax / 127 in fp16 and q = round(w / d), so d * q
    is each weight's nearest multiple of d, and the largest weight of a block keeps its value to d's rounding."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=gen) * torch.logspace(-1.5, 1, 64).unsqueeze(1)   # d normal in fp16
    w[3, 32:64] = 0.0                                                                  # an all-zero block
    q, d = kernels.quantize_q8_0(w)
    assert q.dtype == torch.int8 and q.shape == (64, 96) and d.dtype == torch.float16 and d.shape == (64, 3)
    scale = d.float().repeat_interleave(32, 1)
    assert int(q.abs().max()) == 127 and not bool((q[3, 32:64] != 0).any()) and float(d[3, 1]) == 0.0
    assert bool(((q.float() * scale - w).abs() <= scale / 2 + 1e-7).all())
    amax = w.reshape(64, 3, 32).abs().amax(-1)
    assert torch.allclose(d.float() * 127, amax, rtol=2 ** -10, atol=0)


def test_bad_shapes_are_refused():
    w = torch.randn(64, 64).bfloat16()
    with pytest.raises(RuntimeError, match="features"):
        kernels.linear(torch.randn(2, 32).bfloat16(), w, None, kernels.pack_linear_weight(w))
    with pytest.raises(RuntimeError, match="packed"):
        torch.ops.rtserve_cpu.packed_linear(torch.randn(2, 64).bfloat16(), w, None)


# Each instruction set's kernel file, the -march that compiles its kernel, and a symbol only that kernel defines.
ISA_BUILDS = [
    ("amx.cpp", "sapphirerapids", "amx_gemm"),
    ("avx512_fp16.cpp", "sapphirerapids", "avx512_fp16_gemm"),
    ("avx512_fp32.cpp", "cooperlake", "avx512_fp32_gemm"),
    ("avx512_vnni.cpp", "cooperlake", "avx512_vnni_gemm"),
]


@pytest.mark.parametrize("source,march,symbol", ISA_BUILDS, ids=[s for s, _, _ in ISA_BUILDS])
def test_every_instruction_set_compiles(source, march, symbol, tmp_path):
    """This CPU runs one kernel; the others must still compile. Each file is built for a CPU of its instruction set
    with the extension's flags, and the object must define its kernel (a file whose kernel an #if dropped would
    compile to nothing and pass otherwise)."""
    import shutil
    import subprocess
    from pathlib import Path

    from torch.utils.cpp_extension import include_paths

    gxx = shutil.which("g++")
    assert gxx is not None, "`make test` installs g++"
    src = Path(kernels.__file__).parent / "csrc" / "packed_linear" / source
    obj = tmp_path / "kernel.o"
    cmd = [gxx, "-std=c++20", "-O1", f"-march={march}", "-ffast-math", "-fopenmp", "-c", str(src), "-o", str(obj),
           *(f"-I{p}" for p in include_paths())]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    symbols = subprocess.run(["nm", "-C", str(obj)], capture_output=True, text=True, check=True).stdout
    assert f"rtserve::packed::{symbol}(" in symbols
