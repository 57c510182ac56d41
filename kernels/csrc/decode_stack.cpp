// All decoder layers of a decode-only step in one call: the same kernels the Python layers call, in the same order.
//
// Why: a decode step is layers x 9 small kernels, and from Python each call pays module dispatch, argument parsing and
// the op lookup, which at a few sequences is a large share of the step (docs/benchmarks.md). Here the loop runs in C++
// and calls the kernels directly. The numbers are bit for bit the Python path's (tests/kernels/test_decode_stack.py):
// every op and its inputs are the same.
//
// weights: per layer the slots of LayerSlot (two norms, then 4 linear layers: qkv, o, gate_up, down, each with the
// slots of RTSERVE_LINEAR_SLOTS; None where absent), then the final norm. The slot names are defined here once;
// Python lays its kernels.decode_stack.DecodeLayerWeights out by them (the `decode_stack_slots` op). A linear layer
// picks its kernel by row count as `kernels.linear.linear` and `GGUFLinear.forward` do.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "packed_linear/packed_linear.h"

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor residual, const at::Tensor& weight, double eps);
at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                      const at::Tensor& slot_mapping, at::Tensor k_cache, at::Tensor v_cache, int64_t heads);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
void paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& rows,
                  const at::Tensor& seqs, double scale, at::Tensor out);

namespace {

// One linear layer's slots, in order: (enum name, the name Python gives it in kernels.decode_stack.LinearWeights).
#define RTSERVE_LINEAR_SLOTS(X)                                                                                \
  X(kWeight, "weight")                 /* dense weight [N, K] */                                                \
  X(kBias, "bias")                                                                                             \
  X(kPacked, "packed")                 /* packed 16-bit tiles (packed_linear) */                                \
  X(kGgufQs, "gguf_qs")                /* GGUF blocks in tile order (packed_linear_gguf) */                     \
  X(kGgufDm, "gguf_dm")                                                                                        \
  X(kInt4Weight, "int4_weight")        /* torch's 4-bit CPU kernel: packed weight ... */                        \
  X(kInt4Scales, "int4_scales_and_zeros") /* ... and its per-group scales and zeros */                          \
  X(kWide, "wide")                     /* fp32 copy for batches above packed_max_rows */                        \
  X(kVnniQs, "vnni_qs")                /* GGUF blocks in VNNI order: batches up to vnni_max_rows (AMX CPUs) */  \
  X(kVnniDm, "vnni_dm")

#define RTSERVE_ENUM(name, str) name,
enum LinearSlot : int64_t { RTSERVE_LINEAR_SLOTS(RTSERVE_ENUM) kSlotsPerLinear };
#undef RTSERVE_ENUM

// A layer's slots: its two norms, then its four linear layers of kSlotsPerLinear slots each.
enum LayerSlot : int64_t {
  kInputNorm,
  kPostAttentionNorm,
  kQkv,
  kO = kQkv + kSlotsPerLinear,
  kGateUp = kO + kSlotsPerLinear,
  kDown = kGateUp + kSlotsPerLinear,
  kSlotsPerLayer = kDown + kSlotsPerLinear,
};

constexpr int64_t kInt4Group = 32;    // GGUF's block size, the group size of torch's 4-bit kernel

using Slots = std::vector<c10::optional<at::Tensor>>;

bool has(const Slots& w, int64_t i) { return w[i].has_value() && w[i]->defined(); }

// The linear layer whose slots start at w[s].
at::Tensor linear(const at::Tensor& x, const Slots& w, int64_t s, int64_t int4_max_rows, int64_t vnni_max_rows,
                  int64_t packed_max_rows) {
  const int64_t rows = x.size(0);
  const c10::optional<at::Tensor> bias = has(w, s + kBias) ? w[s + kBias] : c10::nullopt;
  if (has(w, s + kVnniQs) && rows <= vnni_max_rows)   // the integer dots on an AMX CPU (GGUFLinear's small batches)
    return packed_linear_gguf(x, *w[s + kVnniQs], *w[s + kVnniDm], bias);
  if (has(w, s + kInt4Weight) && rows <= int4_max_rows) {   // torch's 4-bit kernel (GGUFLinear at 1-2 rows)
    at::Tensor y =
        at::_weight_int4pack_mm_for_cpu(x.contiguous(), *w[s + kInt4Weight], kInt4Group, *w[s + kInt4Scales]);
    return bias ? y + *bias : y;
  }
  // fp16 packed kernels and the integer dots (GGUF blocks in VNNI order, 64-byte rows) take every row count
  static const bool fp16 = rtserve::cpu_isa() == rtserve::Isa::kAvx512Fp16;
  const bool vnni = has(w, s + kGgufQs) && w[s + kGgufQs]->size(-1) == 64;
  if (rows <= packed_max_rows || fp16 || vnni) {
    if (has(w, s + kGgufQs)) return packed_linear_gguf(x, *w[s + kGgufQs], *w[s + kGgufDm], bias);
    if (has(w, s + kPacked) && (rows <= packed_max_rows || w[s + kPacked]->scalar_type() == at::kHalf))
      return packed_linear(x, *w[s + kPacked], bias);
  }
  if (rows > packed_max_rows && has(w, s + kWide)) {   // kernels.linear's `wide` path: MKL's fp32 GEMM, rounded once
    const c10::optional<at::Tensor> bias_f = bias ? c10::optional<at::Tensor>(bias->to(at::kFloat)) : c10::nullopt;
    return at::linear(x.to(at::kFloat), *w[s + kWide], bias_f).to(x.scalar_type());
  }
  return at::linear(x, *w[s + kWeight], bias);
}

// The names of one layer's slots, in order ("input_norm", ..., "qkv.weight", ...), for Python to lay them out by.
std::vector<std::string> decode_stack_slots() {
#define RTSERVE_NAME(name, str) str,
  static const char* const linear[] = {RTSERVE_LINEAR_SLOTS(RTSERVE_NAME)};
#undef RTSERVE_NAME
  std::vector<std::string> names = {"input_norm", "post_attention_norm"};
  for (const char* layer : {"qkv", "o", "gate_up", "down"})
    for (const char* slot : linear) names.push_back(std::string(layer) + "." + slot);
  TORCH_CHECK(static_cast<int64_t>(names.size()) == kSlotsPerLayer);
  return names;
}

}  // namespace

at::Tensor decode_layers(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                         const at::Tensor& rows, const at::Tensor& seqs, const at::Tensor& kv_cache,
                         const c10::List<c10::optional<at::Tensor>>& weight_list, int64_t num_heads, double eps,
                         double scale, int64_t int4_max_rows, int64_t vnni_max_rows, int64_t packed_max_rows) {
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(1) == 2 && kv_cache.is_contiguous(),
              "decode_layers: kv_cache must be [layers, 2, pages, page_size, kv_heads, head_dim] contiguous");
  const int64_t layers = kv_cache.size(0), tokens = x.size(0), d = kv_cache.size(5);
  const Slots weights(weight_list.begin(), weight_list.end());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kSlotsPerLayer + 1,
              "decode_layers: expected ", layers * kSlotsPerLayer + 1, " weight slots, got ", weights.size());
  TORCH_CHECK(x.dim() == 2 && tokens == seq_lens.numel() && tokens == rows.numel(),
              "decode_layers: one token per sequence (a decode-only step)");
  const at::Tensor c = cos.reshape({tokens, d}), s = sin.reshape({tokens, d});
  at::Tensor residual = x, h;
  at::Tensor hidden = x;
  for (int64_t i = 0; i < layers; ++i) {
    const int64_t base = i * kSlotsPerLayer;
    const at::Tensor& input_norm = *weights[base + kInputNorm];
    h = i == 0 ? rms_norm(x.contiguous(), input_norm, eps) : add_rms_norm(hidden, residual, input_norm, eps);
    const at::Tensor k_cache = kv_cache.select(0, i).select(0, 0), v_cache = kv_cache.select(0, i).select(0, 1);
    const at::Tensor qkv = linear(h, weights, base + kQkv, int4_max_rows, vnni_max_rows, packed_max_rows);
    const at::Tensor q = rope_store(qkv, c, s, slot_mapping, k_cache, v_cache, num_heads);
    at::Tensor o = at::empty_like(q);
    paged_decode(q, k_cache, v_cache, block_tables, seq_lens, rows, seqs, scale, o);
    const at::Tensor attn =
        linear(o.view({tokens, -1}), weights, base + kO, int4_max_rows, vnni_max_rows, packed_max_rows);
    h = add_rms_norm(attn, residual, *weights[base + kPostAttentionNorm], eps);
    const at::Tensor act =
        silu_and_mul(linear(h, weights, base + kGateUp, int4_max_rows, vnni_max_rows, packed_max_rows));
    hidden = linear(act, weights, base + kDown, int4_max_rows, vnni_max_rows, packed_max_rows);
  }
  return add_rms_norm(hidden, residual, *weights.back(), eps);
}

TORCH_LIBRARY_FRAGMENT(rtserve_cpu, m) {
  m.def("decode_layers(Tensor x, Tensor cos, Tensor sin, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, "
        "Tensor rows, Tensor seqs, Tensor(a!) kv_cache, Tensor?[] weights, int num_heads, float eps, float scale, "
        "int int4_max_rows, int vnni_max_rows, int packed_max_rows) -> Tensor");
  m.impl("decode_layers", c10::DispatchKey::CPU, TORCH_FN(decode_layers));
  m.def("decode_stack_slots() -> str[]", TORCH_FN(decode_stack_slots));
}
