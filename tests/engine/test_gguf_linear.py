"""`quantization="gguf"`: small batches run on the GGUF file's own Q4_1 / Q8_0 blocks (engine/layers/gguf_linear.py,
engine/models/gguf_weights.py).

The 4-bit planes and the packed blocks must be the file's weights (checked layer by layer against the dense weights
the model loads, which transformers dequantized, and against the `gguf` library's own dequantization), each batch size
must take the kernel the design gives it, decode steps on them must stay as close to HF transformers' bf16 as our
dense bf16 path is, and a model the path cannot serve must fail with a typed error."""
import functools

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize
from transformers import AutoModelForCausalLM

import kernels
from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError, ModelLoadError
from engine.layers.gguf_linear import GGUFLinear
from engine.model_runner import load_model
from engine.models.gguf_weights import attach_gguf_linears
from engine.models.loader import default_model_path, resolve_model_dir
from kernels import Isa
from tests.engine.prompts import PROMPTS

# The design (docs/benchmarks.md has the measurements): torch's 4-bit kernel takes batches up to this many rows, the
# packed kernel the rest up to kernels.PACKED_MAX_ROWS (on AVX-512 FP16 and VNNI: every size), dense weights beyond.
# On AMX the integer dots take batches up to kernels.AMX_VNNI_MAX_ROWS instead of the 4-bit kernel (unless
# RTSERVE_VNNI=0, kernels.int8_small_batches).
INT4_MAX_ROWS = {Isa.NONE: 8, Isa.AMX: 2, Isa.AVX512_FP32: 4, Isa.AVX512_FP16: 0, Isa.AVX512_VNNI: 0}


def test_every_quantized_layer_is_the_files_weight():
    model = load_model(resolve_model_dir(None), torch.bfloat16, torch.device("cpu"))
    swapped = attach_gguf_linears(model, default_model_path(), resolve_model_dir(None))
    layers = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    assert swapped == len(layers) == 4 * len(model.layers) + 1          # every linear layer and the Q8_0 lm_head
    for lin in layers:
        w = lin.weight.float()
        err = (lin.dequantized_int4().float() - w).abs()
        # the dense weight is bf16(d * q + m); the planes use bf16 scales: both within ~2 bf16 steps of the file's value
        assert err.max().item() <= 2 ** -6 * w.abs().max().item(), err.max().item()
        assert err.mean().item() < 1e-3


@functools.cache
def _gguf_tensors() -> dict:
    return {t.name: t for t in gguf.GGUFReader(str(default_model_path())).tensors}


def _file_weight_fp16(*names: str) -> torch.Tensor:
    """The GGUF file's weights for these tensors (stacked as our fused layers stack them), dequantized by the `gguf`
    library and rounded to fp16: what the packed kernel multiplies by on an AVX-512 FP16 CPU. (gguf computes
    d * q + m in fp32; for this file that rounds to the same fp16 as the exact value, checked once by hand.)"""
    tensors = _gguf_tensors()
    w = [dequantize(np.ascontiguousarray(tensors[n].data), tensors[n].tensor_type) for n in names]
    return torch.from_numpy(np.concatenate([x.reshape(x.shape[0], -1) for x in w]).astype(np.float16))


def test_the_packed_kernel_multiplies_by_exactly_the_dense_weights():
    model = load_model(resolve_model_dir(None), torch.bfloat16, torch.device("cpu"))
    attach_gguf_linears(model, default_model_path(), resolve_model_dir(None))
    layers = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    assert all(lin.packed_blocks is not None for lin in layers)   # AMX or AVX-512 (this machine and CI): packed
    for lin in layers[:4] + layers[-5:]:                    # the first and last layers, and the Q8_0 lm_head
        got, dense = lin.dequantized_packed(), lin.weight.detach()
        if kernels.packed_isa() is Isa.AVX512_VNNI:   # fp32(w * (1 +- 1 ulp)) rounded to bf16: at most a step off
            assert (got.float() - dense.float()).abs().max() <= 2 ** -8 * dense.float().abs().max()
            assert (got == dense).float().mean() > 0.98   # ~0.6 % land a step off (bf16 midpoints)
        elif kernels.packed_isa() is not Isa.AVX512_FP16:
            assert torch.equal(got, dense)
        else:   # fp16(w) seen through a bf16 output: bf16(w), or one bf16 step off where the fp16 value is a tie
            step = dense.float().abs() * 2 ** -7   # (~1 in 8 fp16 values is a bf16 midpoint: 2-6 % of these layers)
            assert ((got.float() - dense.float()).abs() <= step).all()
    if kernels.packed_isa() is Isa.AVX512_FP16:   # and bit for bit: the fp16 kernel on the file's weights
        lin = model.layers[3].mlp.gate_up_proj
        w16 = _file_weight_fp16("blk.3.ffn_gate.weight", "blk.3.ffn_up.weight")
        x = torch.randn(9, w16.shape[1], dtype=torch.bfloat16)
        assert torch.equal(lin(x), torch.ops.rtserve_cpu.packed_linear(x, kernels.tile_order(w16), None))


def test_each_batch_size_takes_its_kernel():
    torch.manual_seed(0)   # the inputs: the last check's rounding error depends on the draw
    model = load_model(resolve_model_dir(None), torch.bfloat16, torch.device("cpu"))
    attach_gguf_linears(model, default_model_path(), resolve_model_dir(None))
    lin = model.layers[3].mlp.gate_up_proj
    fp16 = kernels.packed_isa() is Isa.AVX512_FP16
    vnni = kernels.packed_isa() is Isa.AVX512_VNNI
    packed = kernels.pack_linear_weight(lin.weight) if not fp16 else \
        kernels.tile_order(_file_weight_fp16("blk.3.ffn_gate.weight", "blk.3.ffn_up.weight"))
    small = kernels.int8_small_batches()
    assert all((m.small_blocks is not None) == small for m in model.modules() if isinstance(m, GGUFLinear))
    int4_max_rows = 0 if small else INT4_MAX_ROWS[kernels.packed_isa()]
    x = torch.randn(1, lin.weight.shape[1], dtype=torch.bfloat16)
    assert torch.equal(model.lm_head(x), torch.ops.rtserve_cpu.packed_linear_gguf(   # the Q8_0 lm_head: packed
        x, *(model.lm_head.small_blocks if small else model.lm_head.packed_blocks), None))   # from 1 row
    for rows in sorted({1, max(int4_max_rows, 1), int4_max_rows + 1, kernels.AMX_VNNI_MAX_ROWS,
                        kernels.AMX_VNNI_MAX_ROWS + 1, 12, 13, 32, kernels.PACKED_MAX_ROWS,
                        kernels.PACKED_MAX_ROWS + 1}):               # 12 / 13: the ring and the buffer (fp16)
        x = torch.randn(rows, lin.weight.shape[1], dtype=torch.bfloat16)
        dense = torch.nn.functional.linear(x, lin.weight)
        y = lin(x)
        if small and rows <= kernels.AMX_VNNI_MAX_ROWS:                    # AMX, small batches: the integer dots
            assert torch.equal(y, torch.ops.rtserve_cpu.packed_linear_gguf(x, *lin.small_blocks, None))
            assert not torch.equal(y, dense)
        elif rows > int4_max_rows and fp16:                                # fp16 FMAs at every size ...
            assert torch.equal(y, torch.ops.rtserve_cpu.packed_linear(x, packed, None))   # ... on the file's weights
        elif vnni:                                                         # int8 dot products at every size
            assert torch.equal(y, torch.ops.rtserve_cpu.packed_linear_gguf(x, *lin.packed_blocks, None))
            assert not torch.equal(y, dense)
        elif rows > kernels.PACKED_MAX_ROWS:                               # prefill / big batches: dense bf16 ...
            if kernels.packed_isa() is Isa.AVX512_FP32:                    # ... in MKL's fp32 GEMM, rounded once
                dense = torch.nn.functional.linear(x.float(), lin.weight.float()).bfloat16()
            assert torch.equal(y, dense)
        elif rows > int4_max_rows:                                         # the packed kernel on the same weights
            assert torch.equal(y, torch.ops.rtserve_cpu.packed_linear(x, packed, None))
        else:                                                              # torch's 4-bit kernel ran ...
            assert not torch.equal(y, dense)
            assert fp16 or not torch.equal(y, torch.ops.rtserve_cpu.packed_linear(x, packed, None))
        assert (y.float() - dense.float()).abs().max() < 0.05 * dense.float().abs().max()   # ... on the same weights


def test_decode_logprobs_close_to_hf_bf16():
    hf = AutoModelForCausalLM.from_pretrained(resolve_model_dir(None), dtype=torch.bfloat16).eval()
    llm = LLM(kv_cache_memory="64MiB", dtype="bfloat16", quantization="gguf")
    vnni = kernels.packed_isa() is Isa.AVX512_VNNI or kernels.int8_small_batches()   # int8 activations in decode
    for prompt in PROMPTS[:3]:
        ids = llm.tokenizer(prompt, add_special_tokens=False).input_ids
        out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=12, logprobs=5))[0]
        with torch.inference_mode():       # HF's next-token distribution at every position we decoded
            ref = hf(torch.tensor([ids + out.token_ids[:-1]])).logits[0, len(ids) - 1:].float().log_softmax(-1)
        for step, (_, top) in enumerate(out.logprobs):   # steps after the first are batch-1 decodes
            chosen = top[0][0]
            assert float(ref[step].max() - ref[step, chosen]) < 0.35, (prompt, step)  # HF's pick, or a near-tie in bf16
            for tok, lp in top:   # as close as dense bf16 is; int8 activations (AVX512_VNNI, as llama.cpp's) move a
                # runner-up's logprob further (up to ~0.8 seen): a block holding an outlier rounds its others coarsely
                assert abs(lp - float(ref[step, tok])) < (1.0 if vnni else 0.35), (prompt, step, tok)
    assert llm.engine.block_manager.num_free == llm.engine.block_manager.num_pages


def test_bad_quantization_requests_fail_clearly(tmp_path):
    with pytest.raises(InvalidRequestError, match="quantization"):
        LLM(dtype="bfloat16", quantization="int3")
    with pytest.raises(ModelLoadError, match=r"\.gguf"):     # a HF directory has no GGUF blocks to run on
        LLM(model=str(resolve_model_dir(None)), dtype="bfloat16", quantization="gguf")
