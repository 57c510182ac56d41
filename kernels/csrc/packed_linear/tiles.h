// What the packed-linear kernels share: the tile layout, the weight a GEMM multiplies by (packed tiles or GGUF
// blocks), the GEMM's operands, and the bf16 output rows.
//
// Packed layout [N/32, K/32, 2, 16, 32] (bf16, or fp16 on the AVX-512 FP16 path): column block nb, k block kb holds
// two 16-column tiles; row r of a tile is the k pair (2r, 2r+1) of its 16 columns, interleaved (AMX's "VNNI" order),
// so one tile load is 1 KiB of contiguous memory. Built in torch at load (kernels.linear.pack_linear_weight).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <type_traits>

#include "packed_linear.h"

// What this build (-march=native) can compile; which of it the CPU runs is cpu_isa()'s call at run time.
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define RTSERVE_HAS_AVX512_BF16 1
#endif
#if defined(RTSERVE_HAS_AVX512_BF16) && defined(__AVX512FP16__)
#define RTSERVE_HAS_AVX512_FP16 1
#endif
#if defined(RTSERVE_HAS_AVX512_BF16) && defined(__AVX512VNNI__)
#define RTSERVE_HAS_AVX512_VNNI 1
#endif
#if defined(RTSERVE_HAS_AVX512_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define RTSERVE_HAS_AMX 1
#endif

namespace rtserve::packed {

constexpr int64_t kTileK = 32;      // 16-bit elements in one 64-byte tile row
constexpr int64_t kBlockN = 32;     // output columns per column block: two 16-column tiles
constexpr int64_t kBlockElems = 2 * 16 * 32;

// The weight of one GEMM, NB column blocks of KB tile pairs: packed 16-bit tiles, or GGUF blocks in the same tile
// order (kernels.linear.pack_gguf_q4_1 / pack_gguf_q8_0), dequantized by the kernel right before use, or in the
// integer-dot kernel's own order (`vnni`, avx512_vnni.cpp; the same bytes a tile pair).
//   q4_1: qs [NB, KB, 2, 16, 16] uint8, dm [NB, KB, 2, 2, 16] fp16
//   q8_0: qs [NB, KB, 2, 16, 32] int8,  dm [NB, KB, 2, 16] fp16
struct Weight {
  int64_t NB = 0, KB = 0;
  const uint16_t* tiles = nullptr;   // packed tiles, or nullptr for GGUF blocks
  const uint8_t* qs = nullptr;
  const at::Half* dm = nullptr;
  bool q4 = false;                   // Q4_1 (else Q8_0)
  bool vnni = false;                 // GGUF blocks in avx512_vnni.cpp's order, not tile order

  bool gguf() const { return tiles == nullptr; }
  int64_t q_block() const { return q4 ? 512 : 1024; }   // bytes of qs per tile pair
  int64_t d_block() const { return q4 ? 64 : 32; }      // halves of dm per tile pair
  const uint16_t* block_tiles(int64_t nb) const { return tiles + nb * KB * kBlockElems; }
  const uint8_t* block_qs(int64_t nb) const { return qs + nb * KB * q_block(); }
  const at::Half* block_dm(int64_t nb) const { return dm + nb * KB * d_block(); }
};

// One GEMM y = x @ W.T + bias: x [M, K] bf16, y [M, N] bf16 (allocated and checked by dispatch.cpp), bias fp32 or
// nullptr.
struct Gemm {
  const at::Tensor& x;
  const Weight& w;
  const float* bias;
  uint16_t* y;
  int64_t M, K, N;
};

// One kernel per instruction set; each is compiled only where the build supports it (see the macros above).
bool amx_usable();   // the OS granted this process the AMX tile state (amx.cpp)
void amx_gemm(const Gemm& g);
void avx512_fp32_gemm(const Gemm& g);
void avx512_fp16_gemm(const Gemm& g);
void avx512_vnni_gemm(const Gemm& g);   // GGUF blocks in VNNI order only

// f(std::integral_constant<int, rows>) for 1 <= rows <= Max: the kernels' row loops are unrolled per row count.
template <int Max, typename F>
inline void with_rows(int64_t rows, F&& f) {
  if constexpr (Max > 1) {
    if (rows < Max) return with_rows<Max - 1>(rows, f);
  }
  f(std::integral_constant<int, Max>{});
}

#ifdef RTSERVE_HAS_AVX512_BF16
// The fp32 accumulators of one 32x32 output block (+ bias) into `rows` rows of y at column block nb, rounded once to
// bf16 (nearest even); Y points at the block's first row.
inline void write_rows(const float (*c)[32], int64_t rows, const float* bias, int64_t nb, uint16_t* Y, int64_t N) {
  const __m512 b0 = bias ? _mm512_loadu_ps(bias + nb * kBlockN) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_loadu_ps(bias + nb * kBlockN + 16) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 lo = _mm512_add_ps(_mm512_load_ps(&c[r][0]), b0);
    const __m512 hi = _mm512_add_ps(_mm512_load_ps(&c[r][16]), b1);
    _mm512_storeu_si512(Y + r * N + nb * kBlockN, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}
#endif

}  // namespace rtserve::packed
