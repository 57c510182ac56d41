// Each row's n largest logits and its log-sum-exp, for random sampling with top-k / top-p / min-p
// (engine/sampler.py). Why: torch's CPU topk and logsumexp each read the whole vocabulary row several times, and for
// a batch of voice replies they were most of a step's sampling; here one vector pass finds the max, one sums the
// exponentials, and one keeps the candidates, every row on its own intra-op thread.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <utility>
#include <vector>

#include "fast_exp.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// on the bits: this file is built with -ffast-math, under which comparisons with infinity may fold away
inline bool is_minus_inf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u == 0xFF800000u;
}

float row_max(const float* v, int64_t n) {
  float mx = -INFINITY;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 m = _mm512_set1_ps(-INFINITY);
  for (; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(v + i));
  mx = _mm512_reduce_max_ps(m);
#endif
  for (; i < n; ++i) mx = v[i] > mx ? v[i] : mx;
  return mx;
}

// sum of exp(v - mx); entries of -inf add 0 (fast_exp clamps at -87, which is below float's smallest normal)
float sum_exp(const float* v, int64_t n, float mx) {
  float s = 0.f;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  const __m512 m = _mm512_set1_ps(mx);
  alignas(64) float buf[16];
  for (; i + 16 <= n; i += 16) {
    _mm512_store_ps(buf, _mm512_sub_ps(_mm512_loadu_ps(v + i), m));
    for (int j = 0; j < 16; ++j) buf[j] = fast_exp(buf[j]);  // vectorised by the compiler
    acc = _mm512_add_ps(acc, _mm512_load_ps(buf));
  }
  s = _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; ++i) s += fast_exp(v[i] - mx);
  return s;
}

// The k largest (value, index) pairs of v, largest first: candidates above a threshold go to a buffer, and when it
// holds 4k the k largest stay and the threshold rises to the smallest of them, so most entries are one compare.
void top_k_of(const float* v, int64_t n, int64_t k, std::vector<std::pair<float, int64_t>>& buf) {
  buf.clear();
  const size_t cap = static_cast<size_t>(4 * k);
  float thr = -INFINITY;
  bool any = false;  // the threshold is a real value (after the first compaction): until then take everything
  auto greater = [](const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  auto compact = [&]() {
    std::nth_element(buf.begin(), buf.begin() + (k - 1), buf.end(), greater);
    buf.resize(k);
    thr = buf[k - 1].first;  // the k-th largest: the ones before it are no smaller
    any = true;
  };
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m512 a = _mm512_loadu_ps(v + i);
    __mmask16 hit = any ? _mm512_cmp_ps_mask(a, _mm512_set1_ps(thr), _CMP_GT_OQ) : __mmask16(0xFFFF);
    while (hit) {
      const int j = __builtin_ctz(hit);
      hit &= hit - 1;
      buf.emplace_back(v[i + j], i + j);
    }
    if (buf.size() >= cap) compact();
  }
#endif
  for (; i < n; ++i) {
    if (!any || v[i] > thr) buf.emplace_back(v[i], i);
    if (buf.size() >= cap) compact();
  }
  const int64_t keep = std::min<int64_t>(k, static_cast<int64_t>(buf.size()));
  std::partial_sort(buf.begin(), buf.begin() + keep, buf.end(), greater);
  buf.resize(keep);
}

// (values [rows, k] descending, their indices [rows, k], log-sum-exp [rows]) of fp32 logits [rows, n]; a row of all
// -inf has log-sum-exp -inf. NaN is not expected (the engine's logits are finite or masked to -inf).
std::tuple<at::Tensor, at::Tensor, at::Tensor> top_candidates(const at::Tensor& x_, int64_t k) {
  TORCH_CHECK(x_.dim() == 2 && x_.scalar_type() == at::kFloat, "top_candidates expects fp32 [rows, n]");
  TORCH_CHECK(k >= 1 && k <= x_.size(1), "top_candidates: k must be in [1, n]");
  const at::Tensor x = x_.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor vals = at::empty({rows, k}, x.options());
  at::Tensor idx = at::empty({rows, k}, x.options().dtype(at::kLong));
  at::Tensor lse = at::empty({rows}, x.options());
  const float* base = x.data_ptr<float>();
  float* vo = vals.data_ptr<float>();
  int64_t* io = idx.data_ptr<int64_t>();
  float* lo = lse.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    std::vector<std::pair<float, int64_t>> buf;
    buf.reserve(static_cast<size_t>(4 * k + 16));
    for (int64_t r = r0; r < r1; ++r) {
      const float* v = base + r * n;
      const float mx = row_max(v, n);
      lo[r] = is_minus_inf(mx) ? -INFINITY : mx + std::log(sum_exp(v, n, mx));
      top_k_of(v, n, k, buf);
      for (int64_t j = 0; j < k; ++j) {
        vo[r * k + j] = buf[j].first;
        io[r * k + j] = buf[j].second;
      }
    }
  });
  return {vals, idx, lse};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rtserve_cpu, m) {
  m.def("top_candidates(Tensor x, int k) -> (Tensor, Tensor, Tensor)");
  m.impl("top_candidates", c10::DispatchKey::CPU, TORCH_FN(top_candidates));
}
