// One block of paged decode attention, the generic path (paged_decode.cpp's
// tasks call it per block of a sequence's table): score the block's tokens for
// every query head, fold them into each head's online softmax, accumulate the
// block's values. Any head size, storage dtype, key/value scales and soft cap;
// AVX-512 speeds up the scoring and the head_dim 64 value sums.
#pragma once
#include "dtype.h"
#include "fast_exp.h"
#include "lanes.h"
#include "vec16.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

// Internal linkage, as if this were still part of the one .cpp file that includes it: GCC's
// inliner then keeps the hot loops' helpers inline (checked against the object code).
namespace {

struct Scratch {
  std::vector<float> q, scores;
};

// Views into the per-task partial results: [rows], [rows], [rows * head_dim].
struct Partial {
  float* max;
  float* sum;
  float* acc;
};

template <typename scalar_t>
__attribute__((always_inline)) inline float dot(const float* __restrict q, const scalar_t* __restrict k, int64_t head_dim) {
  float total = 0.0f;
#pragma omp simd reduction(+ : total)
  for (int64_t d = 0; d < head_dim; ++d) total += q[d] * load(k[d]);
  return total;
}

#if defined(__AVX512F__)
// With AVX-512, a dot product's last step (summing 16 lanes) costs more than
// its multiply-adds at head_dim 64. Scoring 16 tokens at once instead leaves
// 16 vectors of partial sums, and one transpose-and-add tree sums all of them
// (~3 shuffles per token instead of ~8).
template <typename scalar_t>
void score_tokens_avx512(const float* __restrict q, const scalar_t* __restrict k, int64_t token_stride, int64_t n,
                         int64_t head_dim, float* __restrict scores) {
  for (int64_t first = 0; first < n; first += 16) {
    const int64_t count = std::min<int64_t>(16, n - first);
    __m512 partial[16];
    for (int64_t t = 0; t < 16; ++t) {
      if (t >= count) {
        partial[t] = _mm512_setzero_ps();
        continue;
      }
      const scalar_t* kt = k + (first + t) * token_stride;
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q), load16(kt));
      for (int64_t d = 16; d < head_dim; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16(kt + d), acc);
      partial[t] = acc;
    }
    _mm512_mask_storeu_ps(scores + first, static_cast<__mmask16>((1u << count) - 1), sum_lanes_of_16(partial));
  }
}

#endif

// scores[t] = q . k_t for the n tokens k_t = k + t * token_stride.
template <typename scalar_t>
__attribute__((always_inline)) inline void score_tokens(const float* __restrict q, const scalar_t* __restrict k,
                                                        int64_t token_stride, int64_t n, int64_t head_dim,
                                                        float* __restrict scores) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16> ||
                std::is_same_v<scalar_t, int8_t>) {
    if (head_dim % 16 == 0) return score_tokens_avx512(q, k, token_stride, n, head_dim, scores);
  }
#endif
  for (int64_t t = 0; t < n; ++t) scores[t] = dot(q, k + t * token_stride, head_dim);
}

#if defined(__AVX512F__)
// 64 floats in four registers (named, not an array, so GCC keeps them there).
struct Vec64 {
  __m512 a, b, c, d;
};

template <typename cache_t>
__attribute__((always_inline)) inline Vec64 load64(const cache_t* p) {
  return {load16(p), load16(p + 16), load16(p + 32), load16(p + 48)};
}

__attribute__((always_inline)) inline void store64(float* p, const Vec64& x) {
  _mm512_storeu_ps(p, x.a);
  _mm512_storeu_ps(p + 16, x.b);
  _mm512_storeu_ps(p + 32, x.c);
  _mm512_storeu_ps(p + 48, x.d);
}

__attribute__((always_inline)) inline __m512 dot_lanes(const Vec64& q, const Vec64& k) {
  return _mm512_fmadd_ps(q.d, k.d, _mm512_fmadd_ps(q.c, k.c, _mm512_fmadd_ps(q.b, k.b, _mm512_mul_ps(q.a, k.a))));
}

__attribute__((always_inline)) inline void add_scaled(Vec64& acc, float weight, const Vec64& v) {
  const __m512 w = _mm512_set1_ps(weight);
  acc.a = _mm512_fmadd_ps(w, v.a, acc.a);
  acc.b = _mm512_fmadd_ps(w, v.b, acc.b);
  acc.c = _mm512_fmadd_ps(w, v.c, acc.c);
  acc.d = _mm512_fmadd_ps(w, v.d, acc.d);
}
#endif

// acc += sum over the block's n tokens of weight[t] (* the token's value scale)
// * v_t, for one query row; v_t = v + t * token_stride.
template <typename cache_t, int64_t kHeadDim>
__attribute__((always_inline)) inline void accumulate_values(const float* __restrict weight, const cache_t* __restrict v,
                                                             int64_t token_stride, int64_t n, const float* value_scales,
                                                             int64_t num_kv_heads, int64_t kv_head,
                                                             float* __restrict acc, int64_t head_dim) {
  auto token_weight = [&](int64_t t) {
    return weight[t] * (value_scales != nullptr ? value_scales[t * num_kv_heads + kv_head] : 1.0f);
  };
#if defined(__AVX512F__)
  if constexpr (kHeadDim == 64 && (std::is_same_v<cache_t, float> || std::is_same_v<cache_t, c10::BFloat16> ||
                                   std::is_same_v<cache_t, int8_t>)) {
    // The row's 64 sums stay in four registers for the whole block instead
    // of a load and store of acc per token.
    Vec64 sums = load64(acc);
    for (int64_t t = 0; t < n; ++t) add_scaled(sums, token_weight(t), load64(v + t * token_stride));
    store64(acc, sums);
    return;
  }
#endif
  for (int64_t t = 0; t < n; ++t) {
    const float w = token_weight(t);
    const cache_t* vt = v + t * token_stride;
#pragma omp simd
    for (int64_t d = 0; d < head_dim; ++d) acc[d] += w * load(vt[d]);
  }
}

// Blocks are scattered over the pool, so the hardware prefetcher cannot guess
// the next one: it is fetched while this one is processed, in equal shares of
// its cache lines spread over the work (all at once stalls on the line fill
// buffers). This issues share ``part`` of ``parts`` of lines [first, first +
// count) starting at ``base`` (null: nothing to fetch).
inline void prefetch_share(const char* base, int64_t first, int64_t count, int64_t part, int64_t parts) {
  if (base == nullptr) return;
  const int64_t end = first + count * (part + 1) / parts;
  for (int64_t line = first + count * part / parts; line < end; ++line) __builtin_prefetch(base + line * 64);
}

// The generic path over one block: n tokens of K/V (cache_t, with per-token
// scales when key_scales / value_scales are not null, pointing at the block's
// first token read), for all rows = H_kv * group query heads; updates each
// row's running max, sum and weighted value sum. k_next / v_next: the next
// block to fetch meanwhile (null: none), block_lines of it.
template <typename cache_t, int64_t kHeadDim>
void attend_block(const float* q, const cache_t* k_block, const cache_t* v_block, const float* key_scales,
                  const float* value_scales, int64_t n, int64_t rows, int64_t group, int64_t num_kv_heads,
                  int64_t head_dim, int64_t block_size, float soft_cap, const char* k_next, const char* v_next,
                  int64_t block_lines, Scratch& s, Partial part) {
  const int64_t token_stride = num_kv_heads * head_dim;
  for (int64_t r = 0; r < rows; ++r) {
    prefetch_share(k_next, 0, block_lines, r, rows);
    float* scores = s.scores.data() + r * block_size;
    score_tokens(q + r * head_dim, k_block + (r / group) * head_dim, token_stride, n, head_dim, scores);
    if (key_scales != nullptr) {
      const float* token_scales = key_scales + r / group;
      for (int64_t t = 0; t < n; ++t) scores[t] *= token_scales[t * num_kv_heads];
    }
    if (soft_cap > 0.0f) {
      for (int64_t t = 0; t < n; ++t) scores[t] = soft_cap * std::tanh(scores[t] / soft_cap);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* scores = s.scores.data() + r * block_size;
    float block_max = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : block_max)
    for (int64_t t = 0; t < n; ++t) block_max = scores[t] > block_max ? scores[t] : block_max;  // vectorizes
    const float new_max = std::max(part.max[r], block_max);
    // exp(-inf) = 0 on the first block, so the empty running sums stay empty.
    const float correction = fast_exp(part.max[r] - new_max);
    float block_sum = 0.0f;
    for (int64_t t = 0; t < n; ++t) {
      scores[t] = fast_exp(scores[t] - new_max);
      block_sum += scores[t];
    }
    part.sum[r] = part.sum[r] * correction + block_sum;
    part.max[r] = new_max;
    if (correction != 1.0f) {
      float* acc = part.acc + r * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) acc[d] *= correction;
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    prefetch_share(v_next, 0, block_lines, r, rows);
    accumulate_values<cache_t, kHeadDim>(s.scores.data() + r * block_size, v_block + (r / group) * head_dim,
                                         token_stride, n, value_scales, num_kv_heads, r / group,
                                         part.acc + r * head_dim, head_dim);
  }
}

}  // namespace
