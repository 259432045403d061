// Causal prefill attention for bf16 with VDPBF16PS (AVX-512 BF16). PyTorch's
// CPU SDPA runs no faster in bf16 than in fp32 on a core without AMX (on
// SmolLM2's 64-dim heads it reaches ~35 GFLOP/s either way), so a bf16 model
// spent as long on prefill attention as an fp32 one. Here Q . K runs on bf16
// pairs into fp32 sums and P . V in fp32, flash-attention style: one tile of query rows
// walks the key tiles up to its diagonal with an online softmax, so the score
// matrix never exists and tiles above the diagonal are never touched.
#include "ops.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include <cstring>
#include <limits>

#include "dtype.h"
#include "fast_exp.h"
#include "vec16.h"

namespace {

constexpr int64_t kKeys = 32;  // keys per tile: two vectors of scores per query row
constexpr int64_t kRows = 8;   // query rows per tile: 16 score accumulators stay in registers
constexpr int64_t kMaxHeadDim = 256;

// One kv head's K as VNNI pairs: packed[t][p][j] holds dims 2p and 2p + 1 of
// key t * kKeys + j, so one load gives a tile's 16 keys for one pair of dims.
// Keys past the end are zeros (their scores are masked anyway).
void pack_keys(const uint16_t* key, int64_t stride, int64_t num_keys, int64_t head_dim, uint32_t* packed) {
  const int64_t pairs = head_dim / 2;
  std::memset(packed, 0, sizeof(uint32_t) * ((num_keys + kKeys - 1) / kKeys) * pairs * kKeys);
  for (int64_t j = 0; j < num_keys; ++j) {
    const auto* row = reinterpret_cast<const uint32_t*>(key + j * stride);
    uint32_t* out = packed + (j / kKeys) * pairs * kKeys + j % kKeys;
    for (int64_t p = 0; p < pairs; ++p) out[p * kKeys] = row[p];
  }
}

// One kv head's V widened to fp32, packed[j][d] (keys past the end of the last
// tile are zeros: their probabilities are zero too). P stays fp32 for P . V, so
// the output carries no rounding of P (Hugging Face's bf16 path rounds P to
// bf16; on real models that is visible in the prompt log-probabilities).
void pack_values(const c10::BFloat16* value, int64_t stride, int64_t num_keys, int64_t head_dim, float* packed) {
  std::memset(packed, 0, sizeof(float) * ((num_keys + kKeys - 1) / kKeys) * kKeys * head_dim);
  for (int64_t j = 0; j < num_keys; ++j)
    for (int64_t d = 0; d < head_dim; ++d) packed[j * head_dim + d] = load(value[j * stride + d]);
}

// The lanes of a 16-key half tile that hold keys <= limit (relative to the half's first key).
inline __mmask16 visible_lanes(int64_t limit) {
  if (limit < 0) return 0;
  return limit >= 15 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (limit + 1)) - 1);
}

struct Shape {
  int64_t num_keys, head_dim, query_offset;
  float scale;
};

// Rows [first, first + count) of one query head (count <= kRows). ``query``
// points at the first row, rows ``query_stride`` apart; ``out`` likewise.
// Row i sees keys j <= first + i + query_offset (and j < num_keys).
void attend_rows(const c10::BFloat16* query, int64_t query_stride, int64_t first, int64_t count,
                 const uint32_t* keys, const float* values, const Shape& shape, c10::BFloat16* out,
                 int64_t out_stride) {
  const int64_t pairs = shape.head_dim / 2;
  alignas(64) float acc[kRows][kMaxHeadDim];
  alignas(64) float probs[kRows][kKeys];  // this tile's P
  float row_max[kRows], row_sum[kRows];
  int64_t limit[kRows];  // the row's last visible key
  const uint32_t* q[kRows];
  for (int64_t r = 0; r < kRows; ++r) {
    // Rows past ``count`` repeat the first one: their sums are computed and never used.
    const int64_t row = r < count ? r : 0;
    q[r] = reinterpret_cast<const uint32_t*>(query + row * query_stride);
    limit[r] = std::min(first + row + shape.query_offset, shape.num_keys - 1);
    row_max[r] = -std::numeric_limits<float>::infinity();
    row_sum[r] = 0.0f;
    std::memset(acc[r], 0, sizeof(float) * shape.head_dim);
  }
  const int64_t last_tile = limit[count - 1] / kKeys;
  const __m512 scale = _mm512_set1_ps(shape.scale), minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t <= last_tile; ++t) {
    __m512 s0[kRows], s1[kRows];
    for (int64_t r = 0; r < kRows; ++r) s0[r] = s1[r] = _mm512_setzero_ps();
    const uint32_t* tile_keys = keys + t * pairs * kKeys;
    for (int64_t p = 0; p < pairs; ++p) {
      const auto k0 = (__m512bh)_mm512_loadu_si512(tile_keys + p * kKeys);
      const auto k1 = (__m512bh)_mm512_loadu_si512(tile_keys + p * kKeys + 16);
      for (int64_t r = 0; r < kRows; ++r) {
        const auto qp = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r][p]));
        s0[r] = _mm512_dpbf16_ps(s0[r], qp, k0);
        s1[r] = _mm512_dpbf16_ps(s1[r], qp, k1);
      }
    }
    for (int64_t r = 0; r < kRows; ++r) {
      if (r >= count) {
        std::memset(probs[r], 0, sizeof(probs[r]));
        continue;
      }
      const int64_t relative = limit[r] - t * kKeys;
      const __mmask16 m0 = visible_lanes(relative), m1 = visible_lanes(relative - 16);
      const __m512 x0 = _mm512_mask_mul_ps(minus_inf, m0, s0[r], scale);
      const __m512 x1 = _mm512_mask_mul_ps(minus_inf, m1, s1[r], scale);
      // Tile 0 always holds a visible key, so the running max is finite from then on.
      const float new_max = std::max(row_max[r], _mm512_reduce_max_ps(_mm512_max_ps(x0, x1)));
      const __m512 shift = _mm512_set1_ps(new_max);
      const __m512 p0 = _mm512_maskz_mov_ps(m0, exp16(_mm512_sub_ps(x0, shift)));
      const __m512 p1 = _mm512_maskz_mov_ps(m1, exp16(_mm512_sub_ps(x1, shift)));
      if (new_max != row_max[r]) {  // rescale what earlier tiles added (nothing, on the first)
        const float correction = t == 0 ? 0.0f : fast_exp(row_max[r] - new_max);
        row_sum[r] *= correction;
        const __m512 c = _mm512_set1_ps(correction);
        for (int64_t d = 0; d < shape.head_dim; d += 16) _mm512_store_ps(acc[r] + d, _mm512_mul_ps(c, _mm512_load_ps(acc[r] + d)));
        row_max[r] = new_max;
      }
      row_sum[r] += _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
      _mm512_store_ps(probs[r], p0);
      _mm512_store_ps(probs[r] + 16, p1);
    }
    const float* tile_values = values + t * kKeys * shape.head_dim;
    for (int64_t d = 0; d < shape.head_dim; d += 16) {
      __m512 o[kRows];
      for (int64_t r = 0; r < kRows; ++r) o[r] = _mm512_load_ps(acc[r] + d);
      for (int64_t k = 0; k < kKeys; ++k) {
        const __m512 v = _mm512_loadu_ps(tile_values + k * shape.head_dim + d);
        for (int64_t r = 0; r < kRows; ++r) o[r] = _mm512_fmadd_ps(_mm512_set1_ps(probs[r][k]), v, o[r]);
      }
      for (int64_t r = 0; r < kRows; ++r) _mm512_store_ps(acc[r] + d, o[r]);
    }
  }
  for (int64_t r = 0; r < count; ++r) {
    const __m512 inverse = _mm512_set1_ps(1.0f / row_sum[r]);
    for (int64_t d = 0; d < shape.head_dim; d += 16)
      store16(out + r * out_stride + d, _mm512_mul_ps(inverse, _mm512_load_ps(acc[r] + d)));
  }
}

}  // namespace
#endif

torch::Tensor prefill_attention(torch::Tensor query, torch::Tensor key, torch::Tensor value, double scale,
                                int64_t query_offset) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3 && key.sizes() == value.sizes(),
              "prefill_attention: query [queries, heads, dim], key and value [keys, kv_heads, dim]");
  TORCH_CHECK(query.size(2) == key.size(2) && query.size(1) % key.size(1) == 0,
              "prefill_attention: query heads must be a multiple of kv heads, with one head size");
  TORCH_CHECK(query_offset >= 0 && query.size(0) + query_offset <= key.size(0),
              "prefill_attention: query i sees keys up to i + query_offset, all of which must exist");
#if defined(__AVX512BF16__)
  const int64_t num_queries = query.size(0), num_heads = query.size(1), num_keys = key.size(0),
                kv_heads = key.size(1), head_dim = query.size(2);
  if (query.scalar_type() == torch::kBFloat16 && key.scalar_type() == torch::kBFloat16 &&
      value.scalar_type() == torch::kBFloat16 && head_dim % 16 == 0 && head_dim <= kMaxHeadDim &&
      query.stride(2) == 1 && key.stride(2) == 1 && value.stride(2) == 1) {
    const int64_t tiles = (num_keys + kKeys - 1) / kKeys, per_head = tiles * kKeys * head_dim;
    auto packed_keys = torch::empty({kv_heads, per_head / 2}, query.options().dtype(torch::kInt));
    auto packed_values = torch::empty({kv_heads, per_head}, query.options().dtype(torch::kFloat));
    auto* pk = reinterpret_cast<uint32_t*>(packed_keys.data_ptr<int>());
    float* pv = packed_values.data_ptr<float>();
    const auto* kp = reinterpret_cast<const uint16_t*>(key.data_ptr<c10::BFloat16>());
    const c10::BFloat16* vp = value.data_ptr<c10::BFloat16>();
    at::parallel_for(0, kv_heads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t h = begin; h < end; ++h) {
        pack_keys(kp + h * key.stride(1), key.stride(0), num_keys, head_dim, pk + h * per_head / 2);
        pack_values(vp + h * value.stride(1), value.stride(0), num_keys, head_dim, pv + h * per_head);
      }
    });
    auto out = torch::empty({num_queries, num_heads, head_dim}, query.options());
    const Shape shape{num_keys, head_dim, query_offset, static_cast<float>(scale)};
    const int64_t row_tiles = (num_queries + kRows - 1) / kRows, group = num_heads / kv_heads;
    const c10::BFloat16* qp = query.data_ptr<c10::BFloat16>();
    c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
    // Bottom rows first: they walk the most key tiles, so the tail of the schedule is short work.
    at::parallel_for(0, num_heads * row_tiles, 1, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t h = item % num_heads, first = (row_tiles - 1 - item / num_heads) * kRows;
        const int64_t kv = h / group;
        attend_rows(qp + first * query.stride(0) + h * query.stride(1), query.stride(0), first,
                    std::min(kRows, num_queries - first), pk + kv * per_head / 2, pv + kv * per_head, shape,
                    op + (first * num_heads + h) * head_dim, num_heads * head_dim);
      }
    });
    return out;
  }
#endif
  // Elsewhere (fp32, other head sizes, no AVX-512 BF16): PyTorch's SDPA with the same visibility.
  const auto q = query.transpose(0, 1).unsqueeze(0), k = key.transpose(0, 1).unsqueeze(0),
             v = value.transpose(0, 1).unsqueeze(0);
  const auto positions = torch::arange(key.size(0), query.options().dtype(torch::kLong));
  const auto mask = positions.unsqueeze(0) <= (positions.slice(0, 0, query.size(0)) + query_offset).unsqueeze(1);
  return at::scaled_dot_product_attention(q, k, v, mask, 0.0, false, scale, true).squeeze(0).transpose(0, 1);
}
