// Fused per-layer ops of the native Llama-family model, for the CPU (float32 and bfloat16).
//
// pdserve/kernels/layer_ops.py owns the contracts and has a torch formulation of each op that computes
// the same values; these replace several torch ops (and their dispatch) by one pass over the
// rows. Semantics follow transformers' Llama modules so float32 results match them to rounding:
//  - RMSNorm: float32 mean of squares, x * rsqrt(mean + eps) rounded to the input dtype, then
//    times the weight in the input dtype (LlamaRMSNorm).
//  - add_rms_norm: residual += x in the input dtype (the decoder layer's residual add), then
//    RMSNorm of the new residual.
//  - RoPE: x * cos + rotate_half(x) * sin with float32 cos/sin per token (apply_rotary_pos_emb),
//    after an optional per-head RMSNorm of q and k (Qwen3's q_norm/k_norm).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <c10/util/Optional.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }

template <typename T>
inline T from_float(float x) {
  return static_cast<T>(x);
}

// Rows per parallel work item: small batches stay on the calling thread.
constexpr int64_t kGrain = 8;

// out[d] = weight[d] * T(x[d] * rsqrt(mean(x^2) + eps)), one row of length dim.
template <typename T>
inline void rms_norm_row(const T* x, const T* weight, T* out, int64_t dim, float eps) {
  float sum_sq = 0.0f;
#pragma omp simd reduction(+ : sum_sq)
  for (int64_t d = 0; d < dim; ++d) {
    const float v = to_float(x[d]);
    sum_sq += v * v;
  }
  const float inv = 1.0f / std::sqrt(sum_sq / static_cast<float>(dim) + eps);
#pragma omp simd
  for (int64_t d = 0; d < dim; ++d) {
    const T normed = from_float<T>(to_float(x[d]) * inv);
    out[d] = from_float<T>(to_float(weight[d]) * to_float(normed));
  }
}

template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& out, double eps) {
  const int64_t rows = x.size(0), dim = x.size(1);
  const T* xp = x.const_data_ptr<T>();
  const T* wp = weight.const_data_ptr<T>();
  T* op = out.mutable_data_ptr<T>();
  const int64_t x_stride = x.stride(0), out_stride = out.stride(0);
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(xp + r * x_stride, wp, op + r * out_stride, dim, float(eps));
  });
}

template <typename T>
void add_rms_norm_impl(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                       const at::Tensor& out, double eps) {
  const int64_t rows = x.size(0), dim = x.size(1);
  const T* xp = x.const_data_ptr<T>();
  T* rp = residual.mutable_data_ptr<T>();
  const T* wp = weight.const_data_ptr<T>();
  T* op = out.mutable_data_ptr<T>();
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* res = rp + r * dim;
      const T* add = xp + r * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) res[d] = from_float<T>(to_float(res[d]) + to_float(add[d]));
      rms_norm_row(res, wp, op + r * dim, dim, float(eps));
    }
  });
}

void check_rows(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && out.sizes() == x.sizes() && weight.dim() == 1 && weight.size(0) == x.size(1));
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() && x.scalar_type() == out.scalar_type());
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1 && weight.is_contiguous());
}

// Rotates one head row in place: x[d] = x[d] * cos[d] + rotate_half(x)[d] * sin[d].
template <typename T>
inline void rope_row(T* x, const float* cos, const float* sin, int64_t head_dim, float* scratch) {
  const int64_t half = head_dim / 2;
#pragma omp simd
  for (int64_t d = 0; d < head_dim; ++d) scratch[d] = to_float(x[d]);
#pragma omp simd
  for (int64_t d = 0; d < half; ++d) {
    x[d] = from_float<T>(scratch[d] * cos[d] + (-scratch[d + half]) * sin[d]);
    x[d + half] = from_float<T>(scratch[d + half] * cos[d + half] + scratch[d] * sin[d + half]);
  }
}

struct RopeShapes {
  int64_t num_heads, num_kv_heads, head_dim, block_size, num_slots;
};

// One token: optional q/k head norms, RoPE on q and k (in place in qkv), q copied to q_out,
// k and v copied to their cache slot.
template <typename T>
void rope_token(T* qkv, const float* cos, const float* sin, const T* q_norm, const T* k_norm, float eps,
                T* q_out, T* k_cache, T* v_cache, int64_t slot, const RopeShapes& sh, float* scratch) {
  const int64_t d = sh.head_dim;
  T* q = qkv;
  T* k = qkv + sh.num_heads * d;
  const T* v = k + sh.num_kv_heads * d;
  for (int64_t h = 0; h < sh.num_heads; ++h) {
    if (q_norm != nullptr) rms_norm_row(q + h * d, q_norm, q + h * d, d, eps);
    rope_row(q + h * d, cos, sin, d, scratch);
  }
  std::memcpy(q_out, q, sh.num_heads * d * sizeof(T));
  const int64_t block = slot / sh.block_size, offset = slot % sh.block_size;
  for (int64_t h = 0; h < sh.num_kv_heads; ++h) {
    if (k_norm != nullptr) rms_norm_row(k + h * d, k_norm, k + h * d, d, eps);
    rope_row(k + h * d, cos, sin, d, scratch);
    const int64_t dst = ((block * sh.num_kv_heads + h) * sh.block_size + offset) * d;
    std::memcpy(k_cache + dst, k + h * d, d * sizeof(T));
    std::memcpy(v_cache + dst, v + h * d, d * sizeof(T));
  }
}

template <typename T>
void rope_write_kv_impl(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                        const T* q_norm, const T* k_norm, float eps, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, const int64_t* slots, const at::Tensor& q_out,
                        const RopeShapes& sh) {
  T* qkv_p = qkv.mutable_data_ptr<T>();
  T* q_p = q_out.mutable_data_ptr<T>();
  T* k_p = k_cache.mutable_data_ptr<T>();
  T* v_p = v_cache.mutable_data_ptr<T>();
  const float* cos_p = cos.const_data_ptr<float>();
  const float* sin_p = sin.const_data_ptr<float>();
  const int64_t row = qkv.stride(0), d = sh.head_dim;
  at::parallel_for(0, qkv.size(0), kGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(d);
    for (int64_t t = begin; t < end; ++t) {
      rope_token(qkv_p + t * row, cos_p + t * d, sin_p + t * d, q_norm, k_norm, eps, q_p + t * sh.num_heads * d,
                 k_p, v_p, slots[t], sh, scratch.data());
    }
  });
}

template <typename T>
const T* optional_ptr(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? t->const_data_ptr<T>() : nullptr;
}

}  // namespace

// RMSNorm(x) * weight; x [rows, dim] with unit column stride.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor out = at::empty(x.sizes(), x.options());
  check_rows(x, weight, out);
  if (x.scalar_type() == at::kFloat) {
    rms_norm_impl<float>(x, weight, out, eps);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "rms_norm: float32 and bfloat16 only");
    rms_norm_impl<at::BFloat16>(x, weight, out, eps);
  }
  return out;
}

// residual += x (in place), then RMSNorm(residual) * weight. All [rows, dim] contiguous.
at::Tensor add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps) {
  at::Tensor out = at::empty(x.sizes(), x.options());
  check_rows(x, weight, out);
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && residual.sizes() == x.sizes());
  TORCH_CHECK(residual.scalar_type() == x.scalar_type());
  if (x.scalar_type() == at::kFloat) {
    add_rms_norm_impl<float>(x, residual, weight, out, eps);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "add_rms_norm: float32 and bfloat16 only");
    add_rms_norm_impl<at::BFloat16>(x, residual, weight, out, eps);
  }
  return out;
}

// qkv [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim] (rows contiguous): normalises
// (optionally) and rotates q and k in place, stores k and v at each token's flat cache slot and
// returns q [num_tokens, num_heads, head_dim].
at::Tensor rope_write_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                         const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm, double eps,
                         const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slot_mapping,
                         int64_t num_heads) {
  TORCH_CHECK(k_cache.dim() == 4 && num_heads > 0);
  at::Tensor q_out = at::empty({qkv.size(0), num_heads, k_cache.size(3)}, qkv.options());
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes());
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && q_out.is_contiguous() && q_out.dim() == 3);
  TORCH_CHECK(qkv.scalar_type() == k_cache.scalar_type() && qkv.scalar_type() == v_cache.scalar_type() &&
              qkv.scalar_type() == q_out.scalar_type());
  const RopeShapes sh{q_out.size(1), k_cache.size(1), k_cache.size(3), k_cache.size(2),
                      k_cache.size(0) * k_cache.size(2)};
  const int64_t num_tokens = qkv.size(0);
  TORCH_CHECK(qkv.size(1) == (sh.num_heads + 2 * sh.num_kv_heads) * sh.head_dim && q_out.size(0) == num_tokens);
  TORCH_CHECK(q_out.size(2) == sh.head_dim && sh.head_dim % 2 == 0);
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
              sin.is_contiguous() && cos.sizes() == sin.sizes() && cos.numel() == num_tokens * sh.head_dim);
  for (const auto& norm : {q_norm, k_norm}) {
    TORCH_CHECK(!norm.has_value() || (norm->numel() == sh.head_dim && norm->is_contiguous() &&
                                      norm->scalar_type() == qkv.scalar_type()));
  }
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
              slot_mapping.size(0) == num_tokens);
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) TORCH_CHECK(slots[t] >= 0 && slots[t] < sh.num_slots, "slot out of range");
  const float feps = static_cast<float>(eps);
  if (qkv.scalar_type() == at::kFloat) {
    rope_write_kv_impl<float>(qkv, cos, sin, optional_ptr<float>(q_norm), optional_ptr<float>(k_norm), feps, k_cache,
                              v_cache, slots, q_out, sh);
  } else {
    TORCH_CHECK(qkv.scalar_type() == at::kBFloat16, "rope_write_kv: float32 and bfloat16 only");
    rope_write_kv_impl<at::BFloat16>(qkv, cos, sin, optional_ptr<at::BFloat16>(q_norm),
                                     optional_ptr<at::BFloat16>(k_norm), feps, k_cache, v_cache, slots, q_out, sh);
  }
  return q_out;
}

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def(
      "rope_write_kv(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor? q_norm, Tensor? k_norm, float eps, "
      "Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slot_mapping, int num_heads) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope_write_kv", &rope_write_kv);
}
