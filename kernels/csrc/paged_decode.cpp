// Paged decode attention for the CPU: one query token per sequence, read straight from its pages (the block table).
//
// Why a C++ op: in pure torch a decode step must first gather every sequence's pages into a padded tensor and then run
// SDPA's flash kernel, whose per-(sequence, head) setup dominates when there is one query row. This loop reads each
// key/value row once, in place, and parallelises over (sequence, kv head) on torch's own thread pool.
//
// Layout (kernels/torch_ops.py): q/out [tokens, heads, d]; k/v cache [pages, page_size, kv_heads, d];
// block_tables [B, max_pages] int32, the pages of each sequence; seq_lens [B] int32 (context including the query
// token).
// rows[i] is the q/out row of decode i and seqs[i] its sequence index. Math in fp32 whatever the storage dtype.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

// Raw views of the op's arguments, shared by both loops.
template <typename scalar_t>
struct Batch {
  const scalar_t *q, *k, *v;
  scalar_t* out;
  const int32_t *tables, *lens;
  const int64_t *rows, *seqs;
  int64_t nd, heads, d, page_size, kv_heads, group, max_pages, q_stride, o_stride, slot_stride;
  float scale;

  Batch(const at::Tensor& q_, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
        const at::Tensor& seq_lens, const at::Tensor& rows_, const at::Tensor& seqs_, double scale_, at::Tensor& out_)
      : q(q_.data_ptr<scalar_t>()), k(k_cache.data_ptr<scalar_t>()), v(v_cache.data_ptr<scalar_t>()),
        out(out_.data_ptr<scalar_t>()), tables(block_tables.data_ptr<int32_t>()), lens(seq_lens.data_ptr<int32_t>()),
        rows(rows_.data_ptr<int64_t>()), seqs(seqs_.data_ptr<int64_t>()), nd(rows_.size(0)), heads(q_.size(1)),
        d(q_.size(2)), page_size(k_cache.size(1)), kv_heads(k_cache.size(2)), group(q_.size(1) / k_cache.size(2)),
        max_pages(block_tables.size(1)), q_stride(q_.stride(0)), o_stride(out_.stride(0)),
        slot_stride(k_cache.size(2) * q_.size(2)), scale(static_cast<float>(scale_)) {}

  // offset of token t's row for kv head h in the cache, through the sequence's block table (its pages)
  int64_t slot(const int32_t* table, int64_t t, int64_t h) const {
    return (static_cast<int64_t>(table[t / page_size]) * page_size + t % page_size) * slot_stride + h * d;
  }
};

// ---- head_dim 64: the whole row lives in four 16-lane registers ------------------------------------------------------
// GCC vector types (portable; AVX-512 registers where the CPU has them). The generic loop below spends most of its time
// in dependent multiply-add chains and in re-reading its accumulators from memory; here the G heads of a group run as
// independent chains and the output accumulators stay in registers across the whole context.
typedef float v16f __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));

template <typename scalar_t>
static inline v16f load16(const scalar_t* p) {
  v16f f;
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    v16h h;
    std::memcpy(&h, p, sizeof(h));
    v16u u = __builtin_convertvector(h, v16u) << 16;
    std::memcpy(&f, &u, sizeof(f));
  } else if constexpr (std::is_same_v<scalar_t, float>) {
    std::memcpy(&f, p, sizeof(f));
  } else {
    for (int x = 0; x < 16; ++x) f[x] = static_cast<float>(p[x]);
  }
  return f;
}

typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

// horizontal sum as a halving tree (a lane-by-lane loop compiles to ~30 scalar instructions; this is 8)
static inline float hsum(v16f v) {
  const v8f a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4f b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// r[t] = sum of v[t]'s lanes for 16 vectors at once: four rounds of pairwise lane shuffles and adds (15 adds, 30
// shuffles for 16 sums, against 8 dependent operations for each sum on its own)
static inline v16f reduce16(const v16f* v) {
  v16f a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // [t 8 partials, t+1 8 partials]
    a[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)  // 4 tokens x 4 partials
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)  // 8 tokens x 2 partials
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// Touch bytes [from, to) of a cache row so that they are in flight while the current head computes.
static inline void prefetch_bytes(const void* row, int64_t from, int64_t to) {
  for (int64_t off = from; off < to; off += 64) __builtin_prefetch(static_cast<const char*>(row) + off, 0, 3);
}

// How far ahead of the loops the pages of K and V are prefetched, in tokens. Pages are scattered in memory, and the
// hardware prefetchers ramp up again at every page (a 4-slot page is 1.5 KB of rows). 64 tokens ahead was the
// shortest distance that gained all there was to gain (docs/benchmarks.md).
constexpr int64_t kPrefetchTokens = 64;

template <typename scalar_t, int G>
static void decode_d64(const Batch<scalar_t>& b) {
  // Decode attention is bound by memory, not arithmetic: a token's keys for all kv heads are one contiguous row
  // (kv_heads x 128 bytes in bf16), but a task per (sequence, kv head) reads 2 of every 6 lines, a strided pattern the
  // hardware prefetchers follow badly. With enough sequences to keep the threads busy a task takes a whole sequence,
  // and the first head's pass prefetches the other heads' lines of each row, so each row is fetched as one stream and
  // the later heads read from cache.
  const int64_t heads_per_task = b.nd >= 4 * at::get_num_threads() ? b.kv_heads : 1;
  const int64_t row_bytes = b.slot_stride * static_cast<int64_t>(sizeof(scalar_t)), head_bytes = 64 * sizeof(scalar_t);
  at::parallel_for(0, b.nd * b.kv_heads / heads_per_task, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin * heads_per_task; task < end * heads_per_task; ++task) {
      const int64_t i = task / b.kv_heads, h = task % b.kv_heads, seq = b.seqs[i], ctx = b.lens[seq];
      const bool prefetch = heads_per_task > 1 && h == 0;
      const int32_t* table = b.tables + seq * b.max_pages;
      // The pass that reads a page from memory prefetches the page `ahead` pages on: the whole page (every head's
      // lines; a page's rows are contiguous) in a whole-sequence task, whose later heads then read from cache, or
      // this head's lines in a per-head task.
      const int64_t num_pages = (ctx + b.page_size - 1) / b.page_size;
      const int64_t ahead = std::max<int64_t>(1, kPrefetchTokens / b.page_size);
      auto page_base = [&](const scalar_t* cache, int64_t j) {  // row 0 of page j (a page index: no division)
        return cache + static_cast<int64_t>(table[j]) * b.page_size * b.slot_stride;
      };
      auto prefetch_page = [&](const scalar_t* cache, int64_t j) {
        if ((heads_per_task > 1 && h > 0) || j >= num_pages) return;
        const char* page = reinterpret_cast<const char*>(page_base(cache, j));
        if (heads_per_task > 1)
          prefetch_bytes(page, 0, b.page_size * row_bytes);
        else
          for (int64_t r = 0; r < b.page_size; ++r)
            prefetch_bytes(page + r * row_bytes + h * head_bytes, 0, head_bytes);
      };
      for (int64_t j = 1; j < ahead; ++j) prefetch_page(b.k, j);
      const scalar_t* q_row = b.q + b.rows[i] * b.q_stride + h * G * 64;
      scores.resize(G * ctx);
      v16f q[G][4];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < 4; ++c) q[g][c] = load16(q_row + g * 64 + c * 16) * b.scale;
      float mx[G];
      for (int g = 0; g < G; ++g) mx[g] = -3.0e38f;
      // scores = q . k, 16 tokens at a time (products, then one reduction for the 16), any rest one by one
      auto group16 = [&](auto row_at, int64_t t) {
        v16f prod[G][16];
        for (int o = 0; o < 16; ++o) {
          const scalar_t* k = row_at(o);
          if (prefetch) prefetch_bytes(k, head_bytes, row_bytes);
          const v16f k0 = load16(k), k1 = load16(k + 16), k2 = load16(k + 32), k3 = load16(k + 48);
          for (int g = 0; g < G; ++g) prod[g][o] = q[g][0] * k0 + q[g][1] * k1 + q[g][2] * k2 + q[g][3] * k3;
        }
        for (int g = 0; g < G; ++g) {
          const v16f sv = reduce16(prod[g]);
          std::memcpy(&scores[g * ctx + t], &sv, sizeof(sv));
          for (int x = 0; x < 16; ++x) mx[g] = sv[x] > mx[g] ? sv[x] : mx[g];
        }
      };
      auto single = [&](const scalar_t* k, int64_t t) {
        if (prefetch) prefetch_bytes(k, head_bytes, row_bytes);
        const v16f k0 = load16(k), k1 = load16(k + 16), k2 = load16(k + 32), k3 = load16(k + 48);
        for (int g = 0; g < G; ++g) {  // the G heads as independent chains
          const float sc = hsum(q[g][0] * k0 + q[g][1] * k1 + q[g][2] * k2 + q[g][3] * k3);
          scores[g * ctx + t] = sc;
          mx[g] = sc > mx[g] ? sc : mx[g];
        }
      };
      if (b.page_size % 16 == 0) {  // groups inside a page: rows at a fixed stride (no division per token)
        for (int64_t j = 0, t0 = 0; t0 < ctx; ++j, t0 += b.page_size) {
          prefetch_page(b.k, j + ahead);
          const scalar_t* kb = page_base(b.k, j) + h * 64;
          const int64_t n = std::min(b.page_size, ctx - t0);
          for (int64_t o0 = 0; o0 + 16 <= n; o0 += 16)
            group16([&](int o) { return kb + (o0 + o) * b.slot_stride; }, t0 + o0);
          for (int64_t o = n / 16 * 16; o < n; ++o) single(kb + o * b.slot_stride, t0 + o);
        }
      } else {  // smaller pages (e.g. 8): a group spans pages, rows walked along the block table
        const scalar_t* rows16[16];
        int64_t page = 0, off = 0;  // block-table entry (a page) and row of the next token
        for (int64_t t0 = 0; t0 < ctx; t0 += 16) {
          const int64_t n = std::min<int64_t>(16, ctx - t0);
          for (int64_t o = 0; o < n; ++o) {
            if (off == 0) prefetch_page(b.k, page + ahead);
            rows16[o] = b.k + (static_cast<int64_t>(table[page]) * b.page_size + off) * b.slot_stride + h * 64;
            if (++off == b.page_size) off = 0, ++page;
          }
          if (n == 16)
            group16([&](int o) { return rows16[o]; }, t0);
          else
            for (int64_t o = 0; o < n; ++o) single(rows16[o], t0 + o);
        }
      }
      float inv[G];
      for (int g = 0; g < G; ++g) {  // softmax numerators; the division happens once, at the end
        float* s = scores.data() + g * ctx;
        float sum = 0.f;
        for (int64_t t = 0; t < ctx; ++t) { s[t] = std::exp(s[t] - mx[g]); sum += s[t]; }
        inv[g] = 1.f / sum;
      }
      v16f acc[G][4] = {};
      for (int64_t j = 0; j < ahead; ++j) prefetch_page(b.v, j);
      for (int64_t j = 0, t0 = 0; t0 < ctx; ++j, t0 += b.page_size) {  // out = p . v, accumulators in registers
        prefetch_page(b.v, j + ahead);
        const scalar_t* vb = page_base(b.v, j) + h * 64;
        const int64_t n = std::min(b.page_size, ctx - t0);
        for (int64_t o = 0; o < n; ++o) {
          const scalar_t* v = vb + o * b.slot_stride;
          if (prefetch) prefetch_bytes(v, head_bytes, row_bytes);
          const v16f v0 = load16(v), v1 = load16(v + 16), v2 = load16(v + 32), v3 = load16(v + 48);
          for (int g = 0; g < G; ++g) {
            const float p = scores[g * ctx + t0 + o];
            acc[g][0] += p * v0; acc[g][1] += p * v1; acc[g][2] += p * v2; acc[g][3] += p * v3;
          }
        }
      }
      scalar_t* o = b.out + b.rows[i] * b.o_stride + h * G * 64;
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < 4; ++c)
          for (int x = 0; x < 16; ++x) o[g * 64 + c * 16 + x] = static_cast<scalar_t>(acc[g][c][x] * inv[g]);
    }
  });
}

// Any head_dim and group: plain loops over fp32 copies of the rows.
template <typename scalar_t>
static void decode_generic(const Batch<scalar_t>& b) {
  const int64_t d = b.d, group = b.group;
  at::parallel_for(0, b.nd * b.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * d), acc(group * d), row(d), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / b.kv_heads, h = task % b.kv_heads, seq = b.seqs[i], ctx = b.lens[seq];
      const int32_t* table = b.tables + seq * b.max_pages;
      const scalar_t* q_row = b.q + b.rows[i] * b.q_stride + h * group * d;
      for (int64_t x = 0; x < group * d; ++x) qf[x] = static_cast<float>(q_row[x]) * b.scale;
      scores.assign(group * ctx, 0.f);
      for (int64_t t = 0; t < ctx; ++t) {
        const scalar_t* k = b.k + b.slot(table, t, h);
        for (int64_t x = 0; x < d; ++x) row[x] = static_cast<float>(k[x]);
        for (int64_t g = 0; g < group; ++g) {
          float s = 0.f;
          for (int64_t x = 0; x < d; ++x) s += qf[g * d + x] * row[x];
          scores[g * ctx + t] = s;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * ctx;
        float mx = s[0];  // ctx >= 1 (it counts the query token); no infinities, so -ffast-math is safe
        for (int64_t t = 1; t < ctx; ++t) mx = s[t] > mx ? s[t] : mx;
        float sum = 0.f;
        for (int64_t t = 0; t < ctx; ++t) { s[t] = std::exp(s[t] - mx); sum += s[t]; }
        for (int64_t t = 0; t < ctx; ++t) s[t] /= sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < ctx; ++t) {
        const scalar_t* v = b.v + b.slot(table, t, h);
        for (int64_t x = 0; x < d; ++x) row[x] = static_cast<float>(v[x]);
        for (int64_t g = 0; g < group; ++g)
          for (int64_t x = 0; x < d; ++x) acc[g * d + x] += scores[g * ctx + t] * row[x];
      }
      scalar_t* o = b.out + b.rows[i] * b.o_stride + h * group * d;
      for (int64_t x = 0; x < group * d; ++x) o[x] = static_cast<scalar_t>(acc[x]);
    }
  });
}

template <typename scalar_t>
static void decode(const Batch<scalar_t>& b) {
  if (b.d == 64) {
    switch (b.group) {
      case 1: return decode_d64<scalar_t, 1>(b);
      case 2: return decode_d64<scalar_t, 2>(b);
      case 3: return decode_d64<scalar_t, 3>(b);
      case 4: return decode_d64<scalar_t, 4>(b);
      case 5: return decode_d64<scalar_t, 5>(b);
      case 6: return decode_d64<scalar_t, 6>(b);
      case 8: return decode_d64<scalar_t, 8>(b);
    }
  }
  decode_generic<scalar_t>(b);
}

void paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& rows,
                  const at::Tensor& seqs, double scale, at::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && q.stride(2) == 1 && q.stride(1) == q.size(2), "bad q layout");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && out.stride(2) == 1 && out.stride(1) == out.size(2),
              "bad cache/out layout");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(), "dtype mismatch");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0 && q.size(2) == k_cache.size(3), "head shapes do not match");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt, "int32 tables expected");
  TORCH_CHECK(rows.scalar_type() == at::kLong && seqs.scalar_type() == at::kLong, "int64 rows/seqs expected");
  TORCH_CHECK(block_tables.is_contiguous() && seq_lens.is_contiguous() && rows.is_contiguous() && seqs.is_contiguous());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode<scalar_t>(Batch<scalar_t>(q, k_cache, v_cache, block_tables, seq_lens, rows, seqs, scale, out));
  });
}

TORCH_LIBRARY(rtserve_cpu, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, Tensor rows, "
        "Tensor seqs, float scale, Tensor(a!) out) -> ()");
  m.impl("paged_decode", c10::DispatchKey::CPU, TORCH_FN(paged_decode));
}
