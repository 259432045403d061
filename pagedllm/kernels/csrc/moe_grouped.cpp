// The grouped expert matmul of a mixture of experts (llama.cpp's mul_mat_id, vLLM's fused_moe):
// one call per projection per layer multiplies each expert's weights by only the rows routed to
// it. The caller sorts the step's (token, expert) pairs by expert and gathers their inputs, so
// expert e's rows of x are x[offsets[e] : offsets[e + 1]] and its outputs land in the same rows
// of out.
//
// Weights are a stack [experts, N, K] of fp32 or bf16 values, or of packed GGUF rows (any type of
// gguf_formats.h); every type is read as runs of 32 weights, so the dense stacks run through the
// same tiles as the packed ones (their "decoder" widens to fp32). Work items are
// (expert, 16 output rows) pairs over the experts that have rows, run in parallel; within one,
// 4 weight rows at a time are decoded into registers (up to kFusedRows rows of x: decode steps)
// or into an fp32 scratch and multiplied by every row of x. Both sum each dot product in the same
// order (quant_tiles.h), so an output does not depend on how many rows its expert got.
#include <ATen/Parallel.h>

#include <vector>

#include "gguf_formats.h"
#include "ops.h"
#include "quant_tiles.h"

namespace {

constexpr int64_t kF32 = 0, kBF16 = 30;   // GGML type ids of the dense stacks
constexpr int64_t kItemRows = 16;         // output rows per work item (4 tiles)
constexpr int64_t kFusedRows = 48;        // up to this many rows, decode into registers
constexpr int64_t kPrefetchTiles = 2;     // the tile this far ahead is fetched while one computes

void decode_f32(const uint8_t* b, float* y) { std::memcpy(y, b, 32 * sizeof(float)); }

void decode_bf16(const uint8_t* b, float* y) {
  for (int j = 0; j < 32; ++j) {
    uint16_t bits;
    std::memcpy(&bits, b + 2 * j, 2);
    const uint32_t wide = static_cast<uint32_t>(bits) << 16;
    std::memcpy(y + j, &wide, 4);
  }
}

#if defined(__AVX512F__)
inline void f32_registers(const uint8_t* b, __m512& lo, __m512& hi) {
  lo = _mm512_loadu_ps(reinterpret_cast<const float*>(b));
  hi = _mm512_loadu_ps(reinterpret_cast<const float*>(b) + 16);
}

inline void bf16_registers(const uint8_t* b, __m512& lo, __m512& hi) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
  const __m512i wide_hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32)));
  lo = _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  hi = _mm512_castsi512_ps(_mm512_slli_epi32(wide_hi, 16));
}

template <typename Body>
void with_expert_format(int64_t qtype, Body&& body) {
  if (qtype == kF32) return body(Format<32, 128, decode_f32, SmallBlock<f32_registers>>{});
  if (qtype == kBF16) return body(Format<32, 64, decode_bf16, SmallBlock<bf16_registers>>{});
  with_format(qtype, body);
}
#else
template <typename Body>
void with_expert_format(int64_t qtype, Body&& body) {
  if (qtype == kF32) return body(Format<32, 128, decode_f32>{});
  if (qtype == kBF16) return body(Format<32, 64, decode_bf16>{});
  with_format(qtype, body);
}
#endif

// Output rows [n0, n1) of one expert (weight rows at w, its M rows of x at x, outputs at y).
template <typename F>
void expert_rows(const uint8_t* w, int64_t row_bytes, int64_t N, int64_t n0, int64_t n1, const float* x,
                 int64_t ldx, int64_t M, int64_t K, float* y, int64_t ldy, std::vector<float>& scratch) {
  for (int64_t n = n0; n < n1; n += kTileRows) {
    const int64_t rows = std::min(kTileRows, N - n);
#if defined(__AVX512F__)
    if constexpr (F::has_registers) {
      if (M <= kFusedRows) {
        const uint8_t* tile[kTileRows];
        for (int64_t i = 0; i < kTileRows; ++i) tile[i] = w + (n + std::min(i, rows - 1)) * row_bytes;
        const int64_t ahead_row = std::min(N, n + kPrefetchTiles * kTileRows);
        const int64_t ahead_bytes = std::min(kTileRows, N - ahead_row) * row_bytes;
        fused_tile<F>(tile, w + ahead_row * row_bytes, ahead_bytes, x, ldx, M, K, y + n, ldy, rows);
        continue;
      }
    }
#endif
    F::decode_rows(w, row_bytes, K, n, n + rows, scratch.data());
    multiply_tile(x, ldx, M, scratch.data(), K, y + n, ldy, rows);
  }
}

template <typename F>
void grouped(const torch::Tensor& x, const torch::Tensor& weights, const int64_t* offsets, torch::Tensor& out) {
  const int64_t E = weights.size(0), N = weights.size(1), K = x.size(1);
  const int64_t row_bytes = K / F::block_size * F::block_bytes;
  TORCH_CHECK(K % F::block_size == 0 && weights.numel() * weights.element_size() == E * N * row_bytes,
              "moe_grouped_linear: weights must be [experts, out_features, in_features] rows of this type");
  const uint8_t* wp = static_cast<const uint8_t*>(weights.data_ptr());
  const float* xp = x.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  const int64_t ldx = x.stride(0), ldy = out.stride(0);
  std::vector<std::pair<int64_t, int64_t>> items;  // (expert, first output row)
  for (int64_t e = 0; e < E; ++e) {
    TORCH_CHECK(offsets[e + 1] >= offsets[e], "moe_grouped_linear: offsets must not decrease");
    if (offsets[e + 1] > offsets[e])
      for (int64_t n = 0; n < N; n += kItemRows) items.emplace_back(e, n);
  }
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(kTileRows * K, 0.0f);  // rows past N stay zero
    for (int64_t i = begin; i < end; ++i) {
      const auto [e, n] = items[i];
      const int64_t first = offsets[e];
      expert_rows<F>(wp + e * N * row_bytes, row_bytes, N, n, std::min(N, n + kItemRows), xp + first * ldx, ldx,
                     offsets[e + 1] - first, K, yp + first * ldy, ldy, scratch);
    }
  });
}

}  // namespace

void moe_grouped_linear(torch::Tensor x, torch::Tensor weights, int64_t qtype, torch::Tensor offsets,
                        torch::Tensor out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.stride(1) == 1,
              "moe_grouped_linear: x must be fp32 [rows, in_features] with contiguous rows");
  TORCH_CHECK(weights.dim() == 3 && weights.is_contiguous(), "moe_grouped_linear: weights must be a contiguous stack");
  const auto expected = qtype == kF32 ? torch::kFloat : qtype == kBF16 ? torch::kBFloat16 : torch::kByte;
  TORCH_CHECK(weights.scalar_type() == expected, "moe_grouped_linear: weights' dtype does not match type id ", qtype);
  TORCH_CHECK(offsets.dim() == 1 && offsets.scalar_type() == torch::kLong && offsets.is_contiguous() &&
                  offsets.size(0) == weights.size(0) + 1,
              "moe_grouped_linear: offsets must be int64 [experts + 1]");
  const int64_t* op = offsets.data_ptr<int64_t>();
  TORCH_CHECK(op[0] == 0 && op[weights.size(0)] == x.size(0), "moe_grouped_linear: offsets must run from 0 to rows");
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == torch::kFloat && out.stride(1) == 1 && out.size(0) == x.size(0) &&
                  out.size(1) == weights.size(1),
              "moe_grouped_linear: out must be an fp32 [rows, out_features] view with contiguous rows");
  with_expert_format(qtype, [&](auto format) { grouped<decltype(format)>(x, weights, op, out); });
}
