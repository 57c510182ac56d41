// The packed linear ops: x @ W.T + bias for bf16 x on weights packed once at load (tiles.h), and the one place that
// picks the instruction set's kernel.
//
//   packed_linear(x, packed, bias): packed 16-bit tiles (kernels.linear.pack_linear_weight): bf16 ones go to AMX where
//     the CPU grants it, else to fp32 FMAs (amx.cpp, avx512_fp32.cpp); fp16 ones to the AVX-512 FP16 kernel
//     (avx512_fp16.cpp).
//   packed_linear_gguf(x, qs, dm, bias): GGUF Q4_1 / Q8_0 blocks in tile order (gguf_blocks.h), dequantized tile by
//     tile: to bf16 (AMX, fp32 FMAs), each weight bit for bit gguf's fp32 dequantization rounded to bf16, so the
//     result equals packed_linear on the dense bf16 weight; or, on an AVX-512 FP16 CPU, to fp16 (the file's weight
//     rounded once). Blocks in VNNI order (kernels.linear.pack_gguf_vnni_*, packed so on an AVX-512 VNNI CPU without
//     AMX or FP16, and on an AMX CPU for small batches) go to the int8 dot products of avx512_vnni.cpp, on x quantized
//     to int8 per block.
// Accumulation is fp32 (fp16 partial sums flushed into fp32 on the FP16 kernel) and the output is rounded once to
// bf16, as oneDNN does.
#include <torch/library.h>

#include "tiles.h"

namespace rtserve {

using packed::Gemm;
using packed::Weight;

namespace {

// The CPU runs avx512_vnni.cpp's kernel (and this build has it): AVX-512 BF16 (the bf16 output rows) and VNNI.
bool vnni_usable() {
#ifdef RTSERVE_HAS_AVX512_VNNI
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16") &&
                         __builtin_cpu_supports("avx512vnni");
  return ok;
#else
  return false;
#endif
}

}  // namespace

Isa cpu_isa() {
#ifdef RTSERVE_HAS_AVX512_BF16
#ifdef RTSERVE_HAS_AMX
  if (packed::amx_usable()) return Isa::kAmx;
#endif
#ifdef RTSERVE_HAS_AVX512_FP16
  static const bool fp16 = __builtin_cpu_supports("avx512fp16") && __builtin_cpu_supports("avx512bf16");
  if (fp16) return Isa::kAvx512Fp16;
#endif
  if (vnni_usable()) return Isa::kAvx512Vnni;
  static const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
  return avx512 ? Isa::kAvx512Fp32 : Isa::kNone;
#else
  return Isa::kNone;
#endif
}

namespace {

// Which kernel multiplies: GGUF blocks in VNNI order the integer dots; other GGUF blocks the CPU's own kernel, except
// on a VNNI CPU (they are in tile order there only with RTSERVE_VNNI=0: the fp32 FMAs); 16-bit tiles the one for
// their dtype (bf16 tiles on an FP16 or VNNI CPU go to the fp32 FMAs, which read bf16 tiles).
Isa kernel_for(bool gguf, bool fp16_tiles, bool vnni_blocks = false) {
  if (vnni_blocks) {
    TORCH_CHECK(vnni_usable(), "packed_linear_gguf: blocks in VNNI order need an AVX-512 VNNI CPU");
    return Isa::kAvx512Vnni;
  }
  const Isa isa = cpu_isa();
  TORCH_CHECK(isa != Isa::kNone, "packed_linear: this CPU or build has neither AMX nor AVX-512 BF16");
  if (fp16_tiles) {
    TORCH_CHECK(isa == Isa::kAvx512Fp16, "packed_linear: fp16 weights need an AVX-512 FP16 CPU");
    return isa;
  }
  if (isa == Isa::kAvx512Vnni || (!gguf && isa == Isa::kAvx512Fp16)) return Isa::kAvx512Fp32;
  return isa;
}

// Checks x and bias against the weight's shape, then runs the kernel into a new [M, N] bf16 output.
at::Tensor run(const at::Tensor& x, const Weight& w, Isa isa, const c10::optional<at::Tensor>& bias) {
  const int64_t K = w.KB * packed::kTileK, N = w.NB * packed::kBlockN;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "packed_linear expects x [rows, K] bf16");
  TORCH_CHECK(x.size(1) == K, "packed_linear: x has ", x.size(1), " features, the packed weight ", K);
  const int64_t M = x.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "packed_linear: bias has ", bias->numel(), " elements, expected ", N);
    bias_f = bias->to(at::kFloat).contiguous();
  }
  if (M == 0) return out;
  const Gemm g{x, w, bias_f.defined() ? bias_f.data_ptr<float>() : nullptr,
               reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), M, K, N};
  switch (isa) {
#ifdef RTSERVE_HAS_AMX
    case Isa::kAmx: packed::amx_gemm(g); break;
#endif
#ifdef RTSERVE_HAS_AVX512_FP16
    case Isa::kAvx512Fp16: packed::avx512_fp16_gemm(g); break;
#endif
#ifdef RTSERVE_HAS_AVX512_BF16
    case Isa::kAvx512Fp32: packed::avx512_fp32_gemm(g); break;
#endif
#ifdef RTSERVE_HAS_AVX512_VNNI
    case Isa::kAvx512Vnni: packed::avx512_vnni_gemm(g); break;
#endif
    default: TORCH_CHECK(false, "packed_linear: this build has no kernel for instruction set ", int64_t(isa));
  }
  return out;
}

int64_t packed_isa_op() { return static_cast<int64_t>(cpu_isa()); }

// Whether GGUF blocks in VNNI order can run here (any CPU with AVX-512 BF16 and VNNI, AMX ones included).
bool vnni_usable_op() { return vnni_usable(); }

}  // namespace
}  // namespace rtserve

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.dim() == 5 && (packed.scalar_type() == at::kBFloat16 || packed.scalar_type() == at::kHalf) &&
                  packed.is_contiguous() &&
                  packed.size(2) == 2 && packed.size(3) == 16 && packed.size(4) == 32,
              "packed_linear expects a weight packed by kernels.linear.pack_linear_weight");
  const bool fp16 = packed.scalar_type() == at::kHalf;
  rtserve::packed::Weight w;
  w.NB = packed.size(0);
  w.KB = packed.size(1);
  w.tiles = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  return rtserve::run(x, w, rtserve::kernel_for(false, fp16), bias);
}

at::Tensor packed_linear_gguf(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& dm,
                              const c10::optional<at::Tensor>& bias) {
  // tile order: a tile row of 16 (Q4_1) or 32 (Q8_0) bytes; VNNI order: 4 (Q4_1) or 8 (Q8_0) vectors of 64 bytes
  const bool vnni = qs.dim() == 5 && qs.size(4) == 64 && (qs.size(3) == 4 || qs.size(3) == 8);
  const bool q4 = vnni ? qs.size(3) == 4 : qs.dim() == 5 && qs.size(4) == 16;
  const bool tiles = qs.dim() == 5 && qs.size(3) == 16 && (qs.size(4) == 16 || qs.size(4) == 32);
  TORCH_CHECK(qs.dim() == 5 && qs.size(2) == 2 && (vnni || tiles) &&
                  qs.is_contiguous() && dm.is_contiguous() && dm.scalar_type() == at::kHalf &&
                  dm.numel() == qs.size(0) * qs.size(1) * 2 * (q4 ? 32 : 16),
              "packed_linear_gguf expects blocks packed by kernels.linear.pack_gguf_q4_1 / pack_gguf_q8_0 "
              "(or their pack_gguf_vnni_* forms)");
  rtserve::packed::Weight w;
  w.NB = qs.size(0);
  w.KB = qs.size(1);
  w.qs = reinterpret_cast<const uint8_t*>(qs.data_ptr());
  w.dm = dm.data_ptr<at::Half>();
  w.q4 = q4;
  w.vnni = vnni;
  return rtserve::run(x, w, rtserve::kernel_for(true, false, vnni), bias);
}

TORCH_LIBRARY_FRAGMENT(rtserve_cpu, m) {
  m.def("packed_isa() -> int", TORCH_FN(rtserve::packed_isa_op));
  m.def("vnni_usable() -> bool", TORCH_FN(rtserve::vnni_usable_op));
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.impl("packed_linear", c10::DispatchKey::CPU, TORCH_FN(packed_linear));
  m.def("packed_linear_gguf(Tensor x, Tensor qs, Tensor dm, Tensor? bias) -> Tensor");
  m.impl("packed_linear_gguf", c10::DispatchKey::CPU, TORCH_FN(packed_linear_gguf));
}
