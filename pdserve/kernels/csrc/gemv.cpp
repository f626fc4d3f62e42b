// Small-batch linear layer (GEMV) with bfloat16 or float32 weights and float32 accumulation, for the CPU.
//
// pdserve/kernels/layer_ops.py owns the contract: out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), for
// few rows m (decode steps). A decode step is bound by reading the weights once, so the kernel
// streams each weight row exactly once and reuses it for every row of x (bf16 values are
// converted to float32 in registers: a 16-bit shift, exact). torch's own GEMV reads float32
// weights at about a third of the bandwidth this reaches. Weights are bf16 either because the
// model runs in bf16, or because the checkpoint is bf16 and the machine computes in float32
// (no native bf16): then reading bf16 halves the bytes and loses nothing. x and out are float32
// or bfloat16 (x converted to float32 once per call; out rounded once).
//
// Vector paths, chosen at compile time (-march=native): with bf16 x on AVX512_BF16, vdpbf16ps
// (32 exact bf16 products summed in float32 per instruction, no conversion at all); otherwise
// AVX-512 (16 lanes) or AVX2+FMA (8 lanes) on converted values; else a loop the compiler vectorises.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <c10/util/Optional.h>

#include <cstdint>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// Rows of x handled together (their accumulators live in registers).
constexpr int64_t kRowTile = 4;
// Output columns per parallel work item: enough weight bytes to amortise the hand-off.
constexpr int64_t kColGrain = 32;

inline float bf16_to_float(uint16_t bits) { return __builtin_bit_cast(float, static_cast<uint32_t>(bits) << 16); }

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
using Vec = __m512;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vload_bf16(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kLanes = 8;
using Vec = __m256;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vload_bf16(const uint16_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#else
constexpr int64_t kLanes = 0;
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
inline Vec vload_w(const uint16_t* p) { return vload_bf16(p); }
inline Vec vload_w(const float* p) { return vload(p); }
#endif
inline float w_to_float(uint16_t bits) { return bf16_to_float(bits); }
inline float w_to_float(float w) { return w; }

// Dot products of one weight row (bf16 bits or float32) with Rows (1..kRowTile) rows of x
// (float32, row stride k).
template <int Rows, typename W>
inline void dot_row(const W* w, const float* x, int64_t k, float* result) {
  int64_t done = 0;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  Vec acc[Rows][2];
  for (int m = 0; m < Rows; ++m) acc[m][0] = acc[m][1] = vzero();
  const int64_t step = 2 * kLanes, vector_end = k - k % step;
  for (int64_t i = 0; i < vector_end; i += step) {
    const Vec w0 = vload_w(w + i), w1 = vload_w(w + i + kLanes);
    for (int m = 0; m < Rows; ++m) {
      acc[m][0] = vfma(w0, vload(x + m * k + i), acc[m][0]);
      acc[m][1] = vfma(w1, vload(x + m * k + i + kLanes), acc[m][1]);
    }
  }
  for (int m = 0; m < Rows; ++m) result[m] = vsum(acc[m][0]) + vsum(acc[m][1]);
  done = vector_end;
#else
  for (int m = 0; m < Rows; ++m) result[m] = 0.0f;
#endif
  for (int64_t i = done; i < k; ++i) {
    const float wi = w_to_float(w[i]);
    for (int m = 0; m < Rows; ++m) result[m] += wi * x[m * k + i];
  }
}

#if defined(__AVX512BF16__)
// Dot products of one weight row with Rows rows of bf16 x (row stride k), by vdpbf16ps.
template <int Rows>
inline void dot_row_bf16(const uint16_t* w, const uint16_t* x, int64_t k, float* result) {
  __m512 acc[Rows][2];
  for (int m = 0; m < Rows; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  const int64_t vector_end = k - k % 64;
  for (int64_t i = 0; i < vector_end; i += 64) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + i), w1 = (__m512bh)_mm512_loadu_si512(w + i + 32);
    for (int m = 0; m < Rows; ++m) {
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, (__m512bh)_mm512_loadu_si512(x + m * k + i));
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], w1, (__m512bh)_mm512_loadu_si512(x + m * k + i + 32));
    }
  }
  for (int m = 0; m < Rows; ++m) result[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]));
  for (int64_t i = vector_end; i < k; ++i) {
    const float wi = bf16_to_float(w[i]);
    for (int m = 0; m < Rows; ++m) result[m] += wi * bf16_to_float(x[m * k + i]);
  }
}
#endif

template <int Rows, typename W, typename X, typename Out>
inline void gemv_col(const X* x, const W* w_row, float b, Out* out, int64_t n, int64_t k) {
  float result[Rows];
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<X, uint16_t>) {
    dot_row_bf16<Rows>(w_row, x, k, result);
  } else {
    dot_row<Rows>(w_row, x, k, result);
  }
#else
  static_assert(std::is_same_v<X, float>, "bf16 x without AVX512_BF16 is converted to float32 first");
  dot_row<Rows>(w_row, x, k, result);
#endif
  for (int m = 0; m < Rows; ++m) out[m * n] = static_cast<Out>(result[m] + b);
}

// Columns outer, row tiles inner: each weight row is read from memory once and stays in L1
// while every row tile of x uses it.
template <typename W, typename X, typename Out>
void gemv(const X* x, const W* w, const float* bias, Out* out, int64_t rows, int64_t n, int64_t k) {
  at::parallel_for(0, n, kColGrain, [&](int64_t begin, int64_t end) {
    for (int64_t col = begin; col < end; ++col) {
      const W* w_row = w + col * k;
      const float b = bias != nullptr ? bias[col] : 0.0f;
      for (int64_t m0 = 0; m0 < rows; m0 += kRowTile) {
        const X* xm = x + m0 * k;
        Out* om = out + m0 * n + col;
        switch (std::min(kRowTile, rows - m0)) {
          case 1: gemv_col<1>(xm, w_row, b, om, n, k); break;
          case 2: gemv_col<2>(xm, w_row, b, om, n, k); break;
          case 3: gemv_col<3>(xm, w_row, b, om, n, k); break;
          default: gemv_col<4>(xm, w_row, b, om, n, k); break;
        }
      }
    }
  });
}

std::vector<float> as_float(const at::Tensor& t) {
  std::vector<float> values(t.numel());
  if (t.scalar_type() == at::kFloat) {
    std::memcpy(values.data(), t.const_data_ptr<float>(), values.size() * sizeof(float));
  } else {
    const auto* bits = reinterpret_cast<const uint16_t*>(t.const_data_ptr<at::BFloat16>());
    for (size_t i = 0; i < values.size(); ++i) values[i] = bf16_to_float(bits[i]);
  }
  return values;
}

}  // namespace

// silu(gate) * up of x = [gate | up] (each [rows, k]), rounded where transformers' modules round:
// for bf16, silu's result and the product are each rounded to bf16.
template <typename T>
at::Tensor silu_mul(const at::Tensor& x) {
  const int64_t rows = x.size(0), k = x.size(1) / 2;
  at::Tensor out = at::empty({rows, k}, x.options());
  const T* in = x.const_data_ptr<T>();
  T* o = out.mutable_data_ptr<T>();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < k; ++i) {
      const float g = static_cast<float>(in[r * 2 * k + i]);
      const T act = static_cast<T>(g / (1.0f + std::exp(-g)));
      o[r * k + i] = static_cast<T>(static_cast<float>(act) * static_cast<float>(in[r * 2 * k + k + i]));
    }
  }
  return out;
}

// [rows, n] = x [rows, k] @ weight [n, k]^T (+ bias [n]); weight bfloat16 (x float32 or bfloat16)
// or float32 (x float32); bias float32 or bfloat16; the result has x's dtype. gated: x is [gate | up] ([rows, 2k]) and the
// product uses silu(gate) * up (the MLP's down projection), computed here for few rows.
at::Tensor linear_gemv(const at::Tensor& x_in, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                       bool gated) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16,
              "linear_gemv: float32/bfloat16 x");
  TORCH_CHECK(x_in.dim() == 2 && x_in.is_contiguous() && (!gated || x_in.size(1) % 2 == 0));
  const at::Tensor x = !gated ? x_in
                       : x_in.scalar_type() == at::kFloat ? silu_mul<float>(x_in)
                                                          : silu_mul<at::BFloat16>(x_in);
  TORCH_CHECK(weight.dim() == 2 && x.size(1) == weight.size(1), "linear_gemv: x and weight widths differ");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 || (weight.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat),
              "linear_gemv: bfloat16 weights, or float32 weights with float32 x");
  TORCH_CHECK(weight.is_contiguous());
  TORCH_CHECK(!bias.has_value() || (bias->numel() == weight.size(0) && bias->is_contiguous()));
  const int64_t rows = x.size(0), n = weight.size(0), k = x.size(1);
  at::Tensor out = at::empty({rows, n}, x.options());
  const std::vector<float> bf = bias.has_value() ? as_float(*bias) : std::vector<float>();
  const float* b = bias.has_value() ? bf.data() : nullptr;
  if (weight.scalar_type() == at::kFloat) {
    gemv(x.const_data_ptr<float>(), weight.const_data_ptr<float>(), b, out.mutable_data_ptr<float>(), rows, n, k);
    return out;
  }
  const auto* w = reinterpret_cast<const uint16_t*>(weight.const_data_ptr<at::BFloat16>());
  if (x.scalar_type() == at::kFloat) {
    gemv(x.const_data_ptr<float>(), w, b, out.mutable_data_ptr<float>(), rows, n, k);
    return out;
  }
  auto* out_bf16 = out.mutable_data_ptr<at::BFloat16>();
#if defined(__AVX512BF16__)
  gemv(reinterpret_cast<const uint16_t*>(x.const_data_ptr<at::BFloat16>()), w, b, out_bf16, rows, n, k);
#else
  const std::vector<float> xf = as_float(x);
  gemv(xf.data(), w, b, out_bf16, rows, n, k);
#endif
  return out;
}

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("linear_gemv(Tensor x, Tensor weight, Tensor? bias, bool gated) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) { m.impl("linear_gemv", &linear_gemv); }
