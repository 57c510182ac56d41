// Paged decode attention for the CPU: one query token per sequence, read straight from the block table.
//
// Why a C++ op: in pure torch a decode step must first gather every sequence's blocks into a padded tensor and then run
// SDPA's flash kernel, whose per-(sequence, head) setup dominates when there is one query row. At 32 sequences of ~160
// tokens that was ~1 ms per layer; this loop reads each key/value row once, in place, and parallelises over
// (sequence, kv head) on torch's own thread pool.
//
// Layout (kernels/torch_ops.py): q/out [tokens, heads, d]; k/v cache [blocks, block_size, kv_heads, d];
// block_tables [B, max_blocks] int32; seq_lens [B] int32 (context including the query token).
// rows[i] is the q/out row of decode i and seqs[i] its sequence index. Math in fp32 whatever the storage dtype.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

// Widen one cache row to fp32. bf16 is the top half of an fp32, so the shift form vectorises (the c10 conversion does not).
template <typename scalar_t>
static inline void to_float(const scalar_t* __restrict src, float* __restrict dst, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
    uint32_t* out = reinterpret_cast<uint32_t*>(dst);
    for (int64_t x = 0; x < n; ++x) out[x] = static_cast<uint32_t>(bits[x]) << 16;
  } else {
    for (int64_t x = 0; x < n; ++x) dst[x] = static_cast<float>(src[x]);
  }
}


// ---- head_dim 64: the whole row lives in four 16-lane registers ------------------------------------------------------
// GCC vector types (portable; AVX-512 registers where the CPU has them). The generic loop below spends most of its time
// in dependent multiply-add chains and in re-reading its accumulators from memory; here the G heads of a group run as
// independent chains and the output accumulators stay in registers across the whole context.
typedef float v16f __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));

template <typename scalar_t>
static inline v16f load16(const scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    v16h h;
    std::memcpy(&h, p, sizeof(h));
    v16u u = __builtin_convertvector(h, v16u) << 16;
    v16f f;
    std::memcpy(&f, &u, sizeof(f));
    return f;
  } else if constexpr (std::is_same_v<scalar_t, float>) {
    v16f f;
    std::memcpy(&f, p, sizeof(f));
    return f;
  } else {
    v16f f;
    for (int x = 0; x < 16; ++x) f[x] = static_cast<float>(p[x]);
    return f;
  }
}

static inline float hsum(v16f v) {
  float s = 0.f;
  for (int x = 0; x < 16; ++x) s += v[x];
  return s;
}

template <typename scalar_t, int G>
static void decode_task_d64(const scalar_t* q_row, const scalar_t* kp, const scalar_t* vp, const int32_t* table,
                            int64_t ctx, int64_t block_size, int64_t slot_stride, int64_t head_off, float scale,
                            float* scores, scalar_t* out_row) {
  v16f q[G][4];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 4; ++c) q[g][c] = load16(q_row + g * 64 + c * 16) * scale;
  float mx[G];
  for (int64_t t = 0; t < ctx; ++t) {
    const scalar_t* k = kp + (static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size) * slot_stride + head_off;
    const v16f k0 = load16(k), k1 = load16(k + 16), k2 = load16(k + 32), k3 = load16(k + 48);
    for (int g = 0; g < G; ++g) {
      const float s = hsum(q[g][0] * k0 + q[g][1] * k1 + q[g][2] * k2 + q[g][3] * k3);
      scores[g * ctx + t] = s;
      mx[g] = (t == 0 || s > mx[g]) ? s : mx[g];
    }
  }
  float inv[G];
  for (int g = 0; g < G; ++g) {
    float* s = scores + g * ctx;
    float sum = 0.f;
    for (int64_t t = 0; t < ctx; ++t) { s[t] = std::exp(s[t] - mx[g]); sum += s[t]; }
    inv[g] = 1.f / sum;
  }
  v16f acc[G][4] = {};
  for (int64_t t = 0; t < ctx; ++t) {
    const scalar_t* v = vp + (static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size) * slot_stride + head_off;
    const v16f v0 = load16(v), v1 = load16(v + 16), v2 = load16(v + 32), v3 = load16(v + 48);
    for (int g = 0; g < G; ++g) {
      const float p = scores[g * ctx + t];
      acc[g][0] += p * v0; acc[g][1] += p * v1; acc[g][2] += p * v2; acc[g][3] += p * v3;
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 4; ++c)
      for (int x = 0; x < 16; ++x) out_row[g * 64 + c * 16 + x] = static_cast<scalar_t>(acc[g][c][x] * inv[g]);
}

template <typename scalar_t, int G>
static bool decode_d64(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& rows,
                       const at::Tensor& seqs, double scale, at::Tensor& out) {
  const int64_t nd = rows.size(0), block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t max_blocks = block_tables.size(1), slot_stride = kv_heads * 64;
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kp = k_cache.data_ptr<scalar_t>();
  const scalar_t* vp = v_cache.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t* row_p = rows.data_ptr<int64_t>();
  const int64_t* seq_p = seqs.data_ptr<int64_t>();
  const int64_t q_stride = q.stride(0), o_stride = out.stride(0);
  at::parallel_for(0, nd * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / kv_heads, h = task % kv_heads, seq = seq_p[i], ctx = lens[seq];
      scores.resize(G * ctx);
      decode_task_d64<scalar_t, G>(qp + row_p[i] * q_stride + h * G * 64, kp, vp, tables + seq * max_blocks, ctx,
                                   block_size, slot_stride, h * 64, static_cast<float>(scale), scores.data(),
                                   op + row_p[i] * o_stride + h * G * 64);
    }
  });
  return true;
}

template <typename scalar_t>
static bool try_d64(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& rows,
                    const at::Tensor& seqs, double scale, at::Tensor& out) {
  if (q.size(2) != 64) return false;
  switch (q.size(1) / k_cache.size(2)) {
    case 1: return decode_d64<scalar_t, 1>(q, k_cache, v_cache, block_tables, seq_lens, rows, seqs, scale, out);
    case 2: return decode_d64<scalar_t, 2>(q, k_cache, v_cache, block_tables, seq_lens, rows, seqs, scale, out);
    case 3: return decode_d64<scalar_t, 3>(q, k_cache, v_cache, block_tables, seq_lens, rows, seqs, scale, out);
    case 4: return decode_d64<scalar_t, 4>(q, k_cache, v_cache, block_tables, seq_lens, rows, seqs, scale, out);
    case 5: return decode_d64<scalar_t, 5>(q, k_cache, v_cache, block_tables, seq_lens, rows, seqs, scale, out);
    case 6: return decode_d64<scalar_t, 6>(q, k_cache, v_cache, block_tables, seq_lens, rows, seqs, scale, out);
    case 8: return decode_d64<scalar_t, 8>(q, k_cache, v_cache, block_tables, seq_lens, rows, seqs, scale, out);
    default: return false;
  }
}

template <typename scalar_t>
static void decode_kernel(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& rows,
                          const at::Tensor& seqs, double scale, at::Tensor& out) {
  const int64_t nd = rows.size(0), heads = q.size(1), d = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2), group = heads / kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kp = k_cache.data_ptr<scalar_t>();
  const scalar_t* vp = v_cache.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t* row_p = rows.data_ptr<int64_t>();
  const int64_t* seq_p = seqs.data_ptr<int64_t>();
  const int64_t q_stride = q.stride(0), o_stride = out.stride(0);
  const int64_t slot_stride = kv_heads * d;  // elements between consecutive token slots in the cache
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, nd * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * d), acc(group * d), row(d), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / kv_heads, h = task % kv_heads;
      const int64_t seq = seq_p[i], ctx = lens[seq];
      const int32_t* table = tables + seq * max_blocks;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t x = 0; x < d; ++x)
          qf[g * d + x] = static_cast<float>(qp[row_p[i] * q_stride + (h * group + g) * d + x]) * fscale;
      scores.assign(group * ctx, 0.f);
      for (int64_t t = 0; t < ctx; ++t) {  // scores = q . k for every key, all heads of the group
        const scalar_t* k = kp + (static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size) * slot_stride + h * d;
        to_float(k, row.data(), d);
        for (int64_t g = 0; g < group; ++g) {
          float s = 0.f;
          const float* qg = qf.data() + g * d;
          for (int64_t x = 0; x < d; ++x) s += qg[x] * row[x];
          scores[g * ctx + t] = s;
        }
      }
      for (int64_t g = 0; g < group; ++g) {  // softmax
        float* s = scores.data() + g * ctx;
        float mx = s[0];  // ctx >= 1 (it counts the query token); no infinities, so -ffast-math is safe
        for (int64_t t = 1; t < ctx; ++t) mx = s[t] > mx ? s[t] : mx;
        float sum = 0.f;
        for (int64_t t = 0; t < ctx; ++t) { s[t] = std::exp(s[t] - mx); sum += s[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < ctx; ++t) s[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < ctx; ++t) {  // out = p . v
        const scalar_t* v = vp + (static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size) * slot_stride + h * d;
        to_float(v, row.data(), d);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * ctx + t];
          float* a = acc.data() + g * d;
          for (int64_t x = 0; x < d; ++x) a[x] += p * row[x];
        }
      }
      for (int64_t g = 0; g < group; ++g)
        for (int64_t x = 0; x < d; ++x)
          op[row_p[i] * o_stride + (h * group + g) * d + x] = static_cast<scalar_t>(acc[g * d + x]);
    }
  });
}

void paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& rows,
                  const at::Tensor& seqs, double scale, at::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && q.stride(2) == 1 && q.stride(1) == q.size(2), "bad q layout");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && out.stride(2) == 1, "bad cache/out layout");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(), "dtype mismatch");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt, "int32 tables expected");
  TORCH_CHECK(rows.scalar_type() == at::kLong && seqs.scalar_type() == at::kLong, "int64 rows/seqs expected");
  TORCH_CHECK(block_tables.is_contiguous() && seq_lens.is_contiguous() && rows.is_contiguous() && seqs.is_contiguous());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    if (!try_d64<scalar_t>(q, k_cache, v_cache, block_tables, seq_lens, rows, seqs, scale, out))
      decode_kernel<scalar_t>(q, k_cache, v_cache, block_tables, seq_lens, rows, seqs, scale, out);
  });
}

TORCH_LIBRARY(rtserve_cpu, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, Tensor rows, "
        "Tensor seqs, float scale, Tensor(a!) out) -> ()");
  m.impl("paged_decode", c10::DispatchKey::CPU, TORCH_FN(paged_decode));
}
