// bf16 linear layers on the CPU's AMX tile units, with weights packed once at load (tiles.h).
//
// Why: oneDNN's bf16 GEMM (F.linear) re-lays the weight out for AMX on every call, which at decode sizes (8-64 rows)
// costs more than the multiply (docs/benchmarks.md). Here the weight is stored in the tile layout and each call only
// streams it: per 32 output columns, two 16x16 fp32 accumulator tiles per 16 rows of x, fed 32 k at a time.
// Accumulation is fp32 and the output is rounded once to bf16 (round to nearest even), as oneDNN does; only the
// summation order differs.
#include "gguf_blocks.h"

#ifdef RTSERVE_HAS_AMX
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>

namespace rtserve::packed {
namespace {

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

// y[:, nb*32 : nb*32+32] = A @ block^T for one column block whose KB tile pairs lie at `wb`.
// A is x in tile order (see `tile_rows`); tiles are configured by the caller's thread.
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

// One GGUF column block for Mp <= 32 (two row tiles at most): each tile pair is dequantized into slot kb % 4 of
// `ring` and loaded at once, so the bf16 weights never leave L1.
template <bool Q4>
inline void gemm_block_fused(const uint16_t* A, int64_t M, int64_t Mp, const Weight& w, int64_t nb,
                             const float* bias, uint16_t* Y, int64_t N, uint16_t* ring) {
  alignas(64) float c[32][32];
  const bool two = Mp > 16;
  const int64_t KB = w.KB;
  const uint16_t* a0 = A;
  const uint16_t* a1 = A + KB * 512;
  const uint8_t* q = w.block_qs(nb);
  const at::Half* d = w.block_dm(nb);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kb = 0; kb < KB; ++kb) {
    uint16_t* wt = ring + (kb & 3) * kBlockElems;
    if constexpr (Q4)
      dequant_q4_1(q + kb * w.q_block(), d + kb * w.d_block(), wt);
    else
      dequant_q8_0(q + kb * w.q_block(), d + kb * w.d_block(), wt);
    _tile_loadd(6, wt, 64);
    _tile_loadd(7, wt + 512, 64);
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

// x in tile order, [Mp / 16, K / 32, 16, 32], zero rows past M: each A tile is then 1 KiB of contiguous memory.
// Why: strided tile loads straight from x (a 2 KiB row stride at K = 1024) were slower than this copy, which costs
// one pass over x.
at::Tensor tile_rows(const at::Tensor& x, int64_t M, int64_t Mp, int64_t K) {
  const int64_t KB = K / kTileK, tiles = Mp / 16;
  const at::Tensor xc = x.contiguous();
  at::Tensor a = at::empty({tiles, KB, 16, kTileK}, x.options());
  const auto* src = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  auto* dst = reinterpret_cast<uint16_t*>(a.data_ptr<at::BFloat16>());
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
  return a;
}

}  // namespace

bool amx_usable() {
  // Linux grants a process the AMX tile state only on request (ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18)
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

void amx_gemm(const Gemm& g) {
  const int64_t Mp = (g.M + 15) / 16 * 16;
  const at::Tensor a = tile_rows(g.x, g.M, Mp, g.K);
  const auto* A = reinterpret_cast<const uint16_t*>(a.data_ptr<at::BFloat16>());
  const Weight& w = g.w;
  at::parallel_for(0, w.NB, 1, [&](int64_t nb0, int64_t nb1) {
    configure_tiles();
    // GGUF blocks at Mp <= 32: each tile pair is dequantized into a 4-slot L1 ring right before its tile loads;
    // larger batches reuse a column block's tiles, so they dequantize it once into a K-long buffer first
    std::unique_ptr<uint16_t[]> buf = block_buffer(w, 4);
    for (int64_t nb = nb0; nb < nb1; ++nb) {
      if (w.gguf() && Mp <= 32 && w.q4)
        gemm_block_fused<true>(A, g.M, Mp, w, nb, g.bias, g.y, g.N, buf.get());
      else if (w.gguf() && Mp <= 32)
        gemm_block_fused<false>(A, g.M, Mp, w, nb, g.bias, g.y, g.N, buf.get());
      else
        gemm_block(A, g.M, Mp, bf16_block(w, nb, buf.get()), w.KB, g.bias, nb, g.y, g.N);
    }
    _tile_release();
  });
}

}  // namespace rtserve::packed
#endif  // RTSERVE_HAS_AMX
