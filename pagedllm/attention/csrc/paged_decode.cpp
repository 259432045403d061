// Paged decode attention for CPUs: one new query token per sequence attends to
// its context straight through the block table. Nothing is gathered into a
// padded copy: each (sequence, KV head) task walks its own blocks, so the work
// and the memory read are exactly the sequence's tokens.
//
// Shapes: query [B, H, D]; key_cache / value_cache [num_blocks, block_size,
// H_kv, D] (block-major, contiguous); block_tables [B, max_blocks] int64;
// context_lens [B] int64. Query head h reads KV head h / (H / H_kv).
// Scores, softmax and the weighted sum are accumulated in fp32 whatever the
// storage dtype.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename scalar_t>
void decode_task(const scalar_t* query, const scalar_t* key_cache, const scalar_t* value_cache,
                 const int64_t* table, int64_t context_len, scalar_t* out, int64_t block_size,
                 int64_t num_kv_heads, int64_t head_dim, int64_t group, int64_t kv_head, float scale,
                 std::vector<float>& scores, std::vector<float>& q, std::vector<float>& acc) {
  const int64_t token_stride = num_kv_heads * head_dim;
  scores.assign(group * context_len, 0.0f);
  q.resize(group * head_dim);
  acc.assign(group * head_dim, 0.0f);
  for (int64_t g = 0; g < group * head_dim; ++g) q[g] = static_cast<float>(query[g]);

  for (int64_t t = 0; t < context_len; ++t) {
    const int64_t slot = table[t / block_size] * block_size + t % block_size;
    const scalar_t* k = key_cache + slot * token_stride + kv_head * head_dim;
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q.data() + g * head_dim;
      float dot = 0.0f;
      for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * static_cast<float>(k[d]);
      scores[g * context_len + t] = dot * scale;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores.data() + g * context_len;
    const float peak = *std::max_element(s, s + context_len);
    float total = 0.0f;
    for (int64_t t = 0; t < context_len; ++t) {
      s[t] = std::exp(s[t] - peak);
      total += s[t];
    }
    const float inv = 1.0f / total;
    for (int64_t t = 0; t < context_len; ++t) s[t] *= inv;
  }
  for (int64_t t = 0; t < context_len; ++t) {
    const int64_t slot = table[t / block_size] * block_size + t % block_size;
    const scalar_t* v = value_cache + slot * token_stride + kv_head * head_dim;
    for (int64_t g = 0; g < group; ++g) {
      const float w = scores[g * context_len + t];
      float* a = acc.data() + g * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) a[d] += w * static_cast<float>(v[d]);
    }
  }
  for (int64_t g = 0; g < group * head_dim; ++g) out[g] = static_cast<scalar_t>(acc[g]);
}

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "paged_decode_attention needs contiguous query and caches");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && context_lens.scalar_type() == torch::kLong,
              "block_tables and context_lens must be int64");
  const int64_t batch = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  const int64_t group = num_heads / num_kv_heads;
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  auto out = torch::empty_like(query);
  const int64_t max_blocks = tables.size(1);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_attention", [&] {
    const scalar_t* q = query.data_ptr<scalar_t>();
    const scalar_t* kc = key_cache.data_ptr<scalar_t>();
    const scalar_t* vc = value_cache.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const int64_t* bt = tables.data_ptr<int64_t>();
    const int64_t* cl = lens.data_ptr<int64_t>();
    at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores, qbuf, acc;
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / num_kv_heads, kv_head = task % num_kv_heads;
        const int64_t offset = (b * num_heads + kv_head * group) * head_dim;
        decode_task<scalar_t>(q + offset, kc, vc, bt + b * max_blocks, cl[b], o + offset, block_size,
                              num_kv_heads, head_dim, group, kv_head, static_cast<float>(scale), scores, qbuf, acc);
      }
    });
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "Paged decode attention (CPU)");
}
