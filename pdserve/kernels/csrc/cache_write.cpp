// Writing new keys and values into the paged KV cache, for the CPU: one memcpy per token and
// kv head. pdserve/kernels/cache_write.py owns the contract; this replaces its torch index_put.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

// Store token t's key/value heads at flat slot slot_mapping[t] of the caches, in place.
void write_kv_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache,
                    const at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && k_cache.sizes() == v_cache.sizes());
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() && value.scalar_type() == v_cache.scalar_type());
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && key.stride(2) == 1 && value.stride(2) == 1);
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous());
  const int64_t num_tokens = key.size(0), num_kv_heads = k_cache.size(1);
  const int64_t block_size = k_cache.size(2), head_dim = k_cache.size(3);
  TORCH_CHECK(key.size(1) == num_kv_heads && key.size(2) == head_dim && slot_mapping.size(0) == num_tokens);
  const int64_t row_bytes = head_dim * static_cast<int64_t>(key.element_size());
  const int64_t num_slots = k_cache.size(0) * block_size;
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot out of range");
  const auto* key_bytes = static_cast<const char*>(key.const_data_ptr());
  const auto* value_bytes = static_cast<const char*>(value.const_data_ptr());
  auto* k_bytes = static_cast<char*>(k_cache.mutable_data_ptr());
  auto* v_bytes = static_cast<char*>(v_cache.mutable_data_ptr());
  const int64_t elem = key.element_size();
  const int64_t key_token = key.stride(0) * elem, key_head = key.stride(1) * elem;
  const int64_t value_token = value.stride(0) * elem, value_head = value.stride(1) * elem;
#pragma omp parallel for num_threads(at::get_num_threads()) if (num_tokens * num_kv_heads * row_bytes > (1 << 20))
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      const int64_t dst = ((block * num_kv_heads + h) * block_size + offset) * row_bytes;
      std::memcpy(k_bytes + dst, key_bytes + t * key_token + h * key_head, row_bytes);
      std::memcpy(v_bytes + dst, value_bytes + t * value_token + h * value_head, row_bytes);
    }
  }
}

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("write_kv_cache(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) { m.impl("write_kv_cache", &write_kv_cache); }
