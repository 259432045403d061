// llama.cpp's packed GGUF block formats of 32 weights (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
// MXFP4) and their decoders to fp32, for quant_linear.cpp's and moe_grouped.cpp's
// kernels; the K types' super-blocks are gguf_k_blocks.h's, gguf_formats.h names them all.
//
// Each block decodes exactly as gguf-py's numpy dequantize does (the same
// products, in the same order), so the dequantized values are that package's
// up to the compiler fusing ``d * q + m`` into one FMA (one rounding less).
#pragma once
#include <c10/util/Half.h>
#include <torch/extension.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

// Internal linkage, as if this were still part of the one .cpp file that includes it: GCC's
// inliner then keeps the hot loops' helpers inline (checked against the object code).
namespace {

// GGML type ids (gguf.GGMLQuantizationType values).
enum QType : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, MXFP4 = 39 };

using BlockDecoder = void (*)(const uint8_t* block, float* out);

inline float f16_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(bits);
}

// MXFP4 (OCP microscaling): one E8M0 exponent byte, then 16 bytes of e2m1 nibbles (byte j: weight
// j low, weight j + 16 high). llama.cpp stores the e2m1 values doubled and halves the scale
// (ggml_e8m0_to_fp32_half), so each weight is an exact product of a power of two and an integer.
constexpr float kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? uint32_t{0x00200000} << e : static_cast<uint32_t>(e - 1) << 23;
  float d;
  std::memcpy(&d, &bits, 4);
  return d;
}

#if !defined(__AVX512F__)
void decode_mxfp4(const uint8_t* b, float* y) {
  const float d = e8m0_half(b[0]);
  for (int j = 0; j < 16; ++j) {
    y[j] = d * kMxfp4Values[b[1 + j] & 0x0F];
    y[j + 16] = d * kMxfp4Values[b[1 + j] >> 4];
  }
}

void decode_q8_0(const uint8_t* b, float* y) {
  const float d = f16_at(b);
  const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(q[j]) * d;
}
#endif

#if defined(__AVX512F__)
// A 32-weight block of Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 as two registers (weights 0-15, 16-31):
// the decoders below store exactly these, and the fused small-batch path multiplies them in place.
//
// Q4 / Q5 decode through a table: a block has only 16 (32) distinct weights, d * (q - offset)
// (+ m), so those are computed once, 16 lanes at a time, and each weight is a lane permute of
// its nibble (VPERMPS reads an index's low 4 bits, VPERMT2PS its low 5): a third of the
// instructions of converting every weight, and the same products as the scalar decoders.
//
// A block's fp16 scales: one 32-bit load, one 128-bit VCVTPH2PS (the conversion f16_at makes,
// exact) and a broadcast per scale, not a 16-bit insert, conversion and broadcast per scale
// (a 512-bit conversion of broadcast pairs was slower on Zen 4). f16_lanes reads the two bytes
// after the scale too: only for blocks where they are the block's own (not Q6_K, whose d ends it).
inline __m128 f16_pair(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  return _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(bits)));  // p's two fp16 in lanes 0, 1
}

inline __m512 f16_lanes(const uint8_t* p) { return _mm512_broadcastss_ps(f16_pair(p)); }

// The fp16 pair (d, m) at p: d in every lane of d, m in every lane of m.
inline void f16_pair_lanes(const uint8_t* p, __m512& d, __m512& m) {
  const __m128 pair = f16_pair(p);
  d = _mm512_broadcastss_ps(pair);
  m = _mm512_broadcastss_ps(_mm_movehdup_ps(pair));
}

template <bool kHasMin>
inline __m512 table_of(const uint8_t* b, __m512 levels) {
  if constexpr (kHasMin) {
    __m512 d, m;
    f16_pair_lanes(b, d, m);
    return _mm512_fmadd_ps(d, levels, m);
  }
  return _mm512_mul_ps(f16_lanes(b), levels);
}

inline __m512 levels_from(float first) {
  return _mm512_add_ps(_mm512_set1_ps(first),
                       _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}

// The 16 nibble bytes widened to one 32-bit lane each: byte j's low nibble is weight j, its
// high nibble weight j + 16.
inline __m512i nibble_lanes(const uint8_t* qs) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
}

// Q4_0: d * (q - 8); Q4_1: d * q + m.
template <bool kHasMin>
inline void q4_registers(const uint8_t* b, __m512& lo, __m512& hi) {
  const __m512 table = table_of<kHasMin>(b, levels_from(kHasMin ? 0.0f : -8.0f));
  const __m512i lanes = nibble_lanes(b + (kHasMin ? 4 : 2));
  lo = _mm512_permutexvar_ps(lanes, table);  // the high nibble sits above the 4 index bits
  hi = _mm512_permutexvar_ps(_mm512_srli_epi32(lanes, 4), table);
}

// Q5_0: d * (q - 16); Q5_1: d * q + m, where q is the nibble plus 16 times the fifth bit
// (a little-endian uint32 of them, bit j for weight j).
template <bool kHasMin>
inline void q5_registers(const uint8_t* b, __m512& lo, __m512& hi) {
  const float first = kHasMin ? 0.0f : -16.0f;
  const __m512 low_table = table_of<kHasMin>(b, levels_from(first)),
               high_table = table_of<kHasMin>(b, levels_from(first + 16.0f));
  uint32_t qh;
  std::memcpy(&qh, b + (kHasMin ? 4 : 2), 4);
  const __m512i lanes = nibble_lanes(b + (kHasMin ? 8 : 6)), sixteen = _mm512_set1_epi32(16);
  const __m512i lo_index = _mm512_and_si512(lanes, _mm512_set1_epi32(0x0F));
  const __m512i hi_index = _mm512_srli_epi32(lanes, 4);
  lo = _mm512_permutex2var_ps(low_table, _mm512_mask_or_epi32(lo_index, static_cast<__mmask16>(qh), lo_index, sixteen),
                              high_table);
  hi = _mm512_permutex2var_ps(
      low_table, _mm512_mask_or_epi32(hi_index, static_cast<__mmask16>(qh >> 16), hi_index, sixteen), high_table);
}

inline void mxfp4_registers(const uint8_t* b, __m512& lo, __m512& hi) {
  const __m512 table = _mm512_mul_ps(_mm512_set1_ps(e8m0_half(b[0])), _mm512_loadu_ps(kMxfp4Values));
  const __m512i lanes = nibble_lanes(b + 1);
  lo = _mm512_permutexvar_ps(lanes, table);  // VPERMPS reads the index's low 4 bits
  hi = _mm512_permutexvar_ps(_mm512_srli_epi32(lanes, 4), table);
}

// Each half widened straight from memory (a 256-bit load and an extract cost one more instruction).
inline void q8_0_registers(const uint8_t* b, __m512& lo, __m512& hi) {
  const __m512 d = f16_lanes(b);
  lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2)))), d);
  hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18)))), d);
}

// The register form of a packed type, for the fused path and the scratch decoder alike:
// load(block) once per block, then registers(sub, lo, hi) for each of its sub_blocks runs of 32
// weights (0-15 in lo, 16-31 in hi). The 32-weight types are one run, decoded from the bytes.
template <void (*kRegisters)(const uint8_t*, __m512&, __m512&)>
struct SmallBlock {
  static constexpr int sub_blocks = 1;
  const uint8_t* block;
  void load(const uint8_t* b) { block = b; }
  void registers(int, __m512& lo, __m512& hi) const { kRegisters(block, lo, hi); }
};

// A block decoded into fp32 through its register form: the scratch path's weights are the fused path's.
template <typename R>
void store_block(const uint8_t* b, float* y) {
  R block;
  block.load(b);
  for (int s = 0; s < R::sub_blocks; ++s) {
    __m512 lo, hi;
    block.registers(s, lo, hi);
    _mm512_storeu_ps(y + 32 * s, lo);
    _mm512_storeu_ps(y + 32 * s + 16, hi);
  }
}
#endif

// Q4_0 / Q4_1: byte j holds weight j (low nibble) and weight j + 16 (high nibble).
#if !defined(__AVX512F__)
template <bool kHasMin>
void decode_q4(const uint8_t* b, float* y) {
  const float d = f16_at(b), m = kHasMin ? f16_at(b + 2) : 0.0f;
  const uint8_t* qs = b + (kHasMin ? 4 : 2);
  for (int j = 0; j < 16; ++j) {
    if constexpr (kHasMin) {
      y[j] = d * static_cast<float>(qs[j] & 0x0F) + m;
      y[j + 16] = d * static_cast<float>(qs[j] >> 4) + m;
    } else {
      y[j] = d * static_cast<float>((qs[j] & 0x0F) - 8);
      y[j + 16] = d * static_cast<float>((qs[j] >> 4) - 8);
    }
  }
}
#endif

// Q5_0 / Q5_1: as Q4, plus a fifth bit per weight in a little-endian uint32 (bit j: weight j).
#if !defined(__AVX512F__)
template <bool kHasMin>
void decode_q5(const uint8_t* b, float* y) {
  const float d = f16_at(b), m = kHasMin ? f16_at(b + 2) : 0.0f;
  uint32_t qh;
  std::memcpy(&qh, b + (kHasMin ? 4 : 2), 4);
  const uint8_t* qs = b + (kHasMin ? 8 : 6);
  for (int j = 0; j < 16; ++j) {
    const int lo = (qs[j] & 0x0F) | (((qh >> j) & 1) << 4);
    const int hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
    if constexpr (kHasMin) {
      y[j] = d * static_cast<float>(lo) + m;
      y[j + 16] = d * static_cast<float>(hi) + m;
    } else {
      y[j] = d * static_cast<float>(lo - 16);
      y[j + 16] = d * static_cast<float>(hi - 16);
    }
  }
}
#endif

}  // namespace
