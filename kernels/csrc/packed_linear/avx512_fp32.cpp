// bf16 linear layers as fp32 FMAs on AVX-512 CPUs without AMX (e.g. a VM that hides AMX), on the packed bf16 tiles of
// tiles.h.
//
// One 64-byte tile row holds 16 columns x a k pair, and a shift / a mask turn it into the fp32 weights of the even and
// odd k of those 16 columns (bf16 is the top half of an fp32). Why not VDPBF16PS: on such CPUs it issues at a fraction
// of the rate of 512-bit FMAs, and oneDNN's bf16 GEMM, built on it, lost to MKL's fp32 GEMM (docs/benchmarks.md).
#include "gguf_blocks.h"

#ifdef RTSERVE_HAS_AVX512_BF16
namespace rtserve::packed {
namespace {

// R rows of fp32 x (row stride K) times one column block (KB tile pairs at wb) into c[0..R), fp32. Below 4 rows the
// even and odd k accumulate apart (4R chains), so even one row keeps both FMA pipes busy instead of waiting on a
// chain's latency; from 4 rows 2R chains are enough, and the registers go to more rows instead (8: 16 accumulators,
// 4 weight vectors, 2 broadcasts), which spreads the weight's shift / mask over more FMAs.
template <int R>
inline void fma_rows(const float* X, int64_t K, const uint16_t* wb, int64_t KB, float (*c)[32]) {
  constexpr bool split = R < 4;
  constexpr int A = split ? 4 : 2;
  __m512 acc[R][A];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < A; ++j) acc[i][j] = _mm512_setzero_ps();
  const __m512i hi_mask = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t kb = 0; kb < KB; ++kb) {
    const uint16_t* w = wb + kb * kBlockElems;
    const float* x = X + kb * kTileK;
    for (int r = 0; r < 16; ++r) {
      const __m512i v0 = _mm512_loadu_si512(w + 32 * r), v1 = _mm512_loadu_si512(w + 512 + 32 * r);
      const __m512 e0 = _mm512_castsi512_ps(_mm512_slli_epi32(v0, 16));
      const __m512 o0 = _mm512_castsi512_ps(_mm512_and_si512(v0, hi_mask));
      const __m512 e1 = _mm512_castsi512_ps(_mm512_slli_epi32(v1, 16));
      const __m512 o1 = _mm512_castsi512_ps(_mm512_and_si512(v1, hi_mask));
      for (int i = 0; i < R; ++i) {
        const __m512 xe = _mm512_set1_ps(x[i * K + 2 * r]), xo = _mm512_set1_ps(x[i * K + 2 * r + 1]);
        if constexpr (split) {
          acc[i][0] = _mm512_fmadd_ps(xe, e0, acc[i][0]);
          acc[i][1] = _mm512_fmadd_ps(xo, o0, acc[i][1]);
          acc[i][2] = _mm512_fmadd_ps(xe, e1, acc[i][2]);
          acc[i][3] = _mm512_fmadd_ps(xo, o1, acc[i][3]);
        } else {
          acc[i][0] = _mm512_fmadd_ps(xo, o0, _mm512_fmadd_ps(xe, e0, acc[i][0]));
          acc[i][1] = _mm512_fmadd_ps(xo, o1, _mm512_fmadd_ps(xe, e1, acc[i][1]));
        }
      }
    }
  }
  for (int i = 0; i < R; ++i) {
    if constexpr (split) {
      _mm512_store_ps(&c[i][0], _mm512_add_ps(acc[i][0], acc[i][1]));
      _mm512_store_ps(&c[i][16], _mm512_add_ps(acc[i][2], acc[i][3]));
    } else {
      _mm512_store_ps(&c[i][0], acc[i][0]);
      _mm512_store_ps(&c[i][16], acc[i][1]);
    }
  }
}


constexpr int kFmaRows = 8;   // rows per pass (see fma_rows)

// y[:, nb*32 : nb*32+32] for all M rows of fp32 X, kFmaRows at a time; the column block stays in L1/L2 between passes.
inline void fma_block(const float* X, int64_t M, int64_t K, const uint16_t* wb, int64_t KB, const float* bias,
                      int64_t nb, uint16_t* Y, int64_t N) {
  alignas(64) float c[32][32];
  for (int64_t m = 0; m < M; m += kFmaRows) {
    const int64_t rows = std::min<int64_t>(kFmaRows, M - m);
    const float* x = X + m * K;
    with_rows<kFmaRows>(rows, [&](auto r) { fma_rows<decltype(r)::value>(x, K, wb, KB, c); });
    write_rows(c, rows, bias, nb, Y + m * N, N);
  }
}

}  // namespace

void avx512_fp32_gemm(const Gemm& g) {
  const at::Tensor a = g.x.to(at::kFloat).contiguous();   // the kernel broadcasts fp32 x values: convert once (exact)
  const float* X = a.data_ptr<float>();
  const Weight& w = g.w;
  at::parallel_for(0, w.NB, 1, [&](int64_t nb0, int64_t nb1) {
    std::unique_ptr<uint16_t[]> buf = block_buffer(w);   // a GGUF column block dequantized to bf16 (L1/L2)
    for (int64_t nb = nb0; nb < nb1; ++nb)
      fma_block(X, g.M, g.K, bf16_block(w, nb, buf.get()), w.KB, g.bias, nb, g.y, g.N);
  });
}

}  // namespace rtserve::packed
#endif  // RTSERVE_HAS_AVX512_BF16
