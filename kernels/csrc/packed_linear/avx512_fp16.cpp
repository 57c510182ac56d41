// bf16 linear layers as fp16 FMAs on AVX-512 FP16 CPUs without AMX, on weights packed as fp16 in the tile layout of
// tiles.h (kernels.linear.pack_linear_weight packs fp16 there), or GGUF blocks dequantized to fp16.
//
// Why: fp16 FMAs have twice the lanes of fp32 ones at the same issue rate, so this kernel takes every batch size,
// prefill included (docs/benchmarks.md).
//
// A tile row (16 columns x a k pair, 32 fp16 lanes) is multiplied by x's k pair broadcast as one 32-bit value, so each
// accumulator lane sums the even or the odd k of its column; the pairs are added at the end. fp16 accumulation would
// lose precision over a long K, so every kFlushKB tile blocks (128 k: 64 products a lane) the fp16 partial sums are
// added into fp32 ones. fp16's range is kept by scaling each row of x by a power of two (exact) to a largest
// magnitude in [8, 16), undone in fp32 at the end. The error against an exact reference is dominated by the bf16
// rounding of the output, as for fp32 accumulation (tests/kernels/test_packed_linear.py bounds it).
#include "gguf_blocks.h"

#ifdef RTSERVE_HAS_AVX512_FP16
#include <cmath>

namespace rtserve::packed {
namespace {

constexpr int64_t kFlushKB = 4;    // tile blocks of fp16 accumulation between flushes into fp32 (128 k)
constexpr int kFp16Rows = 12;   // rows per pass: 24 accumulators, 2 weight vectors, broadcasts

struct Fp16Rows {
  at::Tensor a, inv;           // x as fp16 k pairs in panels of kFp16Rows rows (see prepare_fp16); 1 / scale per row
};

// x [M, K] bf16 -> scaled fp16, as panels of kFp16Rows rows: panel p holds, for each k pair j, the 32-bit pairs of its
// rows side by side ([ceil(M / 12)][K / 2][12] uint32), so the kernel's 12 broadcasts per k pair read one 48-byte run
// instead of 12 rows K apart.
inline __m512 load_bf16(const uint16_t* s) {   // 16 bf16 -> fp32 (exact: bf16 is an fp32's top half)
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s))), 16));
}

Fp16Rows prepare_fp16(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), panels = (M + kFp16Rows - 1) / kFp16Rows;
  const at::Tensor xc = x.contiguous();
  Fp16Rows p{at::empty({panels * kFp16Rows * K}, x.options().dtype(at::kHalf)),
             at::empty({M}, x.options().dtype(at::kFloat))};
  const auto* src = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  auto* dst = reinterpret_cast<uint32_t*>(p.a.data_ptr<at::Half>());
  float* inv = p.inv.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    std::unique_ptr<uint16_t[]> row(new uint16_t[K]);
    for (int64_t r = p0 * kFp16Rows; r < std::min(M, p1 * kFp16Rows); ++r) {
      const uint16_t* s = src + r * K;
      __m512 mx = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(load_bf16(s + k)));
      const float m = _mm512_reduce_max_ps(mx);
      int e = 0;
      if (m > 0 && std::isfinite(m)) std::frexp(m, &e);   // m = f * 2^e, f in [0.5, 1)
      const float scale = std::ldexp(1.0f, 4 - e);          // m * scale in [8, 16)
      inv[r] = 1.0f / scale;
      const __m512 sv = _mm512_set1_ps(scale);
      for (int64_t k = 0; k < K; k += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(row.get() + k),
                            _mm512_cvtps_ph(_mm512_mul_ps(load_bf16(s + k), sv),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      uint32_t* panel = dst + r / kFp16Rows * kFp16Rows * (K / 2) + r % kFp16Rows;
      const auto* pairs = reinterpret_cast<const uint32_t*>(row.get());
      for (int64_t j = 0; j < K / 2; ++j) panel[j * kFp16Rows] = pairs[j];
    }
  });
  return p;
}

// R rows of one x panel (`P`, see prepare_fp16) times one fp16 column block (KB tile pairs at wb) into c[0..R): per
// row 64 fp32 lanes, (even k, odd k) pairs of columns 0-7, 8-15 (tile 0), 16-23, 24-31 (tile 1). Below 4 rows
// alternate k pairs accumulate apart, so the FMA pipes do not wait on a chain's latency.
template <int R, typename Tiles>
inline void fma16_rows(const uint32_t* P, const Tiles& tiles, int64_t KB, float (*c)[64]) {
  constexpr int S = R < 4 ? 2 : 1;
  __m512h acc[R][2][S];
  __m512 sum[R][4];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < 4; ++j) sum[i][j] = _mm512_setzero_ps();
  for (int64_t kb0 = 0; kb0 < KB; kb0 += kFlushKB) {
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < 2; ++j)
        for (int s = 0; s < S; ++s) acc[i][j][s] = _mm512_setzero_ph();
    const int64_t kb1 = std::min<int64_t>(KB, kb0 + kFlushKB);
    for (int64_t kb = kb0; kb < kb1; ++kb) {
      const uint16_t* w = tiles(kb);
      const uint32_t* x = P + kb * 16 * kFp16Rows;
#pragma GCC unroll 16
      for (int r = 0; r < 16; ++r) {
        const __m512h w0 = _mm512_castsi512_ph(_mm512_loadu_si512(w + 32 * r));
        const __m512h w1 = _mm512_castsi512_ph(_mm512_loadu_si512(w + 512 + 32 * r));
        for (int i = 0; i < R; ++i) {
          const __m512h a = _mm512_castsi512_ph(_mm512_set1_epi32(static_cast<int>(x[r * kFp16Rows + i])));
          acc[i][0][r % S] = _mm512_fmadd_ph(a, w0, acc[i][0][r % S]);
          acc[i][1][r % S] = _mm512_fmadd_ph(a, w1, acc[i][1][r % S]);
        }
      }
    }
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < 2; ++j)
        for (int s = 0; s < S; ++s) {
          const __m512i v = _mm512_castph_si512(acc[i][j][s]);
          sum[i][2 * j] = _mm512_add_ps(sum[i][2 * j], _mm512_cvtph_ps(_mm512_castsi512_si256(v)));
          sum[i][2 * j + 1] = _mm512_add_ps(sum[i][2 * j + 1], _mm512_cvtph_ps(_mm512_extracti64x4_epi64(v, 1)));
        }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < 4; ++j) _mm512_store_ps(&c[i][16 * j], sum[i][j]);
}

// 16 column sums from the (even k, odd k) lanes of two 16-lane vectors
inline __m512 add_pairs(__m512 a, __m512 b) {
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  return _mm512_add_ps(_mm512_permutex2var_ps(a, even, b), _mm512_permutex2var_ps(a, odd, b));
}

inline void write_rows16(const float (*c)[64], int64_t rows, const float* inv, const float* bias, int64_t nb,
                         uint16_t* Y, int64_t N) {
  const __m512 b0 = bias ? _mm512_loadu_ps(bias + nb * kBlockN) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_loadu_ps(bias + nb * kBlockN + 16) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 s = _mm512_set1_ps(inv[r]);
    const __m512 lo = _mm512_fmadd_ps(add_pairs(_mm512_load_ps(&c[r][0]), _mm512_load_ps(&c[r][16])), s, b0);
    const __m512 hi = _mm512_fmadd_ps(add_pairs(_mm512_load_ps(&c[r][32]), _mm512_load_ps(&c[r][48])), s, b1);
    _mm512_storeu_si512(Y + r * N + nb * kBlockN, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}


// Where fma16_rows gets column block nb's fp16 tile pair kb: packed fp16 weights or a dequantized buffer (`base`),
// or GGUF blocks dequantized right before use into a 2-slot ring, which stays in L1. The ring is for a single pass
// over the rows (M <= kFp16Rows): there a K-long buffer would be written once and read once, through L2.
struct Fp16Tiles {
  const Weight& w;
  int64_t nb;
  const uint16_t* base = nullptr;
  uint16_t* ring = nullptr;
  const uint16_t* operator()(int64_t kb) const {
    if (base) return base + kb * kBlockElems;
    uint16_t* slot = ring + (kb & 1) * kBlockElems;
    dequant_fp16(w, nb, kb, slot);
    return slot;
  }
};

// y[:, nb*32 : nb*32+32] for all M rows, kFp16Rows at a time; the column block stays in L1/L2 between passes.
inline void fma16_block(const uint32_t* A, const float* inv, int64_t M, int64_t K, const Fp16Tiles& tiles, int64_t KB,
                        const float* bias, int64_t nb, uint16_t* Y, int64_t N) {
  alignas(64) float c[kFp16Rows][64];
  for (int64_t m = 0; m < M; m += kFp16Rows) {
    const int64_t rows = std::min<int64_t>(kFp16Rows, M - m);
    const uint32_t* x = A + m * (K / 2);   // panel m / 12
    with_rows<kFp16Rows>(rows, [&](auto r) { fma16_rows<decltype(r)::value>(x, tiles, KB, c); });
    write_rows16(c, rows, inv + m, bias, nb, Y + m * N, N);
  }
}

}  // namespace

void avx512_fp16_gemm(const Gemm& g) {
  const Fp16Rows rows = prepare_fp16(g.x);
  const auto* A = reinterpret_cast<const uint32_t*>(rows.a.data_ptr<at::Half>());
  const float* inv = rows.inv.data_ptr<float>();
  const Weight& w = g.w;
  at::parallel_for(0, w.NB, 1, [&](int64_t nb0, int64_t nb1) {
    std::unique_ptr<uint16_t[]> buf = block_buffer(w, 2);
    for (int64_t nb = nb0; nb < nb1; ++nb) {
      Fp16Tiles tiles{w, nb};
      if (!w.gguf()) {
        tiles.base = w.block_tiles(nb);
      } else if (g.M > kFp16Rows) {   // several passes over the rows: dequantize the block once
        for (int64_t kb = 0; kb < w.KB; ++kb) dequant_fp16(w, nb, kb, buf.get() + kb * kBlockElems);
        tiles.base = buf.get();
      } else {
        tiles.ring = buf.get();
      }
      fma16_block(A, inv, g.M, g.K, tiles, w.KB, g.bias, nb, g.y, g.N);
    }
  });
}

}  // namespace rtserve::packed
#endif  // RTSERVE_HAS_AVX512_FP16
