// llama.cpp's packed GGUF block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K,
// Q5_K, Q6_K, MXFP4) and their decoders to fp32, for quant_linear.cpp's and
// moe_grouped.cpp's kernels.
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
template <bool kHasMin>
inline __m512 table_of(const uint8_t* b, __m512 levels) {
  const __m512 d = _mm512_set1_ps(f16_at(b));
  if constexpr (kHasMin) return _mm512_fmadd_ps(d, levels, _mm512_set1_ps(f16_at(b + 2)));
  return _mm512_mul_ps(d, levels);
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

inline void q8_0_registers(const uint8_t* b, __m512& lo, __m512& hi) {
  const __m512 d = _mm512_set1_ps(f16_at(b));
  const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
  lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))), d);
  hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))), d);
}

template <void (*kRegisters)(const uint8_t*, __m512&, __m512&)>
void store_registers(const uint8_t* b, float* y) {
  __m512 lo, hi;
  kRegisters(b, lo, hi);
  _mm512_storeu_ps(y, lo);
  _mm512_storeu_ps(y + 16, hi);
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

#if defined(__AVX512F__)
using BlockRegisters = void (*)(const uint8_t* block, __m512& lo, __m512& hi);
#else
using BlockRegisters = void*;  // no register form without AVX-512
#endif

// One packed type: its block geometry (gguf.GGML_QUANT_SIZES) and decoder, all compile-time
// constants, so that the decoder inlines into the row loop (an indirect call per block of 32
// weights would cost more than decoding it). ``kRegisters``: the 32-weight types' block as two
// registers (what kDecode stores), for the fused few-rows path; null for the K types.
template <int64_t kBlockSize, int64_t kBlockBytes, BlockDecoder kDecode, BlockRegisters kRegisters = nullptr>
struct Format {
  static constexpr int64_t block_size = kBlockSize, block_bytes = kBlockBytes;
  static constexpr BlockRegisters registers = kRegisters;

  // Rows [begin, end) of the packed weight as fp32, one row of `K` after another into `out`.
  static void decode_rows(const uint8_t* packed, int64_t row_bytes, int64_t K, int64_t begin, int64_t end,
                          float* out) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* row = packed + n * row_bytes;
      float* y = out + (n - begin) * K;
      for (int64_t blk = 0; blk < K / kBlockSize; ++blk) kDecode(row + blk * kBlockBytes, y + blk * kBlockSize);
    }
  }
};

// body(Format<...>{}) for the format of GGML type id `qtype`.
template <typename Body>
void with_format(int64_t qtype, Body&& body) {
  switch (qtype) {
#if defined(__AVX512F__)
    case Q8_0: return body(Format<32, 34, store_registers<q8_0_registers>, q8_0_registers>{});
    case Q4_0: return body(Format<32, 18, store_registers<q4_registers<false>>, q4_registers<false>>{});
    case Q4_1: return body(Format<32, 20, store_registers<q4_registers<true>>, q4_registers<true>>{});
    case Q5_0: return body(Format<32, 22, store_registers<q5_registers<false>>, q5_registers<false>>{});
    case Q5_1: return body(Format<32, 24, store_registers<q5_registers<true>>, q5_registers<true>>{});
    case MXFP4: return body(Format<32, 17, store_registers<mxfp4_registers>, mxfp4_registers>{});
#else
    case Q8_0: return body(Format<32, 34, decode_q8_0>{});
    case Q4_0: return body(Format<32, 18, decode_q4<false>>{});
    case Q4_1: return body(Format<32, 20, decode_q4<true>>{});
    case Q5_0: return body(Format<32, 22, decode_q5<false>>{});
    case Q5_1: return body(Format<32, 24, decode_q5<true>>{});
    case MXFP4: return body(Format<32, 17, decode_mxfp4>{});
#endif
    case Q4_K: return body(Format<256, 144, decode_k<false>>{});
    case Q5_K: return body(Format<256, 176, decode_k<true>>{});
    case Q6_K: return body(Format<256, 210, decode_q6_k>{});
    default: TORCH_CHECK(false, "packed GGUF type id ", qtype, " has no CPU kernel");
  }
}

// TORCH_CHECKs that ``packed`` is F's packed rows of ``in_features`` weights.
template <typename F>
void check_packed_rows(const torch::Tensor& packed, int64_t in_features) {
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == torch::kByte && packed.is_contiguous(),
              "packed weight must be contiguous uint8 [out_features, bytes_per_row]");
  TORCH_CHECK(in_features % F::block_size == 0 && packed.size(1) == in_features / F::block_size * F::block_bytes,
              "packed weight rows do not hold in_features=", in_features, " weights of this type");
}

}  // namespace
