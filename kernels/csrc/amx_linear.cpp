// bf16 linear layers on the CPU's AMX tile units (or, on an AVX-512 CPU without AMX, fp16 or fp32 FMAs), with weights
// packed once at load.
//
// Why: oneDNN's bf16 GEMM (F.linear) re-lays the weight out for AMX on every call, so at decode sizes (8-64 rows) it
// ran at ~0.1-0.4 TFLOP/s on this CPU: a 32-sequence decode step of SmolLM2-135M spent ~50 of ~90 ms in its 121 GEMMs.
// Here the weight is stored in the tile layout (`kernels.pack_linear_weight`, done in torch at load) and each call only
// streams it: per 32 output columns, two 16x16 fp32 accumulator tiles per 16 rows of x, fed 32 k at a time.
//
// Packed layout [N/32, K/32, 2, 16, 32] bf16: block (nb, kb) holds two 16-column B tiles; row r of a tile is the k pair
// (2r, 2r+1) of its 16 columns, interleaved (AMX's "VNNI" order), so one tile load is 1 KiB of contiguous memory.
// Accumulation is fp32 and the output is rounded once to bf16 (round to nearest even), as oneDNN does; only the
// summation order differs.
//
// Without AMX (AVX-512 with BF16 conversions, e.g. a VM that hides AMX) the same packed layout feeds fp32 FMAs: one
// 64-byte tile row holds 16 columns x a k pair, and a shift / a mask turn it into the fp32 weights of the even and odd
// k of those 16 columns (bf16 is the top half of an fp32). Why not VDPBF16PS: on such a CPU it issued at ~1.5 G/s a
// core against ~6 G/s for 512-bit FMAs (97 against 191 GFLOP/s, measured), and oneDNN's bf16 GEMM, built on it, ran
// at half of MKL's fp32 GEMM (0.17 against 0.31 TFLOP/s at 256-1024 rows, 2 cores).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define RTSERVE_AVX512 1
#endif
#if defined(RTSERVE_AVX512) && defined(__AVX512FP16__)
#define RTSERVE_FP16 1
#endif
#if defined(RTSERVE_AVX512) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define RTSERVE_AMX 1
#endif

namespace {

constexpr int64_t kTileK = 32;      // bf16 elements in one 64-byte tile row
constexpr int64_t kBlockN = 32;     // output columns per block: two 16-column tiles
constexpr int64_t kBlockElems = 2 * 16 * 32;

#ifdef RTSERVE_AMX
struct TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0-3: fp32 accumulators (rows m..m+15 / m+16..m+31 x columns 0-15 / 16-31 of the block); 4-5: x; 6-7: weight.
void configure_tiles() {
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}
#endif

bool amx_usable() {
#ifdef RTSERVE_AMX
  // Linux grants a process the AMX tile state only on request (ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18)
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
#else
  return false;
#endif
}

int packed_isa_impl() {
#ifdef RTSERVE_AVX512
  if (amx_usable()) return 2;
#ifdef RTSERVE_FP16
  static const bool fp16 = __builtin_cpu_supports("avx512fp16") && __builtin_cpu_supports("avx512bf16");
  if (fp16) return 3;
#endif
  static const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
  return avx512 ? 1 : 0;
#else
  return 0;
#endif
}

#ifdef RTSERVE_AVX512
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

#ifdef RTSERVE_AMX
// y[:, nb*32 : nb*32+32] = A @ block^T for one column block whose KB tile pairs lie at `wb` (tile layout above).
// A is x in tile order (see `prepare`); tiles are configured by the caller's thread.
inline void gemm_block(const uint16_t* A, int64_t M, int64_t Mp, const uint16_t* wb, int64_t KB,
                       const float* bias, int64_t nb, uint16_t* Y, int64_t N) {
  alignas(64) float c[32][32];
  for (int64_t m = 0; m < Mp; m += 32) {
    const bool two = m + 16 < Mp;
    const uint16_t* a0 = A + m / 16 * KB * 512;
    _tile_zero(0);
    _tile_zero(1);
    if (two) {
      const uint16_t* a1 = a0 + KB * 512;
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t kb = 0; kb < KB; ++kb) {
        const uint16_t* w = wb + kb * kBlockElems;
        _tile_loadd(6, w, 64);
        _tile_loadd(7, w + 512, 64);
        _tile_loadd(4, a0 + kb * 512, 64);
        _tile_loadd(5, a1 + kb * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(2, &c[16][0], 128);
      _tile_stored(3, &c[16][16], 128);
    } else {
      for (int64_t kb = 0; kb < KB; ++kb) {
        const uint16_t* w = wb + kb * kBlockElems;
        _tile_loadd(6, w, 64);
        _tile_loadd(7, w + 512, 64);
        _tile_loadd(4, a0 + kb * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
      }
    }
    _tile_stored(0, &c[0][0], 128);
    _tile_stored(1, &c[0][16], 128);
    write_rows(c, std::min<int64_t>(32, M - m), bias, nb, Y + m * N, N);
  }
}
#endif

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

#ifdef RTSERVE_AMX
// One column block for Mp <= 32 (two row tiles at most): each tile pair is dequantized into slot kb % 4 of `ring` and
// loaded at once, so the bf16 weights never leave L1.
template <bool Q4>
inline void gemm_block_fused(const uint16_t* A, int64_t M, int64_t Mp, const uint8_t* q, const at::Half* d,
                             int64_t KB, const float* bias, int64_t nb, uint16_t* Y, int64_t N, uint16_t* ring) {
  alignas(64) float c[32][32];
  const bool two = Mp > 16;
  const uint16_t* a0 = A;
  const uint16_t* a1 = A + KB * 512;
  constexpr int64_t q_block = Q4 ? 512 : 1024, d_block = Q4 ? 64 : 32;  // bytes / halves per tile pair
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kb = 0; kb < KB; ++kb) {
    uint16_t* w = ring + (kb & 3) * kBlockElems;
    if (Q4)
      dequant_q4_1(q + kb * q_block, d + kb * d_block, w);
    else
      dequant_q8_0(q + kb * q_block, d + kb * d_block, w);
    _tile_loadd(6, w, 64);
    _tile_loadd(7, w + 512, 64);
    _tile_loadd(4, a0 + kb * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (two) {
      _tile_loadd(5, a1 + kb * 512, 64);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, &c[0][0], 128);
  _tile_stored(1, &c[0][16], 128);
  _tile_stored(2, &c[16][0], 128);
  _tile_stored(3, &c[16][16], 128);
  write_rows(c, std::min<int64_t>(32, M), bias, nb, Y, N);
}
#endif  // RTSERVE_AMX

// --- AVX-512 without AMX: fp32 FMAs on the same packed weights.
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
    switch (rows) {
      case 8: fma_rows<8>(x, K, wb, KB, c); break;
      case 7: fma_rows<7>(x, K, wb, KB, c); break;
      case 6: fma_rows<6>(x, K, wb, KB, c); break;
      case 5: fma_rows<5>(x, K, wb, KB, c); break;
      case 4: fma_rows<4>(x, K, wb, KB, c); break;
      case 3: fma_rows<3>(x, K, wb, KB, c); break;
      case 2: fma_rows<2>(x, K, wb, KB, c); break;
      default: fma_rows<1>(x, K, wb, KB, c); break;
    }
    write_rows(c, rows, bias, nb, Y + m * N, N);
  }
}
#endif  // RTSERVE_AVX512

#ifdef RTSERVE_FP16
// --- AVX-512 FP16 without AMX: fp16 FMAs, twice the lanes of fp32 ones at the same issue rate (measured here: ~6.4 G
// FMAs/s a core either way, 410 against 205 GFLOP/s), on weights packed as fp16 in the same tile layout.
//
// A tile row (16 columns x a k pair, 32 fp16 lanes) is multiplied by x's k pair broadcast as one 32-bit value, so each
// accumulator lane sums the even or the odd k of its column; the pairs are added at the end. fp16 accumulation would
// lose precision over a long K, so every kFlushKB tile blocks (128 k: 64 products a lane) the fp16 partial sums are
// added into fp32 ones. fp16's range is kept by scaling each row of x by a power of two (exact) to a largest
// magnitude in [8, 16), undone in fp32 at the end. Measured against an exact reference on N(0,1) x and N(0, 0.05)
// weights: max error 3.2e-3 of the largest output against 2.7e-3 for fp32 accumulation rounded once to bf16; both
// are dominated by the bf16 rounding of the output.
constexpr int64_t kFlushKB = 4;
constexpr int kFp16Rows = 12;   // rows per pass: 24 accumulators, 2 weight vectors, broadcasts

struct Fp16Rows {
  at::Tensor a, inv;           // x as fp16 k pairs in panels of kFp16Rows rows (see prepare_fp16); 1 / scale per row
};

// x [M, K] bf16 -> scaled fp16, as panels of kFp16Rows rows: panel p holds, for each k pair j, the 32-bit pairs of its
// rows side by side ([ceil(M / 12)][K / 2][12] uint32), so the kernel's 12 broadcasts per k pair read one 48-byte run
// instead of 12 rows K apart (measured 1.2-1.3x on 516-row GEMMs against row-major x).
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

// y[:, nb*32 : nb*32+32] for all M rows, kFp16Rows at a time; the column block stays in L1/L2 between passes.
template <typename Tiles>
inline void fma16_block(const uint32_t* A, const float* inv, int64_t M, int64_t K, const Tiles& tiles, int64_t KB,
                        const float* bias, int64_t nb, uint16_t* Y, int64_t N) {
  alignas(64) float c[kFp16Rows][64];
  for (int64_t m = 0; m < M; m += kFp16Rows) {
    const int64_t rows = std::min<int64_t>(kFp16Rows, M - m);
    const uint32_t* x = A + m * (K / 2);   // panel m / 12
    switch (rows) {
      case 12: fma16_rows<12>(x, tiles, KB, c); break;
      case 11: fma16_rows<11>(x, tiles, KB, c); break;
      case 10: fma16_rows<10>(x, tiles, KB, c); break;
      case 9: fma16_rows<9>(x, tiles, KB, c); break;
      case 8: fma16_rows<8>(x, tiles, KB, c); break;
      case 7: fma16_rows<7>(x, tiles, KB, c); break;
      case 6: fma16_rows<6>(x, tiles, KB, c); break;
      case 5: fma16_rows<5>(x, tiles, KB, c); break;
      case 4: fma16_rows<4>(x, tiles, KB, c); break;
      case 3: fma16_rows<3>(x, tiles, KB, c); break;
      case 2: fma16_rows<2>(x, tiles, KB, c); break;
      default: fma16_rows<1>(x, tiles, KB, c); break;
    }
    write_rows16(c, rows, inv + m, bias, nb, Y + m * N, N);
  }
}

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
// Where fma16_rows gets column block nb's fp16 tile pair kb: packed fp16 weights or a dequantized buffer (`base`),
// or GGUF blocks dequantized right before use into a 2-slot ring, which stays in L1. The ring is for a single pass
// over the rows (M <= kFp16Rows): there a K-long buffer would be written once and read once, through L2 at K = 1536.
struct Fp16Tiles {
  const uint16_t* base = nullptr;
  const uint8_t* q = nullptr;
  const at::Half* d = nullptr;
  int64_t q_block = 0, d_block = 0;
  bool q4 = true;
  uint16_t* ring = nullptr;
  void dequant(int64_t kb, uint16_t* out) const {
    if (q4)
      dequant_q4_1_fp16(q + kb * q_block, d + kb * d_block, out);
    else
      dequant_q8_0_fp16(q + kb * q_block, d + kb * d_block, out);
  }
  const uint16_t* operator()(int64_t kb) const {
    if (base) return base + kb * kBlockElems;
    uint16_t* slot = ring + (kb & 1) * kBlockElems;
    dequant(kb, slot);
    return slot;
  }
};
#endif  // RTSERVE_FP16

struct Prepared {
  at::Tensor out, a, bias_f;
  int64_t M, Mp;
  int isa;                  // 2 AMX (a: x in tile order, bf16), 1 AVX-512 (a: x as fp32 [M, K])
  const float* bias = nullptr;
};

Prepared prepare(const at::Tensor& x, int64_t K, int64_t N, const c10::optional<at::Tensor>& bias) {
  Prepared p;
  p.isa = packed_isa_impl();
  TORCH_CHECK(p.isa > 0, "amx_linear: this CPU or build has neither AMX nor AVX-512 BF16");
  if (p.isa == 3) p.isa = 1;   // bf16 weights on an FP16 CPU: the fp32 FMA kernel
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "amx_linear expects x [rows, K] bf16");
  TORCH_CHECK(x.size(1) == K, "amx_linear: x has ", x.size(1), " features, the packed weight ", K);
  p.M = x.size(0);
  p.out = at::empty({p.M, N}, x.options());
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "amx_linear: bias has ", bias->numel(), " elements, expected ", N);
    p.bias_f = bias->to(at::kFloat).contiguous();
    p.bias = p.bias_f.data_ptr<float>();
  }
  p.Mp = (p.M + 15) / 16 * 16;
  if (p.isa == 1) {   // the FMA kernel broadcasts fp32 x values: convert once (exact)
    p.a = x.to(at::kFloat).contiguous();
    return p;
  }
  // x in tile order, [Mp / 16, K / 32, 16, 32], zero rows past M: each A tile is then 1 KiB of contiguous memory.
  // Strided tile loads straight from x (a 2 KiB row stride at K = 1024) ran at ~0.4 TFLOP/s a core on a 512-row
  // GEMM against ~0.68 from this layout; the copy costs one pass over x.
  const int64_t KB = K / kTileK, tiles = p.Mp / 16;
  const at::Tensor xc = x.contiguous();
  p.a = at::empty({tiles, KB, 16, kTileK}, x.options());
  const auto* src = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  auto* dst = reinterpret_cast<uint16_t*>(p.a.data_ptr<at::BFloat16>());
  const int64_t M = p.M;
  at::parallel_for(0, tiles, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t kb = 0; kb < KB; ++kb)
        for (int64_t r = 0; r < 16; ++r) {
          uint16_t* d = dst + ((t * KB + kb) * 16 + r) * kTileK;
          const int64_t row = t * 16 + r;
          if (row < M)
            std::memcpy(d, src + row * K + kb * kTileK, kTileK * 2);
          else
            std::memset(d, 0, kTileK * 2);
        }
  });
  return p;
}

}  // namespace

int64_t packed_isa() { return packed_isa_impl(); }

#ifdef RTSERVE_FP16
namespace {
// Shared by both fp16 entry points: x to fp16 rows, then `block(nb, M, buf)` hands back where column block nb's fp16
// tiles come from (Fp16Tiles: the packed weight, GGUF blocks dequantized into the thread's K-long buffer, or into
// its ring) for fma16_block.
template <typename Block>
at::Tensor fp16_gemm(const at::Tensor& x, int64_t NB, int64_t KB, const c10::optional<at::Tensor>& bias,
                     bool needs_buffer, Block block) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "amx_linear expects x [rows, K] bf16");
  const int64_t K = KB * kTileK, N = NB * kBlockN, M = x.size(0);
  TORCH_CHECK(x.size(1) == K, "amx_linear: x has ", x.size(1), " features, the packed weight ", K);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  at::Tensor bias_f;
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "amx_linear: bias has ", bias->numel(), " elements, expected ", N);
    bias_f = bias->to(at::kFloat).contiguous();
    b = bias_f.data_ptr<float>();
  }
  const Fp16Rows rows = prepare_fp16(x);
  const auto* A = reinterpret_cast<const uint32_t*>(rows.a.data_ptr<at::Half>());
  const float* inv = rows.inv.data_ptr<float>();
  auto* Y = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, NB, 1, [&](int64_t nb0, int64_t nb1) {
    std::unique_ptr<uint16_t[]> buf(needs_buffer ? new uint16_t[std::max<int64_t>(KB, 2) * kBlockElems] : nullptr);
    for (int64_t nb = nb0; nb < nb1; ++nb)
      fma16_block(A, inv, M, K, block(nb, M, buf.get()), KB, b, nb, Y, N);
  });
  return out;
}
}  // namespace
#endif

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.dim() == 5 && (packed.scalar_type() == at::kBFloat16 || packed.scalar_type() == at::kHalf) &&
                  packed.is_contiguous() &&
                  packed.size(2) == 2 && packed.size(3) == 16 && packed.size(4) == 32,
              "amx_linear expects a weight packed by kernels.pack_linear_weight");
  const int64_t NB = packed.size(0), KB = packed.size(1), N = NB * kBlockN;
  if (packed.scalar_type() == at::kHalf) {   // fp16 tiles: the FP16 FMA kernel, any number of rows
#ifdef RTSERVE_FP16
    TORCH_CHECK(packed_isa_impl() == 3, "amx_linear: fp16 weights need an AVX-512 FP16 CPU");
    const auto* W = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::Half>());
    return fp16_gemm(x, NB, KB, bias, false, [&](int64_t nb, int64_t, uint16_t*) {
      Fp16Tiles t;
      t.base = W + nb * KB * kBlockElems;
      return t;
    });
#else
    TORCH_CHECK(false, "amx_linear: this build has no AVX-512 FP16 kernel");
#endif
  }
  Prepared p = prepare(x, KB * kTileK, N, bias);
  if (p.M == 0) return p.out;
#ifdef RTSERVE_AVX512
  const auto* W = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  auto* Y = reinterpret_cast<uint16_t*>(p.out.data_ptr<at::BFloat16>());
  if (p.isa == 1) {
    const float* X = p.a.data_ptr<float>();
    at::parallel_for(0, NB, 1, [&](int64_t nb0, int64_t nb1) {
      for (int64_t nb = nb0; nb < nb1; ++nb)
        fma_block(X, p.M, KB * kTileK, W + nb * KB * kBlockElems, KB, p.bias, nb, Y, N);
    });
    return p.out;
  }
#endif
#ifdef RTSERVE_AMX
  const auto* A = reinterpret_cast<const uint16_t*>(p.a.data_ptr<at::BFloat16>());
  at::parallel_for(0, NB, 1, [&](int64_t nb0, int64_t nb1) {
    configure_tiles();
    for (int64_t nb = nb0; nb < nb1; ++nb)
      gemm_block(A, p.M, p.Mp, W + nb * KB * kBlockElems, KB, p.bias, nb, Y, N);
    _tile_release();
  });
#endif
  return p.out;
}

// The same GEMM on GGUF blocks: each column block is dequantized to bf16 (or, on the fp16 path, fp16) tiles
// (L1/L2-resident) right before use, so the weight streams from memory at 5 (Q4_1) or 9 (Q8_0) bits a weight, not 16.
//   q4_1: qs [NB, KB, 2, 16, 16] uint8, dm [NB, KB, 2, 2, 16] fp16
//   q8_0: qs [NB, KB, 2, 16, 32] int8,  dm [NB, KB, 2, 16] fp16
at::Tensor amx_linear_gguf(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& dm,
                           const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(qs.dim() == 5 && qs.size(2) == 2 && qs.size(3) == 16 && (qs.size(4) == 16 || qs.size(4) == 32) &&
                  qs.is_contiguous() && dm.is_contiguous() && dm.scalar_type() == at::kHalf &&
                  dm.numel() == qs.size(0) * qs.size(1) * 2 * (qs.size(4) == 16 ? 32 : 16),
              "amx_linear_gguf expects blocks packed by kernels.pack_gguf_q4_1 / pack_gguf_q8_0");
  const bool q4 = qs.size(4) == 16;
  const int64_t NB = qs.size(0), KB = qs.size(1), N = NB * kBlockN;
#ifdef RTSERVE_FP16
  if (packed_isa_impl() == 3) {   // dequantized to fp16 tiles (the file's weights rounded once), any number of rows
    const auto* Q = reinterpret_cast<const uint8_t*>(qs.data_ptr());
    const auto* D = dm.data_ptr<at::Half>();
    const int64_t q_block = q4 ? 512 : 1024, d_block = q4 ? 64 : 32;
    return fp16_gemm(x, NB, KB, bias, true, [&](int64_t nb, int64_t M, uint16_t* buf) {
      Fp16Tiles t;
      t.q = Q + nb * KB * q_block;
      t.d = D + nb * KB * d_block;
      t.q_block = q_block;
      t.d_block = d_block;
      t.q4 = q4;
      t.ring = buf;
      if (M > kFp16Rows) {   // several passes over the rows: dequantize the block once
        for (int64_t kb = 0; kb < KB; ++kb) t.dequant(kb, buf + kb * kBlockElems);
        t.base = buf;
      }
      return t;
    });
  }
#endif
  Prepared p = prepare(x, KB * kTileK, N, bias);
  if (p.M == 0) return p.out;
#ifdef RTSERVE_AVX512
  const auto* Q = reinterpret_cast<const uint8_t*>(qs.data_ptr());
  const auto* D = dm.data_ptr<at::Half>();
  auto* Y = reinterpret_cast<uint16_t*>(p.out.data_ptr<at::BFloat16>());
  const int64_t q_block = q4 ? 512 : 1024, d_block = q4 ? 64 : 32;  // bytes / halves per tile pair
  // a column block's tile pairs dequantized into a K-long bf16 buffer (L1/L2), then multiplied
  auto dequant_block = [&](int64_t nb, uint16_t* out) {
    const uint8_t* q = Q + nb * KB * q_block;
    const at::Half* d = D + nb * KB * d_block;
    for (int64_t kb = 0; kb < KB; ++kb) {
      if (q4)
        dequant_q4_1(q + kb * q_block, d + kb * d_block, out + kb * kBlockElems);
      else
        dequant_q8_0(q + kb * q_block, d + kb * d_block, out + kb * kBlockElems);
    }
  };
  if (p.isa == 1) {
    const float* X = p.a.data_ptr<float>();
    at::parallel_for(0, NB, 1, [&](int64_t nb0, int64_t nb1) {
      std::unique_ptr<uint16_t[]> buf(new uint16_t[KB * kBlockElems]);
      for (int64_t nb = nb0; nb < nb1; ++nb) {
        dequant_block(nb, buf.get());
        fma_block(X, p.M, KB * kTileK, buf.get(), KB, p.bias, nb, Y, N);
      }
    });
    return p.out;
  }
#endif
#ifdef RTSERVE_AMX
  const auto* A = reinterpret_cast<const uint16_t*>(p.a.data_ptr<at::BFloat16>());
  at::parallel_for(0, NB, 1, [&](int64_t nb0, int64_t nb1) {
    configure_tiles();
    // Mp <= 32: each tile pair is dequantized into a 4-slot L1 ring right before its tile loads (measured ~1.3x
    // faster than the buffered form there); larger batches reuse a column block's tiles, so they dequantize it once
    // into a K-long buffer first
    std::unique_ptr<uint16_t[]> buf(new uint16_t[std::max<int64_t>(KB, 4) * kBlockElems]);
    for (int64_t nb = nb0; nb < nb1; ++nb) {
      if (p.Mp <= 32) {
        const uint8_t* q = Q + nb * KB * q_block;
        const at::Half* d = D + nb * KB * d_block;
        if (q4)
          gemm_block_fused<true>(A, p.M, p.Mp, q, d, KB, p.bias, nb, Y, N, buf.get());
        else
          gemm_block_fused<false>(A, p.M, p.Mp, q, d, KB, p.bias, nb, Y, N, buf.get());
        continue;
      }
      dequant_block(nb, buf.get());
      gemm_block(A, p.M, p.Mp, buf.get(), KB, p.bias, nb, Y, N);
    }
    _tile_release();
  });
#endif
  return p.out;
}

TORCH_LIBRARY_FRAGMENT(rtserve_cpu, m) {
  m.def("packed_isa() -> int", TORCH_FN(packed_isa));
  m.def("amx_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.impl("amx_linear", c10::DispatchKey::CPU, TORCH_FN(amx_linear));
  m.def("amx_linear_gguf(Tensor x, Tensor qs, Tensor dm, Tensor? bias) -> Tensor");
  m.impl("amx_linear_gguf", c10::DispatchKey::CPU, TORCH_FN(amx_linear_gguf));
}
