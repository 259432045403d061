// exp(x) for fp32 as plain arithmetic, so `#pragma omp simd` loops vectorize
// it (a libm call would stay scalar). Cephes' expf: x = n ln2 + r with
// |r| <= ln2 / 2, a degree-6 polynomial for e^r, and 2^n put straight into
// the exponent bits. About 1 ulp over the clamped range. Inputs below -80
// give e^-80 (~2e-35) instead of something smaller or 0: no softmax sum
// (always >= 1) can tell, and results stay clear of denormals, which cost
// the CPU a microcode assist per lane when flush-to-zero is off (as in Python).
#pragma once
#include <bit>
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

// The constants both versions below share.
namespace fast_exp_constants {
constexpr float kMin = -80.0f, kMax = 88.0f, kLog2e = 1.44269504088896341f;
// ln2 split in two so n * ln2 is exact enough: r keeps its low bits.
constexpr float kLn2High = 0.693359375f, kLn2Low = 2.12194440e-4f;
// e^r = 1 + r + r^2 * poly(r), poly's coefficients from the highest power down.
constexpr float kPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
}  // namespace fast_exp_constants

inline float fast_exp(float x) {
  using namespace fast_exp_constants;
  // Ternaries, not fmin/fmax or a memcpy: those keep GCC from vectorizing callers.
  x = x < kMin ? kMin : (x > kMax ? kMax : x);
  const float n = std::floor(x * kLog2e + 0.5f);
  const float r = x - n * kLn2High + n * kLn2Low;
  float p = kPoly[0];
  for (int i = 1; i < 6; ++i) p = p * r + kPoly[i];
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return p * std::bit_cast<float>(bits);
}

#if defined(__AVX512F__)
// fast_exp on 16 lanes with intrinsics (for kernels that hold a vector of
// scores rather than a loop GCC would vectorize); 2^n by vscalefps.
inline __m512 exp16(__m512 x) {
  using namespace fast_exp_constants;
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(kMax)), _mm512_set1_ps(kMin));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(kLog2e), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(kLn2Low), _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), x));
  __m512 p = _mm512_set1_ps(kPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kPoly[i]));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}
#endif
