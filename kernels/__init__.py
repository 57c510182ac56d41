"""The compute the engine and the audio stage call: attention and the KV cache (`kernels.attention`, layout in
`kernels/torch_ops.py`, Triton in `kernels/triton/`), linear layers on packed weights (`kernels.linear`), the per-layer
ops (`kernels.layer_ops`), the decode stack (`kernels.decode_stack`), CPU features and threads (`kernels.cpu`) and
every RTSERVE_* setting (`kernels.settings`). The C++ CPU ops behind them live in kernels/csrc/ (`kernels.cpu_ext`).
"""
from kernels.attention import BACKENDS, empty_kv_cache, paged_attention, resolve_backend, set_backend, store_kvcache
from kernels.cpu import Isa, cpu_isa, default_thread_count, packed_isa, set_thread_count, without_amx
from kernels.layer_ops import (add_rms_norm, apply_rope, argmax, rms_norm, rope_and_store, silu_and_mul,
                               top_candidates)
from kernels.linear import (AMX_VNNI_MAX_ROWS, FP16_MAX_WEIGHT, GGUF_ANY_ROWS, PACKED_MAX_ROWS, linear, linear_gguf,
                            int8_small_batches, pack_gguf, pack_gguf_q4_1, pack_gguf_q8_0, pack_gguf_small_batches,
                            pack_gguf_vnni_q4_1, pack_gguf_vnni_q8_0, pack_linear_weight, pack_wide_weight,
                            quantize_q8_0, tile_order, weight_isa)

__all__ = [
    "BACKENDS", "empty_kv_cache", "paged_attention", "resolve_backend", "set_backend", "store_kvcache",
    "Isa", "cpu_isa", "default_thread_count", "packed_isa", "set_thread_count", "without_amx",
    "add_rms_norm", "apply_rope", "argmax", "rms_norm", "rope_and_store", "silu_and_mul", "top_candidates",
    "AMX_VNNI_MAX_ROWS", "FP16_MAX_WEIGHT", "GGUF_ANY_ROWS", "PACKED_MAX_ROWS", "int8_small_batches", "linear",
    "linear_gguf", "pack_gguf",
    "pack_gguf_q4_1", "pack_gguf_q8_0", "pack_gguf_small_batches", "pack_gguf_vnni_q4_1", "pack_gguf_vnni_q8_0",
    "pack_linear_weight", "pack_wide_weight", "quantize_q8_0", "tile_order", "weight_isa",
]
