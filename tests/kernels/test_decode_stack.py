"""The C++ decode stack (kernels/csrc/decode_stack.cpp, kernels/decode_stack.py) against the Python layers."""
from __future__ import annotations

import pytest
import torch

from kernels import decode_stack


def test_slots_are_named_once():
    """The op names its slots; every name is a field of the dataclasses Python fills them from."""
    assert decode_stack.available(), "g++ and ninja are installed by `make test`; the op must build"
    names = torch.ops.rtserve_cpu.decode_stack_slots()
    fields = set(decode_stack.DecodeLayerWeights.__dataclass_fields__)
    linear_fields = set(decode_stack.LinearWeights.__dataclass_fields__)
    assert len(names) == len(set(names))
    for name in names:
        layer_field, _, linear_field = name.partition(".")
        assert layer_field in fields and (not linear_field or linear_field in linear_fields), name
    assert {n.partition(".")[0] for n in names} == fields


@pytest.mark.parametrize("quantization", ["gguf", None], ids=["gguf", "dense-bf16"])
def test_decode_stack_is_the_python_layers_bit_for_bit(quantization, monkeypatch):
    """A decode-only step runs all layers in one C++ call. Its hidden states and the KV cache it writes must be exactly
    the Python layers' (`RTSERVE_DECODE_STACK=0`) at every batch size, whichever kernel each size picks (torch's 4-bit
    kernel at 1-2 rows, the packed kernel to 64, oneDNN or MKL beyond). The stack's entry point is wrapped (each call
    goes through) to see that it ran, and that the switch kept it off."""
    from engine.model_runner import load_model
    from engine.models.gguf_weights import attach_gguf_linears
    from engine.models.llama import AttentionMetadata
    from engine.models.loader import default_model_path, resolve_model_dir

    model = load_model(resolve_model_dir(None), torch.bfloat16, torch.device("cpu"))
    if quantization == "gguf":
        attach_gguf_linears(model, default_model_path(), resolve_model_dir(None))
    gen = torch.Generator().manual_seed(0)
    page_size, num_pages = 16, 1400
    kv = torch.randn(len(model.layers), 2, num_pages, page_size, model.num_kv_heads, model.head_dim, generator=gen)
    kv = kv.to(torch.bfloat16)
    steps = []
    for batch in (1, 2, 3, 8, 65):
        ctx = torch.randint(1, 300, (batch,), generator=gen).tolist()
        n_pages = max(c // page_size + 1 for c in ctx)
        tables = torch.randperm(num_pages, generator=gen)[:batch * n_pages].view(batch, n_pages).int()
        for i, c in enumerate(ctx):
            tables[i, c // page_size + 1:] = -1
        meta = AttentionMetadata(
            slot_mapping=torch.tensor([int(tables[i, c // page_size]) * page_size + c % page_size
                                       for i, c in enumerate(ctx)]),
            cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32),
            seq_lens=torch.tensor([c + 1 for c in ctx], dtype=torch.int32), block_tables=tables)
        ids = torch.randint(0, model.config["vocab_size"], (batch,), generator=gen)
        steps.append((ids, torch.tensor(ctx), meta))

    calls = []
    real = decode_stack.decode_layers
    monkeypatch.setattr(decode_stack, "decode_layers", lambda *a, **k: calls.append(1) or real(*a, **k))
    outs = {}
    for switch in ("1", "0"):
        monkeypatch.setenv("RTSERVE_DECODE_STACK", switch)
        model.pack_weights()                 # packs, and builds the stack anew on first use, reading the switch
        calls.clear()
        outs[switch] = []
        for ids, pos, meta in steps:
            cache = kv.clone()
            with torch.inference_mode():
                outs[switch].append((model(ids, pos, meta, cache), cache))
        assert len(calls) == (len(steps) if switch == "1" else 0), (switch, len(calls))
    for batch, (stacked, python) in enumerate(zip(outs["1"], outs["0"])):
        assert torch.equal(stacked[0], python[0]), batch
        assert torch.equal(stacked[1], python[1]), batch
