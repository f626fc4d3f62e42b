// The native model's decoder layers in one call: the same ops, in the same order, as the Python
// loop in pdserve/engine/models/llama.py (NativeLlama._layers_python), so a step pays one Python call
// instead of ~10 per layer. pdserve/kernels/layer_ops.py owns the contract (LayerOps.layer_stack);
// each op is the one the Python loop calls (layer_ops.cpp, gemv.cpp, paged_attention.cpp), and
// attention stays entirely in the C++ kernel (the caller uses this only for steps where the
// Python side would hand no chunk to SDPA).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>
#include <torch/library.h>

#include <c10/util/Optional.h>

#include <cstdint>
#include <limits>

// Defined in the other translation units of this library.
at::Tensor add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps);
at::Tensor rope_write_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                         const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm, double eps,
                         const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slot_mapping,
                         int64_t num_heads);
at::Tensor linear_gemv(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                       bool gated);
void paged_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                     const at::Tensor& out, double scale, int64_t sdpa_min_chunk, int64_t sdpa_min_prompt,
                     int64_t row_tile);

namespace {

constexpr int64_t kRowTile = 16;  // pdserve/kernels/paged_attention.py's CPP_ROW_TILE

struct Step {
  bool gemv;
  double eps, scale;
  int64_t num_heads;
};

// LayerOps.linear: the GEMV kernel for few rows, else torch's GEMM on weights in x's dtype.
at::Tensor linear(const Step& step, const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& b) {
  if (step.gemv) return linear_gemv(x, w, b, false);
  return at::linear(x, w.scalar_type() == x.scalar_type() ? w : w.to(x.scalar_type()), b);
}

// LayerOps.gated_linear: (silu(gate) * up) @ w.T for gate_up = [gate | up].
at::Tensor gated_linear(const Step& step, const at::Tensor& gate_up, const at::Tensor& w) {
  if (step.gemv) return linear_gemv(gate_up, w, c10::nullopt, true);
  const auto halves = gate_up.chunk(2, -1);
  return linear(step, at::mul(at::silu(halves[0]), halves[1]), w, c10::nullopt);
}

}  // namespace

// hidden: the first layer's normalised input; residual: the stream before it (updated in place).
// Returns the last layer's MLP output (the caller adds it to the residual with the final norm).
at::Tensor layer_stack(const at::Tensor& hidden_in, const at::Tensor& residual, at::TensorList input_norms,
                       at::TensorList qkv, const c10::List<c10::optional<at::Tensor>>& qkv_bias,
                       const c10::List<c10::optional<at::Tensor>>& q_norms,
                       const c10::List<c10::optional<at::Tensor>>& k_norms, at::TensorList o_proj,
                       const c10::List<c10::optional<at::Tensor>>& o_bias, at::TensorList post_norms,
                       at::TensorList gate_up, at::TensorList down_proj, at::TensorList k_caches,
                       at::TensorList v_caches, const at::Tensor& cos, const at::Tensor& sin,
                       const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                       const at::Tensor& query_start_loc, double eps, double scale, int64_t num_heads, bool gemv) {
  const size_t num_layers = qkv.size();
  for (const size_t n : {input_norms.size(), qkv_bias.size(), q_norms.size(), k_norms.size(), o_proj.size(),
                         o_bias.size(), post_norms.size(), gate_up.size(), down_proj.size(), k_caches.size(),
                         v_caches.size()}) {
    TORCH_CHECK(n == num_layers, "layer_stack: every per-layer list needs one entry per layer");
  }
  const Step step{gemv, eps, scale, num_heads};
  const int64_t num_tokens = hidden_in.size(0);
  at::Tensor hidden = hidden_in;
  for (size_t l = 0; l < num_layers; ++l) {
    if (l > 0) hidden = add_rms_norm(hidden, residual, input_norms[l], eps);
    const at::Tensor fused = linear(step, hidden, qkv[l], qkv_bias.get(l));
    const at::Tensor q = rope_write_kv(fused, cos, sin, q_norms.get(l), k_norms.get(l), eps, k_caches[l], v_caches[l],
                                       slot_mapping, num_heads);
    const at::Tensor attn = at::empty(q.sizes(), q.options());
    paged_attention(q, k_caches[l], v_caches[l], block_tables, seq_lens, query_start_loc, attn, scale,
                    std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::max(), kRowTile);
    const at::Tensor o = linear(step, attn.view({num_tokens, -1}), o_proj[l], o_bias.get(l));
    hidden = add_rms_norm(o, residual, post_norms[l], eps);
    hidden = gated_linear(step, linear(step, hidden, gate_up[l], c10::nullopt), down_proj[l]);
  }
  return hidden;
}

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def(
      "layer_stack(Tensor hidden, Tensor(a!) residual, Tensor[] input_norms, Tensor[] qkv, Tensor?[] qkv_bias, "
      "Tensor?[] q_norms, Tensor?[] k_norms, Tensor[] o_proj, Tensor?[] o_bias, Tensor[] post_norms, "
      "Tensor[] gate_up, Tensor[] down_proj, Tensor(b!)[] k_caches, Tensor(c!)[] v_caches, Tensor cos, Tensor sin, "
      "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float eps, float scale, "
      "int num_heads, bool gemv) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) { m.impl("layer_stack", &layer_stack); }
