// Loads and stores between the storage dtype and fp32 without branches, so
// loops over bf16 vectorize (c10::BFloat16's own float conversion checks for
// NaN, which stops the vectorizer). Stores round to nearest even, as PyTorch
// does; NaN inputs are not preserved, and nothing here produces them.
#pragma once
#include <c10/util/BFloat16.h>

#include <bit>
#include <cstdint>

template <typename scalar_t>
inline float load(scalar_t value) {
  return static_cast<float>(value);
}

template <>
inline float load<c10::BFloat16>(c10::BFloat16 value) {
  return std::bit_cast<float>(static_cast<uint32_t>(value.x) << 16);
}

template <typename scalar_t>
inline scalar_t store(float value) {
  return static_cast<scalar_t>(value);
}

template <>
inline c10::BFloat16 store<c10::BFloat16>(float value) {
  uint32_t bits = std::bit_cast<uint32_t>(value);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return c10::BFloat16(static_cast<uint16_t>(bits >> 16), c10::BFloat16::from_bits());
}

// The value ``value`` takes once stored in ``scalar_t``: where PyTorch rounds an
// intermediate result to the tensor dtype, the kernels round here too.
template <typename scalar_t>
inline float round_to(float value) {
  return load<scalar_t>(store<scalar_t>(value));
}
