// y = x @ W^T for a weight W kept in llama.cpp's packed GGUF blocks (Q8_0, Q4_0,
// Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, MXFP4), dequantized tile by tile so that the
// dense fp32 weight never exists as a whole (gguf_formats.h names the decoders).
//
// Few rows of x (decode): a task decodes 4 weight rows into registers (AVX-512)
// or an fp32 scratch that stays in L2, then multiplies every row of x by them, so
// each weight byte is read from memory and decoded once per call. Many rows
// (prefill): a tile of weight rows is dequantized into fp32 scratch and
// multiplied by MKL (at::mm), or by the packed fp32 kernel where the caller
// asks for it (``packed_tiles``: where the engine packs fp32 weights), tile
// after tile.
//
// Sums run in another order than a dense fp32 matmul over the dequantized
// weight, so results agree with it to fp32 rounding, not bit for bit. The tiles live in
// quant_tiles.h, shared with the grouped expert kernel (moe_grouped.cpp).
#include <ATen/Parallel.h>

#include <vector>

#include "gguf_formats.h"
#include "ops.h"
#include "quant_tiles.h"

namespace {

// The few-rows path, 4 weight rows at a time. With AVX-512 every type's register form decodes a tile's
// blocks into registers and multiply them at once (see fused_group; as fast or faster than the
// scratch at every row count up to 48 on Zen 4, 2x on the memory-bound LM head); without it
// the tile decodes into an fp32 scratch that stays in L1/L2, then multiply_tile.
template <typename F>
void few_rows(const torch::Tensor& x, const uint8_t* pp, int64_t row_bytes, int64_t N, torch::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), num_tiles = (N + kTileRows - 1) / kTileRows;
  const float* xp = x.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  at::parallel_for(0, num_tiles, 4, [&](int64_t begin, int64_t end) {
#if defined(__AVX512F__)
    if constexpr (F::has_registers) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t n = t * kTileRows, rows = std::min(kTileRows, N - n);
        // A partial last tile repeats its last row; only `rows` outputs are written.
        const uint8_t* w[kTileRows];
        for (int64_t i = 0; i < kTileRows; ++i) w[i] = pp + (n + std::min(i, rows - 1)) * row_bytes;
        // The tile kFusedPrefetchTiles ahead is fetched while this one computes: four streams of
        // 34-byte blocks are too few to keep DRAM busy (the LM head ran at half speed without it).
        const int64_t ahead_row = std::min(N, n + kFusedPrefetchTiles * kTileRows);
        const int64_t ahead_bytes = std::min(kTileRows, N - ahead_row) * row_bytes;
        fused_tile<F>(w, pp + ahead_row * row_bytes, ahead_bytes, xp, x.stride(0), M, K, yp + n, out.stride(0), rows);
      }
    } else
#endif
    {
      std::vector<float> tile(kTileRows * K, 0.0f);  // rows past N stay zero
      for (int64_t t = begin; t < end; ++t) {
        const int64_t n = t * kTileRows, rows = std::min(kTileRows, N - n);
        F::decode_rows(pp, row_bytes, K, n, n + rows, tile.data());
        multiply_tile(xp, x.stride(0), M, tile.data(), K, yp + n, out.stride(0), rows);
      }
    }
  });
}

template <typename F>
void linear(const torch::Tensor& x, const torch::Tensor& packed, torch::Tensor& out, int64_t small_rows,
            bool packed_tiles) {
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0);
  check_packed_rows<F>(packed, K);
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const int64_t row_bytes = packed.size(1);
  if (M <= small_rows) return few_rows<F>(x, pp, row_bytes, N, out);
  // A tile of dequantized rows is multiplied by the packed fp32 kernel (packed_linear.cpp,
  // 1.2-1.5x MKL's sgemm at prefill sizes where the engine packs fp32 weights) once its 16-row
  // blocks are reordered, or by MKL. Every tile is then a multiple of 16 rows.
  const bool through_packed = packed_tiles && N % 16 == 0 && packed_linear_available(torch::kFloat);
  // About 2 MB of fp32 weights per tile: big enough for MKL, small enough to stay in cache.
  int64_t tile_rows = std::max<int64_t>(64, (int64_t{1} << 19) / K);
  if (through_packed) tile_rows -= tile_rows % 48;  // whole 48-output tiles of the packed kernel
  auto scratch = torch::empty({std::min(tile_rows, N), K}, torch::kFloat);
  float* sp = scratch.data_ptr<float>();
  for (int64_t n = 0; n < N; n += tile_rows) {
    const int64_t rows = std::min(tile_rows, N - n);
    at::parallel_for(n, n + rows, 8, [&](int64_t begin, int64_t end) {
      F::decode_rows(pp, row_bytes, K, begin, end, sp + (begin - n) * K);
    });
    auto target = out.narrow(1, n, rows);
    auto dense = scratch.narrow(0, 0, rows);
    if (through_packed) {
      // [rows, K] -> [rows / 16, K, 16, 1], the layout packed_linear reads for fp32.
      auto tile = dense.view({rows / 16, 16, K}).permute({0, 2, 1}).contiguous().unsqueeze(-1);
      packed_linear_out(x, tile, std::nullopt, target);
    } else {
      at::mm_out(target, x, dense.t());
    }
  }
}

}  // namespace

torch::Tensor quant_dequantize(torch::Tensor packed, int64_t qtype, int64_t in_features) {
  auto out = torch::empty({packed.size(0), in_features}, torch::kFloat);
  with_format(qtype, [&](auto format) {
    using F = decltype(format);
    check_packed_rows<F>(packed, in_features);
    const uint8_t* pp = packed.data_ptr<uint8_t>();
    float* op = out.data_ptr<float>();
    at::parallel_for(0, packed.size(0), 16, [&](int64_t begin, int64_t end) {
      F::decode_rows(pp, packed.size(1), in_features, begin, end, op + begin * in_features);
    });
  });
  return out;
}

void quant_linear(torch::Tensor x, torch::Tensor packed, int64_t qtype, torch::Tensor out, int64_t small_rows,
                  bool packed_tiles) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.stride(1) == 1,
              "quant_linear: x must be fp32 [rows, in_features] with contiguous rows");
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == torch::kFloat && out.stride(1) == 1 && out.size(0) == x.size(0) &&
                  out.size(1) == packed.size(0),
              "quant_linear: out must be an fp32 [rows, out_features] view with contiguous rows");
  with_format(qtype, [&](auto format) { linear<decltype(format)>(x, packed, out, small_rows, packed_tiles); });
}
