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

#if defined(__AVX512BF16__)
// Decode attention over a bf16 pool on a CPU with AVX-512 BF16 (VDPBF16PS), for
// the grouped path's shapes, without widening K to fp32 first:
// - Q . K: the query row as it is stored (bf16, unscaled) against the bf16 key
//   pairs, 32 products per instruction into fp32 lanes. A product of two bf16
//   values is exact in fp32, so each score is the same fp32 sum of the same
//   products as the widening path's (in another order); the softmax scale
//   multiplies the 16 scores afterwards.
// - P . V: P stays fp32 (no rounding of the probabilities, as in
//   prefill_attention.cpp). A 32-bit lane of a V row holds dims 2i and 2i + 1;
//   a shift puts dim 2i's value in fp32 and a mask dim 2i + 1's, one operation
//   per 16 values where the widening load takes two, so the accumulators hold
//   the even and the odd dims apart and are interleaved back into acc once per
//   block.
// - All KV heads of one block in one call, phase by phase (every head's scores,
// then every query row's softmax, then every head's values): the rows' softmax
// steps are independent, so the core overlaps them, where one call per KV head
// left each head's scores -> max -> exp -> values chain exposed. In a loop over
// SmolLM2's blocks (3 KV heads, 3 query heads each) 16% faster than the
// widening grouped path (BENCHMARKS.md, "Issue 42").
// q: the sequence's query rows as stored (bf16, row h * kGroup + r is query
// head r of KV head h, 64 apart); k, v: the block's first token read, tokens
// num_kv_heads * 64 apart; n <= 16 tokens valid; max / sum / acc: every row's
// running state; scratch: rows * 17 floats. The next block's lines are
// fetched meanwhile (as attend_block_grouped does).
inline __m512 even_dims(__m512i pairs) { return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)); }
inline __m512 odd_dims(__m512i pairs) {
  return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// 32 dims of acc (dim order) as their even and odd dims, and back.
struct EvenOdd {
  __m512 even, odd;
};

__attribute__((always_inline)) inline EvenOdd split_even_odd(const float* p, __m512 scale) {
  const __m512 lo = _mm512_loadu_ps(p), hi = _mm512_loadu_ps(p + 16);
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  return {_mm512_mul_ps(scale, _mm512_permutex2var_ps(lo, even, hi)),
          _mm512_mul_ps(scale, _mm512_permutex2var_ps(lo, odd, hi))};
}

__attribute__((always_inline)) inline void store_even_odd(float* p, const EvenOdd& x) {
  const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i second = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  _mm512_storeu_ps(p, _mm512_permutex2var_ps(x.even, first, x.odd));
  _mm512_storeu_ps(p + 16, _mm512_permutex2var_ps(x.even, second, x.odd));
}

// One query row's 64 sums in the even / odd layout.
struct RowSums {
  EvenOdd low, high;  // dims 0-31, 32-63
};

__attribute__((always_inline)) inline void add_scaled_pairs(RowSums& acc, float weight, __m512 e0, __m512 o0, __m512 e1,
                                                            __m512 o1) {
  const __m512 w = _mm512_set1_ps(weight);
  acc.low.even = _mm512_fmadd_ps(w, e0, acc.low.even);
  acc.low.odd = _mm512_fmadd_ps(w, o0, acc.low.odd);
  acc.high.even = _mm512_fmadd_ps(w, e1, acc.high.even);
  acc.high.odd = _mm512_fmadd_ps(w, o1, acc.high.odd);
}

template <int kGroup>
void attend_block_dpbf16(const c10::BFloat16* q, float scale, const c10::BFloat16* k, const c10::BFloat16* v,
                         int64_t num_kv_heads, int64_t n, float* max, float* sum, float* acc, float* scratch,
                         const char* k_next, const char* v_next, int64_t block_lines) {
  static_assert(kGroup >= 1 && kGroup <= 4, "1-4 query heads per KV head");
  const int64_t token_stride = num_kv_heads * 64, rows = num_kv_heads * kGroup;
  float* scores = scratch;               // [rows][16]: scores, then the weights exp(score - max)
  float* correction = scratch + rows * 16;  // [rows]
  const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
  for (int64_t h = 0; h < num_kv_heads; ++h) {
    const int64_t first_line = block_lines * h / num_kv_heads;
    const int64_t lines = block_lines * (h + 1) / num_kv_heads - first_line;
    __m512bh qa[kGroup], qb[kGroup];
    for (int r = 0; r < kGroup; ++r) {
      qa[r] = (__m512bh)_mm512_loadu_si512(q + (h * kGroup + r) * 64);
      qb[r] = (__m512bh)_mm512_loadu_si512(q + (h * kGroup + r) * 64 + 32);
    }
    __m512 partial[kGroup][16];  // per row and token: 16 lanes whose sum is the unscaled score
    for (int64_t t = 0; t < 16; ++t) {
      prefetch_share(k_next, first_line, lines, t, 16);
      if (t >= n) {
        for (int r = 0; r < kGroup; ++r) partial[r][t] = _mm512_setzero_ps();
        continue;
      }
      const auto ka = (__m512bh)_mm512_loadu_si512(k + t * token_stride + h * 64);
      const auto kb = (__m512bh)_mm512_loadu_si512(k + t * token_stride + h * 64 + 32);
      for (int r = 0; r < kGroup; ++r)
        partial[r][t] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), qa[r], ka), qb[r], kb);
    }
    for (int r = 0; r < kGroup; ++r) _mm512_storeu_ps(scores + (h * kGroup + r) * 16, sum_lanes_of_16(partial[r]));
  }
  const __m512 scale16 = _mm512_set1_ps(scale);
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 x = _mm512_mask_mul_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), valid,
                                        _mm512_loadu_ps(scores + r * 16), scale16);
    const float new_max = std::max(max[r], _mm512_reduce_max_ps(x));
    // exp(-inf) = 0 on the first block, so the empty running sums stay empty.
    correction[r] = fast_exp(max[r] - new_max);
    const __m512 e = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(x, _mm512_set1_ps(new_max))));
    sum[r] = sum[r] * correction[r] + _mm512_reduce_add_ps(e);
    max[r] = new_max;
    _mm512_storeu_ps(scores + r * 16, e);
  }
  for (int64_t h = 0; h < num_kv_heads; ++h) {
    const int64_t first_line = block_lines * h / num_kv_heads;
    const int64_t lines = block_lines * (h + 1) / num_kv_heads - first_line;
    RowSums a[kGroup];
    for (int r = 0; r < kGroup; ++r) {
      const int64_t row = h * kGroup + r;
      const __m512 c = _mm512_set1_ps(correction[row]);
      a[r] = RowSums{split_even_odd(acc + row * 64, c), split_even_odd(acc + row * 64 + 32, c)};
    }
    const float* weights = scores + h * kGroup * 16;
    for (int64_t t = 0; t < n; ++t) {
      prefetch_share(v_next, first_line, lines, t, 16);
      const __m512i low = _mm512_loadu_si512(v + t * token_stride + h * 64);
      const __m512i high = _mm512_loadu_si512(v + t * token_stride + h * 64 + 32);
      const __m512 e0 = even_dims(low), o0 = odd_dims(low), e1 = even_dims(high), o1 = odd_dims(high);
      for (int r = 0; r < kGroup; ++r) add_scaled_pairs(a[r], weights[r * 16 + t], e0, o0, e1, o1);
    }
    for (int r = 0; r < kGroup; ++r) {
      const int64_t row = h * kGroup + r;
      store_even_odd(acc + row * 64, a[r].low);
      store_even_odd(acc + row * 64 + 32, a[r].high);
    }
  }
}

using Dpbf16BlockFn = void (*)(const c10::BFloat16*, float, const c10::BFloat16*, const c10::BFloat16*, int64_t,
                               int64_t, float*, float*, float*, float*, const char*, const char*, int64_t);

// The VDPBF16PS path for this call's shapes, or null where it does not apply
// (the same shapes as grouped_block_fn's: head_dim 64, 16-token blocks, 1-4
// query heads per KV head, no soft cap).
template <int64_t kHeadDim>
Dpbf16BlockFn dpbf16_block_fn(int64_t block_size, int64_t group, bool capped) {
  if constexpr (kHeadDim == 64) {
    if (block_size != 16 || capped) return nullptr;
    switch (group) {
      case 1: return attend_block_dpbf16<1>;
      case 2: return attend_block_dpbf16<2>;
      case 3: return attend_block_dpbf16<3>;
      case 4: return attend_block_dpbf16<4>;
      default: return nullptr;
    }
  }
  return nullptr;
}
#endif

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

// Whether decode attention over a bf16 pool may take the VDPBF16PS path where it
// applies (PAGEDLLM_DECODE_BF16_DOT=0: the widening path, for comparisons); read once per call.
#include <cstdlib>
#include <string_view>
inline bool dpbf16_decode_enabled() {
  const char* flag = std::getenv("PAGEDLLM_DECODE_BF16_DOT");
  return flag == nullptr || std::string_view(flag) != "0";
}
