// llama.cpp's K-quant super-blocks (Q4_K, Q5_K, Q6_K: 256 weights, 8 runs of 32 with a scale
// each) and their decoders: register forms where the CPU has AVX-512 (the fused path's and the
// scratch decoder's, as gguf_blocks.h's 32-weight types), scalar decoders elsewhere. Both decode
// exactly as gguf-py's numpy dequantize does (see gguf_blocks.h).
#pragma once
#include "gguf_blocks.h"

// Internal linkage, as gguf_blocks.h.
namespace {

#if defined(__AVX512F__)
// Q4_K / Q5_K: 8 runs of 32, run s with scale d * sc[s] and min dmin * mn[s] (six-bit integers
// packed in 12 bytes), run 2i + h taking nibble h of qs[32i .. 32i + 31] (Q5_K: and bit s of
// qh[0 .. 31] as its fifth bit). load() unpacks the 16 products into a vector once per block;
// each run is then a table of its 16 (32) levels, d * sc * q - dmin * mn, permuted by the
// nibbles, as the Q4_1 / Q5_1 blocks are. d * sc * q is exact in fp32 (17-bit d * sc times a
// 5-bit q), so the fused subtraction rounds as gguf's separate product and difference do.
template <bool kFifthBit>
struct KBlock {
  static constexpr int sub_blocks = 8;
  alignas(64) float scale[16];  // d * sc[0..7], then dmin * mn[0..7]
  const uint8_t* qs;
  __m256i qh;

  void load(const uint8_t* b) {
    uint32_t u[4];  // llama.cpp's unpacking (ggml-cpu's utmp): bytes 0-7 the scales, 8-15 the mins
    std::memcpy(u, b + 4, 12);
    u[3] = ((u[2] >> 4) & 0x0F0F0F0F) | (((u[1] >> 6) & 0x03030303) << 4);
    const uint32_t low_mins = u[1] & 0x3F3F3F3F;
    u[1] = (u[2] & 0x0F0F0F0F) | (((u[0] >> 6) & 0x03030303) << 4);
    u[2] = low_mins;
    u[0] &= 0x3F3F3F3F;
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(u));
    const __m512 sixbit = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
    __m512 d_lanes, dmin_lanes;
    f16_pair_lanes(b, d_lanes, dmin_lanes);
    const __m512 d = _mm512_mask_blend_ps(0xFF00, d_lanes, dmin_lanes);
    _mm512_store_ps(scale, _mm512_mul_ps(d, sixbit));
    if constexpr (kFifthBit) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
    qs = b + (kFifthBit ? 48 : 16);
  }

  void registers(int s, __m512& lo, __m512& hi) const {
    const __m512 ds = _mm512_set1_ps(scale[s]), dm = _mm512_set1_ps(scale[8 + s]);
    const __m512 table = _mm512_fmsub_ps(ds, levels_from(0.0f), dm);
    __m512i lo_index = nibble_lanes(qs + 32 * (s >> 1)), hi_index = nibble_lanes(qs + 32 * (s >> 1) + 16);
    if (s & 1) {
      lo_index = _mm512_srli_epi32(lo_index, 4);
      hi_index = _mm512_srli_epi32(hi_index, 4);
    }
    if constexpr (!kFifthBit) {
      lo = _mm512_permutexvar_ps(lo_index, table);  // VPERMPS reads the index's low 4 bits
      hi = _mm512_permutexvar_ps(hi_index, table);
    } else {
      const __m512 high_table = _mm512_fmsub_ps(ds, levels_from(16.0f), dm);
      const __m512i nibble = _mm512_set1_epi32(0x0F), sixteen = _mm512_set1_epi32(16);
      lo_index = _mm512_and_si512(lo_index, nibble);  // VPERMT2PS reads 5 bits: clear the other nibble
      hi_index = _mm512_and_si512(hi_index, nibble);
      // Bit l of `fifth`: bit s of qh[l], moved to each byte's sign bit.
      const uint32_t fifth = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_slli_epi16(qh, 7 - s)));
      lo = _mm512_permutex2var_ps(
          table, _mm512_mask_or_epi32(lo_index, static_cast<__mmask16>(fifth), lo_index, sixteen), high_table);
      hi = _mm512_permutex2var_ps(
          table, _mm512_mask_or_epi32(hi_index, static_cast<__mmask16>(fifth >> 16), hi_index, sixteen), high_table);
    }
  }
};

// Q6_K: 8 runs of 32 (see decode_q6_k), two int8 scales each (weights 0-15, 16-31). A run's six-bit
// values are assembled 32 bytes at a time, then widened: (d * scale) * (q - 32), gguf's products.
struct Q6KBlock {
  static constexpr int sub_blocks = 8;
  alignas(64) float scale[16];  // d * scales[0..15]
  const uint8_t* b;

  void load(const uint8_t* block) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192));
    const __m512 scales = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
    _mm512_store_ps(scale, _mm512_mul_ps(_mm512_set1_ps(f16_at(block + 208)), scales));
    b = block;
  }

  void registers(int run, __m512& lo, __m512& hi) const {
    const int half = run >> 2, r = run & 3;  // bits 2r, 2r + 1 of qh; nibble r / 2 of ql
    const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * half + 32 * (r & 1)));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * half));
    // 16-bit shifts: the bits kept by each byte's mask come from that byte.
    const __m256i low = _mm256_and_si256(_mm256_srli_epi16(ql, 4 * (r >> 1)), _mm256_set1_epi8(0x0F));
    const __m256i high = _mm256_and_si256(r < 2 ? _mm256_slli_epi16(qh, 4 - 2 * r) : _mm256_srli_epi16(qh, 2 * r - 4),
                                          _mm256_set1_epi8(0x30));
    const __m256i q = _mm256_sub_epi8(_mm256_or_si256(low, high), _mm256_set1_epi8(32));
    lo = _mm512_mul_ps(_mm512_set1_ps(scale[2 * run]),
                       _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))));
    hi = _mm512_mul_ps(_mm512_set1_ps(scale[2 * run + 1]),
                       _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))));
  }
};

#endif

#if !defined(__AVX512F__)
// The 8 six-bit scales and mins of a Q4_K / Q5_K super-block (llama.cpp's get_scale_min_k4).
inline void k4_scales(const uint8_t* s, int* sc, int* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 2) & 0x30);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30);
  }
}

// Q4_K / Q5_K: 8 sub-blocks of 32; sub-block 2i + h takes nibble h of qs[32i .. 32i + 31]
// (and, for Q5_K, bit 2i + h of qh[0 .. 31] as its fifth bit).
template <bool kFifthBit>
void decode_k(const uint8_t* b, float* y) {
  const float d = f16_at(b), dmin = f16_at(b + 2);
  int sc[8], mn[8];
  k4_scales(b + 4, sc, mn);
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + (kFifthBit ? 48 : 16);
  for (int s = 0; s < 8; ++s) {
    const float ds = d * static_cast<float>(sc[s]), dm = dmin * static_cast<float>(mn[s]);
    const int shift = 4 * (s & 1);
    for (int l = 0; l < 32; ++l) {
      int q = (qs[(s >> 1) * 32 + l] >> shift) & 0x0F;
      if constexpr (kFifthBit) q |= ((qh[l] >> s) & 1) << 4;
      y[s * 32 + l] = ds * static_cast<float>(q) - dm;
    }
  }
}

// Q6_K: low nibbles in ql[128], two high bits each in qh[64], an int8 scale per 16 weights.
// Each half of 128 weights is 4 runs of 32: run r takes nibble r / 2 of ql[64 * half + 32 * (r % 2) + l]
// and bits 2r, 2r + 1 of qh[32 * half + l]. Loops of fixed shifts, so that they vectorize.
void decode_q6_k(const uint8_t* b, float* y) {
  const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
  const float d = f16_at(b + 208);
  for (int half = 0; half < 2; ++half) {
    const uint8_t* ql = b + 64 * half;
    const uint8_t* qh = b + 128 + 32 * half;
    for (int run = 0; run < 4; ++run) {
      const uint8_t* low = ql + 32 * (run & 1);
      const int low_shift = 4 * (run >> 1), high_shift = 2 * run;
      float* out = y + 128 * half + 32 * run;
      const float d0 = d * static_cast<float>(scales[8 * half + 2 * run]);
      const float d1 = d * static_cast<float>(scales[8 * half + 2 * run + 1]);
      for (int l = 0; l < 32; ++l) {
        const int q = (((low[l] >> low_shift) & 0x0F) | (((qh[l] >> high_shift) & 0x03) << 4)) - 32;
        out[l] = (l < 16 ? d0 : d1) * static_cast<float>(q);
      }
    }
  }
}
#endif

}  // namespace
