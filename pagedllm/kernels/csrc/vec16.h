// 16 lanes of fp32 from and to each storage dtype (AVX-512), shared by the
// kernels that work a vector at a time: bf16 widens by a shift, and narrows
// with the round-to-nearest-even of dtype.h's store (and PyTorch's).
#pragma once

#if defined(__AVX512F__)
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// The bf16 bit patterns of v's lanes, rounded to nearest even, in each lane's high half.
inline __m512i round_bf16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }

inline void store16(c10::BFloat16* p, __m512 v) {
  const __m256i narrowed = _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_bf16_bits(v), 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrowed);
}

// The values v's lanes take once stored as scalar_t (as dtype.h's round_to).
template <typename scalar_t>
inline __m512 round16(__m512 v) {
  return v;
}

template <>
inline __m512 round16<c10::BFloat16>(__m512 v) {
  return _mm512_castsi512_ps(_mm512_and_si512(round_bf16_bits(v), _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
#endif
