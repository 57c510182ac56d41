// GGUF Q4_1 / Q8_0 blocks (in the tile order of tiles.h) dequantized to 16-bit tile pairs, shared by the kernels:
// to bf16 for AMX and the fp32 FMAs, to fp16 for the AVX-512 FP16 FMAs. A GEMM dequantizes each column block right
// before use, so the weight streams from memory at 5 (Q4_1) or 9 (Q8_0) bits a weight, not 16.
#pragma once

#include "tiles.h"

namespace rtserve::packed {

#ifdef RTSERVE_HAS_AVX512_BF16
// Per-column scales of a 16-column tile, spread to the tile-row lanes: lane e of a row belongs to column e / 2.
inline void spread(const at::Half* h, __m512& lo, __m512& hi) {
  const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
  lo = _mm512_permutexvar_ps(_mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0), v);
  hi = _mm512_permutexvar_ps(_mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8), v);
}

// fp32 products and sums rounded separately (no FMA), as gguf's numpy dequantization computes them, so a dequantized
// weight is bit for bit the bf16 weight the dense model was loaded with
inline __m512 no_fma(__m512 v) {
  asm volatile("" : "+v"(v));
  return v;
}

// Q4_1 tile pair -> bf16 tile pair. Per tile: qs [16 rows][16 bytes], byte i holding lanes i (low nibble) and i + 16
// (high nibble) of its row; dm [2][16] fp16: d then m per column. w = d * q + m.
inline void dequant_q4_1(const uint8_t* qs, const at::Half* dm, uint16_t* out) {
  for (int t = 0; t < 2; ++t, qs += 256, dm += 32, out += 512) {
    __m512 d_lo, d_hi, m_lo, m_hi;
    spread(dm, d_lo, d_hi);
    spread(dm + 16, m_lo, m_hi);
    for (int r = 0; r < 16; ++r) {
      const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16 * r)));
      const __m512 q_lo = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(0x0F)));
      const __m512 q_hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
      const __m512 lo = _mm512_add_ps(no_fma(_mm512_mul_ps(d_lo, q_lo)), m_lo);
      const __m512 hi = _mm512_add_ps(no_fma(_mm512_mul_ps(d_hi, q_hi)), m_hi);
      _mm512_storeu_si512(out + 32 * r, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
}

// Q8_0 tile pair -> bf16 tile pair. Per tile: qs [16 rows][32] int8 in tile-row order; dm [16] fp16 d per column.
inline void dequant_q8_0(const uint8_t* qs, const at::Half* dm, uint16_t* out) {
  for (int t = 0; t < 2; ++t, qs += 512, dm += 16, out += 512) {
    __m512 d_lo, d_hi;
    spread(dm, d_lo, d_hi);
    for (int r = 0; r < 16; ++r) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * r));
      const __m512 q_lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
      const __m512 q_hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
      _mm512_storeu_si512(out + 32 * r,
                          (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(q_hi, d_hi), _mm512_mul_ps(q_lo, d_lo)));
    }
  }
}

using DequantPair = void (*)(const uint8_t* qs, const at::Half* dm, uint16_t* out);

// Tile pair kb of column block nb of GGUF weight w -> a 16-bit tile pair at out, by the Q4_1 or the Q8_0 dequantizer.
template <DequantPair Q4_1, DequantPair Q8_0>
inline void dequant(const Weight& w, int64_t nb, int64_t kb, uint16_t* out) {
  const uint8_t* q = w.block_qs(nb) + kb * w.q_block();
  const at::Half* d = w.block_dm(nb) + kb * w.d_block();
  if (w.q4)
    Q4_1(q, d, out);
  else
    Q8_0(q, d, out);
}

constexpr auto dequant_bf16 = dequant<dequant_q4_1, dequant_q8_0>;

// Column block nb's bf16 tiles: the packed ones in place, or GGUF blocks dequantized into `buf` (KB tile pairs).
inline const uint16_t* bf16_block(const Weight& w, int64_t nb, uint16_t* buf) {
  if (!w.gguf()) return w.block_tiles(nb);
  for (int64_t kb = 0; kb < w.KB; ++kb) dequant_bf16(w, nb, kb, buf + kb * kBlockElems);
  return buf;
}

// A per-thread buffer for bf16_block: KB tile pairs (at least `min_pairs`) for GGUF weights, none for packed ones.
inline std::unique_ptr<uint16_t[]> block_buffer(const Weight& w, int64_t min_pairs = 1) {
  if (!w.gguf()) return nullptr;
  return std::unique_ptr<uint16_t[]>(new uint16_t[std::max<int64_t>(w.KB, min_pairs) * kBlockElems]);
}
#endif  // RTSERVE_HAS_AVX512_BF16

#ifdef RTSERVE_HAS_AVX512_FP16
// Per-column fp16 scales of a 16-column tile, spread to the tile-row lanes (lane e belongs to column e / 2).
inline __m512h spread16(const at::Half* h) {
  const __m512i idx = _mm512_set_epi16(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8,
                                       7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i v = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
  return _mm512_castsi512_ph(_mm512_permutexvar_epi16(idx, v));
}

// Q4_1 tile pair -> fp16 tile pair: w = d * q + m in one fp16 FMA, i.e. the file's weight rounded once to fp16
// (q has 4 bits and d, m are fp16: the product and sum are exact before that rounding).
inline void dequant_q4_1_fp16(const uint8_t* qs, const at::Half* dm, uint16_t* out) {
  for (int t = 0; t < 2; ++t, qs += 256, dm += 32, out += 512) {
    const __m512h d = spread16(dm), m = spread16(dm + 16);
    for (int r = 0; r < 16; ++r) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16 * r));
      const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(b), _mm_srli_epi16(b, 4), 1);
      const __m512i q = _mm512_and_si512(_mm512_cvtepu8_epi16(both), _mm512_set1_epi16(0x0F));
      _mm512_storeu_si512(out + 32 * r, _mm512_castph_si512(_mm512_fmadd_ph(_mm512_cvtepi16_ph(q), d, m)));
    }
  }
}

// Q8_0 tile pair -> fp16 tile pair: w = d * q rounded once to fp16.
inline void dequant_q8_0_fp16(const uint8_t* qs, const at::Half* dm, uint16_t* out) {
  for (int t = 0; t < 2; ++t, qs += 512, dm += 16, out += 512) {
    const __m512h d = spread16(dm);
    for (int r = 0; r < 16; ++r) {
      const __m512i q = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * r)));
      _mm512_storeu_si512(out + 32 * r, _mm512_castph_si512(_mm512_mul_ph(_mm512_cvtepi16_ph(q), d)));
    }
  }
}

constexpr auto dequant_fp16 = dequant<dequant_q4_1_fp16, dequant_q8_0_fp16>;
#endif  // RTSERVE_HAS_AVX512_FP16

}  // namespace rtserve::packed
