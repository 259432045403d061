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
inline float fast_exp(float x) {
  // Ternaries, not fmin/fmax or a memcpy: those keep GCC from vectorizing callers.
  x = x < -80.0f ? -80.0f : (x > 88.0f ? 88.0f : x);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  // ln2 split in two so n * ln2 is exact enough: r keeps its low bits.
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return p * std::bit_cast<float>(bits);
}
