// Every packed GGUF type as one compile-time Format (its geometry, its decoder, its register
// form), and the switch from a GGML type id to it, for quant_linear.cpp's and moe_grouped.cpp's kernels.
#pragma once
#include <torch/extension.h>

#include <type_traits>

#include "gguf_blocks.h"
#include "gguf_k_blocks.h"

// Internal linkage, as gguf_blocks.h.
namespace {

// One packed type: its block geometry (gguf.GGML_QUANT_SIZES) and decoder, all compile-time
// constants, so that the decoder inlines into the row loop (an indirect call per block of 32
// weights would cost more than decoding it). ``kRegisters``: the type's register form (what
// kDecode stores), for the fused few-rows path; void where there is none (no AVX-512).
template <int64_t kBlockSize, int64_t kBlockBytes, BlockDecoder kDecode, typename kRegisters = void>
struct Format {
  static constexpr int64_t block_size = kBlockSize, block_bytes = kBlockBytes;
  using Registers = kRegisters;
  static constexpr bool has_registers = !std::is_void_v<kRegisters>;

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

#if defined(__AVX512F__)
// A type with a register form, whose scratch decoder stores it.
template <int64_t kBlockSize, int64_t kBlockBytes, typename R>
using Fused = Format<kBlockSize, kBlockBytes, store_block<R>, R>;
#endif

// body(Format<...>{}) for the format of GGML type id `qtype`.
template <typename Body>
void with_format(int64_t qtype, Body&& body) {
  switch (qtype) {
#if defined(__AVX512F__)
    case Q8_0: return body(Fused<32, 34, SmallBlock<q8_0_registers>>{});
    case Q4_0: return body(Fused<32, 18, SmallBlock<q4_registers<false>>>{});
    case Q4_1: return body(Fused<32, 20, SmallBlock<q4_registers<true>>>{});
    case Q5_0: return body(Fused<32, 22, SmallBlock<q5_registers<false>>>{});
    case Q5_1: return body(Fused<32, 24, SmallBlock<q5_registers<true>>>{});
    case MXFP4: return body(Fused<32, 17, SmallBlock<mxfp4_registers>>{});
    case Q4_K: return body(Fused<256, 144, KBlock<false>>{});
    case Q5_K: return body(Fused<256, 176, KBlock<true>>{});
    case Q6_K: return body(Fused<256, 210, Q6KBlock>{});
#else
    case Q8_0: return body(Format<32, 34, decode_q8_0>{});
    case Q4_0: return body(Format<32, 18, decode_q4<false>>{});
    case Q4_1: return body(Format<32, 20, decode_q4<true>>{});
    case Q5_0: return body(Format<32, 22, decode_q5<false>>{});
    case Q5_1: return body(Format<32, 24, decode_q5<true>>{});
    case MXFP4: return body(Format<32, 17, decode_mxfp4>{});
    case Q4_K: return body(Format<256, 144, decode_k<false>>{});
    case Q5_K: return body(Format<256, 176, decode_k<true>>{});
    case Q6_K: return body(Format<256, 210, decode_q6_k>{});
#endif
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
