// The grouped fast path of paged decode attention (AVX-512 only): head_dim 64,
// 16-token blocks, fp32 or bf16 storage, up to 4 query heads per KV head.
// One call handles the `kGroup` query heads that share a KV head, over one
// block: each K and V token is loaded (and converted) once for all of them, and
// each row's 16 scores are one vector, so the softmax is a few vector ops
// instead of a scalar loop per token.
#pragma once
#include "paged_decode_block.h"

#if defined(__AVX512F__)
// Internal linkage, as if this were still part of the one .cpp file that includes it: GCC's
// inliner then keeps the hot loops' helpers inline (checked against the object code).
namespace {

// Lines [first, first + count) of the next block's K and V to fetch while
// one grouped call computes (null pointers: nothing to fetch).
struct PrefetchShare {
  const char* key;
  const char* value;
  int64_t first, count;
};

// Rows r < kGroup of q / max / sum / acc (acc and q 64 apart) are the query
// heads of one KV head; k and v point at that head's slice of token 0 of the
// block, tokens token_stride apart; n <= 16 tokens are valid.
template <typename cache_t, int kGroup>
void attend_block_grouped(const float* q, const cache_t* k, const cache_t* v, int64_t token_stride, int64_t n,
                          float* max, float* sum, float* acc, PrefetchShare next) {
  static_assert(kGroup >= 1 && kGroup <= 4, "1-4 query heads per KV head");
  const Vec64 q0 = load64(q);
  const Vec64 q1 = kGroup > 1 ? load64(q + 64) : q0;
  const Vec64 q2 = kGroup > 2 ? load64(q + 128) : q0;
  const Vec64 q3 = kGroup > 3 ? load64(q + 192) : q0;
  __m512 partial[kGroup][16];  // per row and token: 16 lanes whose sum is the score
  for (int64_t t = 0; t < 16; ++t) {
    prefetch_share(next.key, next.first, next.count, t, 16);
    if (t >= n) {
      for (int r = 0; r < kGroup; ++r) partial[r][t] = _mm512_setzero_ps();
      continue;
    }
    const Vec64 kt = load64(k + t * token_stride);
    partial[0][t] = dot_lanes(q0, kt);
    if constexpr (kGroup > 1) partial[1][t] = dot_lanes(q1, kt);
    if constexpr (kGroup > 2) partial[2][t] = dot_lanes(q2, kt);
    if constexpr (kGroup > 3) partial[3][t] = dot_lanes(q3, kt);
  }
  const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
  alignas(64) float weights[kGroup][16];
  float correction[kGroup];
  for (int r = 0; r < kGroup; ++r) {
    const __m512 scores = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-std::numeric_limits<float>::infinity()),
                                               sum_lanes_of_16(partial[r]));
    const float new_max = std::max(max[r], _mm512_reduce_max_ps(scores));
    // exp(-inf) = 0 on the first block, so the empty running sums stay empty.
    correction[r] = fast_exp(max[r] - new_max);
    const __m512 e = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(scores, _mm512_set1_ps(new_max))));
    sum[r] = sum[r] * correction[r] + _mm512_reduce_add_ps(e);
    max[r] = new_max;
    _mm512_store_ps(weights[r], e);
  }
  auto rescaled = [&](int r) {
    const Vec64 row = load64(acc + r * 64);
    const __m512 c = _mm512_set1_ps(correction[r]);
    return Vec64{_mm512_mul_ps(c, row.a), _mm512_mul_ps(c, row.b), _mm512_mul_ps(c, row.c), _mm512_mul_ps(c, row.d)};
  };
  Vec64 a0 = rescaled(0);
  Vec64 a1 = kGroup > 1 ? rescaled(1) : a0;
  Vec64 a2 = kGroup > 2 ? rescaled(2) : a0;
  Vec64 a3 = kGroup > 3 ? rescaled(3) : a0;
  for (int64_t t = 0; t < n; ++t) {
    prefetch_share(next.value, next.first, next.count, t, 16);
    const Vec64 vt = load64(v + t * token_stride);
    add_scaled(a0, weights[0][t], vt);
    if constexpr (kGroup > 1) add_scaled(a1, weights[1][t], vt);
    if constexpr (kGroup > 2) add_scaled(a2, weights[2][t], vt);
    if constexpr (kGroup > 3) add_scaled(a3, weights[3][t], vt);
  }
  store64(acc, a0);
  if constexpr (kGroup > 1) store64(acc + 64, a1);
  if constexpr (kGroup > 2) store64(acc + 128, a2);
  if constexpr (kGroup > 3) store64(acc + 192, a3);
}

template <typename cache_t>
using GroupedBlockFn = void (*)(const float*, const cache_t*, const cache_t*, int64_t, int64_t, float*, float*, float*,
                                PrefetchShare);

// The grouped path for this call's shapes, or null where it does not apply
// (it has no key scales and no soft cap).
template <typename cache_t, int64_t kHeadDim>
GroupedBlockFn<cache_t> grouped_block_fn(int64_t block_size, int64_t group, bool quantized, bool capped) {
  if constexpr (kHeadDim == 64 && (std::is_same_v<cache_t, float> || std::is_same_v<cache_t, c10::BFloat16>)) {
    if (block_size != 16 || quantized || capped) return nullptr;
    switch (group) {
      case 1: return attend_block_grouped<cache_t, 1>;
      case 2: return attend_block_grouped<cache_t, 2>;
      case 3: return attend_block_grouped<cache_t, 3>;
      case 4: return attend_block_grouped<cache_t, 4>;
      default: return nullptr;
    }
  }
  return nullptr;
}

}  // namespace
#endif
