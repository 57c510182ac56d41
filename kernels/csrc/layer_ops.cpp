// RMSNorm and SiLU-and-multiply for 16-bit activations on the CPU.
//
// Why: torch's bf16 `rms_norm` and `silu(gate) * up` on the CPU were a large share of a prefill step (a step runs two
// norms and one MLP activation per layer; docs/benchmarks.md). These loops do the math in fp32 per row and round
// exactly where HF's bf16 modules round, so outputs equal torch's but for rare last-bit differences (summation order,
// exp). fp32 models keep HF's own op order in Python (engine/layers/layernorm.py, engine/models/llama.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "fast_exp.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

template <typename T>
inline float to_f(T v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    uint16_t h;
    std::memcpy(&h, &v, 2);
    uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  } else {
    return static_cast<float>(v);
  }
}

// fp32 -> T with round-to-nearest-even (what torch does when a bf16 op stores its fp32 result); inputs are finite here
template <typename T>
inline T from_f(float f) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);
    uint16_t h = static_cast<uint16_t>(u >> 16);
    T out;
    std::memcpy(&out, &h, 2);
    return out;
  } else {
    return static_cast<T>(f);
  }
}

template <typename T>
void rms_norm_rows(const T* __restrict x, const T* __restrict w, T* __restrict out, int64_t rows, int64_t n,
                   float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * n;
      T* o = out + r * n;
      float ss = 0.f;
      for (int64_t i = 0; i < n; ++i) {
        const float v = to_f(xr[i]);
        ss += v * v;
      }
      const float rs = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
      for (int64_t i = 0; i < n; ++i)  // HF: weight * (x * rsqrt(var + eps)).to(dtype)
        o[i] = from_f<T>(to_f(w[i]) * to_f(from_f<T>(to_f(xr[i]) * rs)));
    }
  });
}

// residual += x (rounded to T, as torch's add), then RMSNorm of the new residual: one pass instead of two ops
template <typename T>
void add_rms_norm_rows(const T* __restrict x, T* __restrict res, const T* __restrict w, T* __restrict out,
                       int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * n;
      T* rr = res + r * n;
      T* o = out + r * n;
      for (int64_t i = 0; i < n; ++i) rr[i] = from_f<T>(to_f(rr[i]) + to_f(xr[i]));
      float ss = 0.f;  // a separate pass, shaped as in rms_norm_rows, so the sum of squares adds up in the same order
      for (int64_t i = 0; i < n; ++i) {
        const float v = to_f(rr[i]);
        ss += v * v;
      }
      const float rs = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
      for (int64_t i = 0; i < n; ++i) o[i] = from_f<T>(to_f(w[i]) * to_f(from_f<T>(to_f(rr[i]) * rs)));
    }
  });
}

// Rotary embedding of q and k (HF's rotate_half form, rounded where torch rounds: x * cos, rotated * sin, their sum)
// and the store of k and v into their cache slots, for one step's fused qkv rows [T, (H + 2 KV) * D].
template <typename T>
void rope_store_rows(const T* __restrict qkv, const T* __restrict cos, const T* __restrict sin,
                     const int64_t* __restrict slots, T* __restrict q_out, T* __restrict k_cache,
                     T* __restrict v_cache, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t d) {
  const int64_t half = d / 2, width = (heads + 2 * kv_heads) * d;
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* row = qkv + t * width;
      const T* c = cos + t * d;
      const T* s = sin + t * d;
      const int64_t slot = slots[t];
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        const T* x = row + h * d;
        T* o = h < heads ? q_out + (t * heads + h) * d
                         : (slot >= 0 ? k_cache + (slot * kv_heads + h - heads) * d : nullptr);
        if (o == nullptr) continue;
        for (int64_t i = 0; i < d; ++i) {
          const float rot = i < half ? -to_f(x[i + half]) : to_f(x[i - half]);
          const float a = to_f(from_f<T>(to_f(x[i]) * to_f(c[i])));
          const float b = to_f(from_f<T>(rot * to_f(s[i])));
          o[i] = from_f<T>(a + b);
        }
      }
      if (slot >= 0) std::memcpy(v_cache + slot * kv_heads * d, row + (heads + kv_heads) * d, kv_heads * d * sizeof(T));
    }
  });
}

template <typename T>
void silu_mul_rows(const T* __restrict gu, T* __restrict out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gu + r * 2 * inter;
      const T* u = g + inter;
      T* o = out + r * inter;
      for (int64_t i = 0; i < inter; ++i) {  // torch: silu(gate) rounds to dtype, then the product rounds again
        const float gv = to_f(g[i]);
        o[i] = from_f<T>(to_f(from_f<T>(gv / (1.f + fast_exp(-gv)))) * to_f(u[i]));
      }
    }
  });
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous() && weight.numel() == x.size(1),
              "rms_norm expects x [rows, n] contiguous and weight [n]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm: weight dtype must match x");
  at::Tensor out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.size(0),
                            x.size(1), static_cast<float>(eps));
  });
  return out;
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_and_mul expects [rows, 2 * inter] contiguous");
  const int64_t inter = gate_up.size(1) / 2;
  at::Tensor out = at::empty({gate_up.size(0), inter}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_and_mul", [&] {
    silu_mul_rows<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), gate_up.size(0), inter);
  });
  return out;
}

at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor residual, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && residual.is_contiguous() && x.sizes() == residual.sizes() &&
                  weight.is_contiguous() && weight.numel() == x.size(1),
              "add_rms_norm expects x and residual [rows, n] contiguous and weight [n]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: dtypes must match");
  at::Tensor out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    add_rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(),
                                out.data_ptr<scalar_t>(), x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                      const at::Tensor& slot_mapping, at::Tensor k_cache, at::Tensor v_cache, int64_t heads) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes(), "rope_store: caches must be [pages, page_size, kv_heads, d]");
  const int64_t kv_heads = k_cache.size(2), d = k_cache.size(3), tokens = qkv.size(0);
  TORCH_CHECK(d % 2 == 0 && qkv.dim() == 2 && qkv.is_contiguous() && qkv.size(1) == (heads + 2 * kv_heads) * d,
              "rope_store: qkv must be [tokens, (heads + 2 * kv_heads) * head_dim] contiguous");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == tokens * d && sin.numel() == tokens * d,
              "rope_store: cos/sin must hold [tokens, head_dim]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == tokens,
              "rope_store: slot_mapping must be [tokens] int64");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type() &&
                  k_cache.scalar_type() == qkv.scalar_type() && v_cache.scalar_type() == qkv.scalar_type(),
              "rope_store: dtypes must match");
  TORCH_CHECK(slot_mapping.numel() == 0 || slot_mapping.max().item<int64_t>() < k_cache.size(0) * k_cache.size(1),
              "rope_store: slot out of range");
  at::Tensor q = at::empty({tokens, heads, d}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_store", [&] {
    rope_store_rows<scalar_t>(qkv.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(),
                              slot_mapping.data_ptr<int64_t>(), q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                              v_cache.data_ptr<scalar_t>(), tokens, heads, kv_heads, d);
  });
  return q;
}

// Index of each row's largest value, the first one on ties, and of the first NaN when a row has one (torch.argmax's
// rules). Greedy sampling runs it on fp32 logits [rows, vocab]: torch's CPU argmax runs on one thread, scalar, a
// visible share of a decode step; here a vector max, then a scan for its first position, on the intra-op threads.
// NaN test on the bits: this file is built with -ffast-math, under which `v != v` folds to false.
inline bool is_nan(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return (u & 0x7FFFFFFFu) > 0x7F800000u;
}

at::Tensor argmax_rows(const at::Tensor& x_) {
  TORCH_CHECK(x_.dim() == 2 && x_.scalar_type() == at::kFloat && x_.size(1) > 0, "argmax_rows expects fp32 [rows, n]");
  const at::Tensor x = x_.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* base = x.data_ptr<float>();
  int64_t* idx = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* v = base + r * n;
      float mx = -INFINITY;
      bool nan = false;
      int64_t i = 0;
#if defined(__AVX512F__)
      // NaN lanes are found on the bits (exponent all ones, mantissa not zero), which -ffast-math leaves alone
      const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF), inf_bits = _mm512_set1_epi32(0x7F800000);
      auto nan_lanes = [&](__m512 a) {
        return _mm512_cmpgt_epu32_mask(_mm512_and_si512(_mm512_castps_si512(a), abs_mask), inf_bits);
      };
      __m512 m = _mm512_set1_ps(-INFINITY);
      __mmask16 any_nan = 0;
      for (; i + 16 <= n; i += 16) {
        const __m512 a = _mm512_loadu_ps(v + i);
        any_nan |= nan_lanes(a);
        m = _mm512_max_ps(a, m);  // a NaN lane keeps m's value
      }
      mx = _mm512_reduce_max_ps(m);
      nan = any_nan != 0;
#endif
      for (; i < n; ++i) {
        nan |= is_nan(v[i]);
        mx = v[i] > mx ? v[i] : mx;
      }
      int64_t j = 0, best = 0;
#if defined(__AVX512F__)
      const __m512 target = _mm512_set1_ps(mx);
      for (; j + 16 <= n; j += 16) {  // first NaN if there is one, else the max's first position
        const __m512 a = _mm512_loadu_ps(v + j);
        const __mmask16 hit = nan ? nan_lanes(a) : _mm512_cmp_ps_mask(a, target, _CMP_EQ_OQ);
        if (hit) break;
      }
#endif
      for (; j < n; ++j)
        if (nan ? is_nan(v[j]) : v[j] == mx) break;
      best = j < n ? j : 0;
      idx[r] = best;
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(rtserve_cpu, m) {
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.impl("add_rms_norm", c10::DispatchKey::CPU, TORCH_FN(add_rms_norm));
  m.def("rope_store(Tensor qkv, Tensor cos, Tensor sin, Tensor slot_mapping, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "int heads) -> Tensor");
  m.impl("rope_store", c10::DispatchKey::CPU, TORCH_FN(rope_store));
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.impl("argmax_rows", c10::DispatchKey::CPU, TORCH_FN(argmax_rows));
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.impl("silu_and_mul", c10::DispatchKey::CPU, TORCH_FN(silu_and_mul));
}
