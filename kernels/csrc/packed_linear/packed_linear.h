// The packed linear ops as the other C++ ops see them (decode_stack.cpp): the instruction sets, and the two ops.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace rtserve {

// Which instruction set runs the packed kernels; the numbers are what the `packed_isa` op returns to Python
// (kernels.cpu.Isa mirrors them).
enum class Isa : int64_t {
  kNone = 0,         // no packed kernel: torch serves every linear layer
  kAvx512Fp32 = 1,   // AVX-512 BF16 without AMX: fp32 FMAs on bf16 tiles (avx512_fp32.cpp)
  kAmx = 2,          // AMX bf16 tiles (amx.cpp)
  kAvx512Fp16 = 3,   // AVX-512 FP16 without AMX: fp16 FMAs on fp16 tiles (avx512_fp16.cpp)
  kAvx512Vnni = 4,   // AVX-512 BF16 + VNNI without AMX or FP16: GGUF blocks as int8 dot products (avx512_vnni.cpp),
                     // 16-bit tiles as fp32 FMAs (avx512_fp32.cpp)
};

// The CPU's packed instruction set, detected once (dispatch.cpp).
Isa cpu_isa();

}  // namespace rtserve

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias);
at::Tensor packed_linear_gguf(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& dm,
                              const c10::optional<at::Tensor>& bias);
