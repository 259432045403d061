// y = x @ weight^T + bias for fp32 with few rows of x: the matmuls of a decode
// step, where every row is one sequence's token.
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
#include <ATen/Parallel.h>

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

__attribute__((always_inline)) inline void accumulate(RowSums& sums, const float* x, __mmask16 mask, __m512 w0,
                                                      __m512 w1, __m512 w2, __m512 w3) {
  const __m512 xv = _mm512_maskz_loadu_ps(mask, x);
  sums.w0 = _mm512_fmadd_ps(xv, w0, sums.w0);
  sums.w1 = _mm512_fmadd_ps(xv, w1, sums.w1);
  sums.w2 = _mm512_fmadd_ps(xv, w2, sums.w2);
  sums.w3 = _mm512_fmadd_ps(xv, w3, sums.w3);
}

// y[m, i] = x[m] . w[i] + bias[i] for i < 4, m < kInputRows; x rows are ldx
// apart, y rows ldy apart. ``prefetch`` (may be null) is the first weight row
// of a later tile, fetched one cache line per row per step of K.
template <int kInputRows>
inline void tile(const float* x, int64_t ldx, const float* w, int64_t K, const float* bias, float* y, int64_t ldy,
                 const float* prefetch) {
  static_assert(kTileRows == 4 && kInputRows >= 1 && kInputRows <= 4, "a tile is 4 weight rows x 1-4 input rows");
  RowSums r0, r1, r2, r3;
  const __mmask16 tail = static_cast<__mmask16>((1u << (K % 16)) - 1);
  for (int64_t k = 0; k < K; k += 16) {  // whole steps of K, then a masked partial one
    const __mmask16 mask = k + 16 <= K ? static_cast<__mmask16>(0xFFFF) : tail;
    if (prefetch != nullptr)
      for (int i = 0; i < kTileRows; ++i) _mm_prefetch(reinterpret_cast<const char*>(prefetch + i * K + k), _MM_HINT_T0);
    const __m512 w0 = _mm512_maskz_loadu_ps(mask, w + k), w1 = _mm512_maskz_loadu_ps(mask, w + K + k),
                 w2 = _mm512_maskz_loadu_ps(mask, w + 2 * K + k), w3 = _mm512_maskz_loadu_ps(mask, w + 3 * K + k);
    accumulate(r0, x + k, mask, w0, w1, w2, w3);
    if constexpr (kInputRows > 1) accumulate(r1, x + ldx + k, mask, w0, w1, w2, w3);
    if constexpr (kInputRows > 2) accumulate(r2, x + 2 * ldx + k, mask, w0, w1, w2, w3);
    if constexpr (kInputRows > 3) accumulate(r3, x + 3 * ldx + k, mask, w0, w1, w2, w3);
  }
  const __m512 all[16] = {r0.w0, r0.w1, r0.w2, r0.w3, r1.w0, r1.w1, r1.w2, r1.w3,
                          r2.w0, r2.w1, r2.w2, r2.w3, r3.w0, r3.w1, r3.w2, r3.w3};
  alignas(64) float sums[16];
  _mm512_store_ps(sums, sum_lanes_of_16(all));  // lane m * 4 + i holds output (m, i)
  for (int m = 0; m < kInputRows; ++m)
    for (int i = 0; i < kTileRows; ++i) y[m * ldy + i] = sums[m * kTileRows + i] + (bias != nullptr ? bias[i] : 0.0f);
}

// All input rows against one tile of weight rows, four input rows at a time.
inline void tile_all_rows(const float* x, int64_t ldx, int64_t M, const float* w, int64_t K, const float* bias,
                          float* y, int64_t ldy, const float* prefetch) {
  int64_t m = 0;
  // Prefetch once, in the first pass: later passes find this tile in L1.
  for (; m + 4 <= M; m += 4, prefetch = nullptr) tile<4>(x + m * ldx, ldx, w, K, bias, y + m * ldy, ldy, prefetch);
  switch (M - m) {
    case 3: tile<3>(x + m * ldx, ldx, w, K, bias, y + m * ldy, ldy, prefetch); break;
    case 2: tile<2>(x + m * ldx, ldx, w, K, bias, y + m * ldy, ldy, prefetch); break;
    case 1: tile<1>(x + m * ldx, ldx, w, K, bias, y + m * ldy, ldy, prefetch); break;
    default: break;
  }
}

}  // namespace
#endif

torch::Tensor linear_small_batch(torch::Tensor x, torch::Tensor weight, std::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.stride(1) == 1,
              "linear_small_batch: x must be fp32 [rows, in_features] with contiguous rows");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat && weight.is_contiguous() &&
                  weight.size(1) == x.size(1),
              "linear_small_batch: weight must be contiguous fp32 [out_features, in_features]");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->is_contiguous() && bias->numel() == weight.size(0),
                "linear_small_batch: bias must be contiguous fp32 [out_features]");
#if defined(__AVX512F__)
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0), num_tiles = N / kTileRows;
  at::parallel_for(0, num_tiles, kTileGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n = t * kTileRows;
      // Only this task's own tiles: another thread streams the rest.
      const float* prefetch = t + kPrefetchTiles < end ? wp + (n + kPrefetchTiles * kTileRows) * K : nullptr;
      tile_all_rows(xp, ldx, M, wp + n * K, K, bp != nullptr ? bp + n : nullptr, yp + n, N, prefetch);
    }
  });
  // Output features past the last whole tile (none for the usual model widths).
  for (int64_t n = num_tiles * kTileRows; n < N; ++n)
    for (int64_t m = 0; m < M; ++m) {
      float total = bp != nullptr ? bp[n] : 0.0f;
      for (int64_t k = 0; k < K; ++k) total += xp[m * ldx + k] * wp[n * K + k];
      yp[m * N + n] = total;
    }
  return y;
#else
  // Without AVX-512 the tile above does not exist: PyTorch's matmul is the kernel.
  return at::linear(x, weight, bias);
#endif
}
