// y = x @ W^T + bias for fp32 or bf16 with W stored column-packed: every matmul of an
// fp32 or bf16 model, decode and prefill, on a CPU with AVX-512 and no AMX (bf16 also
// needs AVX-512 BF16).
//
// Why a layout of its own: in nn.Linear's [N, K] layout each output is a dot product
// along K, so a kernel holds 16 partial sums per output in one vector and must add
// them across lanes at the end (the small-batch kernel's transpose tree, ~15% of a
// K = 576 matmul), and it reloads every input vector for each group of 4 weight rows.
// Packed as [N / 16, K / g, 16, g] (g = 2 for bf16, the VNNI order VDPBF16PS
// multiplies; g = 1 for fp32), lane j of an accumulator is output j itself: g inputs
// broadcast to all lanes times one 64-byte weight vector add to 16 outputs, and
// nothing is reduced across lanes. A tile is 3 vectors of outputs (48) x up to 8
// input rows, 24 accumulators in registers; per step of K it loads 3 weight vectors
// and broadcasts 8 inputs for 24 VDPBF16PS / FMA, which keeps the multiplier busy
// (~90% of its peak on a Zen 4 core, at any row count). The tile's weights (48 x K)
// stay in L1/L2 while further groups of 8 rows reuse them, and the next tile's are
// prefetched into L2 during the first group.
//
// MKL's sgemm and oneDNN's bf16 GEMM read nn.Linear's layout: on a Zen 4 core they
// reach 40-85% of the same peak (MKL's small-M sgemm least), the small-batch kernel
// 55-75% (BENCHMARKS.md, "bf16 weights packed for VDPBF16PS", "fp32 weights packed too").
//
// Numerics: every sum runs in fp32 along K in order, the bias is added in fp32 and y
// is rounded to the dtype once (bf16: products of two bf16 are exact in fp32, as in
// oneDNN's bf16 matmul); the summation order differs from MKL's and oneDNN's, so
// results agree with them to fp32 rounding of the sums, not bit for bit.
#include <ATen/Parallel.h>

#include <cstring>

#include "ops.h"

#if defined(__AVX512F__)
#include <immintrin.h>

namespace {

constexpr int kTileVectors = 3;  // 16-output weight vectors per tile
constexpr int kTileRows = 8;     // input rows per tile pass
constexpr int64_t kOutputsPerVector = 16;
constexpr int64_t kStepElements = 64;  // bytes of one weight vector per step of K
// Tiles per parallel task: a task streams a long run of weights.
constexpr int64_t kTileGrain = 8;

// fp32: one K per step, FMA.
struct Fp32 {
  using scalar_t = float;
  using weights_t = __m512;
  using inputs_t = __m512;
  static constexpr int64_t kGroup = 1;
  static weights_t load(const float* w) { return _mm512_loadu_ps(w); }
  static inputs_t broadcast(const float* x) { return _mm512_set1_ps(*x); }
  static __m512 multiply_add(__m512 sums, inputs_t x, weights_t w) { return _mm512_fmadd_ps(x, w, sums); }
  static void store(float* y, __m512 sums) { _mm512_storeu_ps(y, sums); }
};

#if defined(__AVX512BF16__)
// bf16: a pair of K per step, VDPBF16PS (both products exact in fp32, summed pairwise into the lane).
struct Bf16 {
  using scalar_t = c10::BFloat16;
  using weights_t = __m512bh;
  using inputs_t = __m512bh;
  static constexpr int64_t kGroup = 2;
  static weights_t load(const c10::BFloat16* w) { return (__m512bh)_mm512_loadu_si512(w); }
  static inputs_t broadcast(const c10::BFloat16* x) {
    int32_t both;  // x[2 step], x[2 step + 1]
    std::memcpy(&both, x, sizeof(both));
    return (__m512bh)_mm512_set1_epi32(both);
  }
  static __m512 multiply_add(__m512 sums, inputs_t x, weights_t w) { return _mm512_dpbf16_ps(sums, x, w); }
  static void store(c10::BFloat16* y, __m512 sums) {
    const __m256bh rounded = _mm512_cvtneps_pbh(sums);  // round to nearest even
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), (__m256i)rounded);
  }
};
#endif

// y[m, 16 v + j] for m < kRows, v < kVectors: w is the tile's first weight vector
// (vectors are ``vector_stride`` elements apart), x rows ldx apart, y rows ldy apart.
template <typename D, int kVectors, int kRows>
inline void tile(const typename D::scalar_t* x, int64_t ldx, const typename D::scalar_t* w, int64_t steps,
                 int64_t vector_stride, const float* bias, typename D::scalar_t* y, int64_t ldy,
                 const typename D::scalar_t* prefetch) {
  constexpr int64_t step_elements = kStepElements / sizeof(typename D::scalar_t);
  __m512 sums[kRows][kVectors];
#pragma GCC unroll 8
  for (int m = 0; m < kRows; ++m)
#pragma GCC unroll 3
    for (int v = 0; v < kVectors; ++v) sums[m][v] = _mm512_setzero_ps();
  for (int64_t step = 0; step < steps; ++step) {
    typename D::weights_t weights[kVectors];
#pragma GCC unroll 3
    for (int v = 0; v < kVectors; ++v) {
      weights[v] = D::load(w + v * vector_stride + step * step_elements);
      // One 64-byte line per vector per step: the next tile arrives at the rate this one is read.
      if (prefetch != nullptr)
        _mm_prefetch(reinterpret_cast<const char*>(prefetch + v * vector_stride + step * step_elements), _MM_HINT_T1);
    }
#pragma GCC unroll 8
    for (int m = 0; m < kRows; ++m) {
      const typename D::inputs_t input = D::broadcast(x + m * ldx + D::kGroup * step);
#pragma GCC unroll 3
      for (int v = 0; v < kVectors; ++v) sums[m][v] = D::multiply_add(sums[m][v], input, weights[v]);
    }
  }
#pragma GCC unroll 3
  for (int v = 0; v < kVectors; ++v) {
    const __m512 b = bias != nullptr ? _mm512_loadu_ps(bias + v * kOutputsPerVector) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int m = 0; m < kRows; ++m) D::store(y + m * ldy + v * kOutputsPerVector, _mm512_add_ps(sums[m][v], b));
  }
}

// All M rows against one tile of kVectors weight vectors, kTileRows rows at a time.
template <typename D, int kVectors>
inline void tile_all_rows(const typename D::scalar_t* x, int64_t ldx, int64_t M, const typename D::scalar_t* w,
                          int64_t steps, int64_t vector_stride, const float* bias, typename D::scalar_t* y,
                          int64_t ldy, const typename D::scalar_t* prefetch) {
  int64_t m = 0;
  // Prefetch in the first pass only: later passes find the tile in cache.
  for (; m + kTileRows <= M; m += kTileRows, prefetch = nullptr)
    tile<D, kVectors, kTileRows>(x + m * ldx, ldx, w, steps, vector_stride, bias, y + m * ldy, ldy, prefetch);
  const auto rest = [&](auto rows) {
    tile<D, kVectors, decltype(rows)::value>(x + m * ldx, ldx, w, steps, vector_stride, bias, y + m * ldy, ldy,
                                             prefetch);
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

template <typename D>
void packed_linear_for(const torch::Tensor& x, const torch::Tensor& packed, const float* bias, torch::Tensor& y) {
  using scalar_t = typename D::scalar_t;
  const int64_t M = x.size(0), vectors = packed.size(0), steps = packed.size(1);
  const int64_t vector_stride = steps * kOutputsPerVector * D::kGroup, ldx = x.stride(0), ldy = y.stride(0);
  const scalar_t* xp = x.data_ptr<scalar_t>();
  const scalar_t* wp = packed.data_ptr<scalar_t>();
  scalar_t* yp = y.data_ptr<scalar_t>();
  const int64_t tiles = (vectors + kTileVectors - 1) / kTileVectors;
  at::parallel_for(0, tiles, kTileGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t first = t * kTileVectors, count = std::min<int64_t>(kTileVectors, vectors - first);
      const scalar_t* w = wp + first * vector_stride;
      // This task's next tile only: another thread streams the rest.
      const scalar_t* prefetch = t + 1 < end ? w + kTileVectors * vector_stride : nullptr;
      const float* b = bias != nullptr ? bias + first * kOutputsPerVector : nullptr;
      scalar_t* out = yp + first * kOutputsPerVector;
      // The last tile of a width that is not a multiple of 48 has 1 or 2 vectors.
      if (count == 3) tile_all_rows<D, 3>(xp, ldx, M, w, steps, vector_stride, b, out, ldy, prefetch);
      else if (count == 2) tile_all_rows<D, 2>(xp, ldx, M, w, steps, vector_stride, b, out, ldy, prefetch);
      else tile_all_rows<D, 1>(xp, ldx, M, w, steps, vector_stride, b, out, ldy, prefetch);
    }
  });
}

}  // namespace

#endif

bool packed_linear_available(at::ScalarType dtype) {
#if defined(__AVX512BF16__)
  if (dtype == torch::kBFloat16) return true;
#endif
#if defined(__AVX512F__)
  if (dtype == torch::kFloat) return true;
#endif
  return false;
}

void packed_linear_out(torch::Tensor x, torch::Tensor packed, std::optional<torch::Tensor> bias, torch::Tensor out) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(packed_linear_available(dtype),
              "packed_linear: not built for ", dtype, " (check packed_linear_available(dtype))");
  const int64_t group = dtype == torch::kBFloat16 ? 2 : 1;
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "packed_linear: x must be [rows, in_features] with contiguous rows");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == dtype && packed.is_contiguous() &&
                  packed.size(2) == 16 && packed.size(3) == group && packed.size(1) * group == x.size(1),
              "packed_linear: packed must be contiguous [out_features / 16, in_features / g, 16, g] of x's dtype "
              "(g = 2 for bf16, 1 for fp32)");
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == dtype && out.stride(1) == 1 && out.size(0) == x.size(0) &&
                  out.size(1) == packed.size(0) * 16,
              "packed_linear: out must be a [rows, out_features] view of x's dtype with contiguous rows");
  std::optional<torch::Tensor> bias32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == packed.size(0) * 16 && bias->is_contiguous(),
                "packed_linear: bias must be contiguous [out_features]");
    bias32 = bias->to(torch::kFloat);
  }
  const float* bp = bias32.has_value() ? bias32->data_ptr<float>() : nullptr;
#if defined(__AVX512F__)
#if defined(__AVX512BF16__)
  if (dtype == torch::kBFloat16) return packed_linear_for<Bf16>(x, packed, bp, out);
#endif
  packed_linear_for<Fp32>(x, packed, bp, out);
#else
  (void)bp;
  TORCH_CHECK(false, "unreachable");
#endif
}

torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, std::optional<torch::Tensor> bias) {
  auto y = torch::empty({x.size(0), packed.size(0) * 16}, x.options());
  packed_linear_out(x, packed, bias, y);
  return y;
}
