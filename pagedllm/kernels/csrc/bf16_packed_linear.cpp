// y = x @ W^T + bias for bf16 with W stored column-packed for VDPBF16PS (AVX-512 BF16):
// every matmul of a bf16 model, decode and prefill, on a CPU with AVX-512 BF16 and no AMX.
//
// Why a layout of its own: in nn.Linear's [N, K] layout each output is a dot product
// along K, so a kernel holds 16 partial sums per output in one vector and must add
// them across lanes at the end (the small-batch kernel's transpose tree, ~15% of a
// K = 576 matmul), and oneDNN's bf16 GEMM reaches 155-197 GFLOP/s of the ~230 a Zen 4
// core peaks at. Packed as [N / 16, K / 2, 16, 2] (16 outputs x one pair of K per
// 64-byte vector, the VNNI order VDPBF16PS multiplies), lane j of an accumulator
// is output j itself: one input pair broadcast to all lanes times one weight
// vector adds to 16 outputs, and nothing is reduced across lanes. A tile is 3
// vectors of outputs (48) x up to 8 input rows, 24 accumulators in registers;
// per pair of K it loads 3 weight vectors and broadcasts 8 input pairs for 24
// VDPBF16PS, which keeps the multiplier busy (~93% of its peak, at any row count).
// The tile's weights (48 x K) stay in L1/L2 while further groups of 8 rows reuse
// them, and the next tile's are prefetched into L2 during the first group.
//
// Numerics: products of two bf16 are exact in fp32, every sum runs in fp32, the
// bias is added in fp32 and y is rounded to bf16 once, as oneDNN's bf16 matmul
// does; the summation order differs, so results agree to fp32 rounding of the sums.
#include <ATen/Parallel.h>

#include <cstring>

#include "ops.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace {

constexpr int kTileVectors = 3;  // 16-output weight vectors per tile
constexpr int kTileRows = 8;     // input rows per tile pass
constexpr int64_t kOutputsPerVector = 16;
// Tiles per parallel task: a task streams a long run of weights.
constexpr int64_t kTileGrain = 8;

// y[m, 16 v + j] for m < kRows, v < kVectors: w is the tile's first weight
// vector (vectors are ``vector_stride`` elements apart), x rows ldx apart, y rows ldy apart.
template <int kVectors, int kRows>
inline void tile(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* w, int64_t pairs, int64_t vector_stride,
                 const float* bias, c10::BFloat16* y, int64_t ldy, const c10::BFloat16* prefetch) {
  __m512 sums[kRows][kVectors];
#pragma GCC unroll 8
  for (int m = 0; m < kRows; ++m)
#pragma GCC unroll 3
    for (int v = 0; v < kVectors; ++v) sums[m][v] = _mm512_setzero_ps();
  for (int64_t pair = 0; pair < pairs; ++pair) {
    __m512bh weights[kVectors];
#pragma GCC unroll 3
    for (int v = 0; v < kVectors; ++v) {
      const c10::BFloat16* vector = w + v * vector_stride + pair * 32;
      weights[v] = (__m512bh)_mm512_loadu_si512(vector);
      // One 64-byte line per vector per pair: the next tile arrives at the rate this one is read.
      if (prefetch != nullptr) _mm_prefetch(reinterpret_cast<const char*>(prefetch + v * vector_stride + pair * 32), _MM_HINT_T1);
    }
#pragma GCC unroll 8
    for (int m = 0; m < kRows; ++m) {
      int32_t both;  // x[m, 2 pair], x[m, 2 pair + 1]
      std::memcpy(&both, x + m * ldx + 2 * pair, sizeof(both));
      const __m512bh input = (__m512bh)_mm512_set1_epi32(both);
#pragma GCC unroll 3
      for (int v = 0; v < kVectors; ++v) sums[m][v] = _mm512_dpbf16_ps(sums[m][v], input, weights[v]);
    }
  }
#pragma GCC unroll 3
  for (int v = 0; v < kVectors; ++v) {
    const __m512 b = bias != nullptr ? _mm512_loadu_ps(bias + v * kOutputsPerVector) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int m = 0; m < kRows; ++m) {
      const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_add_ps(sums[m][v], b));  // round to nearest even
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * ldy + v * kOutputsPerVector), (__m256i)rounded);
    }
  }
}

// All M rows against one tile of kVectors weight vectors, kTileRows rows at a time.
template <int kVectors>
inline void tile_all_rows(const c10::BFloat16* x, int64_t ldx, int64_t M, const c10::BFloat16* w, int64_t pairs,
                          int64_t vector_stride, const float* bias, c10::BFloat16* y, int64_t ldy,
                          const c10::BFloat16* prefetch) {
  int64_t m = 0;
  // Prefetch in the first pass only: later passes find the tile in cache.
  for (; m + kTileRows <= M; m += kTileRows, prefetch = nullptr)
    tile<kVectors, kTileRows>(x + m * ldx, ldx, w, pairs, vector_stride, bias, y + m * ldy, ldy, prefetch);
  const auto rest = [&](auto rows) {
    tile<kVectors, decltype(rows)::value>(x + m * ldx, ldx, w, pairs, vector_stride, bias, y + m * ldy, ldy, prefetch);
  };
  switch (M - m) {
    case 7: rest(std::integral_constant<int, 7>{}); break;
    case 6: rest(std::integral_constant<int, 6>{}); break;
    case 5: rest(std::integral_constant<int, 5>{}); break;
    case 4: rest(std::integral_constant<int, 4>{}); break;
    case 3: rest(std::integral_constant<int, 3>{}); break;
    case 2: rest(std::integral_constant<int, 2>{}); break;
    case 1: rest(std::integral_constant<int, 1>{}); break;
    default: break;
  }
}

}  // namespace

bool bf16_packed_linear_available() { return true; }

torch::Tensor bf16_packed_linear(torch::Tensor x, torch::Tensor packed, std::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.stride(1) == 1,
              "bf16_packed_linear: x must be bf16 [rows, in_features] with contiguous rows");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == torch::kBFloat16 && packed.is_contiguous() &&
                  packed.size(2) == kOutputsPerVector && packed.size(3) == 2 && packed.size(1) * 2 == x.size(1),
              "bf16_packed_linear: packed must be contiguous bf16 [out_features / 16, in_features / 2, 16, 2]");
  const int64_t M = x.size(0), vectors = packed.size(0), pairs = packed.size(1), N = vectors * kOutputsPerVector;
  const int64_t vector_stride = pairs * 32, ldx = x.stride(0);
  std::optional<torch::Tensor> bias32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N && bias->is_contiguous(), "bf16_packed_linear: bias must be contiguous [out_features]");
    bias32 = bias->to(torch::kFloat);
  }
  const float* bp = bias32.has_value() ? bias32->data_ptr<float>() : nullptr;
  auto y = torch::empty({M, N}, x.options());
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  const c10::BFloat16* wp = packed.data_ptr<c10::BFloat16>();
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  const int64_t tiles = (vectors + kTileVectors - 1) / kTileVectors;
  at::parallel_for(0, tiles, kTileGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t first = t * kTileVectors, count = std::min<int64_t>(kTileVectors, vectors - first);
      const c10::BFloat16* w = wp + first * vector_stride;
      // This task's next tile only: another thread streams the rest.
      const c10::BFloat16* prefetch = t + 1 < end ? w + kTileVectors * vector_stride : nullptr;
      const float* b = bp != nullptr ? bp + first * kOutputsPerVector : nullptr;
      c10::BFloat16* out = yp + first * kOutputsPerVector;
      // The last tile of a width that is not a multiple of 48 has 1 or 2 vectors.
      if (count == 3) tile_all_rows<3>(xp, ldx, M, w, pairs, vector_stride, b, out, N, prefetch);
      else if (count == 2) tile_all_rows<2>(xp, ldx, M, w, pairs, vector_stride, b, out, N, prefetch);
      else tile_all_rows<1>(xp, ldx, M, w, pairs, vector_stride, b, out, N, prefetch);
    }
  });
  return y;
}

#else

// Built without AVX-512 BF16: callers check availability and keep nn.Linear's layout.
bool bf16_packed_linear_available() { return false; }

torch::Tensor bf16_packed_linear(torch::Tensor, torch::Tensor, std::optional<torch::Tensor>) {
  TORCH_CHECK(false, "bf16_packed_linear: built without AVX-512 BF16 (check bf16_packed_linear_available())");
}

#endif
