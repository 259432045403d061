// y = x @ weight^T + bias for fp32 or bf16 with few rows of x: the matmuls of a
// decode step, where every row is one sequence's token.
//
// Why not MKL: at 1-32 rows a decode step's matmuls are bound by streaming the
// weights from DRAM (SmolLM2's fp32 weights are 4x the L2 and larger than the
// share of L3 we get), and MKL's small-M sgemm neither keeps enough multiply-adds
// in flight per weight byte nor overlaps the next weights' fetch with the
// current ones' arithmetic: at 8 rows it reaches about 40% of the DRAM rate.
// Here each weight row is read from memory exactly once per call, in the order
// it lies ([N, K] as nn.Linear stores it), and the rows the next-but-one tile
// needs are prefetched while this tile computes, so the arithmetic hides under
// the stream.
//
// Tile: 4 weight rows x up to 4 input rows, 16 AVX-512 accumulators (one per
// output), each summing 16 lanes along K; one transpose-and-add tree reduces
// all 16 at the end. The 4 weight rows stay in L1 while further groups of 4
// input rows reuse them. Summation order differs from MKL's, so results agree
// with torch.nn.functional.linear to fp32 rounding, not bit for bit.
//
// bf16: the weights are widened to fp32 as they are loaded (a shift: exact) and
// every sum runs in fp32; x is widened once up front and y rounded to bf16 once
// at the end, as oneDNN's bf16 matmul accumulates in fp32 and rounds once. On a
// CPU without AVX-512 BF16 or AMX, oneDNN emulates bf16 and runs 2-4x slower than
// fp32 at decode sizes; here a bf16 call streams half the bytes of an fp32 one.
// Built for a CPU with AVX-512 BF16 (AMD Zen 4, Intel Cooper Lake and later),
// bf16 takes the same tiles with VDPBF16PS instead: 32 bf16 products per
// instruction summed pairwise into the 16 fp32 lanes, x kept in bf16, so a step
// of K costs half the instructions of widen-and-FMA (the products of two bf16
// are exact in fp32; only the summation order differs, as with oneDNN's).
#include <ATen/Parallel.h>

#include "dtype.h"

#include "ops.h"

#if defined(__AVX512F__)
#include <immintrin.h>

#include "lanes.h"

namespace {

constexpr int64_t kTileRows = 4;  // weight rows per tile
// Tiles ahead whose weights are prefetched: one tile ahead arrives too late at
// 1-4 input rows (little arithmetic to hide behind), four is evicted before use.
constexpr int64_t kPrefetchTiles = 2;
// Tiles per parallel task: large enough that a task is a long sequential stream.
constexpr int64_t kTileGrain = 16;

// One input row's four running dot products, one per weight row of the tile.
// Named members, not an array: GCC keeps an array indexed in a loop in memory
// and stores it back every step; a struct of four it holds in registers.
struct RowSums {
  __m512 w0 = _mm512_setzero_ps(), w1 = _mm512_setzero_ps(), w2 = _mm512_setzero_ps(), w3 = _mm512_setzero_ps();
};

// 16 weights (fewer under ``mask``) as fp32: bf16 widens by a 16-bit shift, which is exact.
__attribute__((always_inline)) inline __m512 load_weights(const float* w, __mmask16 mask) {
  return _mm512_maskz_loadu_ps(mask, w);
}

__attribute__((always_inline)) inline __m512 load_weights(const c10::BFloat16* w, __mmask16 mask) {
  const __m256i bits = _mm256_maskz_loadu_epi16(mask, w);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// How a tile steps along K. Widened: 16 values a step, x in fp32, weights
// widened to fp32, one FMA per (x, w) vector pair.
struct WidenedSteps {
  static constexpr int64_t kStep = 16;
  using Mask = __mmask16;
  using Operand = __m512;
  static Mask tail_mask(int64_t K) { return static_cast<Mask>((1u << (K % kStep)) - 1); }
  template <typename W>
  static Operand weights(const W* w, Mask mask) { return load_weights(w, mask); }
  static Operand inputs(const float* x, Mask mask) { return _mm512_maskz_loadu_ps(mask, x); }
  static __m512 madd(__m512 sums, Operand x, Operand w) { return _mm512_fmadd_ps(x, w, sums); }
};

#if defined(__AVX512BF16__)
// Native bf16: 32 values a step, x and weights both bf16, VDPBF16PS adds each
// pair of products into one fp32 lane (masked-off values are zeros: they add 0).
struct Bf16DotSteps {
  static constexpr int64_t kStep = 32;
  using Mask = __mmask32;
  using Operand = __m512bh;
  static Mask tail_mask(int64_t K) { return static_cast<Mask>((1ull << (K % kStep)) - 1); }
  static Operand weights(const c10::BFloat16* w, Mask mask) { return (__m512bh)_mm512_maskz_loadu_epi16(mask, w); }
  static Operand inputs(const c10::BFloat16* x, Mask mask) { return (__m512bh)_mm512_maskz_loadu_epi16(mask, x); }
  static __m512 madd(__m512 sums, Operand x, Operand w) { return _mm512_dpbf16_ps(sums, x, w); }
};
#endif

template <typename Steps, typename X>
__attribute__((always_inline)) inline void accumulate(RowSums& sums, const X* x, typename Steps::Mask mask,
                                                      typename Steps::Operand w0, typename Steps::Operand w1,
                                                      typename Steps::Operand w2, typename Steps::Operand w3) {
  const auto xv = Steps::inputs(x, mask);
  sums.w0 = Steps::madd(sums.w0, xv, w0);
  sums.w1 = Steps::madd(sums.w1, xv, w1);
  sums.w2 = Steps::madd(sums.w2, xv, w2);
  sums.w3 = Steps::madd(sums.w3, xv, w3);
}

// y[m, i] = x[m] . w[i] + bias[i] for i < 4, m < kInputRows; x rows are ldx
// apart, y rows ldy apart. ``prefetch`` (may be null) is the first weight row
// of a later tile, fetched one cache line per row per step of K.
template <typename Steps, int kInputRows, typename X, typename W>
inline void tile(const X* x, int64_t ldx, const W* w, int64_t K, const float* bias, float* y, int64_t ldy,
                 const W* prefetch) {
  static_assert(kTileRows == 4 && kInputRows >= 1 && kInputRows <= 4, "a tile is 4 weight rows x 1-4 input rows");
  constexpr int64_t kStep = Steps::kStep;
  RowSums r0, r1, r2, r3;
  const auto tail = Steps::tail_mask(K);
  const auto whole = static_cast<typename Steps::Mask>(~0ull);
  for (int64_t k = 0; k < K; k += kStep) {  // whole steps of K, then a masked partial one
    const auto mask = k + kStep <= K ? whole : tail;
    if (prefetch != nullptr)  // one cache line per weight row per step (a step is 64 bytes of either type)
      for (int i = 0; i < kTileRows; ++i) _mm_prefetch(reinterpret_cast<const char*>(prefetch + i * K + k), _MM_HINT_T1);
    const auto w0 = Steps::weights(w + k, mask), w1 = Steps::weights(w + K + k, mask),
               w2 = Steps::weights(w + 2 * K + k, mask), w3 = Steps::weights(w + 3 * K + k, mask);
    accumulate<Steps>(r0, x + k, mask, w0, w1, w2, w3);
    if constexpr (kInputRows > 1) accumulate<Steps>(r1, x + ldx + k, mask, w0, w1, w2, w3);
    if constexpr (kInputRows > 2) accumulate<Steps>(r2, x + 2 * ldx + k, mask, w0, w1, w2, w3);
    if constexpr (kInputRows > 3) accumulate<Steps>(r3, x + 3 * ldx + k, mask, w0, w1, w2, w3);
  }
  const __m512 all[16] = {r0.w0, r0.w1, r0.w2, r0.w3, r1.w0, r1.w1, r1.w2, r1.w3,
                          r2.w0, r2.w1, r2.w2, r2.w3, r3.w0, r3.w1, r3.w2, r3.w3};
  alignas(64) float sums[16];
  _mm512_store_ps(sums, sum_lanes_of_16(all));  // lane m * 4 + i holds output (m, i)
  for (int m = 0; m < kInputRows; ++m)
    for (int i = 0; i < kTileRows; ++i) y[m * ldy + i] = sums[m * kTileRows + i] + (bias != nullptr ? bias[i] : 0.0f);
}

// All input rows against one tile of weight rows, four input rows at a time.
template <typename Steps, typename X, typename W>
inline void tile_all_rows(const X* x, int64_t ldx, int64_t M, const W* w, int64_t K, const float* bias,
                          float* y, int64_t ldy, const W* prefetch) {
  int64_t m = 0;
  // Prefetch once, in the first pass: later passes find this tile in L1.
  for (; m + 4 <= M; m += 4, prefetch = nullptr) tile<Steps, 4>(x + m * ldx, ldx, w, K, bias, y + m * ldy, ldy, prefetch);
  switch (M - m) {
    case 3: tile<Steps, 3>(x + m * ldx, ldx, w, K, bias, y + m * ldy, ldy, prefetch); break;
    case 2: tile<Steps, 2>(x + m * ldx, ldx, w, K, bias, y + m * ldy, ldy, prefetch); break;
    case 1: tile<Steps, 1>(x + m * ldx, ldx, w, K, bias, y + m * ldy, ldy, prefetch); break;
    default: break;
  }
}

// y = x @ w^T + bias over fp32 bias and y, with x and w as ``Steps`` reads them.
template <typename Steps, typename X, typename W>
void small_batch_matmul(const torch::Tensor& x, const W* wp, int64_t N, const float* bp, torch::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), ldx = x.stride(0), num_tiles = N / kTileRows;
  const X* xp = x.data_ptr<X>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, num_tiles, kTileGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n = t * kTileRows;
      // Only this task's own tiles: another thread streams the rest.
      const W* prefetch = t + kPrefetchTiles < end ? wp + (n + kPrefetchTiles * kTileRows) * K : nullptr;
      tile_all_rows<Steps>(xp, ldx, M, wp + n * K, K, bp != nullptr ? bp + n : nullptr, yp + n, N, prefetch);
    }
  });
  // Output features past the last whole tile (none for the usual model widths).
  for (int64_t n = num_tiles * kTileRows; n < N; ++n)
    for (int64_t m = 0; m < M; ++m) {
      float total = bp != nullptr ? bp[n] : 0.0f;
      for (int64_t k = 0; k < K; ++k) total += load(xp[m * ldx + k]) * load(wp[n * K + k]);
      yp[m * N + n] = total;
    }
}

}  // namespace
#endif

torch::Tensor linear_small_batch(torch::Tensor x, torch::Tensor weight, std::optional<torch::Tensor> bias) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && (dtype == torch::kFloat || dtype == torch::kBFloat16) && x.stride(1) == 1,
              "linear_small_batch: x must be fp32 or bf16 [rows, in_features] with contiguous rows");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == dtype && weight.is_contiguous() &&
                  weight.size(1) == x.size(1),
              "linear_small_batch: weight must be contiguous [out_features, in_features] of x's dtype");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == dtype && bias->is_contiguous() && bias->numel() == weight.size(0),
                "linear_small_batch: bias must be contiguous [out_features] of x's dtype");
#if defined(__AVX512F__)
  const int64_t N = weight.size(0);
  // bf16: bias widened once, sums in fp32, y rounded once at the end.
  const std::optional<torch::Tensor> bias32 =
      bias.has_value() ? std::optional<torch::Tensor>(bias->to(torch::kFloat)) : std::nullopt;
  const float* bp = bias32.has_value() ? bias32->data_ptr<float>() : nullptr;
  auto y = torch::empty({x.size(0), N}, x.options().dtype(torch::kFloat));
  if (dtype == torch::kFloat) {
    small_batch_matmul<WidenedSteps, float>(x, weight.data_ptr<float>(), N, bp, y);
    return y;
  }
#if defined(__AVX512BF16__)
  small_batch_matmul<Bf16DotSteps, c10::BFloat16>(x, weight.data_ptr<c10::BFloat16>(), N, bp, y);
#else
  // x widened once (a few rows); the weights widen as they stream.
  small_batch_matmul<WidenedSteps, float>(x.to(torch::kFloat), weight.data_ptr<c10::BFloat16>(), N, bp, y);
#endif
  return y.to(torch::kBFloat16);
#else
  // Without AVX-512 the tile above does not exist: PyTorch's matmul is the kernel.
  return at::linear(x, weight, bias);
#endif
}
