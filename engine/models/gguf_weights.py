"""`quantization="gguf"`: the model's linear layers swapped for GGUFLinear layers built from the GGUF file's blocks
(llama.cpp's tensor names and q/k row order)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import ModelLoadError
from engine.layers.gguf_linear import READERS, GGUFLinear, GgufBlocks


def cached_gguf_blocks(gguf_path: Path, cache_dir: Path) -> dict[str, np.ndarray]:
    """The raw blocks of every Q4_1 / Q8_0 tensor in the file, keyed "<type>:<gguf name>". gguf's reader parses all
    metadata (the whole tokenizer vocabulary) on every open, so the blocks are copied once into `cache_dir/gguf/`."""
    from safetensors.numpy import load_file, save_file

    path = cache_dir / "gguf" / "blocks.safetensors"
    if not path.is_file():
        import gguf

        reader = gguf.GGUFReader(str(gguf_path))
        state = {f"{t.tensor_type.name}:{t.name}": np.ascontiguousarray(t.data) for t in reader.tensors
                 if t.tensor_type.name in READERS}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        save_file(state, str(tmp))
        tmp.replace(path)
    return load_file(str(path))


def _unpermute_rows(n_rows: int, n_head: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation for its interleaved rope (transformers does the same on load)."""
    idx = np.arange(n_rows)
    return idx.reshape(n_head, n_rows // n_head // 2, 2).swapaxes(2, 1).reshape(n_rows)


def attach_gguf_linears(model: nn.Module, gguf_path: Path, cache_dir: Path) -> int:
    """Swap the linear layers of `model` (and lm_head when it is Q8_0 or Q4_1) for GGUFLinear layers built from
    `gguf_path`; returns the number swapped.

    Raises ModelLoadError when the file is not a llama-family GGUF with Q4_1 layer weights, or when its blocks do not
    dequantize to the weights the model was loaded with (the check catches layout or permutation mistakes)."""
    cfg = model.config
    if cfg.get("model_type") not in ("llama", "mistral"):
        raise ModelLoadError(f"quantization='gguf' supports llama-family GGUF files, not {cfg.get('model_type')!r}")
    tensors = cached_gguf_blocks(gguf_path, cache_dir)
    blocks = {key.split(":", 1)[1]: key for key in tensors}
    n_head, n_kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    dtype = model.lm_head.weight.dtype

    def raw(name: str, permute_heads: int | None = None, types=("Q4_1",)) -> tuple[str, np.ndarray]:
        key = blocks.get(name)
        if key is None or key.split(":")[0] not in types:
            raise ModelLoadError(f"quantization='gguf' needs {'/'.join(types)} blocks for {name} in {gguf_path.name}")
        rows = tensors[key]
        if permute_heads:
            rows = rows[_unpermute_rows(rows.shape[0], permute_heads)]
        return key.split(":")[0], rows

    def gguf_blocks(*parts) -> GgufBlocks:
        kinds = {kind for kind, _ in parts}
        return READERS[kinds.pop()](np.concatenate([rows for _, rows in parts]))

    swapped = 0
    for i, layer in enumerate(model.layers):
        b = f"blk.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = GGUFLinear(attn.qkv_proj, gguf_blocks(raw(b + "attn_q.weight", n_head),
                                                       raw(b + "attn_k.weight", n_kv), raw(b + "attn_v.weight")))
        attn.o_proj = GGUFLinear(attn.o_proj, gguf_blocks(raw(b + "attn_output.weight")))
        mlp.gate_up_proj = GGUFLinear(mlp.gate_up_proj, gguf_blocks(raw(b + "ffn_gate.weight"), raw(b + "ffn_up.weight")))
        mlp.down_proj = GGUFLinear(mlp.down_proj, gguf_blocks(raw(b + "ffn_down.weight")))
        swapped += 4
    head = "output.weight" if "output.weight" in blocks else "token_embd.weight"   # tied embeddings: no output.weight
    if head in blocks and blocks[head].split(":")[0] in READERS:
        model.lm_head = GGUFLinear(model.lm_head, gguf_blocks(raw(head, types=tuple(READERS))))
        swapped += 1
    checks = [model.layers[i].self_attn.qkv_proj for i in {0, len(model.layers) - 1}]   # first and last layer
    checks += [model.layers[-1].mlp.down_proj] + ([model.lm_head] if isinstance(model.lm_head, GGUFLinear) else [])
    gen = torch.Generator().manual_seed(0)
    for lin in checks:       # cheap, and catches any layout or permutation error
        x = torch.randn(4, lin.weight.shape[1], generator=gen).to(dtype)
        dense = F.linear(x, lin.weight).float()
        err = (lin(x).float() - dense).abs().max().item()
        if err > 0.05 * dense.abs().max().item():
            raise ModelLoadError(f"the quantized blocks of {gguf_path.name} do not match the loaded weights "
                                 f"(max error {err:.3g}); cannot use quantization='gguf'")
    return swapped
