// All decoder layers of a decode-only step in one call: the same kernels the Python layers call, in the same order.
//
// Why: a decode step of SmolLM2-135M is 30 layers x 9 kernels. From Python each kernel call costs a few microseconds of
// module dispatch, argument parsing and the op lookup; at 1-32 sequences that was 3-4 ms of a 17-27 ms step
// (docs/benchmarks.md). Here the loop runs in C++ and calls the kernels directly, so the step is the kernels' time.
// The numbers are bit for bit the Python path's (tests/test_cpu_kernels.py): every op and its inputs are the same.
//
// weights, per layer (kSlotsPerLayer): input norm, post-attention norm, then 4 linear layers (qkv, o, gate_up, down)
// of kSlotsPerLinear slots each: dense weight, bias, AMX-packed dense weight, GGUF qs, GGUF dm, torch int4 packed,
// torch int4 scales_and_zeros, fp32 copy for large batches (None where absent); then the final norm. A linear layer
// picks its kernel by row count as `kernels.linear` and `Q4Linear.forward` do.
#include <ATen/ATen.h>
#include <torch/library.h>

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor residual, const at::Tensor& weight, double eps);
at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                      const at::Tensor& slot_mapping, at::Tensor k_cache, at::Tensor v_cache, int64_t heads);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias);
at::Tensor amx_linear_gguf(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& dm,
                           const c10::optional<at::Tensor>& bias);
int64_t packed_isa();
void paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& rows,
                  const at::Tensor& seqs, double scale, at::Tensor out);

namespace {

constexpr int64_t kSlotsPerLinear = 8;
constexpr int64_t kSlotsPerLayer = 2 + 4 * kSlotsPerLinear;
constexpr int64_t kAmxMaxRows = 64;   // kernels.AMX_MAX_ROWS
constexpr int64_t kInt4Group = 32;    // gguf_q4.GROUP

using Slots = std::vector<c10::optional<at::Tensor>>;

bool has(const Slots& w, int64_t i) { return w[i].has_value() && w[i]->defined(); }

at::Tensor linear(const at::Tensor& x, const Slots& w, int64_t s, int64_t int4_max_rows) {
  const int64_t rows = x.size(0);
  const c10::optional<at::Tensor> bias = has(w, s + 1) ? w[s + 1] : c10::nullopt;
  if (has(w, s + 5) && rows <= int4_max_rows) {   // torch's 4-bit kernel (Q4Linear at 1-2 rows)
    at::Tensor y = at::_weight_int4pack_mm_for_cpu(x.contiguous(), *w[s + 5], kInt4Group, *w[s + 6]);
    return bias ? y + *bias : y;
  }
  static const bool fp16 = packed_isa() == 3;   // fp16 packed kernels take every row count
  if (rows <= kAmxMaxRows || fp16) {
    if (has(w, s + 3)) return amx_linear_gguf(x, *w[s + 3], *w[s + 4], bias);
    if (has(w, s + 2) && (rows <= kAmxMaxRows || w[s + 2]->scalar_type() == at::kHalf))
      return amx_linear(x, *w[s + 2], bias);
  }
  if (rows > kAmxMaxRows && has(w, s + 7)) {   // kernels.linear's `wide` path: MKL's fp32 GEMM, rounded once to bf16
    const c10::optional<at::Tensor> bias_f = bias ? c10::optional<at::Tensor>(bias->to(at::kFloat)) : c10::nullopt;
    return at::linear(x.to(at::kFloat), *w[s + 7], bias_f).to(x.scalar_type());
  }
  return at::linear(x, *w[s], bias);
}

}  // namespace

at::Tensor decode_layers(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                         const at::Tensor& rows, const at::Tensor& seqs, const at::Tensor& kv_cache,
                         const c10::List<c10::optional<at::Tensor>>& weight_list, int64_t num_heads, double eps,
                         double scale, int64_t int4_max_rows) {
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(1) == 2 && kv_cache.is_contiguous(),
              "decode_layers: kv_cache must be [layers, 2, blocks, block_size, kv_heads, head_dim] contiguous");
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
    const int64_t base = i * kSlotsPerLayer, lin = base + 2;
    h = i == 0 ? rms_norm(x.contiguous(), *weights[base], eps) : add_rms_norm(hidden, residual, *weights[base], eps);
    const at::Tensor k_cache = kv_cache.select(0, i).select(0, 0), v_cache = kv_cache.select(0, i).select(0, 1);
    const at::Tensor q = rope_store(linear(h, weights, lin, int4_max_rows), c, s, slot_mapping, k_cache, v_cache,
                                    num_heads);
    at::Tensor o = at::empty_like(q);
    paged_decode(q, k_cache, v_cache, block_tables, seq_lens, rows, seqs, scale, o);
    const at::Tensor attn = linear(o.view({tokens, -1}), weights, lin + kSlotsPerLinear, int4_max_rows);
    h = add_rms_norm(attn, residual, *weights[base + 1], eps);
    const at::Tensor act = silu_and_mul(linear(h, weights, lin + 2 * kSlotsPerLinear, int4_max_rows));
    hidden = linear(act, weights, lin + 3 * kSlotsPerLinear, int4_max_rows);
  }
  return add_rms_norm(hidden, residual, *weights.back(), eps);
}

TORCH_LIBRARY_FRAGMENT(rtserve_cpu, m) {
  m.def("decode_layers(Tensor x, Tensor cos, Tensor sin, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, "
        "Tensor rows, Tensor seqs, Tensor(a!) kv_cache, Tensor?[] weights, int num_heads, float eps, float scale, "
        "int int4_max_rows) -> Tensor");
  m.impl("decode_layers", c10::DispatchKey::CPU, TORCH_FN(decode_layers));
}
