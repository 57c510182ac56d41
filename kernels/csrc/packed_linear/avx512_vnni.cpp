// GGUF Q4_1 / Q8_0 linear layers as int8 dot products (VPDPBUSD) on AVX-512 VNNI CPUs without AMX or AVX-512 FP16,
// as llama.cpp computes them: each row of x is quantized per 32-element block to int8 with its own scale
// (xq = round(x / dx), dx = max|x| / 127), and each GGUF block's integer dot product with it is scaled once:
//   Q4_1 (w = d * q + m):  sum w * x^ = d * dx * sum(q * xq) + m * dx * sum(xq)
//   Q8_0 (w = d * q):      sum w * x^ = d * dx * (sum((q + 128) * xq) - 128 * sum(xq))
// where x^ = dx * xq is the quantized row, so the result is exactly the file's weights times x^ (up to fp32 rounding):
// its error against x is w . (x - x^), at most half a step dx/2 a weight (tests/kernels/test_vnni_linear.py).
//
// Why: without AMX or FP16 the other kernels multiply in fp32, 16 products an instruction; VPDPBUSD does 64 (u8 x s8,
// summed by 4 into int32 lanes), and the 4-bit weights need only a mask or a shift to become its u8 operand.
//
// The blocks are in their own order here (kernels.linear.pack_gguf_vnni_*), not tiles.h's: per 16-column tile, one
// 64-byte vector holds 4 consecutive k of each of the 16 columns in its 32-bit lanes, so x's 4 k are one broadcast
// 32-bit value and a lane is one column's sum.
//   Q4_1: qs [NB, KB, 2 tiles, 4, 64] uint8: vector v's byte 4c + b holds q[c][8v + b] (low nibble) and
//         q[c][8v + 4 + b] (high nibble); dm as tiles.h's (d then m, 16 columns each, per tile)
//   Q8_0: qs [NB, KB, 2 tiles, 8, 64] uint8: vector v's byte 4c + b is q[c][4v + b] + 128 (VPDPBUSD's unsigned
//         operand); dm as tiles.h's
#include "tiles.h"

#ifdef RTSERVE_HAS_AVX512_VNNI
namespace rtserve::packed {
namespace {

// x [M, K] quantized per block of 32: q int8 [M, K]; per row and block: d = dx, s = dx * sum(xq) (Q4_1's m term),
// c = 128 * sum(xq) (Q8_0's offset).
struct QuantizedRows {
  std::unique_ptr<int8_t[]> q;
  std::unique_ptr<float[]> d, s;
  std::unique_ptr<int32_t[]> c;
};

inline __m512 load_bf16(const uint16_t* p) {   // 16 bf16 -> fp32 (exact: bf16 is an fp32's top half)
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

QuantizedRows quantize_rows(const at::Tensor& x, int64_t M, int64_t K) {
  const int64_t KB = K / kTileK;
  QuantizedRows r{std::unique_ptr<int8_t[]>(new int8_t[M * K]), std::unique_ptr<float[]>(new float[M * KB]),
                  std::unique_ptr<float[]>(new float[M * KB]), std::unique_ptr<int32_t[]>(new int32_t[M * KB])};
  const at::Tensor xc = x.contiguous();
  const auto* src = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  at::parallel_for(0, M * KB, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {   // block b = row b / KB, k block b % KB; x's rows are K apart, as is q
      const __m512 lo = load_bf16(src + b * kTileK), hi = load_bf16(src + b * kTileK + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      // dx = amax * (1 / 127) and xq = x * (127 / amax), each product and quotient rounded once, so the test's torch
      // reference rounds exactly as here (x at half a step is common: amax / 2). The barrier keeps -ffast-math from
      // folding the quotient into the products ((x * 127) / amax rounds differently).
      const float d = amax * (1.0f / 127.0f);
      __m512 vid = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
      asm volatile("" : "+v"(vid));
      const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, vid));   // round to nearest even; |x * id| <= 127
      const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, vid));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(r.q.get() + b * kTileK), _mm512_cvtepi32_epi8(qlo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(r.q.get() + b * kTileK + 16), _mm512_cvtepi32_epi8(qhi));
      const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
      r.d[b] = d;
      r.s[b] = d * static_cast<float>(sum);
      r.c[b] = 128 * sum;
    }
  });
  return r;
}

inline __m512 half16(const at::Half* h) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
}

// R rows of quantized x (from row `row`) times 16-column tile t of column block `nb` into c[i][16t .. 16t + 16).
// Each block's integer sums start afresh, so the blocks' chains overlap; below 4 rows Q4_1's two scale terms
// accumulate apart so one row's fp32 chain does not wait on itself; from 4 rows the rows are enough chains.
template <int R, bool Q4>
inline void vnni_rows(const QuantizedRows& xq, int64_t row, int64_t K, const Weight& w, int64_t nb, int t,
                      float (*c)[32]) {
  constexpr bool split = R < 4;
  const int64_t KB = w.KB;
  __m512 acc[R], acc_m[R];
  for (int i = 0; i < R; ++i) acc[i] = acc_m[i] = _mm512_setzero_ps();
  const uint8_t* qs = w.block_qs(nb) + t * (w.q_block() / 2);
  const at::Half* dm = w.block_dm(nb) + t * (w.d_block() / 2);
  const int8_t* X = xq.q.get() + row * K;
  const float* XD = xq.d.get() + row * KB;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t kb = 0; kb < KB; ++kb, qs += w.q_block(), dm += w.d_block()) {
    __m512i sum[R];
    for (int i = 0; i < R; ++i) sum[i] = _mm512_setzero_si512();
    const int8_t* x = X + kb * kTileK;
    if constexpr (Q4) {
      for (int v = 0; v < 4; ++v) {
        const __m512i b = _mm512_loadu_si512(qs + 64 * v);
        const __m512i lo = _mm512_and_si512(b, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), nibble);
        for (int i = 0; i < R; ++i) {
          const int8_t* xi = x + i * K + 8 * v;
          sum[i] = _mm512_dpbusd_epi32(sum[i], lo, _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xi)));
          sum[i] = _mm512_dpbusd_epi32(sum[i], hi, _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xi + 4)));
        }
      }
      const __m512 d = half16(dm), m = half16(dm + 16);
      for (int i = 0; i < R; ++i) {
        const int64_t blk = i * KB + kb;
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[i]), _mm512_mul_ps(d, _mm512_set1_ps(XD[blk])), acc[i]);
        __m512& am = split ? acc_m[i] : acc[i];
        am = _mm512_fmadd_ps(m, _mm512_set1_ps(xq.s[row * KB + blk]), am);
      }
    } else {
      for (int v = 0; v < 8; ++v) {
        const __m512i b = _mm512_loadu_si512(qs + 64 * v);
        for (int i = 0; i < R; ++i)
          sum[i] = _mm512_dpbusd_epi32(sum[i], b,
                                       _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x + i * K + 4 * v)));
      }
      const __m512 d = half16(dm);
      for (int i = 0; i < R; ++i) {
        const int64_t blk = i * KB + kb;
        const __m512i s = _mm512_sub_epi32(sum[i], _mm512_set1_epi32(xq.c[row * KB + blk]));
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, _mm512_set1_ps(XD[blk])), acc[i]);
      }
    }
  }
  for (int i = 0; i < R; ++i) _mm512_store_ps(&c[i][16 * t], split ? _mm512_add_ps(acc[i], acc_m[i]) : acc[i]);
}

constexpr int kVnniRows = 8;         // rows per pass: 8 int32 sums, 8 fp32 accumulators, the weights and scales
constexpr int64_t kChunkRows = 64;   // rows whose quantized x (64 x K bytes) stays in L2 while a thread's columns pass

template <bool Q4>
void gemm(const Gemm& g) {
  const QuantizedRows xq = quantize_rows(g.x, g.M, g.K);
  const Weight& w = g.w;
  at::parallel_for(0, w.NB, 1, [&](int64_t nb0, int64_t nb1) {
    alignas(64) float c[kVnniRows][32];
    for (int64_t m0 = 0; m0 < g.M; m0 += kChunkRows) {
      const int64_t m1 = std::min(g.M, m0 + kChunkRows);
      for (int64_t nb = nb0; nb < nb1; ++nb) {
        for (int64_t m = m0; m < m1; m += kVnniRows) {
          const int64_t rows = std::min<int64_t>(kVnniRows, m1 - m);
          with_rows<kVnniRows>(rows, [&](auto r) {
            vnni_rows<decltype(r)::value, Q4>(xq, m, g.K, w, nb, 0, c);
            vnni_rows<decltype(r)::value, Q4>(xq, m, g.K, w, nb, 1, c);
          });
          write_rows(c, rows, g.bias, nb, g.y + m * g.N, g.N);
        }
      }
    }
  });
}

}  // namespace

void avx512_vnni_gemm(const Gemm& g) {
  TORCH_CHECK(g.w.gguf() && g.w.vnni, "avx512_vnni_gemm: the weight must be GGUF blocks in VNNI order");
  if (g.w.q4)
    gemm<true>(g);
  else
    gemm<false>(g);
}

}  // namespace rtserve::packed
#endif  // RTSERVE_HAS_AVX512_VNNI
