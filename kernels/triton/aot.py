"""Compile the kernels ahead of time for a CUDA target without a GPU: catches GPU-only codegen errors on CPU CI.

`python -m kernels.triton.aot [sm ...]` (TRITON_INTERPRET must be unset: the interpreter never compiles).
Uses the ptxas that ships in the triton wheel; nothing is launched.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

DTYPES = ("bf16", "fp16", "fp32")


@dataclass(slots=True)
class Compiled:
    kernel: str
    arch: int
    dtype: str
    cubin_bytes: int
    tensor_cores: bool  # PTX uses mma/wgmma


def _attention_source(dtype: str, group: int, head_dim: int, page_size: int, num_splits: int = 1):
    from triton.compiler import ASTSource

    import kernels.triton._kernels as k
    fn = k._unified_attention_kernel
    fp32 = dtype == "fp32"
    block_m = 64
    consts = dict(PAGE_SIZE=page_size, HEAD_DIM=head_dim, HEAD_DIM_P=max(16, 1 << (head_dim - 1).bit_length()),
                  GROUP=group, BLOCK_Q=block_m // group, BLOCK_M=block_m, TILE=32, CAST_FP32=fp32,
                  DOT_PRECISION="ieee" if fp32 else "tf32", INTERP=False, NUM_SPLITS=num_splits)
    sig = {n: "i32" for n in fn.arg_names}
    sig.update({n: "*" + dtype for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")})
    sig.update({n: "*i32" for n in ("cu_q_ptr", "seq_lens_ptr", "block_tables_ptr")})
    sig.update({n: "*fp32" for n in ("part_acc_ptr", "part_ml_ptr")})
    sig["scale_log2e"] = "fp32"
    sig.update({n: "constexpr" for n in consts})
    return ASTSource(fn, sig, consts)


def _store_source(dtype: str, kv_heads: int, head_dim: int, page_size: int):
    from triton.compiler import ASTSource

    import kernels.triton._kernels as k
    fn = k._store_kvcache_kernel
    consts = dict(PAGE_SIZE=page_size, NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim,
                  HEADS_P=1 << (kv_heads - 1).bit_length(), HEAD_DIM_P=1 << (head_dim - 1).bit_length(), INTERP=False)
    sig = {n: "i32" for n in fn.arg_names}
    sig.update({n: "*" + dtype for n in ("key_ptr", "value_ptr", "k_cache_ptr", "v_cache_ptr")})
    sig["slot_ptr"] = "*i64"
    sig.update({n: "constexpr" for n in consts})
    return ASTSource(fn, sig, consts)


def _merge_source(dtype: str, head_dim: int, num_splits: int):
    from triton.compiler import ASTSource

    import kernels.triton._kernels as k
    fn = k._merge_splits_kernel
    consts = dict(NUM_SPLITS=num_splits, HEAD_DIM=head_dim, HEAD_DIM_P=max(16, 1 << (head_dim - 1).bit_length()),
                  INTERP=False)
    sig = {n: "i32" for n in fn.arg_names}
    sig.update({"part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "out_ptr": "*" + dtype})
    sig.update({n: "constexpr" for n in consts})
    return ASTSource(fn, sig, consts)


def compile_all(archs=(90, 80), group: int = 3, head_dim: int = 64, page_size: int = 4) -> list[Compiled]:
    """SmolLM2-135M shapes by default (9 heads over 3 kv heads, head_dim 64), in the engine's default 4-slot pages."""
    import triton
    from triton.backends.compiler import GPUTarget

    if triton.knobs.runtime.interpret:
        raise RuntimeError("unset TRITON_INTERPRET: the interpreter does not compile")
    done = []
    for arch in archs:
        target = GPUTarget("cuda", arch, 32)
        for dtype in DTYPES:
            for name, src in (("paged_attention", _attention_source(dtype, group, head_dim, page_size)),
                              ("paged_attn_split", _attention_source(dtype, group, head_dim, page_size, 16)),
                              ("merge_splits", _merge_source(dtype, head_dim, 16)),
                              ("store_kvcache", _store_source(dtype, max(1, 9 // group), head_dim, page_size))):
                ck = triton.compile(src, target=target)
                ptx = ck.asm["ptx"]
                done.append(Compiled(name, arch, dtype, len(ck.asm["cubin"]), "mma" in ptx))
    return done


def main(argv: list[str] | None = None) -> None:
    archs = tuple(int(a.removeprefix("sm_")) for a in (argv or sys.argv[1:])) or (90, 80)
    for c in compile_all(archs):
        print(f"sm_{c.arch} {c.kernel:16s} {c.dtype}: {c.cubin_bytes} bytes cubin, tensor cores: {c.tensor_cores}")


if __name__ == "__main__":
    main()
