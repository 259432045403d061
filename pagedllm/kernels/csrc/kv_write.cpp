// Storing a step's new K/V in the paged pool: each token's [kv_heads, head_dim]
// row goes to its slot (block * block_size + offset). One call for K and V
// instead of two index_copy_ dispatches, whose set-up costs more than the copy
// at decode sizes (a few hundred bytes per token).
#include <cstring>

#include "ops.h"

namespace {

void check_rows(const torch::Tensor& rows, const char* name) {
  TORCH_CHECK(rows.stride(2) == 1 && rows.stride(1) == rows.size(2), "write_kv_cache: ", name,
              " must be [tokens, kv_heads, head_dim] with each token's heads contiguous");
}

}  // namespace

void write_kv_cache(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache, torch::Tensor value_cache,
                    torch::Tensor slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(), "write_kv_cache: key and value must be the same 3-D shape");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  value_cache.sizes() == key_cache.sizes(),
              "write_kv_cache: the caches must be contiguous [num_blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(key.size(1) == key_cache.size(2) && key.size(2) == key_cache.size(3),
              "write_kv_cache: key/value heads and head_dim must match the cache's");
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() && value.scalar_type() == key_cache.scalar_type() &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "write_kv_cache: key, value and both caches must have one dtype");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0) &&
                  slot_mapping.scalar_type() == torch::kLong,
              "write_kv_cache: slot_mapping must be int64 with one slot per token");
  check_rows(key, "key");
  check_rows(value, "value");
  const int64_t tokens = key.size(0), num_slots = key_cache.size(0) * key_cache.size(1);
  const int64_t element = key.element_size(), row_bytes = key.size(1) * key.size(2) * element;
  auto slots = slot_mapping.contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const char* k = static_cast<const char*>(key.data_ptr());
  const char* v = static_cast<const char*>(value.data_ptr());
  char* k_pool = static_cast<char*>(key_cache.data_ptr());
  char* v_pool = static_cast<char*>(value_cache.data_ptr());
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "write_kv_cache: slot ", slot[t], " is outside the pool's ",
                num_slots, " slots");
    std::memcpy(k_pool + slot[t] * row_bytes, k + t * key.stride(0) * element, row_bytes);
    std::memcpy(v_pool + slot[t] * row_bytes, v + t * value.stride(0) * element, row_bytes);
  }
}
