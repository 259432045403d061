// The multiply tiles shared by quant_linear.cpp (one packed weight) and moe_grouped.cpp (a
// stack of expert weights): a tile of 4 decoded weight rows times every row of x, from an fp32
// scratch (multiply_tile) or from blocks decoded into registers (fused_tile).
#pragma once
#include <torch/extension.h>

#include <algorithm>

#include "gguf_formats.h"

#if defined(__AVX512F__)
#include <immintrin.h>

#include "lanes.h"
#endif

// Internal linkage, as gguf_blocks.h: each including .cpp gets its own inlinable copy.
namespace {

constexpr int64_t kTileRows = 4;  // weight rows decoded per decode-path tile

#if defined(__AVX512F__)
// y[m, i] = x[m] . w[i] for kGroup (1-4) rows of x and the tile's 4 decoded weight rows (K a
// multiple of 16): 16 accumulators, one per output, kept in registers by the fixed group size.
template <int kGroup>
void multiply_group(const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy, int64_t rows) {
  __m512 acc[16];
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __m512 w0 = _mm512_loadu_ps(w + k), w1 = _mm512_loadu_ps(w + K + k), w2 = _mm512_loadu_ps(w + 2 * K + k),
                 w3 = _mm512_loadu_ps(w + 3 * K + k);
#pragma GCC unroll 4
    for (int m = 0; m < kGroup; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * ldx + k);
      acc[4 * m] = _mm512_fmadd_ps(xv, w0, acc[4 * m]);
      acc[4 * m + 1] = _mm512_fmadd_ps(xv, w1, acc[4 * m + 1]);
      acc[4 * m + 2] = _mm512_fmadd_ps(xv, w2, acc[4 * m + 2]);
      acc[4 * m + 3] = _mm512_fmadd_ps(xv, w3, acc[4 * m + 3]);
    }
  }
  alignas(64) float sums[16];
  _mm512_store_ps(sums, sum_lanes_of_16(acc));  // lane 4m + i: output (m, i)
  for (int m = 0; m < kGroup; ++m)
    for (int64_t i = 0; i < rows; ++i) y[m * ldy + i] = sums[4 * m + i];
}

// The fused path: rows of x against weight rows whose blocks are decoded into registers and
// multiplied at once (no fp32 scratch written and read back). The decoded values and each
// output's order of sums are multiply_group's (one accumulator per output, its lanes summed by
// sum_lanes_of_16's fixed tree), so the outputs do not depend on how the rows are grouped.
//
// Up to kMaxFusedRows rows of x take all 4 weight rows of a tile at once (20 accumulators). More
// rows take the tile as two pairs of weight rows against up to kMaxPairRows rows of x: each
// block is then decoded once per pair of groups of up to 10 rows, not once per 5 rows (at 8 rows
// of x, once instead of twice; at 32, 4 times instead of 7), for the same multiplies.
constexpr int64_t kMaxFusedRows = 5;   // 20 accumulators + 8 weight + 2 input registers of 32
constexpr int64_t kMaxPairRows = 10;   // 20 accumulators + 4 weight registers + decode temporaries
constexpr int64_t kFusedPrefetchTiles = 2;

// kWeightRows (4 or 2) weight rows at w[0..] x kGroup rows of x; `rows` of the weight rows are real.
template <typename F, int kGroup, int kWeightRows = 4>
void fused_group(const uint8_t* const* w, const uint8_t* ahead, int64_t ahead_bytes, const float* x, int64_t ldx,
                 int64_t K, float* y, int64_t ldy, int64_t rows) {
  using Registers = typename F::Registers;
  constexpr int kAccumulators = kWeightRows * kGroup;  // accumulator kWeightRows * m + i: output (m, i)
  __m512 acc[kAccumulators];
  for (auto& a : acc) a = _mm512_setzero_ps();
  const int64_t blocks = K / F::block_size, lines_per_block = ((ahead_bytes + 63) / 64 + blocks - 1) / blocks;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    for (int64_t line = blk * lines_per_block; line < (blk + 1) * lines_per_block; ++line)
      __builtin_prefetch(ahead + line * 64, 0, 2);  // into L2 (T1): L1 has too few miss buffers
    Registers block[kWeightRows];
    for (int i = 0; i < kWeightRows; ++i) block[i].load(w[i] + blk * F::block_bytes);
    for (int sub = 0; sub < Registers::sub_blocks; ++sub) {  // runs of 32 weights, in order
      __m512 lo[kWeightRows], hi[kWeightRows];
      for (int i = 0; i < kWeightRows; ++i) block[i].registers(sub, lo[i], hi[i]);
      const float* xk = x + blk * F::block_size + sub * 32;
      for (int half = 0; half < 2; ++half) {  // weights 0-15 then 16-31: multiply_group's k order
        const __m512* wv = half == 0 ? lo : hi;
#pragma GCC unroll 10
        for (int m = 0; m < kGroup; ++m) {
          const __m512 xv = _mm512_loadu_ps(xk + m * ldx + half * 16);
          for (int i = 0; i < kWeightRows; ++i)
            acc[kWeightRows * m + i] = _mm512_fmadd_ps(xv, wv[i], acc[kWeightRows * m + i]);
        }
      }
    }
  }
  for (int first = 0; first < kAccumulators; first += 16) {  // 16 outputs per reduction
    __m512 part[16];
    for (int j = 0; j < 16; ++j) part[j] = first + j < kAccumulators ? acc[first + j] : _mm512_setzero_ps();
    alignas(64) float sums[16];
    _mm512_store_ps(sums, sum_lanes_of_16(part));
    for (int j = 0; j < 16 && first + j < kAccumulators; ++j) {
      const int m = (first + j) / kWeightRows, i = (first + j) % kWeightRows;
      if (i < rows) y[m * ldy + i] = sums[j];
    }
  }
}

// kGroup (6 to kMaxPairRows) rows of x against the tile as two pairs of weight rows.
template <typename F, int kGroup>
void fused_pairs(const uint8_t* const* w, const uint8_t* ahead, int64_t ahead_bytes, const float* x, int64_t ldx,
                 int64_t K, float* y, int64_t ldy, int64_t rows) {
  fused_group<F, kGroup, 2>(w, ahead, ahead_bytes, x, ldx, K, y, ldy, rows);
  if (rows > 2) fused_group<F, kGroup, 2>(w + 2, nullptr, 0, x, ldx, K, y + 2, ldy, rows - 2);
}

template <typename F>
void fused_tile(const uint8_t* const* w, const uint8_t* ahead, int64_t ahead_bytes, const float* x, int64_t ldx,
                int64_t M, int64_t K, float* y, int64_t ldy, int64_t rows) {
  // Groups of equal size up to kMaxPairRows (the last one smaller); only the first prefetches.
  const int64_t groups = (M + kMaxPairRows - 1) / kMaxPairRows, size = (M + groups - 1) / groups;
  for (int64_t m = 0; m < M; m += size, ahead_bytes = 0) {
    const float* xm = x + m * ldx;
    float* ym = y + m * ldy;
    switch (std::min(size, M - m)) {
      case 10: fused_pairs<F, 10>(w, ahead, ahead_bytes, xm, ldx, K, ym, ldy, rows); break;
      case 9: fused_pairs<F, 9>(w, ahead, ahead_bytes, xm, ldx, K, ym, ldy, rows); break;
      case 8: fused_pairs<F, 8>(w, ahead, ahead_bytes, xm, ldx, K, ym, ldy, rows); break;
      case 7: fused_pairs<F, 7>(w, ahead, ahead_bytes, xm, ldx, K, ym, ldy, rows); break;
      case 6: fused_pairs<F, 6>(w, ahead, ahead_bytes, xm, ldx, K, ym, ldy, rows); break;
      case 5: fused_group<F, 5>(w, ahead, ahead_bytes, xm, ldx, K, ym, ldy, rows); break;
      case 4: fused_group<F, 4>(w, ahead, ahead_bytes, xm, ldx, K, ym, ldy, rows); break;
      case 3: fused_group<F, 3>(w, ahead, ahead_bytes, xm, ldx, K, ym, ldy, rows); break;
      case 2: fused_group<F, 2>(w, ahead, ahead_bytes, xm, ldx, K, ym, ldy, rows); break;
      default: fused_group<F, 1>(w, ahead, ahead_bytes, xm, ldx, K, ym, ldy, rows); break;
    }
  }
}
#endif

// y[m, i] = x[m] . w[i] for the tile's 4 decoded weight rows and all M rows of x; only the
// first `rows` outputs of each row of y are written (the last tile may be partial).
void multiply_tile(const float* x, int64_t ldx, int64_t M, const float* w, int64_t K, float* y, int64_t ldy,
                   int64_t rows) {
#if defined(__AVX512F__)
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) multiply_group<4>(x + m * ldx, ldx, w, K, y + m * ldy, ldy, rows);
  switch (M - m) {
    case 3: multiply_group<3>(x + m * ldx, ldx, w, K, y + m * ldy, ldy, rows); break;
    case 2: multiply_group<2>(x + m * ldx, ldx, w, K, y + m * ldy, ldy, rows); break;
    case 1: multiply_group<1>(x + m * ldx, ldx, w, K, y + m * ldy, ldy, rows); break;
    default: break;
  }
#else  // portable: the compiler vectorizes the inner sum (-ffast-math lets it reorder)
  for (int64_t m = 0; m < M; ++m)
    for (int64_t i = 0; i < rows; ++i) {
      float total = 0.0f;
      for (int64_t k = 0; k < K; ++k) total += x[m * ldx + k] * w[i * K + k];
      y[m * ldy + i] = total;
    }
#endif
}

}  // namespace
