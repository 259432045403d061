// Bidirectional attention within each sequence of a packed batch (an encoder's
// layer): the sequences' tokens are concatenated rows, sequence s owning rows
// cu_seqlens[s] .. cu_seqlens[s + 1]. q, k and v are read in place from the
// fused QKV output (strided views) and each head's output is written straight
// into its columns of the packed [tokens, heads * dim] result, so nothing is
// padded: PyTorch's SDPA needs every sequence of a call padded to the longest,
// and the copies in and out cost the encoder nearly as much as the attention
// itself (12% and 15% of its time in a two-thread profile, docs/pooling.md "Speed").
//
// One work item is one (sequence, head): its keys are packed once into tiles of
// 32 keys ([tile][dim][32], fp32) and its values into rows, then 8 query rows at
// a time take every score into a small buffer, an exact softmax over it (max,
// exp, sum), and P . V. Items go longest first to whichever thread is free,
// since sequence costs differ by the square of their lengths.
#include "ops.h"

#if defined(__AVX512F__)
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "dtype.h"
#include "fast_exp.h"
#include "vec16.h"

namespace {

constexpr int64_t kKeys = 32;  // keys per tile: two vectors of scores per query row
constexpr int64_t kRows = 8;   // query rows per tile: 16 accumulators stay in registers

template <typename scalar_t>
struct Head {
  const scalar_t *q, *k, *v;  // the sequence's first row of this head
  int64_t q_stride, k_stride, v_stride;
  scalar_t* out;
  int64_t out_stride, len, dim, window;  // window < 0: every key of the sequence
  float scale;
};

// One (sequence, head) in fp32: keys[t][d][j] = key t * kKeys + j, dim d (keys past the end
// are zeros), values[j][d] = value j, dim d. Packed values also keep P . V off the fused QKV
// rows, whose stride (3 * hidden floats) maps one head's values onto few L1 sets.
template <typename scalar_t>
void pack_head(const Head<scalar_t>& h, float* keys, float* values) {
  const int64_t tiles = (h.len + kKeys - 1) / kKeys;
  std::memset(keys, 0, sizeof(float) * tiles * h.dim * kKeys);
  for (int64_t j = 0; j < h.len; ++j) {
    float* out = keys + (j / kKeys) * h.dim * kKeys + j % kKeys;
    for (int64_t d = 0; d < h.dim; ++d) out[d * kKeys] = load(h.k[j * h.k_stride + d]);
    for (int64_t d = 0; d < h.dim; d += 16) _mm512_storeu_ps(values + j * h.dim + d, load16(h.v + j * h.v_stride + d));
  }
}

// Dims [d, d + 16 * kVecs) of the ``count`` output rows: P . V over keys [first_key, last_key],
// times each row's 1 / sum. The sums stay in local registers (an accumulator array passed by
// reference was stored back on every key).
template <int kVecs, typename scalar_t>
void weighted_values(const float* values, int64_t dim, const float* probs, int64_t width, int64_t first_key,
                     int64_t last_key, int64_t d, const float* inverse, scalar_t* out, int64_t out_stride,
                     int64_t count) {
  __m512 o[kRows][kVecs];
  for (int64_t r = 0; r < kRows; ++r)
    for (int i = 0; i < kVecs; ++i) o[r][i] = _mm512_setzero_ps();
  for (int64_t j = first_key; j <= last_key; ++j) {
    __m512 v[kVecs];
    for (int i = 0; i < kVecs; ++i) v[i] = _mm512_loadu_ps(values + j * dim + d + 16 * i);
    const float* p = probs + (j - first_key);
    for (int64_t r = 0; r < kRows; ++r) {
      const __m512 pr = _mm512_set1_ps(p[r * width]);
      for (int i = 0; i < kVecs; ++i) o[r][i] = _mm512_fmadd_ps(pr, v[i], o[r][i]);
    }
  }
  for (int64_t r = 0; r < count; ++r)
    for (int i = 0; i < kVecs; ++i)
      store16(out + r * out_stride + d + 16 * i, _mm512_mul_ps(_mm512_set1_ps(inverse[r]), o[r][i]));
}

// scores[r][c] = q_r . k_(first_tile * kKeys + c) (q pre-scaled) for the keys in [lo[r], hi[r]],
// -inf for the rest; top[r] gets lanes whose max is the row's.
void tile_scores(const float* keys, const float* q, int64_t dim, const int64_t* lo, const int64_t* hi,
                 int64_t first_tile, int64_t last_tile, float* scores, __m512* top) {
  const int64_t width = (last_tile - first_tile + 1) * kKeys;
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t r = 0; r < kRows; ++r) top[r] = minus_inf;
  for (int64_t t = first_tile; t <= last_tile; ++t) {
    __m512 s0[kRows], s1[kRows];
    for (int64_t r = 0; r < kRows; ++r) s0[r] = s1[r] = _mm512_setzero_ps();
    const float* tile = keys + t * dim * kKeys;
    for (int64_t d = 0; d < dim; ++d) {
      const __m512 k0 = _mm512_loadu_ps(tile + d * kKeys), k1 = _mm512_loadu_ps(tile + d * kKeys + 16);
      for (int64_t r = 0; r < kRows; ++r) {
        const __m512 qd = _mm512_set1_ps(q[r * dim + d]);
        s0[r] = _mm512_fmadd_ps(qd, k0, s0[r]);
        s1[r] = _mm512_fmadd_ps(qd, k1, s1[r]);
      }
    }
    const __m512i key0 = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(t * kKeys)));
    const __m512i key1 = _mm512_add_epi32(key0, _mm512_set1_epi32(16));
    for (int64_t r = 0; r < kRows; ++r) {
      const __m512i l = _mm512_set1_epi32(static_cast<int>(lo[r])), u = _mm512_set1_epi32(static_cast<int>(hi[r]));
      const __mmask16 m0 = _mm512_cmpge_epi32_mask(key0, l) & _mm512_cmple_epi32_mask(key0, u);
      const __mmask16 m1 = _mm512_cmpge_epi32_mask(key1, l) & _mm512_cmple_epi32_mask(key1, u);
      const __m512 x0 = _mm512_mask_mov_ps(minus_inf, m0, s0[r]), x1 = _mm512_mask_mov_ps(minus_inf, m1, s1[r]);
      float* row = scores + r * width + (t - first_tile) * kKeys;
      _mm512_storeu_ps(row, x0);
      _mm512_storeu_ps(row + 16, x1);
      top[r] = _mm512_max_ps(top[r], _mm512_max_ps(x0, x1));
    }
  }
}

// Each row of scores [kRows][width] becomes exp(score - the row's max) (0 where -inf), in
// place: the exact softmax's numerators; inverse[r] gets 1 / their sum.
void softmax_numerators(float* scores, int64_t width, const __m512* top, float* inverse) {
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t r = 0; r < kRows; ++r) {
    float* row = scores + r * width;
    const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(top[r]));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t c = 0; c < width; c += 16) {
      const __m512 x = _mm512_loadu_ps(row + c);
      const __m512 p = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, minus_inf, _CMP_NEQ_OQ), exp16(_mm512_sub_ps(x, shift)));
      sum = _mm512_add_ps(sum, p);
      _mm512_storeu_ps(row + c, p);
    }
    inverse[r] = 1.0f / _mm512_reduce_add_ps(sum);
  }
}

// Query rows [first, first + count) (count <= kRows) of one head, over its packed keys and
// values. ``scratch`` holds kRows * (dim + padded keys) floats.
template <typename scalar_t>
void attend_rows(const Head<scalar_t>& h, const float* keys, const float* values, int64_t first, int64_t count,
                 float* scratch) {
  float* q = scratch;  // [kRows][dim], scaled; the rows past count repeat the first
  int64_t lo[kRows], hi[kRows];  // each row's visible keys: the window, or the whole sequence
  for (int64_t r = 0; r < kRows; ++r) {
    const int64_t row = first + (r < count ? r : 0);
    lo[r] = h.window < 0 ? 0 : std::max<int64_t>(0, row - h.window);
    hi[r] = h.window < 0 ? h.len - 1 : std::min(h.len - 1, row + h.window);
    for (int64_t d = 0; d < h.dim; ++d) q[r * h.dim + d] = h.scale * load(h.q[row * h.q_stride + d]);
  }
  const int64_t first_tile = lo[0] / kKeys, last_tile = hi[count - 1] / kKeys;
  const int64_t width = (last_tile - first_tile + 1) * kKeys, first_key = lo[0], last_key = hi[count - 1];
  float* scores = scratch + kRows * h.dim;  // [kRows][width]
  __m512 top[kRows];
  float inverse[kRows];
  tile_scores(keys, q, h.dim, lo, hi, first_tile, last_tile, scores, top);
  softmax_numerators(scores, width, top, inverse);
  const float* probs = scores + (first_key - first_tile * kKeys);
  scalar_t* out = h.out + first * h.out_stride;
  for (int64_t d = 0; d < h.dim; d += 32) {
    if (h.dim - d >= 32)
      weighted_values<2>(values, h.dim, probs, width, first_key, last_key, d, inverse, out, h.out_stride, count);
    else
      weighted_values<1>(values, h.dim, probs, width, first_key, last_key, d, inverse, out, h.out_stride, count);
  }
}

template <typename scalar_t>
void run(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
         const std::vector<int64_t>& starts, double scale, int64_t window, torch::Tensor& out) {
  const int64_t seqs = static_cast<int64_t>(starts.size()) - 1, heads = query.size(1), dim = query.size(2);
  std::vector<int64_t> order(seqs);  // longest first
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return starts[a + 1] - starts[a] > starts[b + 1] - starts[b];
  });
  int64_t longest = 0;
  for (int64_t s = 0; s < seqs; ++s) longest = std::max(longest, starts[s + 1] - starts[s]);
  const int64_t padded = (longest + kKeys - 1) / kKeys * kKeys;
  const auto* qp = query.data_ptr<scalar_t>();
  const auto* kp = key.data_ptr<scalar_t>();
  const auto* vp = value.data_ptr<scalar_t>();
  auto* op = out.data_ptr<scalar_t>();
  std::atomic<int64_t> next{0};
  const int64_t items = seqs * heads, threads = std::min<int64_t>(at::get_num_threads(), items);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<float> keys(padded * dim), values(padded * dim), scratch(kRows * (dim + padded));
    for (int64_t item = next++; item < items; item = next++) {
      const int64_t s = order[item / heads], head = item % heads, start = starts[s];
      const Head<scalar_t> h{qp + start * query.stride(0) + head * query.stride(1),
                             kp + start * key.stride(0) + head * key.stride(1),
                             vp + start * value.stride(0) + head * value.stride(1),
                             query.stride(0), key.stride(0), value.stride(0),
                             op + start * heads * dim + head * dim, heads * dim,
                             starts[s + 1] - start, dim, window, static_cast<float>(scale)};
      pack_head(h, keys.data(), values.data());
      for (int64_t first = 0; first < h.len; first += kRows)
        attend_rows(h, keys.data(), values.data(), first, std::min(kRows, h.len - first), scratch.data());
    }
  });
}

}  // namespace
#endif

bool varlen_attention_available(at::ScalarType dtype) {
#if defined(__AVX512F__)
  return dtype == torch::kFloat || dtype == torch::kBFloat16;
#else
  return false;
#endif
}

torch::Tensor varlen_attention(torch::Tensor query, torch::Tensor key, torch::Tensor value, torch::Tensor cu_seqlens,
                               double scale, int64_t window) {
  TORCH_CHECK(varlen_attention_available(query.scalar_type()),
              "varlen_attention: not built for ", query.scalar_type(), " (check varlen_attention_available(dtype))");
  TORCH_CHECK(query.dim() == 3 && key.sizes() == query.sizes() && value.sizes() == query.sizes(),
              "varlen_attention: query, key and value must all be [tokens, heads, dim]");
  TORCH_CHECK(key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type(),
              "varlen_attention: query, key and value must share one dtype");
  TORCH_CHECK(query.stride(2) == 1 && key.stride(2) == 1 && value.stride(2) == 1,
              "varlen_attention: each head's dims must be contiguous (stride 1)");
  TORCH_CHECK(query.size(2) % 16 == 0, "varlen_attention: the head size must be a multiple of 16");
  TORCH_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.size(0) >= 2 && cu_seqlens.scalar_type() == torch::kLong,
              "varlen_attention: cu_seqlens must be int64 [sequences + 1]");
  const auto offsets = cu_seqlens.contiguous();
  const std::vector<int64_t> starts(offsets.data_ptr<int64_t>(), offsets.data_ptr<int64_t>() + offsets.size(0));
  for (size_t s = 0; s + 1 < starts.size(); ++s)
    TORCH_CHECK(starts[s] < starts[s + 1], "varlen_attention: cu_seqlens must rise strictly (no empty sequence)");
  TORCH_CHECK(starts.front() == 0 && starts.back() == query.size(0),
              "varlen_attention: cu_seqlens must run from 0 to the number of tokens");
  auto out = torch::empty({query.size(0), query.size(1) * query.size(2)}, query.options());
#if defined(__AVX512F__)
  if (query.scalar_type() == torch::kFloat) run<float>(query, key, value, starts, scale, window, out);
  else run<c10::BFloat16>(query, key, value, starts, scale, window, out);
#endif
  return out;
}
